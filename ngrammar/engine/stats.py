"""Engine counters (``EngineStats``), the per-step trace (``StepRecord``) and the timed forward."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from ngrammar.runner.model_runner import ModelRunner, StepInput

StepKind = Literal["chain", "decode", "verify", "prefill", "mixed", "idle"]


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for ``LLMEngine.step_trace`` (where a benchmark's time goes, step by step)."""

    # "chain": a plain step launched before the previous one was read back; "decode": a plain one
    # launched from committed state; "mixed": decode tokens of running sequences and prefill chunks
    # in one forward
    kind: StepKind
    batch_size: int  # sequences in the step (prefill: chunks)
    width: int  # draft width (1: plain)
    start: float  # perf_counter() at the start of the engine step
    seconds: float  # the engine step's wall time
    host_seconds: float  # of which host drafting / corpus indexing and grammar masks
    reason: str = ""  # decode steps with NGRAM: why the draft policy chose the width (``policy.REASONS``)
    shadow_seconds: float = 0.0  # of ``host_seconds``, shadow drafts (``CorpusUpkeep._shadow_step``)


@dataclass
class EngineStats:
    steps: int = 0
    chained_steps: int = 0  # decode steps launched before the previous step was read back
    chained_out_of_verify: int = 0  # ... of which the previous step was a verify step
    chained_mixed: int = 0  # ... of which prefilled prompts too (a chained mixed step)
    chained_into_verify: int = 0  # verify steps launched before the plain step before them was read back
    policy_drains: int = 0  # chains the draft policy broke for a verify step (overlap scheduling)
    # ... after which the next decode step was plain after all: the policy, seeing the committed
    # token, called the verify step off (or the batch changed: a member finished on that token)
    false_drains: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    mixed_steps: int = 0  # steps that decoded running sequences and prefilled others in one forward
    verify_steps: int = 0  # sequence-steps verified with a draft tree
    verify_emitted: int = 0  # tokens those verify steps emitted, bonus included
    spec_steps: int = 0  # batched verify steps
    pipelined_steps: int = 0  # ... of which left in flight (``EngineConfig.pipeline_verify``)
    prepared_trees: int = 0  # trees drafted ahead, while a verify forward ran, for its likely outcome
    prepared_hits: int = 0  # ... that the outcome matched: the next step verified them undrafted
    draft_seconds: float = 0.0  # host drafting (corpus match + tree build) and corpus indexing
    shadow_trees: int = 0  # shadow trees drafted during plain steps (``ShadowDrafts``)
    shadow_samples: int = 0  # ... walked to a decision and taught to the draft policy
    shadow_seconds: float = 0.0  # host time of both
    grammar_seconds: float = 0.0  # host grammar masks (links + DFS), overlapped with the forward
    grammar_pruned_nodes: int = 0  # draft nodes a grammar forbade, dropped before the verify launch
    trimmed_nodes: int = (
        0  # tree nodes (padding, forbidden drafts) verify steps did not compute: B * (D - D')
    )
    vetoed_steps: int = 0  # verify steps called off: no draft was left to verify (a plain step ran)
    verify_seconds: float = 0.0  # whole verify steps
    # Host time from a verify step's result landing on the host to the next forward's launch: what
    # the device idles through between the two forwards (``verify_gaps`` of them).
    verify_gap_seconds: float = 0.0
    verify_gaps: int = 0
    gap_start: float | None = None  # perf_counter() when the last verify result landed (gap open)
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    last_step_seconds: float = 0.0
    finished_requests: int = 0
    # Prefix cache: prompt tokens of first admissions looked up, and of those found cached.
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def avg_spec_accept_length(self) -> float:
        return self.verify_emitted / self.verify_steps if self.verify_steps else 0.0


def timed_forward(runner: ModelRunner, step: StepInput, stats: EngineStats) -> torch.Tensor:
    """``runner.forward`` with its launch time added to ``stats.forward_seconds``; it closes the
    gap since the last verify result landed (``verify_gap_seconds``)."""
    t = time.perf_counter()
    if stats.gap_start is not None:
        stats.verify_gap_seconds += t - stats.gap_start
        stats.verify_gaps += 1
        stats.gap_start = None
    logits = runner.forward(step)
    stats.forward_seconds += time.perf_counter() - t
    return logits
