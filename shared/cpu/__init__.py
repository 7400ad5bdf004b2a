"""The CPU's own compiled kernels (C through ctypes): quantized matmuls over GGUF blocks."""
