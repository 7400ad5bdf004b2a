"""Compute ops with a torch reference (the CPU path); Triton kernels join them per op later."""
