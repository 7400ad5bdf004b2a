"""Batched on-device sampling: per-request parameters and the sampler that applies them."""

from .params import SamplingParams
from .sampler import SampleOutput, Sampler, make_generator

__all__ = ["SampleOutput", "Sampler", "SamplingParams", "make_generator"]
