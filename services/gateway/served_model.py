"""The model the gateway serves, as far as the gateway needs it: name, tokenizer, chat template
and context length, all read from the GGUF header (never the weights)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.loader import GGUFFile
from shared.tokenizer import ChatTemplate, Tokenizer, load_tokenizer


@dataclass(frozen=True)
class ServedModel:
    name: str
    path: Path
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    context_length: int  # training context from the metadata; workers may serve less
    created: int  # unix time of the file, for /v1/models

    @classmethod
    def load(cls, path: Path, name: str) -> ServedModel:
        metadata = GGUFFile(path).metadata
        return cls(
            name=name,
            path=path,
            tokenizer=load_tokenizer(metadata),
            chat_template=ChatTemplate.from_metadata(metadata),
            context_length=_context_length(metadata),
            created=int(path.stat().st_mtime),
        )


def _context_length(metadata: dict[str, Any]) -> int:
    arch = metadata.get("general.architecture", "")
    value = metadata.get(f"{arch}.context_length")
    # Files without it are rare; 4096 is llama.cpp's n_ctx_train fallback as well.
    return int(value) if value else 4096
