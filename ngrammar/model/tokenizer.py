"""Tokenizer wrapper: encode/decode, chat template, stop tokens and incremental detokenization."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

Message = dict[str, str]


class Tokenizer:
    """A fast Hugging Face tokenizer plus what the engine needs to know about it."""

    def __init__(self, folder: Path, eos_token_ids: Sequence[int] = ()) -> None:
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(str(folder))
        eos = set(int(t) for t in eos_token_ids)
        if self.hf.eos_token_id is not None:
            eos.add(int(self.hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        text = self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return self.encode(text)


@dataclass
class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never end inside a multi-byte character.

    Decoding every token alone breaks byte-level BPE characters split over tokens, so each step
    decodes from a small window before the new tokens and emits only the stable suffix; a trailing
    U+FFFD means the character is incomplete and is held back until the next token completes it.
    """

    tokenizer: Tokenizer
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = field(default="")

    def step(self, token_ids: Sequence[int]) -> str:
        prefix = self.tokenizer.decode(token_ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(token_ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(token_ids)
        self.text += delta
        return delta
