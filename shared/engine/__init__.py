"""The in-process engine: sequences, scheduler step loop, model runner, and its factory."""

from shared.engine.engine import LLMEngine
from shared.engine.sequence import SeqStatus, Sequence, TokenEvent

__all__ = ["LLMEngine", "SeqStatus", "Sequence", "TokenEvent"]
