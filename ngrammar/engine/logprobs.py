"""Logprobs of emitted tokens: computed on the device with the step, packed for its one read."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from ngrammar.engine.sequence import Sequence
from ngrammar.outputs import TokenLogprob


def logprob_tensors(
    seqs: Seq[Sequence], logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor
) -> list[torch.Tensor]:
    """Logprobs of emitted tokens ([B, K]: row of ``logits`` and token of each, -1 past a run)
    plus the top-k; [] when no member asked for logprobs."""
    k = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
    if k is None:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    r = rows.clamp(min=0)
    chosen = logp[r, tokens.clamp(min=0)]  # [B, K]
    top = logp[r].topk(max(k, 1), dim=-1)  # [B, K, k]
    return [chosen, top.values, top.indices]


def unpack_logprobs(
    seqs: Seq[Sequence], host: list[torch.Tensor], counts: Seq[int]
) -> list[list[TokenLogprob]] | None:
    """Per member, the first ``counts[b]`` logprobs of ``logprob_tensors``' read-back tensors."""
    if not host:
        return None
    chosen, top_v, top_i = (t.tolist() for t in host)
    out: list[list[TokenLogprob]] = []
    for b, seq in enumerate(seqs):
        k = seq.params.logprobs or 0
        out.append(
            [
                TokenLogprob(0, chosen[b][j], tuple(zip(top_i[b][j][:k], top_v[b][j][:k])))
                for j in range(counts[b])
            ]
        )
    return out
