"""Sampling on the device: temperature, top-k, top-p, min-p and counter-based seeded randomness.

Randomness is a hash of (request seed, sequence position, column, stream), not a stateful
generator: a request's draws do not depend on what else is in the batch, every row needs no Python
loop, and CUDA graphs can capture it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ngrammar.runner.transfer import to_device
from ngrammar.sampling_params import SamplingParams

_M1 = 0x7FEB352D  # multipliers below 2**31 keep every product of 32-bit values inside int64
_M2 = 0x5F356495
_MASK32 = 0xFFFFFFFF

STREAM_SAMPLE = 0  # plain sampling noise over the vocabulary
STREAM_TREE_COIN = 1  # one coin per draft node
STREAM_FINAL_COIN = 2  # the residual / bonus draw of a verify step


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def hash_uniform(seeds: torch.Tensor, offsets: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """[R, width] float32 uniforms strictly inside (0, 1), a pure function of the inputs."""
    base = _mix32((seeds & _MASK32) ^ _mix32((offsets * 4 + stream) & _MASK32))  # [R]
    cols = torch.arange(width, device=seeds.device, dtype=torch.int64)
    bits = _mix32(base[:, None] ^ _mix32(cols + 0x9E3779B)[None, :])
    return unit_interval(bits)


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 strictly inside (0, 1), from their top 23 bits: (k + 0.5) / 2^23 is
    exact in float32 for every k < 2^23. (With 24 bits, k = 2^24 - 1 rounded up to exactly 1.0, where
    the sampler's -log(u) is 0: that column won the race whatever its probability, as inf, or as NaN
    when it had none - a grammar-masked token.)"""
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row parameters on the device; ``all_greedy`` and ``needs_sort`` are host flags."""

    temperature: torch.Tensor  # [R] float32 (0 for greedy rows)
    top_p: torch.Tensor  # [R]
    top_k: torch.Tensor  # [R] int64, 0 = off
    min_p: torch.Tensor  # [R]
    seeds: torch.Tensor  # [R] int64
    offsets: torch.Tensor  # [R] int64: the sequence length at the draw, so reruns repeat it
    all_greedy: bool
    needs_sort: bool
    needs_min_p: bool

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        offsets: Sequence[int],
        device: torch.device,
    ) -> SamplingTensors:
        # Two host->device copies (float and int parameters), not one per field.
        temps = [0.0 if p.greedy else p.temperature for p in params]  # (a tiny temperature is greedy)
        floats = to_device(
            [temps, [p.top_p for p in params], [p.min_p for p in params]], torch.float32, device
        )
        ints = to_device([[p.top_k for p in params], list(seeds), list(offsets)], torch.int64, device)
        return cls(
            temperature=floats[0],
            top_p=floats[1],
            top_k=ints[0],
            min_p=floats[2],
            seeds=ints[1],
            offsets=ints[2],
            all_greedy=all(p.greedy for p in params),
            needs_sort=any(p.top_k > 0 or p.top_p < 1 for p in params),
            needs_min_p=any(p.min_p > 0 for p in params),
        )

    def repeat(self, times: int) -> SamplingTensors:
        """Each row repeated ``times`` times (one per draft node of a verify step)."""

        def r(x: torch.Tensor) -> torch.Tensor:
            return x.repeat_interleave(times)

        return SamplingTensors(
            r(self.temperature),
            r(self.top_p),
            r(self.top_k),
            r(self.min_p),
            r(self.seeds),
            r(self.offsets),
            self.all_greedy,
            self.needs_sort,
            self.needs_min_p,
        )


def target_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[R, V] the distribution each row samples from; greedy rows become one-hot at the argmax."""
    greedy = st.temperature == 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    probs = torch.softmax(logits.float() / temp[:, None], dim=-1)
    if st.needs_min_p:
        top = probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < st.min_p[:, None] * top, 0.0, probs)
    if st.needs_sort:
        probs = _top_k_top_p(probs, st.top_k, st.top_p)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # keep a token while the mass before it < top_p
    keep = (rank < k) & ((mass_before < top_p[:, None]) | (rank == 0))
    return torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[R] sampled token ids (exponential-race sampling with hashed noise)."""
    if st.all_greedy:
        return logits.argmax(dim=-1)
    probs = target_probs(logits, st)
    u = hash_uniform(st.seeds, st.offsets, probs.shape[-1], STREAM_SAMPLE)
    return (probs / -torch.log(u)).argmax(dim=-1)
