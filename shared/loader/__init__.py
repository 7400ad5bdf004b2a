"""GGUF file access: header (cached), tensor table, raw bytes and errors."""

from shared.loader.errors import GGUFError
from shared.loader.gguf_file import GGUFFile, TensorInfo

__all__ = ["GGUFError", "GGUFFile", "TensorInfo"]
