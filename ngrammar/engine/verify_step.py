"""NGRAM speculative step: draft on the host, launch the tree verify, mask and accept, read back.

One verify step for B sequences with D nodes each (``NgramSpecWorker.launch_verify``):
  1. ``DraftProposer.propose`` -> host DraftTree (tokens [B*D], ancestor mask [B, D, D]): n-gram,
     grammar-forced, field-memory and external-corpus drafts, trimmed (speculative/proposer.py);
     n-gram trees drafted ahead for this outcome (``DraftAhead``) are taken as they are;
  2. the verify forward is launched (host->device copies only; nothing is read back before it);
  3. while it runs: the corpus indexes the last step's tokens; host ``derive_tree_links`` + grammar
     DFS -> bitmask [B*D, V/32], copied in non-blocking and applied to all B*D logits rows;
  4. greedy or target-only sampling acceptance on the device;
  5. the accepted path's KV is moved next to the prefix on the device; the one device->host read of
     the accepted tokens is started (``PendingVerify``); its ``wait`` gives a ``VerifyResult``, which
     the engine commits through the same path as a plain step's tokens.
The worker sees the runner, the grammar rows and the stats, never the engine or its scheduler.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ngrammar.config import SpeculativeConfig
from ngrammar.engine.grammar_rows import GrammarRows
from ngrammar.engine.logprobs import logprob_tensors, unpack_logprobs
from ngrammar.engine.sequence import Sequence
from ngrammar.engine.stats import EngineStats, timed_forward
from ngrammar.model.tokenizer import Tokenizer
from ngrammar.outputs import TokenLogprob
from ngrammar.runner.acceptance import (
    TreeAcceptResult,
    tree_speculative_sampling_target_only,
    unpack_accepted,
    verify_tree_greedy_from_logits,
)
from ngrammar.runner.model_runner import ModelRunner, PendingRead, StepInput, move_kv_slots
from ngrammar.runner.sampler import (
    STREAM_FINAL_COIN,
    STREAM_TREE_COIN,
    SamplingTensors,
    hash_uniform,
    target_probs,
)
from ngrammar.runner.transfer import to_device
from ngrammar.sampling_params import InvalidRequestError
from ngrammar.speculative.corpus import NgramCorpus
from ngrammar.speculative.draft_ahead import DraftAhead
from ngrammar.speculative.external import DraftCorpora, DraftCorpusError
from ngrammar.speculative.field_memory import FieldMemory
from ngrammar.speculative.forced import ForcedText
from ngrammar.speculative.policy import MAX_MATCH, FixedWidthPolicy, make_policy
from ngrammar.speculative.proposer import DraftProposer, Proposal
from ngrammar.speculative.replay import ReplayTarget
from ngrammar.speculative.step_costs import NO_GRAMMAR, grammar_class
from ngrammar.speculative.tree import (
    DraftTree,
    Outcomes,
    reconstruct_indices_from_tree_mask,
    subtree_outcomes,
)
from ngrammar.speculative.upkeep import CorpusUpkeep

# On CUDA a constrained step's grammar check before the launch covers the first level of each
# tree only: the device idles while the host walks, a walk of whole trees grows with the batch,
# and a member none of whose first drafts its grammar allows is what calls a step off. On a CPU
# the forward waits for the host anyway and costs far more per token than a walk: the whole tree
# is checked, so trimming narrows the verify as far as it can.
CUDA_GRAMMAR_CHECK_DEPTH = 1
# A verify step drafted one token behind (``launch_verify_ahead``) drafts twice its width, at most
# this many nodes: the subtree under the token in flight then still fills most of the width.
MAX_AHEAD_WIDTH = 64


@functools.cache
def _placeholder_mask(batch: int, width: int) -> np.ndarray:
    """A [B, D, D] tree mask of the right shape for a step whose mask is picked on the device."""
    mask = np.broadcast_to(np.tri(width, dtype=np.bool_), (batch, width, width))
    mask.flags.writeable = False
    return mask


@dataclass
class VerifyResult:
    """A verify step's outcome on the host: what the engine commits (``plain_step.commit_runs``)
    and what the draft policy learns (``NgramSpecWorker.observe_step``)."""

    seqs: list[Sequence]
    chosen: int  # the width the policy chose: what it is taught
    width: int  # the width verified (narrower where the trees were trimmed)
    runs: list[list[int]]  # per member: the accepted drafts, then the bonus token (1..width tokens)
    logprobs: list[list[TokenLogprob]] | None  # per member, one per token of its run
    drafts: dict[str, int]  # seq id -> drafts the model accepted (what a stop may cut is kept here)
    censored: set[str]  # ... whose run ended at a leaf of the tree as drafted (not a rejection)
    depths: dict[str, int]  # ... how many levels that tree had below its root
    launched: float  # perf_counter() at the start of the engine step that launched it
    # ... the match length each is learned at, where the step knew it (None: the policy's last probe)
    lengths: dict[str, int] | None = None


@dataclass
class _Verified:
    """A verify forward launched, as the acceptance needs it: the trees verified (host), what the
    policy learns of them, the logits and, for the eager acceptance, the drafts [B, D] and mask
    [B, D, D] on the device (None: the CUDA graph's acceptor reads its own static buffers)."""

    seqs: list[Sequence]
    chosen: int
    tree: DraftTree
    has_child: np.ndarray
    levels: list[int]
    logits: torch.Tensor
    inputs: tuple[torch.Tensor, torch.Tensor] | None
    launched: float


@dataclass
class VerifyAhead:
    """A verify forward launched before its members' last tokens were read back
    (``NgramSpecWorker.launch_verify_ahead``); ``finish_ahead`` completes it once they are
    committed."""

    seqs: list[Sequence]
    chosen: int
    outcomes: Outcomes
    logits: torch.Tensor
    inputs: tuple[torch.Tensor, torch.Tensor] | None
    launched: float


@dataclass
class PendingVerify:
    """A launched verify step whose packed result (and logprobs) is on its way to the host."""

    seqs: list[Sequence]
    chosen: int
    width: int
    read: PendingRead  # [B, 2W + 1] packed acceptance (``TreeAcceptResult.packed``), then logprobs
    has_child: np.ndarray  # [B, W] bool: whether each verified node had children as drafted
    levels: list[int]  # [B] levels below the root of each tree as drafted
    launched: float
    # On the device, for a plain step chained out of this one before its result is read
    # (``LLMEngine._chain_out_of_verify``): [B] each member's next root (its bonus token) and its
    # accepted length (drafts + 1: how far past the verify's root that token sits).
    next_tokens: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    # A verify step chained into a plain step (``finish_ahead``): the match length each member is
    # learned at (with the token that picked its tree); a member absent (its token broke its match:
    # the root alone was verified) teaches nothing. None: every member, at the policy's last probe.
    learn_at: dict[str, int] | None = None

    def wait(self) -> VerifyResult:
        """The result on the host. Members that finished while the step was in flight (an abort, a
        stop on the token a chained-into step was picked by) keep nothing and teach nothing (their
        state was forgotten at their finish)."""
        host = self.read.wait()
        tokens, lens, nodes = unpack_accepted(host[0])
        seqs, at = self.seqs, self.learn_at
        taught = [b for b, s in enumerate(seqs) if not s.is_finished and (at is None or s.seq_id in at)]
        return VerifyResult(
            seqs,
            self.chosen,
            self.width,
            [tokens[b][: lens[b]] for b in range(len(seqs))],
            unpack_logprobs(seqs, host[1:], lens),
            # The model's agreement with the drafts (lens - 1), not what the request keeps of it.
            {seqs[b].seq_id: lens[b] - 1 for b in taught},
            {seqs[b].seq_id for b in taught if not self.has_child[b, nodes[b][lens[b] - 1]]},
            {seqs[b].seq_id: self.levels[b] for b in taught},
            self.launched,
            at,
        )


class NgramSpecWorker:
    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        grammar: GrammarRows,
        stats: EngineStats,
        tokenizer: Tokenizer,
        forced: Callable[[], ForcedText] | None = None,
    ) -> None:
        """``forced``: builds the grammar's forced-text helper on first use (only constrained
        requests need it); ``tokenizer`` indexes the external draft corpora."""
        self.config = config
        self.runner = runner
        self.device = runner.device
        self.grammar = grammar
        self.stats = stats
        self.corpus = NgramCorpus.from_config(config)
        self.proposer = DraftProposer(
            self.corpus,
            config.grammar_drafts,
            forced=forced,
            memory=FieldMemory(config.field_memory) if config.field_memory else None,
            corpora=DraftCorpora(config, tokenizer),
        )
        self.policy = make_policy(config)
        self.upkeep = CorpusUpkeep(config, self.corpus, self.policy, stats, self.device)
        self.readback_links = False  # benchmark switch: the old path that reads links back first
        self.sync_debug = False  # GPU check: drafting -> verify launch runs under sync debug "error"
        # CUDA-graph greedy verify steps accept with the one-launch Triton kernel (kernels/tree_accept.py:
        # four kernels instead of ~100 small ops); Triton compiles for CUDA only, so a CPU keeps the ops.
        self.accept_kernel = self.device.type == "cuda"
        self.last_drafts: dict[str, int] = {}  # seq id -> drafts it accepted in the last verify step
        # seq id -> whether its last verify step's run ended at a leaf of its tree (the drafts ran
        # out, not the model's agreement): its match likely goes on, and so do verify steps.
        self.ran_to_leaf: dict[str, bool] = {}
        self._grammar_class = NO_GRAMMAR  # of the last batch the policy chose for (``grammar_class``)
        self.ahead = DraftAhead(self.corpus)  # the corpus' drafting, with trees drafted ahead
        self.on_prepare: Callable[[], None] | None = None  # test hook: called when trees are drafted ahead
        self.replay: ReplayTarget | None = None  # benchmarks: recorded outputs decide acceptance

    # ------------------------------------------------------- corpus upkeep
    def on_admit(self, seq: Sequence) -> None:
        self.upkeep.on_admit(seq)

    def index_plain_step(self, seqs: list[Sequence], read_wait: float) -> None:
        """Index a plain step's batch (its forward just launched) when that is cheap next to the
        step (``CorpusUpkeep.index_plain_step``)."""
        self.upkeep.index_plain_step(seqs, read_wait, self._grammar_class)

    def on_finish(self, seqs: list[Sequence]) -> None:
        ids = [s.seq_id for s in seqs]
        for seq_id in ids:
            self.ran_to_leaf.pop(seq_id, None)
        self.ahead.forget(ids)
        self.proposer.on_finish(seqs)
        self.policy.forget(ids)
        self.upkeep.forget(ids)

    def check_corpora(self, names: tuple[str, ...]) -> None:
        """Raise InvalidRequestError unless every named external corpus exists."""

        corpora = self.proposer.corpora
        assert corpora is not None
        try:
            corpora.check(names)
        except DraftCorpusError as e:
            raise InvalidRequestError(str(e)) from None

    # ------------------------------------------------------------- policy
    @property
    def reason(self) -> str:
        """Why the policy chose the last width (``policy.REASONS``)."""
        return self.policy.reason

    @property
    def final_ok(self) -> bool:
        """Whether the last width chosen ``final`` pays without a drain deciding again
        (``DraftPolicy.final_ok``)."""
        return self.policy.final_ok

    def graph_widths(self) -> list[int]:
        """The widths a decode or verify step may run at: every width the policy may pick, or a
        trimmed tree be verified at (``DraftProposer.propose``)."""
        return self.policy.widths

    def chain_after_verify(self, seqs: list[Sequence]) -> bool:
        """Whether a plain step should follow a verify step of ``seqs`` still in flight (launched
        before its result is read: ``LLMEngine._chain_out_of_verify``), judged before the result
        is known: yes unless most members' last verify run ended at a leaf of its tree (a run
        that ends on a rejection breaks the match that chose the verify step, so plain decoding
        usually follows; one that ran out of drafts usually verifies again). A wrong guess costs
        one plain step; the policy decides the step after it with the result committed."""
        if self.policy.widths[-1] == 1 or isinstance(self.policy, FixedWidthPolicy):
            return False
        leaves = sum(self.ran_to_leaf.get(s.seq_id, False) for s in seqs)
        return 2 * leaves < len(seqs)

    def set_step_profile(self, profile: Mapping[tuple[int, int], float]) -> None:
        """Device seconds per (batch bucket, width) measured at start-up (``CUDAGraphRunner.profile``):
        the policy prices a width by them until its own steps are timed (``StepCosts.set_profile``)."""
        self.policy.costs.set_profile(profile)

    def choose_width(
        self, seqs: list[Sequence], draining: bool, ahead: bool = False, final: bool = False
    ) -> int:
        """The next decode step's width. ``draining``: no request waits to join the batch (the
        policy then judges it by its critical members). ``ahead``: one token per sequence is still
        in flight (overlap scheduling): the match lengths are those of the committed tokens, and
        the policy prices what the token in flight may make of them
        (``AcceptanceModel.expected``); pricing each length at its bound, one longer, broke chains for
        verify steps the committed token then called off. ``final``: a verify step could go ahead
        without that token (``LLMEngine._chain_into_verify``), where a member it breaks gains
        nothing: ``final_ok`` then says whether the width chosen pays so."""
        self._grammar_class = grammar_class(s.params.grammar_kind for s in seqs)
        # A request that opted out never takes a verify step, so neither does its batch.
        if not all(s.params.speculative for s in seqs):
            return 1
        cap = self._width_cap(seqs)
        if cap == 1:
            return 1
        proposer, grow = self.proposer, int(ahead)
        return self.policy.choose(
            [s.seq_id for s in seqs],
            lambda: [proposer.match_length(s, MAX_MATCH) for s in seqs],
            self._grammar_class,
            (lambda: [s.remaining_tokens - grow for s in seqs]) if draining else None,
            ahead,
            cap,
            final,
        )

    def _width_cap(self, seqs: list[Sequence]) -> int | None:
        """The widest step worth choosing when every member asked for a tree size
        (``SamplingParams.num_draft_tokens``; None: some member did not): the narrowest of the
        policy's widths that holds the largest tree asked for (each member's own size bounds its
        tree: ``proposer._cap``), so the policy times and prices only widths the batch can use.
        1: no member asked for a draft."""
        asked = [s.params.num_draft_tokens for s in seqs]
        if any(a is None for a in asked):
            return None
        most = max(a for a in asked if a is not None)
        if most <= 1:
            return 1
        return min((w for w in self.policy.widths if w >= most), default=self.policy.max_width)

    def observe_step(
        self,
        batch_size: int,
        width: int,
        seconds: float,
        restart: float | None = None,
        result: VerifyResult | None = None,
    ) -> None:
        """A decode step was committed: teach the policy its time and, for a verify step
        (``result``), what each member accepted."""
        if result is not None:
            self.last_drafts = result.drafts
            for seq_id in result.drafts:
                self.ran_to_leaf[seq_id] = seq_id in result.censored
        self.policy.observe(
            batch_size,
            width,
            seconds,
            None if result is None else result.drafts,
            self._grammar_class,
            () if result is None else result.censored,
            None if result is None else result.depths,
            restart,
            None if result is None else result.lengths,
        )

    # --------------------------------------------------------------- step
    def acceptor(self, one_rank: bool) -> Callable[..., Any] | None:
        """The acceptance the CUDA-graph runner captures after each verify graph (``graph_acceptor``);
        None with tensor parallelism, where each rank moves its own KV shard
        (``DriverRunner.compact_accepted_kv``), which a rank-0-only graph would not."""
        return self.graph_acceptor if one_rank else None

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
            move_kv_slots(self.runner.kv_cache, slots, fused.kv_src)
            return TreeAcceptResult.of(fused), fused.packed
        result = verify_tree_greedy_from_logits(candidates, mask, logits)
        self.runner.compact_accepted_kv(slots, result.accept_nodes, result.accept_len)
        return result, result.packed()

    def launch_verify(
        self,
        seqs: list[Sequence],
        width: int,
        launched: float,
        prepare: bool = False,
        chain: bool = False,
        drained: bool = False,
    ) -> PendingVerify | None:
        """Launch one verify step drafting ``width`` nodes per sequence and start reading its
        result back; None when no draft was left to verify (the caller runs a plain step).
        ``prepare`` (pipelined verify): then draft the next trees for the likely outcome
        (``prepare_next``) while the forward runs, before anything waits for it. ``chain``: keep
        the device result a plain step chained out of this one starts from (``PendingVerify``).
        ``drained``: the overlap chain was drained for this step (a call-off then wasted it)."""
        runner = self.runner
        chosen, t0 = width, time.perf_counter()
        with self._no_sync_region():
            proposal = self._propose(seqs, width, drained)
            if proposal is None:
                return None
            tree = proposal.tree
            if tree.draft_token_num < width:
                self.stats.trimmed_nodes += len(seqs) * (width - tree.draft_token_num)
                width = tree.draft_token_num
            step = self._step_input(seqs, tree, tree.depths())  # the mask is host data, no device read
            graph_accept = self._graph_accepts(seqs, step)
            inputs = None  # the drafts and mask on the device, for the eager acceptance
            if not graph_accept:
                inputs = (
                    to_device(tree.tokens.reshape(len(seqs), width), torch.int64, self.device),
                    to_device(tree.mask, torch.bool, self.device),
                )
            if self.readback_links:
                self._read_links_back(tree)
            logits = timed_forward(runner, step, self.stats)  # [B*D, V]; before any host-side tree work
        verified = _Verified(
            seqs, chosen, tree, proposal.has_child, proposal.levels, logits, inputs, launched
        )
        pending = self._accept_and_read(verified, chain)
        if prepare and proposal.batched:
            self.prepare_next(seqs, tree, chosen)
        self.stats.spec_steps += 1
        self.stats.verify_seconds += time.perf_counter() - t0
        return pending

    def launch_verify_ahead(
        self, seqs: list[Sequence], width: int, in_flight: torch.Tensor, launched: float
    ) -> VerifyAhead | None:
        """Launch a verify step for ``seqs`` whose next token is still in flight (``in_flight`` [B]
        on the device: a chained plain step's samples), before that token is read back: the
        corpus drafts from the committed tokens, one level deeper than a verify step would
        (``subtree_outcomes``: under each draft of the token in flight, its subtree), and the
        device picks each member's tree by that token (``_pick_on_device``). None: no draft to
        verify in any outcome (the caller drains instead). ``finish_ahead``, after the token is
        committed, masks nothing (the batch has no grammar), accepts and starts the read."""
        t0 = time.perf_counter()
        with self._no_sync_region():
            t = time.perf_counter()
            wide = min(MAX_AHEAD_WIDTH, 2 * width)
            drafted = self.corpus.batch_get([s.seq_id for s in seqs], [s.token_ids for s in seqs], wide)
            graphs = self.runner.graphs
            widths = [w for w in (graphs.widths if graphs is not None else self.policy.widths) if w > 1]
            outcomes = subtree_outcomes(drafted, widths, width)
            self.stats.draft_seconds += time.perf_counter() - t
            if outcomes is None:
                return None
            d = outcomes.trees.draft_token_num
            ids, positions, mask = self._pick_on_device(seqs, outcomes, in_flight)
            starts = [s.num_cached for s in seqs]
            step = StepInput(
                [[0] * d for _ in seqs],
                [[start] * d for start in starts],
                starts,
                [s.pages for s in seqs],
                list(range(len(seqs) * d)),
                _placeholder_mask(len(seqs), d),
                input_ids=ids,
                device_positions=positions,
                device_tree_mask=mask,
            )
            graph_accept = self._graph_accepts(seqs, step)
            logits = timed_forward(self.runner, step, self.stats)
        self.stats.chained_into_verify += 1
        self.stats.verify_seconds += time.perf_counter() - t0
        inputs = None if graph_accept else (ids.view(len(seqs), d), mask)
        return VerifyAhead(seqs, width, outcomes, logits, inputs, launched)

    def finish_ahead(self, ahead: VerifyAhead, chain: bool = False) -> PendingVerify:
        """``launch_verify_ahead``'s second half, once the token in flight is committed (each
        member's last token): the trees picked, acceptance and the read started, as a verify step's."""
        t0 = time.perf_counter()
        seqs = ahead.seqs
        pick, tree = ahead.outcomes.picked([s.token_ids[-1] for s in seqs])
        missed = ahead.outcomes.per_request - 1
        verified = _Verified(
            seqs,
            ahead.chosen,
            tree,
            tree.has_child(),
            tree.depths().max(axis=1).tolist(),
            ahead.logits,
            ahead.inputs,
            ahead.launched,
        )
        pending = self._accept_and_read(verified, chain)
        # Learned at the length with the token that picked the tree, as a drained step is probed.
        pending.learn_at = {
            s.seq_id: self.proposer.match_length(s, MAX_MATCH)
            for s, k in zip(seqs, pick.tolist())
            if k != missed
        }
        self.stats.spec_steps += 1
        self.stats.verify_seconds += time.perf_counter() - t0
        return pending

    def _pick_on_device(
        self, seqs: list[Sequence], outcomes: Outcomes, in_flight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each member's outcome tree picked by its token in flight, on the device, no host read:
        node tokens [B * D] (the root: that token), positions [B * D] (``num_cached`` + depth) and
        the ancestor mask [B, D, D]."""
        b, k, d = len(seqs), outcomes.per_request, outcomes.trees.draft_token_num
        dev = self.device
        children = to_device(outcomes.children, torch.int64, dev)  # [B, K - 1]
        tokens = to_device(outcomes.trees.tokens, torch.int64, dev).view(b, k, d)
        depths = to_device(outcomes.trees.depths(), torch.int64, dev).view(b, k, d)
        masks = to_device(outcomes.trees.mask, torch.bool, dev).view(b, k, d, d)
        starts = to_device([s.num_cached for s in seqs], torch.int64, dev)
        hit = children == in_flight[:, None]
        pick = torch.where(hit.any(dim=1), hit.to(torch.int32).argmax(dim=1), k - 1)  # the first hit
        rows = torch.arange(b, device=dev)
        ids = tokens[rows, pick]
        ids[:, 0] = in_flight
        positions = starts[:, None] + depths[rows, pick]
        return ids.reshape(-1), positions.reshape(-1), masks[rows, pick]

    def _graph_accepts(self, seqs: list[Sequence], step: StepInput) -> bool:
        """Greedy verify steps served by a CUDA graph accept from its static buffers (one replay);
        everything else takes the drafts and mask for the eager acceptance (no acceptor with tensor
        parallelism: every rank moves its own KV)."""
        graphs = self.runner.graphs
        return (
            all(s.params.greedy for s in seqs)
            and graphs is not None
            and graphs.acceptor is not None
            and graphs.accepts(step)
        )

    def _accept_and_read(self, v: _Verified, chain: bool) -> PendingVerify:
        """A launched verify forward's host work while it runs, then its acceptance on the device:
        replay targets, corpus indexing, grammar rows, acceptance, the accepted paths' KV moved,
        the read started. ``chain``: keep the device result a plain step chained out of it starts
        from (``PendingVerify``)."""
        runner, seqs, tree, logits = self.runner, v.seqs, v.tree, v.logits
        width = tree.draft_token_num
        depths = tree.depths()
        if self.replay is not None:
            replay = self.replay
            starts = [s.num_cached for s in seqs]
            targets = [
                t
                for s, start, row in zip(seqs, starts, depths.tolist())
                for t in replay.targets(s.prompt_token_ids, [start + depth for depth in row])
            ]
            replay.apply(logits[: len(targets)], targets)
        upkeep = self.upkeep
        upkeep.index_outputs(seqs, upkeep.index_budget(len(seqs), self._grammar_class))
        self.grammar.apply_tree(seqs, tree, logits)
        deepest = int(depths.max())  # levels below the deepest root of the verified trees
        # The accepted paths' KV moves next to their prefixes on the device, before the read: the
        # host never computes slots, and the copy is queued while the verify forward still runs.
        if v.inputs is None:  # acceptance, the move and the packing: one graph launch
            assert runner.graphs is not None
            accepted, packed = runner.graphs.accept(len(seqs), width)
            result, packed = accepted.head(len(seqs)), packed[: len(seqs)]
        else:
            candidates, mask = v.inputs
            greedy = all(s.params.greedy for s in seqs)
            result = self._accept(seqs, candidates, mask, logits, width, greedy)
            # A path is at most as long as the deepest tree: only those positions can move.
            slots = runner.last_slots().view(len(seqs), width)  # [B, D] this forward's KV slots
            runner.compact_accepted_kv(slots, result.accept_nodes[:, : deepest + 1], result.accept_len)
            packed = result.packed()
        lp = logprob_tensors(seqs, logits, result.accept_index, result.accept_tokens)
        read = runner.to_host_async(packed, *lp)
        pending = PendingVerify(seqs, v.chosen, width, read, v.has_child, v.levels, v.launched)
        if chain:  # copies: a graph's outputs are overwritten by its next replay
            pending.next_tokens, pending.offsets = result.bonus.clone(), result.accept_len.clone()
        return pending

    # ----------------------------------------------------------- drafting
    def _trees_for(self, seqs: list[Sequence], width: int) -> DraftTree:
        """This step's n-gram trees: those drafted ahead where they still hold, the others now."""
        tree, hits = self.ahead.trees_for(seqs, width)
        self.stats.prepared_hits += hits
        return tree

    def prepare_next(self, seqs: list[Sequence], tree: DraftTree, width: int) -> None:
        """Draft, while this verify step's forward runs, each member's next tree for the outcome
        most worth betting on (``DraftAhead.prepare``)."""
        if self.on_prepare is not None:
            self.on_prepare()
        t = time.perf_counter()
        self.stats.prepared_trees += self.ahead.prepare(seqs, tree, width)
        self.stats.draft_seconds += time.perf_counter() - t

    def _trims(self) -> bool:
        """Whether to trim this step's trees (``_propose``): yes, unless the policy picked the width
        to time it (a step called off would leave the width untimed, and the policy would ask again
        at every step)."""
        return self.policy.reason != "time"

    def _propose(self, seqs: list[Sequence], width: int, drained: bool) -> Proposal | None:
        """This step's trees (``DraftProposer.propose``), trimmed (``_trims``) to the narrowest
        width that holds the nodes worth verifying: padding is there only to fill D, and a
        forbidden draft is masked out of its parent's logits, so neither can be accepted. None: no
        member kept a draft, and the caller runs a plain step instead: the policy hears of it
        (``observe_vetoed``; ``drained``: the call-off cost a drained chain). A constrained batch's
        grammars settle here, before the launch; the bitmask rows are still built while the forward
        runs."""
        grammar = grammar_class(s.params.grammar_kind for s in seqs)
        if grammar != NO_GRAMMAR:
            t = time.perf_counter()
            self.grammar.settle(seqs)
            self.stats.grammar_seconds += time.perf_counter() - t
        t = time.perf_counter()  # drafting: the proposer's walks included, the settling not
        # Trees narrow to a CUDA graph's width where there are graphs (an eager verify step costs
        # several graph replays), else to one of the policy's.
        graphs = self.runner.graphs
        widths = graphs.widths if graphs is not None else self.policy.widths
        depth = CUDA_GRAMMAR_CHECK_DEPTH if self.device.type == "cuda" else None
        proposal = self.proposer.propose(
            seqs, width, self._trims(), widths, depth, drafted=lambda: self._trees_for(seqs, width)
        )
        self.stats.draft_seconds += time.perf_counter() - t
        if proposal is None:
            self.stats.vetoed_steps += 1
            self.policy.observe_vetoed(len(seqs), width, grammar, [s.seq_id for s in seqs], drained)
            return None
        self.stats.grammar_pruned_nodes += proposal.pruned
        return proposal

    @contextlib.contextmanager
    def _no_sync_region(self) -> Iterator[None]:
        """With ``sync_debug`` on CUDA, any device->host sync from drafting to the launch raises."""
        armed = self.sync_debug and self.device.type == "cuda" and not self.readback_links
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
        """Benchmark switch: links computed on the device and read back (a blocking device->host
        copy) before the verify launch, to measure what computing them on the host saves."""
        device = self.device
        mask = to_device(tree.mask, torch.bool, device)
        seq_lens = torch.zeros(tree.bs, dtype=torch.int64, device=device)
        _, _, nt, ns = reconstruct_indices_from_tree_mask(mask, seq_lens, tree.bs, tree.draft_token_num)
        self.runner.to_host(nt, ns, to_device(tree.tokens, torch.int64, device))

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
        st = SamplingTensors.build(
            [s.params for s in seqs], [s.seed for s in seqs], [len(s.token_ids) for s in seqs], self.device
        )
        probs = target_probs(logits, st.repeat(width)).view(bs, width, -1)
        coins = hash_uniform(st.seeds, st.offsets, width, STREAM_TREE_COIN)
        final = hash_uniform(st.seeds, st.offsets, 1, STREAM_FINAL_COIN)[:, 0]
        c = self.config
        return tree_speculative_sampling_target_only(
            candidates, mask, probs, coins, final, c.threshold_single, c.threshold_acc
        )
