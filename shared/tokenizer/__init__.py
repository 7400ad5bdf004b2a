"""Tokenization of GGUF models, identical to llama.cpp: encode/decode, streaming decode, chat
templates. Start with `load_tokenizer(GGUFFile(path).metadata)`."""

from shared.tokenizer.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplate
from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "NoChatTemplate",
    "Tokenizer",
    "load_tokenizer",
]
