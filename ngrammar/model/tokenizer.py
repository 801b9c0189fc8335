"""Tokenizer wrapper: encode/decode, chat template, stop tokens and incremental detokenization."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

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

    @cached_property
    def vocab_bytes(self) -> list[bytes]:
        """Each token's raw bytes (a special token's: its text), as xgrammar decodes the vocabulary
        (byte-level BPE, byte fallback or raw): a token may hold part of a UTF-8 character."""
        import xgrammar as xgr

        return list(xgr.TokenizerInfo.from_huggingface(self.hf).decoded_vocab)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Tokens ``decode`` leaves out of text: the named special tokens and every added token
        flagged special (SmolLM2's ``<repo_name>``..., Llama-3's reserved and header tokens)."""
        added = {int(i) for i, t in self.hf.added_tokens_decoder.items() if t.special}
        return frozenset(added | {int(t) for t in self.hf.all_special_ids})

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes; b"" for ids past the tokenizer (a model's padded vocabulary)."""
        vocab = self.vocab_bytes
        return vocab[token_id] if 0 <= token_id < len(vocab) else b""

    def encode(self, text: str) -> list[int]:
        """Text's tokens alone (no BOS): for text inside a prompt, e.g. a rendered chat template."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        """A whole plain-text prompt, with the special tokens the tokenizer adds (Llama's and
        Mistral's BOS), as ``tokenizer(text)`` and vLLM do; SmolLM2's adds none."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        text = self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return self.encode(text)


PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output's (vLLM uses 5 too)


@dataclass
class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never end inside a multi-byte character.

    Decoding every token alone breaks byte-level BPE characters split over tokens, so each step
    decodes from a small window before the new tokens and emits only the stable suffix. A trailing
    U+FFFD means the last character is incomplete: everything before it is emitted (a verify step
    appends several tokens at once, and a finished sequence's text is what was emitted), the partial
    character is held back, and the window stays put until a later token completes it. (So a
    U+FFFD that the text really ends with is held back too, as in vLLM: it cannot be told apart.)
    """

    tokenizer: Tokenizer
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = field(default="")
    pending: int = 0  # characters emitted past read_offset's text while a character is incomplete

    @classmethod
    def after_prompt(cls, tokenizer: Tokenizer, prompt_len: int) -> IncrementalDetokenizer:
        """For a completion of a ``prompt_len``-token prompt: the window starts a few prompt tokens
        back, as in vLLM, so the output decodes in context (a SentencePiece decoder strips the
        leading space of the first token it decodes: alone, " loads" would come out "loads")."""
        return cls(tokenizer, max(prompt_len - PROMPT_CONTEXT_TOKENS, 0), prompt_len)

    def step(self, token_ids: Sequence[int]) -> str:
        prefix = self.tokenizer.decode(token_ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(token_ids[self.prefix_offset :])
        incomplete = full.endswith("\ufffd")
        stable = full.rstrip("\ufffd") if incomplete else full
        start = len(prefix) + self.pending
        delta = stable[start:] if len(stable) > start else ""
        if incomplete:
            self.pending += len(delta)
        elif len(full) > len(prefix):
            self.prefix_offset, self.read_offset, self.pending = self.read_offset, len(token_ids), 0
        self.text += delta
        return delta
