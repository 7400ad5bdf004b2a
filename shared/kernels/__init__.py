"""Triton kernels, each beside a torch reference in shared/ops that its test compares it with."""
