"""Model definitions built from GGUF metadata, and `load_model` to build one from a file."""

from shared.model.batch import ForwardBatch, SeqChunk
from shared.model.config import ModelConfig
from shared.model.loading import load_model

__all__ = ["ForwardBatch", "ModelConfig", "SeqChunk", "load_model"]
