"""Piecewise CUDA graphs for the steps the uniform graphs cannot serve: prefill and mixed steps.

A mixed step (decode rows plus prefill chunks) has variable per-sequence query lengths, so it
cannot replay a whole-step graph; run eagerly, its ~300 launches cost the host several ms, and
under continuous arrivals (a server at 256 streams) nearly every step is one. Here everything
between two attention calls (embedding, norms, projections, MLPs, the final norm) is captured once
per token bucket and replayed; attention alone runs eagerly, on the step's real tokens and the
step's own plan, between the replays.

Capture: the model runs once per bucket with a ``SegmentCut`` as its plan. The attention backend
hands each layer's call to the cut, which ends the graph being captured, keeps that layer's q, k, v
and RoPE tables (tensors of the graph's pool, at fixed addresses) and an output buffer, and begins
the next graph. A bucket of L layers has L + 1 graphs sharing one pool.

Replay of T tokens in bucket Tb >= T: ids and positions copied into the static buffers (rows T..Tb
keep stale, valid values), graph 0, then per layer the eager attention on rows [:T] into the output
buffer and the next graph. Rows past T only ever meet row-wise operations (every projection, norm
and MLP treats each token alone), so their stale values never reach a real row, and attention (the
only op across rows) sees real rows only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ngrammar.attention.metadata import SegmentCut
from ngrammar.runner.cuda_graph import buckets

if TYPE_CHECKING:
    from ngrammar.model.llama import LlamaForCausalLM

# Token buckets: fine steps where small prefills land, every 64 tokens above 128.
_SMALL_BUCKETS = (16, 32, 64, 96, 128)
_LARGE_STEP = 64


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets of the piecewise graphs, up to and including ``max_tokens``."""
    return buckets(max_tokens, _SMALL_BUCKETS, _LARGE_STEP)


@dataclass
class _Layer:
    """What one layer's attention call saw during capture (all [Tb, ...] tensors of the pool)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer_cache: torch.Tensor
    scale: float
    rope: tuple[torch.Tensor, torch.Tensor] | None
    out: torch.Tensor  # [Tb, Hq, d]: the eager attention's output, read by the next graph (a view of
    # a buffer every bucket shares: replays never overlap)


@dataclass
class _Bucket:
    tokens: int
    graphs: list[Any] = field(default_factory=list)  # torch.cuda.CUDAGraph, L + 1 of them
    layers: list[_Layer] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [Tb, hidden]: the last graph's output


class _Capture(SegmentCut):
    """The plan of a capture run: each attention call ends one graph and begins the next."""

    def __init__(self, bucket: _Bucket, pool: Any, capture: bool, outs: list[torch.Tensor]) -> None:
        self.bucket = bucket
        self.pool = pool
        self.capture = capture  # False: the warm-up run (compiles the segments' kernels)
        # Each layer's attention output, shared by every bucket (made by the largest, captured first)
        self.outs = outs
        self.layer = 0

    def begin(self) -> None:
        if self.capture:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            self.bucket.graphs.append(graph)

    def end(self) -> None:
        if self.capture:
            self.bucket.graphs[-1].capture_end()

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        self.end()
        if self.layer == len(self.outs):
            self.outs.append(torch.zeros(q.shape, dtype=layer_cache.dtype, device=q.device))
        out = self.outs[self.layer][: q.shape[0]]
        self.layer += 1
        if self.capture:
            self.bucket.layers.append(_Layer(q, k, v, layer_cache, scale, rope, out))
        self.begin()
        return out


class PiecewiseGraphs:
    """Eager-shaped steps of up to ``max_tokens`` tokens (prefill, mixed) served from per-bucket
    segment graphs; ``forward`` takes the step's ids, positions and attention plan."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_tokens: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = max_tokens
        device = kv_cache.device
        self._ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._pool = torch.cuda.graph_pool_handle()
        self._outs: list[torch.Tensor] = []
        self._entries: dict[int, _Bucket] = {}
        self.replays: Counter[int] = Counter()  # per bucket (tests, benchmarks)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket, largest first, into one pool (a smaller bucket reuses what a larger one
        freed; replays never overlap)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for tokens in reversed(self.buckets):
                self._entries[tokens] = self._capture(tokens)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _capture(self, tokens: int) -> _Bucket:
        bucket = _Bucket(tokens)
        ids, positions = self._ids[:tokens], self._positions[:tokens]
        for capture in (False, True):  # a warm-up run compiles every kernel before capturing
            cut = _Capture(bucket, self._pool, capture, self._outs)
            torch.cuda.synchronize()
            cut.begin()
            hidden = self.model(ids, positions, self.kv_cache, cut)
            cut.end()
        bucket.hidden = hidden
        return bucket

    def accepts(self, tokens: int) -> bool:
        return 0 < tokens <= self.max_tokens

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: Any, backend: Any) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's T = len(ids) tokens; ``plan``: the backend's plan
        for the step's real metadata. Valid until the next replay of the same bucket."""
        t = ids.shape[0]
        bucket = self._entries[next(b for b in self.buckets if b >= t)]
        self.replays[bucket.tokens] += 1
        self._ids[:t].copy_(ids)
        self._positions[:t].copy_(positions)
        bucket.graphs[0].replay()
        for layer, graph in zip(bucket.layers, bucket.graphs[1:]):
            rope = None if layer.rope is None else (layer.rope[0][:t], layer.rope[1][:t])
            out = backend.forward(
                layer.q[:t], layer.k[:t], layer.v[:t], layer.layer_cache, plan, layer.scale, rope
            )
            layer.out[:t].copy_(out)
            graph.replay()
        assert bucket.hidden is not None
        return bucket.hidden[:t]
