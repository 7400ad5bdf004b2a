"""The error for a GGUF file that cannot be used: it names the file, the tensor and the problem."""

from __future__ import annotations


class GGUFError(ValueError):
    """A GGUF file is unreadable or does not fit the model it claims to be."""

    def __init__(self, path: str, problem: str, tensor: str | None = None) -> None:
        self.path = path
        self.tensor = tensor
        self.problem = problem
        where = f"{path}: tensor '{tensor}'" if tensor else path
        super().__init__(f"{where}: {problem}")
