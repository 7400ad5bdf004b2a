"""Structured output: a request's grammar (JSON schema, regex, Lark or GBNF, compiled by
llguidance) turned into a mask of the tokens its next step may sample."""

from shared.grammar.constraint import Constraint, GrammarCompiler
from shared.grammar.masks import apply_masks, fill_masks

__all__ = ["Constraint", "GrammarCompiler", "apply_masks", "fill_masks"]
