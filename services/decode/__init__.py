"""Decode role (continuous-batching decode, CUDA graphs): lands with the service pipeline."""
