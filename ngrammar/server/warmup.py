"""Warm-up before a server says it is healthy: every kernel shape a request can hit is compiled at
start, so no request pays a compile.

CUDA graphs are captured when the engine is built (``LLMEngine.enable_cuda_graphs``); what is left
compiles lazily on first use: Triton's kernels for prefill chunks, prefix-cache hits, mixed steps,
decode and verify widths, and grammar-masked steps. ``warm_up`` runs requests of each kind through
the engine, and ``CompileCounter`` counts Triton compilations (0 where no kernel is compiled, as on
a CPU), so /metrics can show that none happens after the start.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

from ngrammar.engine.stats import EngineStats
from ngrammar.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ngrammar.engine.engine import LLMEngine

_WARM_PROMPT = "Warm-up: the quick brown fox jumps over the lazy dog. " * 8
_WARM_TOKENS = 8


class CompileCounter:
    """Triton kernel compilations in this process since it was installed (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self._chained: Any = None

    def install(self) -> CompileCounter:
        try:
            import triton.knobs
        except ImportError:  # no Triton: nothing is ever compiled
            return self
        hooks = triton.knobs.runtime
        self._chained = hooks.jit_post_compile_hook
        hooks.jit_post_compile_hook = self._on_compile
        return self

    def _on_compile(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.count += 1
        return None if self._chained is None else self._chained(*args, **kwargs)


def warm_up(engine: LLMEngine, counter: CompileCounter) -> int:
    """Run one request of every shape class through the (idle) engine; returns the compilations.

    A prompt long enough for several prefill pages, the same prompt again (a prefix-cache hit: its
    prefill starts on cached pages), a batch that decodes while another prefills (a mixed step), a
    grammar-masked request, and n = 2 (batched decode). With NGRAM on, the repeated prompt drafts
    from the corpus, so verify steps run too. A CPU engine runs eager torch ops, which compile
    nothing: it is not warmed up."""
    before = counter.count
    if engine.device.type != "cuda":
        return 0
    greedy = SamplingParams(max_tokens=_WARM_TOKENS, temperature=0, ignore_eos=True)
    batches: list[list[tuple[str, SamplingParams]]] = [
        [(_WARM_PROMPT, greedy)],
        [(_WARM_PROMPT, greedy), (_WARM_PROMPT[::-1], greedy)],
        [("Reply in JSON.", SamplingParams(max_tokens=_WARM_TOKENS, temperature=0, json_object=True))],
        [(_WARM_PROMPT, SamplingParams(max_tokens=_WARM_TOKENS, temperature=0.8, n=2, seed=0))],
    ]
    for i, batch in enumerate(batches):
        for j, (prompt, params) in enumerate(batch):
            engine.add_request(prompt, params, f"warm-up-{i}-{j}", stream=False)
        while engine.has_unfinished():
            engine.step()
    _reset_counts(engine)
    return counter.count - before


def _reset_counts(engine: LLMEngine) -> None:
    """The warm-up's requests are nobody's: the statistics start from zero after it (in place: the
    engine's parts hold the stats object)."""
    fresh = EngineStats()
    for f in dataclasses.fields(EngineStats):
        setattr(engine.stats, f.name, getattr(fresh, f.name))
    engine.blocks.query_tokens = engine.blocks.hit_tokens = 0
