"""Prefill role (prompt processing in chunks, writes KV blocks): lands with the service pipeline."""
