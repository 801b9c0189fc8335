"""Draft policies: the width D of each decode step (1 = plain decode), behind one protocol.

- ``FixedWidthPolicy``: always D (a benchmark baseline, and the equal-work comparisons).
- ``ThresholdDraftPolicy``: D when some member's context suffix of at least ``min_match`` tokens
  has been seen continued by the n-gram corpus, else plain. No timing, no learning.
- ``AdaptiveDraftPolicy``: the width with the best expected tokens per second from measured step
  costs (``step_costs.StepCosts``) and learned acceptance (``acceptance.AcceptanceModel``; one for
  free text, one for constrained batches, which accept far more at the same match length).

The adaptive policy speculates only when a width beats plain decoding by ``margin`` (timings are
noisy). The match lengths (the longest suffix of each context that the corpus has seen followed by
something, capped at ``MAX_MATCH``) are probed only when some width could win at all; after a probe
that found nothing worth verifying the next probes in that batch bucket are skipped for
``bucket // 4`` steps, or for as many as keep the probes' host time under ``probe_share`` of plain
decoding. While plain wins, the best width is still re-tried now and then when some sequence has a
2-token match, so the estimates cannot get stuck below the truth; the interval between re-tries
keeps their cost under ``explore_overhead`` of plain throughput. With overlap scheduling a verify
step's cost includes the chain it breaks (``_charge_break``). Shadow drafts
(``ngrammar.speculative.shadow``) teach acceptance from plain steps at no device cost
(``observe_shadow``); while they keep coming, re-tries are skipped, except one per
``cost_refresh`` steps of a bucket to re-time its verify steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

from ngrammar.config import SpeculativeConfig
from ngrammar.speculative.acceptance import AcceptanceModel, run_length2
from ngrammar.speculative.policy_params import MAX_MATCH, AdaptiveParams
from ngrammar.speculative.step_costs import NO_GRAMMAR, Bucket, StepCosts, bucket_of

__all__ = [
    "MAX_MATCH",
    "REASONS",
    "AdaptiveDraftPolicy",
    "DraftPolicy",
    "FixedWidthPolicy",
    "ThresholdDraftPolicy",
    "bucket_of",
    "make_policy",
    "width_ladder",
]

# Why ``choose`` picked its width: "fixed" (a fixed width), "threshold" / "short" (the threshold
# policy: a long enough match, or none), "time" (a width's cost is not known yet), "wait" (a probe
# found nothing worth verifying lately), "hopeless" (no width could win even at the best rates),
# "no match" (every tree would be padding), "baseline" (plain, re-timed while speculating),
# "exploit" (a width is expected to win), "explore" (re-trying a losing width), "plain" (plain is
# expected to win), "empty" (no sequences), "parity" (a width costs about a plain step, as a
# pipelined verify step can, and a member has a draft).
REASONS = (
    "fixed",
    "threshold",
    "short",
    "time",
    "wait",
    "hopeless",
    "no match",
    "baseline",
    "exploit",
    "explore",
    "plain",
    "empty",
    "parity",
)

MatchLengths = Callable[[], Sequence[int]]  # the batch's match lengths, in seq_ids order (computed on demand)


def width_ladder(max_width: int) -> list[int]:
    """1, D and D/2, D/4, ... down to 4: the widths a step may run at (picked, or trimmed to)."""
    out = {1, max_width}
    w = max_width // 2
    while w >= 4:
        out.add(w)
        w //= 2
    return sorted(out)


def _rate(cost: float | None, width: int, drafts: float) -> float:
    """Expected tokens per second per sequence of a step costing ``cost`` seconds (per bucket
    slot) at this width, given its mean accepted drafts."""
    return (1.0 + min(max(drafts, 0.0), width - 1)) / (cost or float("inf"))


class DraftPolicy(Protocol):
    """Chooses each decode step's width and learns from what the steps did.

    Every policy times the steps (``costs``: the worker budgets its host work with them);
    ``learns`` says whether acceptance samples (shadow drafts, called-off steps) are worth
    computing for it."""

    max_width: int
    widths: list[int]  # 1 and every width a step may run at (``width_ladder``)
    reason: str  # why the last ``choose`` returned what it did (one of REASONS)
    # Whether the last width ``choose`` picked with ``final`` pays without a drain deciding again
    # once the token in flight is known (a verify step chained into the plain step in flight).
    final_ok: bool
    learns: bool
    costs: StepCosts

    def choose(
        self,
        seq_ids: Sequence[str],
        match_lengths: MatchLengths,
        grammar: str = NO_GRAMMAR,
        remaining: Callable[[], Sequence[int]] | None = None,
        ahead: bool = False,
        cap: int | None = None,
        final: bool = False,
    ) -> int: ...

    def observe(
        self,
        batch_size: int,
        width: int,
        seconds: float,
        drafts: Mapping[str, int] | None = None,
        grammar: str = NO_GRAMMAR,
        censored: Collection[str] = (),
        depths: Mapping[str, int] | None = None,
        restart: float | None = None,
        lengths: Mapping[str, int] | None = None,
    ) -> None: ...

    def observe_vetoed(
        self, batch_size: int, width: int, grammar: str, seq_ids: Sequence[str], drained: bool = False
    ) -> None: ...

    def observe_shadow(self, width: int, samples: Sequence[tuple[str, int, int, bool, int]]) -> None: ...

    def forget(self, seq_ids: Sequence[str]) -> None: ...

    def step_cost(self, bucket: Bucket, width: int) -> float | None: ...


class _TimedPolicy:
    """What the simple policies share: the width ladder and step timing, no learning."""

    learns = False

    def __init__(self, max_width: int) -> None:
        self.max_width = max_width
        self.widths = width_ladder(max_width)
        self.costs = StepCosts(self.widths)
        self.reason = ""
        self.final_ok = False

    def observe(
        self,
        batch_size: int,
        width: int,
        seconds: float,
        drafts: Mapping[str, int] | None = None,
        grammar: str = NO_GRAMMAR,
        censored: Collection[str] = (),
        depths: Mapping[str, int] | None = None,
        restart: float | None = None,
        lengths: Mapping[str, int] | None = None,
    ) -> None:
        b = bucket_of(batch_size, grammar)
        self.costs.record(b, width, seconds * b[0] / max(batch_size, 1))

    def observe_vetoed(
        self, batch_size: int, width: int, grammar: str, seq_ids: Sequence[str], drained: bool = False
    ) -> None:
        pass  # nothing learned: the next step decides afresh

    def observe_shadow(self, width: int, samples: Sequence[tuple[str, int, int, bool, int]]) -> None:
        pass

    def forget(self, seq_ids: Sequence[str]) -> None:
        pass

    def step_cost(self, bucket: Bucket, width: int) -> float | None:
        return self.costs.cost(bucket, width)


class FixedWidthPolicy(_TimedPolicy):
    """Every decode step verifies a tree of ``max_width`` nodes."""

    def choose(
        self,
        seq_ids: Sequence[str],
        match_lengths: MatchLengths,
        grammar: str = NO_GRAMMAR,
        remaining: Callable[[], Sequence[int]] | None = None,
        ahead: bool = False,
        cap: int | None = None,
        final: bool = False,
    ) -> int:
        self.reason = "fixed" if seq_ids else "empty"
        self.final_ok = final  # every step verifies: nothing to decide again
        return _capped(self.widths, cap)[-1] if seq_ids else 1


class ThresholdDraftPolicy(_TimedPolicy):
    """``max_width`` when some member's match length is at least ``min_match``, else plain: a
    match that short or shorter drafts from what little context follows, and rarely pays."""

    def __init__(self, max_width: int, min_match: int = 2) -> None:
        super().__init__(max_width)
        self.min_match = min_match

    def choose(
        self,
        seq_ids: Sequence[str],
        match_lengths: MatchLengths,
        grammar: str = NO_GRAMMAR,
        remaining: Callable[[], Sequence[int]] | None = None,
        ahead: bool = False,
        cap: int | None = None,
        final: bool = False,
    ) -> int:
        if not seq_ids:
            self.reason = "empty"
            return 1
        # ``ahead``: the token in flight may extend a match by one. Final only where the match is
        # long enough already: else a drain decides again once the token is known.
        lengths = match_lengths()
        long_enough = self.max_width > 1 and max(lengths) >= self.min_match - int(ahead)
        self.final_ok = final and long_enough and max(lengths) >= self.min_match
        self.reason = "threshold" if long_enough else "short"
        return _capped(self.widths, cap)[-1] if long_enough else 1


class AdaptiveDraftPolicy:
    """The width with the best expected tokens per second (see the module docstring)."""

    learns = True

    def __init__(self, max_width: int, params: AdaptiveParams | None = None) -> None:
        self.max_width = max_width
        self.params = params or AdaptiveParams()
        self.widths = width_ladder(max_width)
        self.costs = StepCosts(self.widths)
        # Constrained sequences accept far more at a match length than free text: learned apart.
        self.acceptance = AcceptanceModel(self.widths[1:], self.params)
        self.constrained = AcceptanceModel(
            self.widths[1:], self.params, self.params.prior_continue_constrained
        )
        self.reason = ""
        self.final_ok = False
        # For the last exploit or explore decision: seq id -> (match length, accepted drafts expected)
        # at the width chosen (for calibration: ``benchmarks/bench_calibration.py``).
        self.priced: dict[str, tuple[int, float]] = {}
        self.probe_cost: dict[Bucket, float] = {}  # bucket -> host seconds per probe (``_probe_gap``)
        self._lengths: dict[str, int] = {}  # seq id -> match length at its last probe
        self._outlook: dict[str, float] = {}  # seq id -> drafts per step it tends to offer
        self._steps: dict[Bucket, int] = {}  # bucket -> decode steps observed
        self._last: dict[tuple[Bucket, int], int] = {}  # (bucket, width) -> step it last ran
        self._probe_at: dict[Bucket, int] = {}  # bucket -> first step a probe may run again
        self._explore_at: dict[Bucket, int] = {}  # bucket -> first step exploring may run
        self._verified: tuple[Bucket, int, int] | None = (
            None  # the last step, if a verify: bucket, width, step
        )
        self._shadowed = 0  # shadow walks of the widest trees observed (``observe_shadow``)
        self._shadow_mark: dict[Bucket, int] = {}  # bucket -> _shadowed when it last skipped a re-try

    def step_cost(self, bucket: Bucket, width: int) -> float | None:
        return self.costs.cost(bucket, width)

    def model(self, grammar: str) -> AcceptanceModel:
        """The acceptance model of a batch of this grammar class."""
        return self.acceptance if grammar == NO_GRAMMAR else self.constrained

    def expected_drafts(self, seq_id: str, match_length: int, width: int, grammar: str = NO_GRAMMAR) -> float:
        """Accepted drafts expected from one verify step of ``seq_id`` at this match length and width."""
        return self.model(grammar).expected_drafts(seq_id, match_length, width)

    def choose(
        self,
        seq_ids: Sequence[str],
        match_lengths: MatchLengths,
        grammar: str = NO_GRAMMAR,
        remaining: Callable[[], Sequence[int]] | None = None,
        ahead: bool = False,
        cap: int | None = None,
        final: bool = False,
    ) -> int:
        """The draft width for a decode step over these sequences (``grammar``: their ``grammar_class``).

        ``remaining`` (tokens each sequence may still emit, computed on demand) is given when the
        batch is draining (nothing waits to join it): then only the members on its critical path
        count (``_drafts``). ``ahead``: a token per member is still in flight, so the lengths are
        one token old and each member is priced by what that token may make of it
        (``AcceptanceModel.expected``); such estimates do not feed the members' outlooks.
        ``final``: a verify step could go ahead without a drain deciding again once the token is
        known (chained into the plain step in flight), where a member whose token breaks its match
        gains nothing: ``final_ok`` says whether the width chosen still pays priced so."""
        widths = _capped(self.widths, cap)
        self.final_ok = False
        width, self.reason = self._decide(seq_ids, match_lengths, grammar, remaining, ahead, widths, final)
        return width

    def _decide(
        self,
        seq_ids: Sequence[str],
        match_lengths: MatchLengths,
        grammar: str,
        remaining: Callable[[], Sequence[int]] | None,
        ahead: bool,
        widths: list[int],
        final: bool = False,
    ) -> tuple[int, str]:
        """``widths``: the policy's widths up to the batch's cap; only those are timed and priced."""
        if not seq_ids:
            return 1, "empty"
        if len(widths) == 1:
            return 1, "fixed"
        b = bucket_of(len(seq_ids), grammar)
        now = self._steps.get(b, 0)
        costs = self.costs.bucket_costs(b)
        model = self.model(grammar)
        for w in widths:  # plain first, then each width with no cost known or borrowable, twice
            if costs[w] is None:
                if w > 1:
                    self._probe(seq_ids, match_lengths, ahead, model)
                return w, "time"
        plain = costs[1]
        assert plain is not None  # every width has a cost from here on
        # The widest width at parity with plain, if any (``AdaptiveParams.parity``).
        par = max(
            (w for w in widths[1:] if (c := costs[w]) is not None and c <= self.params.parity * plain),
            default=None,
        )
        if now < self._probe_at.get(b, 0):
            return 1, "wait"
        bar = self.params.margin * _rate(
            plain, 1, 0.0
        )  # a width must beat plain's tokens per second by the margin
        exploring = now >= self._explore_at.get(b, 0)
        if (
            exploring
            and self._shadowed - self._shadow_mark.get(b, 0) >= self.params.shadow_enough
            and now - max(self._last.get((b, w), -self.params.cost_refresh) for w in widths[1:])
            < self.params.cost_refresh
        ):
            # Shadow walks kept the acceptance estimates current since the bucket last skipped a
            # re-try, and a verify step timed the bucket lately: no re-try is needed.
            self._shadow_mark[b] = self._shadowed
            self._explore_at[b] = now + self._explore_gap(b, widths[-1])
            exploring = False
        if not exploring:
            first, p = model.best_rates(seq_ids)
            if par is None and not any(
                _rate(costs[w], w, run_length2(first, p, w - 1)) > bar for w in widths[1:]
            ):
                return 1, "hopeless"  # no width could win even at the best match length: skip the probe
        probed = time.perf_counter()
        lengths, expected = self._probe(seq_ids, match_lengths, ahead, model)
        if expected is None:  # every tree would be padding: nothing to gain, nothing to explore
            self._probe_at[b] = now + self._probe_gap(b, len(seq_ids), plain, probed)
            return 1, "no match"
        rem = None if remaining is None else remaining()
        critical = None if rem is None else self._critical(seq_ids, rem)
        rates = {w: _rate(costs[w], w, self._drafts(expected[w], critical)) for w in widths[1:]}
        best = max(rates, key=rates.__getitem__)
        exploit = rates[best] > bar
        if exploit or par is not None:
            if now - self._last.get((b, 1), 0) >= self.params.baseline_every:
                return 1, "baseline"  # refresh the plain cost while speculating
            if not exploit and par is not None:  # no width pays by the estimates, but a draft exists
                best = par
                self.final_ok = final and ahead  # (at parity a token that breaks a match costs nothing)
            elif final and ahead:  # does it pay where that token leaves a member nothing?
                missed = model.expected(seq_ids, lengths, (best,), ahead=True, final=True)[best]
                self.final_ok = _rate(costs[best], best, self._drafts(missed, critical)) > bar
            self.priced = dict(zip(seq_ids, zip(lengths, expected[best])))
            return best, "exploit" if exploit else "parity"
        if exploring and max(lengths) >= 2:
            self.priced = dict(zip(seq_ids, zip(lengths, expected[best])))
            return (
                best,
                "explore",
            )  # plain is winning: re-try speculation now and then, where there is a match
        self._probe_at[b] = now + self._probe_gap(b, len(seq_ids), plain, probed)
        if exploring:
            self._explore_at[b] = now + self.params.explore_every
        return 1, "plain"

    def _probe_gap(self, bucket: Bucket, batch_size: int, plain: float, since: float) -> int:
        """After a probe (begun at ``since``, ``time.perf_counter``) that found nothing worth
        verifying, the next one in this bucket waits this many steps (0 and 1 both mean the next
        step; g > 1: one probe per g steps): ``bucket // 4``, or more where probing that often
        would take more than ``probe_share`` of plain decoding's time, up to ``max_probe_gap``
        steps (the cost is re-sampled only by a probe). ``plain``: the bucket's plain
        step cost (normalized to the bucket's size; always timed by then: ``_decide`` probes only
        once every width has a cost). A probe is host Python over every member
        (match lengths, then pricing each at every width), and where the host has little idle
        time it lengthens the step. Probe costs are kept per bucket: they grow with the batch."""
        seconds = time.perf_counter() - since
        old = self.probe_cost.get(bucket)
        # Host time only spikes upwards (a page fault, a GC pause): follow a cheaper sample at once.
        cost = self.probe_cost[bucket] = (
            seconds if old is None or seconds < old else old + 0.2 * (seconds - old)
        )
        need = cost / (
            self.params.probe_share * plain * batch_size / bucket[0]
        )  # steps per probe at the share
        return max(bucket[0] // 4, min(math.ceil(need), self.params.max_probe_gap) if need > 1.0 else 0)

    def explore_interval(self, bucket: Bucket, width: int) -> int:
        """Steps between re-tries of a losing width: long enough that re-trying costs at most
        ``explore_overhead`` of plain throughput (a verify step of a large batch on a GPU costs
        several plain steps; on a CPU at batch 1 about 1.5)."""
        ratio = (self.costs.cost(bucket, width) or 0.0) / (self.costs.cost(bucket, 1) or float("inf"))
        return max(self.params.explore_every, math.ceil((ratio - 1.0) / self.params.explore_overhead))

    def _probe(
        self,
        seq_ids: Sequence[str],
        match_lengths: MatchLengths,
        ahead: bool = False,
        model: AcceptanceModel | None = None,
    ) -> tuple[Sequence[int], dict[int, list[float]] | None]:
        """The batch's match lengths, and the drafts each member is expected to accept per width
        (None when no member has a match, and never ``ahead``, where a length-0 member may reach
        length 1), by ``model`` (the unconstrained one by default); updates each member's outlook
        unless ``ahead``."""
        lengths = match_lengths()
        self._lengths.update(zip(seq_ids, lengths))
        model = self.acceptance if model is None else model
        expected = model.expected(seq_ids, lengths, ahead=ahead) if ahead or any(lengths) else None
        if ahead:
            return lengths, expected
        widest = None if expected is None else expected[self.max_width]
        outlook = self._outlook
        for i, seq_id in enumerate(seq_ids):
            d = 0.0 if widest is None else widest[i]
            old = outlook.get(seq_id)
            outlook[seq_id] = d if old is None else old + self.params.outlook_alpha * (d - old)
        return lengths, expected

    def _critical(self, seq_ids: Sequence[str], remaining: Sequence[int]) -> list[int]:
        """A draining batch's critical members (indices): those projected to need at least
        ``self.params.critical_share`` of the most steps (tokens left / (1 + the drafts their recent match
        lengths offer))."""
        outlook = self._outlook
        projected = [r / (1.0 + outlook.get(s, 0.0)) for s, r in zip(seq_ids, remaining)]
        cut = self.params.critical_share * max(projected)
        return [i for i, steps in enumerate(projected) if steps >= cut]

    @staticmethod
    def _drafts(expected: list[float], critical: list[int] | None) -> float:
        """Accepted drafts per sequence per verify step that the batch's progress is worth.

        Without ``critical``: the batch mean (finished sequences are replaced, so throughput is
        what counts). With it, the batch drains: it ends with its last member, and a step costs
        about the same whoever is in it, so only its critical members count, and the step is
        worth the least any of them gains. Speculating for copying members while a member that
        matches little still has as far to go only makes every step dearer: that member finishes
        later, and the batch with it (a remaining-weighted mean made fixed-length code edits slower
        than plain)."""
        if critical is None:
            return sum(expected) / len(expected)
        return min(expected[i] for i in critical)

    def observe(
        self,
        batch_size: int,
        width: int,
        seconds: float,
        drafts: Mapping[str, int] | None = None,
        grammar: str = NO_GRAMMAR,
        censored: Collection[str] = (),
        depths: Mapping[str, int] | None = None,
        restart: float | None = None,
        lengths: Mapping[str, int] | None = None,
    ) -> None:
        """A decode step ran: its time, and for a verify step the drafts each sequence accepted.

        ``censored`` names the sequences whose accepted path ended at a leaf of its tree: their
        run did not stop at a rejection. A sequence accepting all ``width - 1`` drafts is
        censored whether named or not. ``depths``: how many levels each sequence's tree had
        below its root (a run can be no longer; unknown means a chain). ``restart``: this plain
        step restarts the overlap chain the verify step before it broke; the verify step's engine
        step spent that long on the host after its commit (``_charge_break``). ``lengths``: the
        match length each sample is learned at, where the step knew it better than the last probe
        (a verify step chained into a plain step was probed a token before its trees' root)."""
        b = bucket_of(batch_size, grammar)
        now = self._steps.get(b, 0)
        self._steps[b] = now + 1
        self._last[(b, width)] = now
        # Step time grows ~linearly with batch size inside a bucket: normalize to the bucket size.
        scale = b[0] / max(batch_size, 1)
        seconds *= scale
        verified, self._verified = self._verified, None
        if restart is not None and width == 1 and verified is not None and verified[0] == b:
            seconds = self._charge_break(verified, seconds, restart * scale)
        self.costs.record(b, width, seconds)
        if width > 1:
            self._verified = (b, width, now)
        if width == 1 or not drafts:
            return
        lengths = self._lengths if lengths is None else lengths
        self.model(grammar).learn(
            width,
            [
                (
                    seq_id,
                    lengths.get(seq_id, 0),
                    accepted,
                    seq_id in censored,
                    None if depths is None else depths.get(seq_id),
                )
                for seq_id, accepted in drafts.items()
            ],
        )
        self._defer_retry(b, now + 1, width)

    def observe_vetoed(
        self, batch_size: int, width: int, grammar: str, seq_ids: Sequence[str], drained: bool = False
    ) -> None:
        """A verify step of ``width`` nodes was called off before its launch: the members' trees held
        no draft to verify, only padding or drafts their grammars forbid
        (``NgramSpecWorker._propose``), and a plain step ran instead. Where the call-off cost
        nothing but the drafting (``drained`` False: no overlap chain was drained for it), choosing
        the width was as good as plain: nothing is learned, and the verify steps that did launch
        price it alone (a width wins when it beats plain on the steps it verifies). Where a chain
        was drained for it, each member is taught to have accepted nothing, as the verify step
        would have. Either way a width that was re-tried waits for its next re-try."""
        if drained:
            self.model(grammar).learn(
                width, [(seq_id, self._lengths.get(seq_id, 0), 0, False, None) for seq_id in seq_ids]
            )
        b = bucket_of(batch_size, grammar)
        self._defer_retry(b, self._steps.get(b, 0) + 1, width)

    def _defer_retry(self, bucket: Bucket, step: int, width: int) -> None:
        """A verify step of ``width`` just ran (or was called off) in ``bucket``: the next re-try
        of a losing width comes one interval after bucket step ``step``."""
        self._explore_at[bucket] = step + self._explore_gap(bucket, width)

    def observe_shadow(self, width: int, samples: Sequence[tuple[str, int, int, bool, int]]) -> None:
        """Walks of shadow trees of ``width`` nodes drafted during plain steps (``ShadowDrafts``),
        each (seq id, match length, accepted drafts, censored, tree depth) of unconstrained batches
        (``CorpusUpkeep._shadow_step``): they teach acceptance as a verify step's would, and while
        they keep coming, re-trying a losing width to keep the estimates from getting stuck is not
        needed (``_decide``)."""
        if not samples:
            return
        widest = width == self.widths[-1]
        self.acceptance.learn(width, samples, teach_bias=widest)
        if widest:  # (the narrower trees are walked at the same steps)
            self._shadowed += len(samples)

    def _explore_gap(self, bucket: Bucket, width: int) -> int:
        return (
            self.explore_interval(bucket, width)
            if self.costs.cost(bucket, 1) is not None
            else self.params.explore_every
        )

    def _charge_break(self, verified: tuple[Bucket, int, int], seconds: float, tail: float) -> float:
        """Charge a verify step for the chain it broke; returns the restarting plain step's time
        as a plain sample.

        With overlap scheduling a verify step breaks the chain: the host work after its commit
        (``tail`` seconds, normalized: the rest of its engine step) and the launch of the plain
        step that restarts the chain run while the device idles. That tail, and what the
        restarting step (``seconds``, normalized) took beyond a plain step, are added to the
        verify step's time sample, and the next exploration moves out to match. Uncharged,
        explorations run more often than their budget allows. The charge is at most the verify
        step's own time, and the restarting step is recorded at a plain step's cost (its excess is
        the verify's, not plain decoding's). Only the engine's overlap path passes a tail: without
        overlap nothing is broken, and on a CPU, where step times vary by tens of ms, a charge that
        is never negative would only bias the costs against speculating."""
        b, width, at = verified
        plain, last = self.costs.cost(b, 1), self.costs.last(b, width)
        if plain is None or last is None:
            return seconds
        excess = max(seconds - plain, 0.0)
        self.costs.add_to_last(b, width, min(tail + excess, last))
        if b in self._explore_at:
            self._explore_at[b] = max(self._explore_at[b], at + 1 + self._explore_gap(b, width))
        return seconds - excess

    def forget(self, seq_ids: Sequence[str]) -> None:
        """Finished sequences: drop their state."""
        for seq_id in seq_ids:
            self._lengths.pop(seq_id, None)
            self._outlook.pop(seq_id, None)
        self.acceptance.forget(seq_ids)
        self.constrained.forget(seq_ids)


POLICIES = ("adaptive", "threshold", "fixed")


def make_policy(config: SpeculativeConfig) -> DraftPolicy:
    """The policy ``config.policy`` names, at width ``config.num_draft_tokens``."""
    if config.policy == "fixed":
        return FixedWidthPolicy(config.num_draft_tokens)
    if config.policy == "threshold":
        return ThresholdDraftPolicy(config.num_draft_tokens, config.threshold_match)
    return AdaptiveDraftPolicy(config.num_draft_tokens)


def _capped(widths: list[int], cap: int | None) -> list[int]:
    """``widths`` (1 first, ascending) up to ``cap`` (None: all)."""
    return widths if cap is None else [w for w in widths if w <= cap]
