"""ngrammar: n-gram tree speculative decoding with grammar-constrained output."""

from ngrammar.llm import LLM
from ngrammar.outputs import CompletionOutput, RequestOutput, TokenLogprob
from ngrammar.sampling_params import InvalidRequestError, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "TokenLogprob",
    "InvalidRequestError",
]
