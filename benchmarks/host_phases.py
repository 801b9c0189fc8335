"""Where an engine step's host time goes: inclusive wall time of named engine methods per step.

cProfile inflates cheap Python calls several times over, so on a host-bound GPU step it cannot tell
a 20 µs phase from a 60 µs one. ``PhaseTimer`` instead wraps a fixed list of engine methods on their
classes (one ``perf_counter`` pair per call, ~0.3 µs) while a generation runs, and reports each
one's time and calls per engine step. Phases nest (``forward`` contains ``stage`` and ``replay``),
so the table is read as a tree, not summed. ``op_costs`` times single CUDA calls the step makes.

    python -m benchmarks.profile_step --model /tmp/ngm/model.gguf --phases
"""

from __future__ import annotations

import functools
import pkgutil
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# (phase name, dotted owner, attribute): the engine's step, nested by indentation in the table.
ENGINE_PHASES: tuple[tuple[str, str, str], ...] = (
    ("step", "ngrammar.engine.engine.LLMEngine", "step"),
    ("  chainable", "ngrammar.engine.engine.LLMEngine", "_chainable"),
    ("  launch decode", "ngrammar.engine.engine.LLMEngine", "_launch_decode"),
    ("  forward", "ngrammar.runner.model_runner.ModelRunner", "forward"),
    ("    accepts", "ngrammar.runner.cuda_graph.CUDAGraphRunner", "accepts"),
    ("    graph forward", "ngrammar.runner.cuda_graph.CUDAGraphRunner", "forward"),
    ("      stage", "ngrammar.runner.cuda_graph.CUDAGraphRunner", "_stage"),
    ("        upload", "ngrammar.runner.cuda_graph.CUDAGraphRunner", "_upload"),
    ("      graph replay", "torch.cuda.CUDAGraph", "replay"),
    ("  read wait", "ngrammar.runner.model_runner.PendingRead", "wait"),
    ("  commit", "ngrammar.engine.engine.LLMEngine", "_commit"),
    ("    append_tokens", "ngrammar.engine.sequence.Sequence", "append_tokens"),
    ("  observe", "ngrammar.engine.engine.LLMEngine", "_observe"),
    ("  sample", "ngrammar.engine.engine.LLMEngine", "_sample"),
    ("    to_host_async", "ngrammar.runner.model_runner.ModelRunner", "to_host_async"),
    ("    grammar rows", "ngrammar.engine.grammar_rows.GrammarRows", "apply_plain"),
    ("      settle grammars", "ngrammar.engine.grammar_rows.GrammarRows", "settle"),
    ("      fill rows (pool)", "ngrammar.grammar.fill_pool.GrammarFillPool", "fill_rows"),
    ("      apply bitmask", "ngrammar.grammar", "apply_bitmask"),
    ("  index plain step", "ngrammar.engine.verify_step.NgramSpecWorker", "index_plain_step"),
    ("  choose width", "ngrammar.engine.verify_step.NgramSpecWorker", "choose_width"),
    ("  schedule", "ngrammar.engine.scheduler.Scheduler", "schedule"),
    ("  verify", "ngrammar.engine.verify_step.NgramSpecWorker", "launch_verify"),
    ("    draft (propose)", "ngrammar.speculative.proposer.DraftProposer", "propose"),
    ("      corpus trees (batch_get)", "ngrammar.speculative.corpus.NgramCorpus", "batch_get"),
    ("    step input", "ngrammar.engine.verify_step.NgramSpecWorker", "_step_input"),
    ("    index outputs", "ngrammar.speculative.upkeep.CorpusUpkeep", "index_outputs"),
    ("    grammar tree masks", "ngrammar.engine.grammar_rows.GrammarRows", "apply_tree"),
    ("    accept graph", "ngrammar.runner.cuda_graph.CUDAGraphRunner", "accept"),
    ("    compact KV", "ngrammar.runner.model_runner.ModelRunner", "compact_accepted_kv"),
    ("  verify commit", "ngrammar.engine.engine.LLMEngine", "_commit_verify"),
    ("  outputs", "ngrammar.engine.engine.LLMEngine", "_collect_outputs"),
)


class PhaseTimer:
    """While entered, each listed method (or module function, looked up where it is defined and
    re-imported at each call) accumulates its inclusive wall time and call count.

    Recursion-safe only in the sense that nested calls of the *same* method are counted twice; none
    of the engine phases recurse."""

    def __init__(self, phases: Sequence[tuple[str, str, str]] = ENGINE_PHASES) -> None:
        self.phases = list(phases)
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved: list[tuple[type, str, Any]] = []

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += clock() - t
                calls[name] += 1

        return timed

    def __enter__(self) -> PhaseTimer:
        try:
            for name, owner, attr in self.phases:
                cls = pkgutil.resolve_name(owner)
                original = cls.__dict__[attr]
                self._saved.append((cls, attr, original))
                setattr(cls, attr, self._wrap(name, original))
        except Exception:
            self.__exit__()  # a name that does not resolve: leave no method wrapped
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, attr, original in reversed(self._saved):
            setattr(cls, attr, original)
        self._saved.clear()

    def per_step(self, steps: int) -> Iterator[tuple[str, float, float]]:
        """(phase, µs per engine step, calls per engine step) for every phase that ran."""
        if steps <= 0:
            raise ValueError("no engine step ran")
        for name, _, _ in self.phases:
            if self.calls.get(name):
                yield name, 1e6 * self.seconds[name] / steps, self.calls[name] / steps


def op_costs(n: int = 200) -> dict[str, float]:
    """Host µs per call of the CUDA operations a plain decode step issues (launch cost only: the
    device is synchronized outside the timed calls)."""
    if not torch.cuda.is_available():
        return {}
    dev = torch.device("cuda")
    logits = torch.randn(1, 49152, device=dev)
    ids = torch.zeros(8, dtype=torch.int64, device=dev)
    tok = torch.zeros(1, dtype=torch.int64, device=dev)
    host = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
    raw = torch.zeros(4096, dtype=torch.uint8, device=dev)
    ops: dict[str, Callable[[], Any]] = {
        "argmax [1, 49152]": lambda: logits.argmax(dim=-1),
        "empty pinned [1]": lambda: torch.empty((1,), dtype=torch.int64, pin_memory=True),
        "d2h copy non_blocking [1]": lambda: host[:8].view(torch.int64).copy_(tok, non_blocking=True),
        "h2d copy non_blocking 4 KB": lambda: raw.copy_(host, non_blocking=True),
        "slice + d2d copy [1]": lambda: ids[:1].copy_(tok),
        "Event() + record": lambda: torch.cuda.Event().record(),
        "event synchronize (done)": _done_event().synchronize,
    }
    out = {}
    for name, op in ops.items():
        op()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            op()
        out[name] = 1e6 * (time.perf_counter() - t) / n
        torch.cuda.synchronize()
    return out


def graph_launch_us(graph: Any, n: int = 50) -> float:
    """Host µs of one ``replay()`` call of a captured graph, the device idle when it is called."""
    total = 0.0
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        total += time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * total / n


def _done_event() -> Any:
    e = torch.cuda.Event()
    e.record()
    torch.cuda.synchronize()
    return e
