"""Speculation service (n-gram and draft-model proposals): lands with speculative decoding."""
