"""Replay target: a benchmark mode in which recorded greedy outputs decide every token.

The forward runs whatever model the engine holds (e.g. a random-weight model of a large model's
shape), and its logits are replaced, row by row, by a one-hot of the token the recorded output has
after that row's position: a plain step emits the recorded token, and a verify step accepts a draft
iff it equals the recorded next token. So NGRAM runs with the real model's acceptance while every
piece of host work (drafting, grammar masks, commit, policy) and the forward of the other shape are
real: the end-to-end speed of NGRAM for a model this box cannot run, or has no weights for.

A row whose path left the recorded output is never on an accepted path (one of its ancestors
disagreed with the record, so its parent's row rejected it), so its one-hot is harmless.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from ngrammar.runner.transfer import to_device


class ReplayTarget:
    """Recorded greedy outputs, keyed by prompt token ids: ``records[prompt] = prompt + output``."""

    def __init__(self, records: Mapping[tuple[int, ...], Sequence[int]], end_token: int) -> None:
        for prompt, tokens in records.items():
            if tuple(tokens[: len(prompt)]) != prompt:
                raise ValueError("a record must start with its prompt")
        self._records = {prompt: list(tokens) for prompt, tokens in records.items()}
        self.end_token = end_token  # what follows a record's last token (a run never gets there)

    @classmethod
    def from_outputs(
        cls, outputs: Iterable[tuple[Sequence[int], Sequence[int]]], end_token: int
    ) -> ReplayTarget:
        """From (prompt ids, output ids) pairs, e.g. each ``RequestOutput``'s prompt and first completion."""
        return cls({tuple(p): list(p) + list(o) for p, o in outputs}, end_token)

    def record(self, prompt: Sequence[int]) -> list[int]:
        found = self._records.get(tuple(prompt))
        if found is None:
            raise KeyError("no recorded output for this prompt: replay needs one per request")
        return found

    def targets(self, prompt: Sequence[int], positions: Iterable[int]) -> list[int]:
        """The recorded token after each position (the token at ``position + 1``)."""
        tokens, end = self.record(prompt), self.end_token
        return [tokens[p + 1] if p + 1 < len(tokens) else end for p in positions]

    def apply(self, logits: torch.Tensor, targets: Sequence[int]) -> None:
        """Overwrite ``logits`` [R, V] in place: row r is 0 at ``targets[r]`` and -inf elsewhere
        (greedy and sampling both draw the target; a grammar mask applied after leaves it)."""
        index = to_device(np.asarray(targets, dtype=np.int64), torch.int64, logits.device)
        logits.fill_(float("-inf"))
        logits.scatter_(1, index[:, None], 0.0)
