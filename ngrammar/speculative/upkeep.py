"""Corpus upkeep: what keeps drafting good between verify steps, in host time a step can spare.

The shared corpus indexes each step's committed tokens (``index_outputs``: after a verify launch,
while the device computes; after a plain launch only when cheap next to the step or hidden in the
host's idle time, ``index_plain_step``), and the adaptive policy's shadow trees
(``ShadowDrafts``) are drafted and resolved in what that leaves. Nothing here touches the KV
cache, the scheduler or a step's drafts: it only feeds the corpus and the policy.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ngrammar.speculative.corpus import NgramCorpus
from ngrammar.speculative.shadow import ShadowDrafts
from ngrammar.speculative.step_costs import NO_GRAMMAR

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from ngrammar.config import SpeculativeConfig
    from ngrammar.engine.stats import EngineStats
    from ngrammar.speculative.policy import DraftPolicy
    from ngrammar.speculative.request import DraftRequest

# Plain steps index their tokens while that costs at most this share of a plain step, or fits in
# the host's idle time (``index_plain_step``); one in PLAIN_INDEX_RETRY skipped steps indexes one
# sequence anyway, re-measuring the cost.
PLAIN_INDEX_SHARE = 0.03
PLAIN_INDEX_RETRY = 32
# Of a plain step's idle host time, this share is kept free when indexing fills the rest: the
# wait varies from step to step, and a step whose host work outlasts its forward delays the chain.
IDLE_MARGIN = 0.25
# A commit that waited less than this share of a plain step: the host is the bottleneck.
HOST_BOUND = 0.05
# A plain step that took at most this many plain steps' time hid its host work (``_idle_seconds``).
HIDDEN_SLACK = 1.1
# Shadow drafts (``ShadowDrafts``) may take this share of a plain step where the host has no idle
# time (a CPU, or a host-bound step): about one member's trees per step at batch 1 on a CPU.
SHADOW_SHARE = 0.005


class CorpusUpkeep:
    """Indexing budgets and shadow drafts for one worker's corpus and policy."""

    def __init__(
        self,
        config: SpeculativeConfig,
        corpus: NgramCorpus,
        policy: DraftPolicy,
        stats: EngineStats,
        device: torch.device,
    ) -> None:
        self.config = config
        self.corpus = corpus
        self.policy = policy
        self.stats = stats
        self.device = device
        self.shadows = ShadowDrafts(corpus, policy.widths[1:])
        # Past this many tokens a catch-up indexes only the last max_trie_depth positions, which
        # costs ~depth^2/2 window inserts instead of depth per token: a long catch-up at a large
        # batch outlasts the verify forward it hides behind.
        self._max_catch_up = config.max_trie_depth // 2
        self._index_cost: float | None = None  # seconds per token indexed (moving average)
        self._plain_skips = 0  # plain steps that skipped indexing (every PLAIN_INDEX_RETRY-th re-measures)
        self._plain_host_seconds = 0.0  # host time the last plain step spent indexing and shadow drafting
        self._plain_host_step = -2  # ``EngineStats.steps`` when it was spent (during that engine step)

    def on_admit(self, seq: DraftRequest) -> None:
        if self.config.index_prompt:
            self.corpus.index_prompt(seq.seq_id, seq.prompt_token_ids)

    def index_outputs(self, seqs: Sequence[DraftRequest], budget: float | None = None) -> None:
        """Insert the windows ending at each sequence's tokens committed since it was last indexed.

        Called right after a verify forward is launched (and after a plain one, see
        ``index_plain_step``), so on a GPU the insertion runs while the device computes; a step's
        drafts see the trie as of the previous step (only windows ending in the newest tokens are
        missing, which a draft almost never needs). After a stretch longer than ``max_catch_up``
        tokens went unindexed only its positions among the last ``max_trie_depth`` are indexed,
        so a catch-up stays one step's worth of work.

        ``budget`` (seconds): the sequences furthest behind go first, and indexing stops once the
        budget is spent (after one sequence at least). A sequence left out stays behind, so it
        comes earlier next time; if it falls more than ``max_catch_up`` tokens behind, the stretch
        before its last ``max_trie_depth`` positions is never indexed (as after any long plain
        stretch). Without a budget a large batch's catch-up after a plain stretch outlasts the
        verify forward it is meant to hide behind."""
        t = time.perf_counter()
        corpus, depth = self.corpus, self.config.max_trie_depth
        tokens = 0
        if budget is not None:
            seqs = sorted(seqs, key=lambda s: corpus.indexed_length(s.seq_id) - len(s.token_ids))
        for seq in seqs:
            tokens += min(len(seq.token_ids) - corpus.indexed_length(seq.seq_id), depth)
            corpus.update(seq.seq_id, seq.token_ids, self._max_catch_up)
            if budget is not None and time.perf_counter() - t >= budget:
                break
        seconds = time.perf_counter() - t
        self.stats.draft_seconds += seconds
        if tokens > 0:
            # Indexing time only spikes upwards (a page fault, a GC pause): follow a cheaper
            # sample at once, a dearer one slowly.
            per_token = seconds / tokens
            old = self._index_cost
            self._index_cost = per_token if old is None or per_token < old else old + 0.2 * (per_token - old)

    def index_plain_step(self, seqs: Sequence[DraftRequest], read_wait: float, grammar: str) -> None:
        """Index a plain step's batch (its forward just launched) when that is cheap next to the step.

        A request that starts repeating itself while decoding plainly must find its repetition in
        the corpus, or its match length stays 0 and it never speculates again. But the insertion
        is host Python, and on a GPU at a large batch a plain step can be host-bound: indexing its
        tokens makes it measurably slower (benchmarks/results/LOG.md). So a
        plain step indexes while the measured cost stays under ``PLAIN_INDEX_SHARE`` of the step,
        or fits in the host's idle time (``_idle_seconds``): with overlap the host waits for
        the device on every chained step (a large share of it at small batches on an H200), and
        indexing there is free. On CUDA that time is a budget too (``index_outputs``). What plain
        steps leave unindexed, the next plain step or verify step catches up (bounded by
        ``max_catch_up``). Every ``PLAIN_INDEX_RETRY`` skipped steps one sequence of the batch
        (in turn) is indexed anyway, so that one inflated measurement cannot switch plain-step
        indexing off for good (a batch that never verifies would never re-measure it); one,
        because a whole batch's catch-up is what the rule keeps off a host-bound step. What the
        indexing leaves of the idle time goes to shadow drafts (``_shadow_step``). ``read_wait``:
        what the engine's last commit waited for the device (``LLMEngine.read_wait``); ``grammar``:
        the batch's grammar class (``step_costs.grammar_class``: plain steps are timed apart)."""
        plain = self.policy.costs.plain_seconds(len(seqs), grammar)
        cost = self._index_cost
        idle = 0.0 if plain is None else self._idle_seconds(plain, read_wait)
        allowed = None if plain is None else max(PLAIN_INDEX_SHARE * plain, idle)
        t = time.perf_counter()
        if allowed is None or cost is None or cost * len(seqs) <= allowed:
            # On CUDA the time allowed is also the budget: after a stretch of skipped steps every
            # member is behind, and catching all of them up at once is one step's worth of work
            # or more (it would stall the chain); the furthest behind go first, the rest later.
            self.index_outputs(seqs, allowed if self.device.type == "cuda" else None)
        else:
            self._plain_skips += 1
            if self._plain_skips % PLAIN_INDEX_RETRY == 0:
                self.index_outputs([seqs[(self._plain_skips // PLAIN_INDEX_RETRY) % len(seqs)]])
        # Shadows share the idle time with indexing, or have their own small share; none in a
        # constrained batch: they are corpus trees, and its verify steps draft under the grammar
        # (forced text, forbidden drafts dropped), which accepts far more (``policy.model``).
        if plain is not None and grammar == NO_GRAMMAR:
            self._shadow_step(seqs, max(SHADOW_SHARE * plain, idle - (time.perf_counter() - t)))
        self._plain_host_seconds = time.perf_counter() - t
        self._plain_host_step = self.stats.steps

    def _shadow_step(self, seqs: Sequence[DraftRequest], budget: float) -> None:
        """Walk the members' shadow trees against their committed tokens, teach the policy what
        the decided ones would have accepted, and draft new ones in ``budget`` seconds
        (``ShadowDrafts``). Only an adaptive policy with a draft width to pick learns; a fixed
        width, or D = 1, needs nothing."""
        if not self.policy.learns or not self.shadows.widths:
            return
        c = self.config
        if c.threshold_single < 1.0 or c.threshold_acc < 1.0:
            # Lenient thresholds accept more than the target's own choice would: a sampled
            # member's walk would price its verify steps low. Greedy members are unaffected.
            seqs = [s for s in seqs if s.params.greedy]
        t = time.perf_counter()
        shadows, stats = self.shadows, self.stats
        if len(shadows):
            samples = shadows.resolve(seqs)
            stats.shadow_samples += len(samples)
            for width in shadows.widths:
                self.policy.observe_shadow(
                    width,
                    [
                        (s.seq_id, s.match_length, s.accepted, s.censored, s.depth)
                        for s in samples
                        if s.width == width
                    ],
                )
        stats.shadow_trees += shadows.draft(seqs, budget - (time.perf_counter() - t))
        stats.shadow_seconds += time.perf_counter() - t

    def _idle_seconds(self, plain: float, wait: float) -> float:
        """Host time a plain step can spend indexing without delaying the device: what the last
        commit waited for it (``wait``: ``LLMEngine.read_wait``) plus what the last plain step spent
        indexing and shadow drafting (it would have waited that long too) if that work was hidden,
        at most a plain step (after a prefill the wait was that forward's), less ``IDLE_MARGIN`` of
        a plain step. A wait under ``HOST_BOUND`` of a plain step says the host is the bottleneck:
        nothing is idle. That work counts only if it was the engine's last step's (a prefill or a
        verify step in between spends none) and was hidden: that step took no longer than
        ``HIDDEN_SLACK`` plain steps: work that lengthened its step was not hidden, and counting
        it as idle would keep every later step that long."""
        if wait <= HOST_BOUND * plain:
            return 0.0
        stats = self.stats
        last = stats.steps == self._plain_host_step + 1 and stats.last_step_seconds <= HIDDEN_SLACK * plain
        return min(wait + (self._plain_host_seconds if last else 0.0), plain) - IDLE_MARGIN * plain

    def index_budget(self, batch_size: int, grammar: str) -> float | None:
        """Host seconds a verify step may spend indexing: a plain step's time at this batch size,
        a lower bound of the verify forward's that the indexing hides behind (the grammar masks
        and the KV compaction queue after it, in what remains of the forward). None: not timed
        yet, or not on CUDA, where the forward has finished before indexing starts (a CPU), so a
        budget would only lose n-grams."""
        if self.device.type != "cuda":
            return None
        return self.policy.costs.plain_seconds(batch_size, grammar)

    def forget(self, seq_ids: list[str]) -> None:
        self.shadows.forget(seq_ids)
