"""Piecewise CUDA graphs for the steps the uniform graphs cannot serve: prefill and mixed steps.

A mixed step (decode rows plus prefill chunks) has variable per-sequence query lengths, so it
cannot replay a whole-step graph; run eagerly, its ~300 launches cost the host several ms, and
under continuous arrivals (a server at 256 streams) nearly every step is one. Here everything
between two attention calls (embedding, norms, projections, MLPs, the final norm) is captured once
per token bucket and replayed; attention alone runs eagerly, on the step's real tokens and the
step's own plan, between the replays.

Capture: the model runs once per bucket with a ``SegmentCut`` as its plan. The model hands each
layer's attention call to the cut, which copies q, k, v into that layer's static buffers (inside the
graph being captured), ends that graph and begins the next; the next graph reads the layer's static
output buffer. A bucket of L layers has L + 1 graphs. The static buffers are sized for the largest
bucket and shared by all (replays never overlap), and every graph draws on one pool, so memory
follows the largest bucket, not the sum of them.

Replay of T tokens in bucket Tb >= T: ids and positions copied into the static buffers (rows T..Tb
keep stale, valid values), graph 0, then per layer the eager attention on rows [:T] into the output
buffer and the next graph. Rows past T only ever meet row-wise operations (every projection, norm
and MLP treats each token alone), so their stale values never reach a real row, and attention (the
only op across rows) sees real rows only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ngrammar.attention.metadata import AttentionBackend, SegmentCut
from ngrammar.model.llama import LlamaForCausalLM
from ngrammar.runner.cuda_graph import bucket_table, buckets

# Token buckets: fine steps where small prefills land, every 64 tokens above 128.
_SMALL_BUCKETS = (16, 32, 64, 96, 128)
_LARGE_STEP = 64


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets of the piecewise graphs, up to and including ``max_tokens``."""
    return buckets(max_tokens, _SMALL_BUCKETS, _LARGE_STEP)


@dataclass(frozen=True)
class _Layer:
    """One layer's attention call at the largest bucket: inputs the graph before it copies in, the
    output the graph after it reads ([max_tokens, heads, d] each), and its constants."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    layer_cache: torch.Tensor
    scale: float


@dataclass(frozen=True)
class _Bucket:
    graphs: list[torch.cuda.CUDAGraph]  # L + 1, replayed in order with attention between
    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [Tb, 1, d/2] that graph 0 gathers
    hidden: torch.Tensor  # [Tb, hidden]: the last graph's output


def _buffer(x: torch.Tensor) -> torch.Tensor:
    """A contiguous zeroed buffer of ``x``'s shape (q, k, v arrive as views of one projection)."""
    return torch.zeros(x.shape, dtype=x.dtype, device=x.device)


class _Cut(SegmentCut):
    """The plan of one run of the model: each attention call copies its inputs into the layer's
    static buffers and returns the layer's static output; with ``graphs`` (not the warm-up run)
    the call also ends the graph being captured and begins the next."""

    def __init__(self, layers: list[_Layer], pool: Any, graphs: list[torch.cuda.CUDAGraph] | None) -> None:
        self.layers = layers  # filled by the first run (the largest bucket's warm-up)
        self.pool = pool  # torch.cuda.graph_pool_handle()
        self.graphs = graphs
        self.capturing = False
        self.index = 0
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin(self) -> None:
        if self.graphs is not None:
            self.graphs.append(torch.cuda.CUDAGraph())
            self.graphs[-1].capture_begin(pool=self.pool)
            self.capturing = True

    def end(self) -> None:
        if self.capturing:
            self.capturing = False
            self.graphs[-1].capture_end()  # type: ignore[index]

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        if self.index == len(self.layers):
            out = torch.zeros(q.shape, dtype=layer_cache.dtype, device=q.device)
            self.layers.append(_Layer(_buffer(q), _buffer(k), _buffer(v), out, layer_cache, scale))
        layer, t = self.layers[self.index], q.shape[0]
        self.index += 1
        for static, x in ((layer.q, q), (layer.k, k), (layer.v, v)):
            static[:t].copy_(x)
        self.rope = rope
        self.end()
        self.begin()
        return layer.out[:t]


class PiecewiseGraphs:
    """Eager-shaped steps of up to ``max_tokens`` tokens (prefill, mixed) served from per-bucket
    segment graphs (``forward``)."""

    def __init__(
        self, model: LlamaForCausalLM, backend: AttentionBackend, kv_cache: torch.Tensor, max_tokens: int
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = max_tokens
        self._bucket_of = bucket_table(self.buckets)
        self._ids = torch.zeros(max_tokens, dtype=torch.int64, device=kv_cache.device)
        self._positions = torch.zeros(max_tokens, dtype=torch.int64, device=kv_cache.device)
        self._pool = torch.cuda.graph_pool_handle()
        self._layers: list[_Layer] = []
        self._entries: dict[int, _Bucket] = {}
        self.replays: Counter[int] = Counter()  # per bucket (tests, benchmarks)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket, largest first (its warm-up sizes the static buffers), on a side stream."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for tokens in reversed(self.buckets):
                self._entries[tokens] = self._capture(tokens)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _capture(self, tokens: int) -> _Bucket:
        self._run(_Cut(self._layers, self._pool, None), tokens)  # warm-up: compiles every kernel
        graphs: list[torch.cuda.CUDAGraph] = []
        cut = _Cut(self._layers, self._pool, graphs)
        hidden = self._run(cut, tokens)
        return _Bucket(graphs, cut.rope, hidden)

    def _run(self, cut: _Cut, tokens: int) -> torch.Tensor:
        """The model over the first ``tokens`` static ids / positions, cut at every attention call.
        A failure mid-capture ends the capture first: a stream left capturing fails every later
        CUDA call with an error that hides this one."""
        torch.cuda.synchronize()
        cut.begin()
        try:
            hidden = self.model(self._ids[:tokens], self._positions[:tokens], self.kv_cache, cut)
        finally:
            cut.end()
        return hidden

    def accepts(self, tokens: int) -> bool:
        return 0 < tokens <= self.max_tokens

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: object) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's T = len(ids) tokens; ``plan``: the backend's plan
        for the step's real metadata. A view of the pool: read it before any other replay."""
        t = ids.shape[0]
        tokens = self._bucket_of[t]
        bucket = self._entries[tokens]
        self.replays[tokens] += 1
        self._ids[:t].copy_(ids)
        self._positions[:t].copy_(positions)
        bucket.graphs[0].replay()
        rope = None if bucket.rope is None else (bucket.rope[0][:t], bucket.rope[1][:t])
        for layer, graph in zip(self._layers, bucket.graphs[1:]):
            q, k, v = layer.q[:t], layer.k[:t], layer.v[:t]
            layer.out[:t].copy_(self.backend.forward(q, k, v, layer.layer_cache, plan, layer.scale, rope))
            graph.replay()
        return bucket.hidden[:t]
