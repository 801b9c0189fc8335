"""``EngineFront``: the engine's request-side surface in the API process, whose engines run in
engine-core processes: the tokenizer (chat template), the request limits and a grammar compiler.
``_Server`` reads it as it reads an in-process ``LLMEngine``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ngrammar.config import EngineConfig
from ngrammar.engine.builder import engine_checkpoint
from ngrammar.engine.engine import tokenize_prompt, validate_request
from ngrammar.grammar import GrammarBackend
from ngrammar.model.tokenizer import Message, Tokenizer
from ngrammar.sampling_params import SamplingParams


@dataclass(frozen=True)
class _Pages:
    page_size: int


class EngineFront:
    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        max_model_len: int,
        kv_capacity_tokens: int,
        page_size: int,
    ) -> None:
        checkpoint = engine_checkpoint(config)
        self.config = config
        self.model_config = checkpoint.config
        self.model_name = model_name
        self.tokenizer = Tokenizer(checkpoint.tokenizer_dir, checkpoint.config.eos_token_ids)
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens  # the smallest core's pool
        self.blocks = _Pages(page_size)
        # Compiles (and so checks) each request's grammar within the server's budget before it is
        # sent; the core compiles it again for its own matchers (its cache is its own).
        self.grammar_backend = GrammarBackend(
            self.tokenizer,
            checkpoint.config.vocab_size,
            config.grammar_cache_size,
            cache_max_bytes=config.grammar_cache_mb << 20,
        )

    def tokenize(self, prompt: str | list[int] | Sequence[Message]) -> list[int]:
        return tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_request(
            prompt_ids, params, self.max_model_len, self.kv_capacity_tokens, self.model_config.vocab_size
        )
