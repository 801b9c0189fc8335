"""NGRAM speculative step: draft on the host, launch the tree verify, mask and accept, commit.

One verify step for B sequences with D nodes each:
  1. ``DraftProposer.propose`` -> host DraftTree (tokens [B*D], ancestor mask [B, D, D]): n-gram,
     grammar-forced, field-memory and external-corpus drafts, trimmed (speculative/proposer.py);
  2. the verify forward is launched (host->device copies only; nothing is read back before it);
  3. while it runs: the corpus indexes the last step's tokens; host ``derive_tree_links`` + grammar
     DFS -> bitmask [B*D, V/32], copied in
     non-blocking and applied to all B*D logits rows;
  4. greedy or target-only sampling acceptance on the device;
  5. the accepted path's KV is moved next to the prefix on the device; one device->host read of the
     accepted tokens; commit (stop strings, EOS, max_tokens, the context end and grammar termination
     cut the run), release the pages past the kept KV.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from ngrammar.config import SpeculativeConfig
from ngrammar.engine.sequence import Sequence
from ngrammar.runner.model_runner import StepInput, move_kv_slots
from ngrammar.runner.sampler import (
    STREAM_FINAL_COIN,
    STREAM_TREE_COIN,
    SamplingTensors,
    hash_uniform,
    target_probs,
)
from ngrammar.runner.transfer import to_device
from ngrammar.speculative.corpus import NgramCorpus
from ngrammar.speculative.external import DraftCorpora
from ngrammar.speculative.field_memory import FieldMemory
from ngrammar.speculative.forced import forced_text
from ngrammar.speculative.policy import MAX_MATCH, make_policy
from ngrammar.speculative.proposer import DraftProposer, Proposal
from ngrammar.speculative.shadow import ShadowDrafts
from ngrammar.speculative.tree import DraftTree, derive_tree_links
from ngrammar.speculative.verify import (
    TreeAcceptResult,
    tree_speculative_sampling_target_only,
    unpack_accepted,
    verify_tree_greedy_from_logits,
)

if TYPE_CHECKING:
    from ngrammar.engine.engine import LLMEngine

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
# On CUDA a constrained step's grammar check before the launch covers the first level of each
# tree only: walking whole 16-node trees made batch-32 verify steps ~7 ms longer on the H200 host
# (the device idles meanwhile), and a member none of whose first drafts its grammar allows is what
# calls a step off. On a CPU the forward waits for the host anyway and costs ~1 ms a token: the
# whole tree is checked, so trimming narrows the verify as far as it can.
CUDA_GRAMMAR_CHECK_DEPTH = 1
# Shadow drafts (``ShadowDrafts``) may take this share of a plain step where the host has no idle
# time (a CPU, or a host-bound step): about one member's trees per step at batch 1 on a CPU.
SHADOW_SHARE = 0.005


class NgramSpecWorker:
    def __init__(self, config: SpeculativeConfig, engine: LLMEngine) -> None:
        self.config = config
        self.engine = engine
        self.corpus = NgramCorpus(
            max_trie_depth=config.max_trie_depth,
            min_bfs_breadth=config.min_bfs_breadth,
            max_bfs_breadth=config.max_bfs_breadth,
            draft_token_num=config.num_draft_tokens,
            match_type=config.match_type,
            capacity=config.capacity,
        )
        self.proposer = DraftProposer(
            self.corpus,
            config.grammar_drafts,
            forced=lambda: forced_text(engine.grammar_backend, engine.tokenizer),
            memory=FieldMemory(config.field_memory) if config.field_memory else None,
            corpora=DraftCorpora(config, engine.tokenizer),
        )
        self.policy = make_policy(config)
        self.shadows = ShadowDrafts(self.corpus, self.policy.widths[1:])
        self.readback_links = False  # benchmark switch: the old path that reads links back first
        self.sync_debug = False  # GPU check: drafting -> verify launch runs under sync debug "error"
        # Triton compiles for CUDA only; CPU graph-path runs (no capture) keep the torch ops.
        self.accept_kernel = config.accept_kernel and engine.device.type == "cuda"
        # ``config.trim_trees``, switchable: equal-work benchmarks that must verify every tree
        # at full width (the readback comparison) turn it off for their runs.
        self.trim_trees = config.trim_trees
        self.last_drafts: dict[str, int] = {}  # seq id -> drafts it accepted in the last verify step
        self._censored: set[str] = set()  # ... of those, whose run ended at a leaf of its tree
        self._tree_depths: dict[str, int] = {}  # ... and how deep each one's draft tree was
        self._constrained = False  # whether the last batch the policy chose for had a grammar
        # Past this many tokens a catch-up indexes only the last max_trie_depth positions, which
        # costs ~depth^2/2 window inserts instead of depth per token (at batch 32 on a GPU, the first
        # verify step after a plain stretch spent 6 ms here with a limit of 2 * depth).
        self._max_catch_up = config.max_trie_depth // 2
        self._index_cost: float | None = None  # seconds per token indexed (moving average)
        self._plain_skips = 0  # plain steps that skipped indexing (every PLAIN_INDEX_RETRY-th re-measures)
        self._plain_host_seconds = 0.0  # host time the last plain step spent indexing and shadow drafting
        self._plain_host_step = -2  # ``EngineStats.steps`` when it was spent (during that engine step)

    # ------------------------------------------------------- corpus upkeep
    def on_admit(self, seq: Sequence) -> None:
        if self.config.index_prompt:
            self.corpus.index_prompt(seq.seq_id, seq.prompt_token_ids)

    def index_outputs(self, seqs: list[Sequence], budget: float | None = None) -> None:
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
        stretch). A catch-up after a plain stretch of a batch of 32 took ~4 ms of host time on the
        H200, past the end of the verify forward it was meant to hide behind."""
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
        self.engine.stats.draft_seconds += seconds
        if tokens > 0:
            # Indexing time only spikes upwards (a page fault, a GC pause): follow a cheaper
            # sample at once, a dearer one slowly.
            per_token = seconds / tokens
            old = self._index_cost
            self._index_cost = per_token if old is None or per_token < old else old + 0.2 * (per_token - old)

    def index_plain_step(self, seqs: list[Sequence]) -> None:
        """Index a plain step's batch (its forward just launched) when that is cheap next to the step.

        A request that starts repeating itself while decoding plainly must find its repetition in
        the corpus, or its match length stays 0 and it never speculates again. But the insertion
        is host Python, and on a GPU at batch 32 a plain step can be host-bound: indexing 32
        tokens made it 12% slower (2.37 vs 2.11 ms on the H200, before overlap scheduling). So a
        plain step indexes while the measured cost stays under ``PLAIN_INDEX_SHARE`` of the step,
        or fits in the host's idle time (``_idle_seconds``): with overlap the host waits for
        the device on every chained step (0.4-0.8 ms of a ~1 ms step at batch 8 on the H200), and
        indexing there is free. On CUDA that time is a budget too (``index_outputs``). What plain
        steps leave unindexed, the next plain step or verify step catches up (bounded by
        ``max_catch_up``). Every ``PLAIN_INDEX_RETRY`` skipped steps one sequence of the batch
        (in turn) is indexed anyway, so that one inflated measurement cannot switch plain-step
        indexing off for good (a batch that never verifies would never re-measure it); one,
        because a whole batch's catch-up is what the rule keeps off a host-bound step. What the
        indexing leaves of the idle time goes to shadow drafts (``_shadow_step``)."""
        plain = self.policy.costs.plain_seconds(len(seqs), self._constrained)
        cost = self._index_cost
        idle = 0.0 if plain is None else self._idle_seconds(plain)
        allowed = None if plain is None else max(PLAIN_INDEX_SHARE * plain, idle)
        t = time.perf_counter()
        if allowed is None or cost is None or cost * len(seqs) <= allowed:
            # On CUDA the time allowed is also the budget: after a stretch of skipped steps every
            # member is behind, and catching all of them up at once is one step's worth of work
            # or more (batch-32 chain steps that indexed reached 1.9-3.6 ms on the H200, against
            # ~1 ms, in session 11); the furthest behind go first, the rest in the next steps.
            self.index_outputs(seqs, allowed if self.engine.device.type == "cuda" else None)
        else:
            self._plain_skips += 1
            if self._plain_skips % PLAIN_INDEX_RETRY == 0:
                self.index_outputs([seqs[(self._plain_skips // PLAIN_INDEX_RETRY) % len(seqs)]])
        if plain is not None:  # shadows share the idle time with indexing, or have their own small share
            self._shadow_step(seqs, max(SHADOW_SHARE * plain, idle - (time.perf_counter() - t)))
        self._plain_host_seconds = time.perf_counter() - t
        self._plain_host_step = self.engine.stats.steps

    def _shadow_step(self, seqs: list[Sequence], budget: float) -> None:
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
        shadows, stats = self.shadows, self.engine.stats
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

    def _idle_seconds(self, plain: float) -> float:
        """Host time a plain step can spend indexing without delaying the device: what the last
        commit waited for it (``LLMEngine.read_wait``) plus what the last plain step spent
        indexing and shadow drafting (it would have waited that long too) if that work was hidden,
        at most a plain step (after a prefill the wait was that forward's), less ``IDLE_MARGIN`` of
        a plain step. A wait under ``HOST_BOUND`` of a plain step says the host is the bottleneck:
        nothing is idle. That work counts only if it was the engine's last step's (a prefill or a
        verify step in between spends none) and was hidden: that step took no longer than
        ``HIDDEN_SLACK`` plain steps. On the H200 at batch 1 (session 13) chained steps that
        indexed and drafted shadows for ~0.13 ms took ~0.17 ms longer than the others, and adding
        that work back as idle time kept every other step that long."""
        wait = self.engine.read_wait
        if wait <= HOST_BOUND * plain:
            return 0.0
        stats = self.engine.stats
        last = stats.steps == self._plain_host_step + 1 and stats.last_step_seconds <= HIDDEN_SLACK * plain
        return min(wait + (self._plain_host_seconds if last else 0.0), plain) - IDLE_MARGIN * plain

    def _index_budget(self, batch_size: int) -> float | None:
        """Host seconds a verify step may spend indexing: a plain step's time at this batch size,
        a lower bound of the verify forward's that the indexing hides behind (the grammar masks
        and the KV compaction queue after it, in what remains of the forward). None: not timed
        yet, or not on CUDA, where the forward has finished before indexing starts (a CPU), so a
        budget would only lose n-grams."""
        if self.engine.device.type != "cuda":
            return None
        return self.policy.costs.plain_seconds(batch_size, self._constrained)

    def on_finish(self, seqs: list[Sequence]) -> None:
        ids = [s.seq_id for s in seqs]
        self.proposer.on_finish(seqs)
        self.policy.forget(ids)
        self.shadows.forget(ids)

    def check_corpora(self, names: tuple[str, ...]) -> None:
        """Raise InvalidRequestError unless every named external corpus exists."""
        from ngrammar.sampling_params import InvalidRequestError
        from ngrammar.speculative.external import DraftCorpusError

        corpora = self.proposer.corpora
        assert corpora is not None
        try:
            corpora.check(names)
        except DraftCorpusError as e:
            raise InvalidRequestError(str(e)) from None

    # ------------------------------------------------------------- policy
    def choose_width(self, seqs: list[Sequence], ahead: bool = False) -> int:
        """The next decode step's width. ``ahead``: one token per sequence is still in flight (overlap
        scheduling): the match lengths are those of the committed tokens, and the policy prices
        what the token in flight may make of them (``AcceptanceModel.expected``); pricing each length
        at its bound, one longer, broke chains for verify steps the committed token then called off."""
        self._constrained = any(s.grammar is not None for s in seqs)
        # A request that opted out never takes a verify step, so neither does its batch.
        if not all(s.params.speculative for s in seqs):
            return 1
        draining = not self.engine.scheduler.waiting
        proposer, grow = self.proposer, int(ahead)
        width = self.policy.choose(
            [s.seq_id for s in seqs],
            lambda: [proposer.match_length(s, MAX_MATCH) for s in seqs],
            self._constrained,
            (lambda: [s.remaining_tokens - grow for s in seqs]) if draining else None,
            ahead,
        )
        return self._asked_width(seqs, width)

    def _asked_width(self, seqs: list[Sequence], width: int) -> int:
        """At most the widest tree a member asked for (``SamplingParams.num_draft_tokens``): the
        widest of the policy's widths that fits it (1: plain)."""
        asked = [s.params.num_draft_tokens for s in seqs]
        if width == 1 or any(a is None for a in asked):
            return width
        most = max(a for a in asked if a is not None)
        return max((w for w in self.policy.widths if w <= min(width, most)), default=1)

    def observe_step(self, batch_size: int, width: int, seconds: float, restart: float | None = None) -> None:
        drafts = self.last_drafts if width > 1 else None
        self.policy.observe(
            batch_size, width, seconds, drafts, self._constrained, self._censored, self._tree_depths, restart
        )

    # --------------------------------------------------------------- step
    def graph_acceptor(
        self, candidates: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor, slots: torch.Tensor
    ) -> tuple[TreeAcceptResult, torch.Tensor]:
        """What the CUDA-graph runner captures after each verify graph, for greedy batches: the
        acceptance, the accepted paths' KV moved next to their prefixes, and the result packed
        for the one read (``TreeAcceptResult.packed``). candidates [bucket, W], mask [bucket, W, W],
        logits [bucket * W, V], slots [bucket, W]. The move covers all W positions of every row: a
        graph cannot size it by the deepest tree (a host value); positions past a path move onto
        themselves, and padding rows move dummy-page KV among dummy-page slots (shared by all
        padding rows, so written more than once, in no set order: nothing reads them).

        With ``accept_kernel`` (CUDA): the argmax, ``greedy_tree_accept`` (which also writes the
        packed row and each move's source slot) and one gather/scatter, instead of ~100 small ops."""
        if self.accept_kernel:
            from ngrammar.kernels.tree_accept import greedy_tree_accept

            bs, width = candidates.shape
            fused = greedy_tree_accept(candidates, mask, logits.argmax(dim=-1).view(bs, width), slots)
            assert fused.kv_src is not None
            move_kv_slots(self.engine.runner.kv_cache, slots, fused.kv_src)
            return TreeAcceptResult.of(fused), fused.packed
        result = verify_tree_greedy_from_logits(candidates, mask, logits)
        self.engine.runner.compact_accepted_kv(slots, result.accept_nodes, result.accept_len)
        return result, result.packed()

    def run_verify(self, seqs: list[Sequence], width: int) -> int:
        """One verify step drafting ``width`` nodes per sequence; returns the width verified (narrower
        where the trees were trimmed: ``_propose``), or 0 when no draft was left to verify (the
        caller runs a plain step)."""
        eng, runner = self.engine, self.engine.runner
        t0 = time.perf_counter()
        with self._no_sync_region():
            proposal = self._propose(seqs, width)
            if proposal is None:
                return 0
            tree = proposal.tree
            if tree.draft_token_num < width:
                eng.stats.trimmed_nodes += len(seqs) * (width - tree.draft_token_num)
                width = tree.draft_token_num
            depths = tree.depths()  # [B, D] host: the mask is host data, no device read
            step = self._step_input(seqs, tree, depths)
            greedy = all(s.params.greedy for s in seqs)
            # Greedy verify steps served by a CUDA graph accept from its static buffers (one replay);
            # everything else copies the drafts and mask in for the eager acceptance.
            graph_accept = greedy and runner.graphs is not None and runner.graphs.accepts(step)
            if not graph_accept:
                meta_mask = to_device(tree.mask, torch.bool, eng.device)
                candidates = to_device(tree.tokens.reshape(len(seqs), width), torch.int64, eng.device)
            if self.readback_links:
                self._read_links_back(tree)
            logits = eng.timed_forward(step)  # [B*D, V]; launched before any host-side tree work
        self.index_outputs(seqs, self._index_budget(len(seqs)))
        t1 = time.perf_counter()
        self._apply_grammar(seqs, tree, logits)
        eng.stats.grammar_seconds += time.perf_counter() - t1
        deepest = int(depths.max())  # levels below the deepest root of the verified trees
        # The accepted paths' KV moves next to their prefixes on the device, before the read: the
        # host never computes slots, and the copy is queued while the verify forward still runs.
        if graph_accept:  # acceptance, the move and the packing: one graph launch
            assert runner.graphs is not None
            accepted, packed = runner.graphs.accept(len(seqs), width)
            result, packed = accepted.head(len(seqs)), packed[: len(seqs)]
        else:
            result = self._accept(seqs, candidates, meta_mask, logits, width, greedy)
            # A path is at most as long as the deepest tree: only those positions can move.
            slots = runner.last_slots().view(len(seqs), width)  # [B, D] this forward's KV slots
            runner.compact_accepted_kv(slots, result.accept_nodes[:, : deepest + 1], result.accept_len)
            packed = result.packed()
        lp = eng.logprob_tensors(seqs, logits, result.accept_index, result.accept_tokens)
        host = runner.to_host(packed, *lp)
        self._commit(seqs, tree, host, proposal.has_child, proposal.levels)
        eng.stats.spec_steps += 1
        eng.stats.verify_seconds += time.perf_counter() - t0
        return width

    def _trims(self) -> bool:
        """Whether to trim this step's trees (``_propose``): yes, unless switched off or the
        policy picked the width to time it (a step called off would leave the width untimed, and
        the policy would ask again at every step)."""
        return self.trim_trees and self.policy.reason != "time"

    def _propose(self, seqs: list[Sequence], width: int) -> Proposal | None:
        """This step's trees (``DraftProposer.propose``), trimmed (``_trims``) to the narrowest
        width that holds the nodes worth verifying: padding is there only to fill D, and a
        forbidden draft is masked out of its parent's logits, so neither can be accepted. None: no
        member kept a draft, so the step would emit one token per member at a verify step's cost:
        the policy learns that each member accepted nothing (as that step would have taught it) and
        the caller runs a plain step instead. A constrained batch's grammars settle here, before
        the launch; the bitmask rows are still built while the forward runs."""
        eng = self.engine
        t = time.perf_counter()
        constrained = any(s.grammar is not None for s in seqs)
        if constrained:
            eng.settle_grammars(seqs)
        # Trees narrow to a CUDA graph's width where there are graphs (an eager verify step costs
        # several graph replays on the H200), else to one of the policy's.
        graphs = eng.runner.graphs
        widths = graphs.widths if graphs is not None else self.policy.widths
        depth = CUDA_GRAMMAR_CHECK_DEPTH if eng.device.type == "cuda" else None
        proposal = self.proposer.propose(seqs, width, self._trims(), widths, depth)
        eng.stats.draft_seconds += time.perf_counter() - t
        if proposal is None:
            eng.stats.vetoed_steps += 1
            self.policy.observe_vetoed(len(seqs), width, constrained, [s.seq_id for s in seqs])
            return None
        eng.stats.grammar_pruned_nodes += proposal.pruned
        return proposal

    @contextlib.contextmanager
    def _no_sync_region(self) -> Iterator[None]:
        """With ``sync_debug`` on CUDA, any device->host sync from drafting to the launch raises."""
        armed = self.sync_debug and self.engine.device.type == "cuda" and not self.readback_links
        if armed:
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if armed:
                torch.cuda.set_sync_debug_mode("default")

    def _step_input(self, seqs: list[Sequence], tree: DraftTree, depths: np.ndarray) -> StepInput:
        d = tree.draft_token_num
        tokens = tree.tokens.reshape(len(seqs), d)
        starts = [s.num_cached for s in seqs]
        positions = (np.asarray(starts)[:, None] + depths).tolist()
        return StepInput(
            tokens.tolist(), positions, starts, [s.pages for s in seqs], list(range(len(seqs) * d)), tree.mask
        )

    def _read_links_back(self, tree: DraftTree) -> None:
        """The pre-#32380 path, kept as a benchmark switch: links computed on the device and read
        back (a blocking device->host copy) before the verify launch."""
        from ngrammar.speculative.tree import reconstruct_indices_from_tree_mask

        eng = self.engine
        mask = to_device(tree.mask, torch.bool, eng.device)
        seq_lens = torch.zeros(tree.bs, dtype=torch.int64, device=eng.device)
        _, _, nt, ns = reconstruct_indices_from_tree_mask(mask, seq_lens, tree.bs, tree.draft_token_num)
        eng.runner.to_host(nt, ns, to_device(tree.tokens, torch.int64, eng.device))

    def _apply_grammar(self, seqs: list[Sequence], tree: DraftTree, logits: torch.Tensor) -> None:
        if not any(s.grammar is not None for s in seqs):
            return
        from ngrammar.grammar import allocate_bitmask, apply_bitmask, build_tree_bitmask

        eng = self.engine
        eng.settle_grammars(seqs)
        bs, d = tree.bs, tree.draft_token_num
        next_token, next_sibling = derive_tree_links(tree.mask, bs, d)
        bitmask = allocate_bitmask(bs * d, eng.model_config.vocab_size, pin_memory=eng.device.type == "cuda")
        drafts = torch.as_tensor(tree.tokens.reshape(bs, d))
        matchers = [None if s.is_finished else s.grammar for s in seqs]
        build_tree_bitmask(matchers, next_token, next_sibling, drafts, bitmask)
        apply_bitmask(logits, bitmask.to(eng.device, non_blocking=True))

    def _accept(
        self,
        seqs: list[Sequence],
        candidates: torch.Tensor,
        mask: torch.Tensor,
        logits: torch.Tensor,
        width: int,
        greedy: bool,
    ) -> TreeAcceptResult:
        if greedy:  # the same function the CUDA-graph path captures
            return verify_tree_greedy_from_logits(candidates, mask, logits)
        bs = len(seqs)
        eng = self.engine
        st = SamplingTensors.build(
            [s.params for s in seqs], [s.seed for s in seqs], [len(s.token_ids) for s in seqs], eng.device
        )
        probs = target_probs(logits, st.repeat(width)).view(bs, width, -1)
        coins = hash_uniform(st.seeds, st.offsets, width, STREAM_TREE_COIN)
        final = hash_uniform(st.seeds, st.offsets, 1, STREAM_FINAL_COIN)[:, 0]
        c = self.config
        return tree_speculative_sampling_target_only(
            candidates, mask, probs, coins, final, c.threshold_single, c.threshold_acc
        )

    def _commit(
        self,
        seqs: list[Sequence],
        tree: DraftTree,
        host: list[torch.Tensor],
        has_child: np.ndarray,
        levels: list[int],
    ) -> None:
        """Append each sequence's accepted run. ``tree``: the verified trees; ``host``: the packed
        result (``TreeAcceptResult.packed``), then logprobs; for the policy, of the trees as drafted:
        ``has_child`` [B, D] (over the verified nodes) says whether a node had children, so a run
        ending at a childless node did not stop at a rejection (it is censored), and ``levels`` [B]
        how many levels each had below its root."""
        eng = self.engine
        width = tree.draft_token_num
        tokens, lens, nodes = unpack_accepted(host[0])
        logprobs = eng.unpack_logprobs(seqs, host[1:], lens)
        emitted = 0
        # What the policy learns is the model's agreement with the drafts (lens - 1 accepted),
        # not what the request kept of it (EOS, a stop string, max_tokens or the context end may cut it).
        self.last_drafts = {seq.seq_id: lens[b] - 1 for b, seq in enumerate(seqs)}
        self._censored = {seq.seq_id for b, seq in enumerate(seqs) if not has_child[b, nodes[b][lens[b] - 1]]}
        self._tree_depths = {seq.seq_id: levels[b] for b, seq in enumerate(seqs)}
        for b, seq in enumerate(seqs):
            start = seq.num_cached
            # (Only a grammar that failed to settle finishes a sequence mid-step: it keeps nothing.)
            kept = (
                0
                if seq.is_finished
                else seq.append_tokens(tokens[b][: lens[b]], None if logprobs is None else logprobs[b])
            )
            # KV of the root and the first kept-1 accepted drafts is kept (compact_accepted_kv put
            # it in place); the last kept token is the next root.
            seq.num_cached = start + max(kept, 1)
            seq.spec_verify_steps += 1
            seq.spec_accepted_tokens += kept
            seq.spec_draft_tokens += width - 1
            emitted += kept
        for seq in seqs:  # the move is queued already: pages past the kept KV may go
            eng.blocks.trim(seq, seq.num_cached)
        eng.stats.verify_steps += len(seqs)
        eng.stats.verify_emitted += emitted
        eng.stats.decode_tokens += emitted
