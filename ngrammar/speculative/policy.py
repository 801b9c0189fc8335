"""Adaptive draft width: pick D per batch (1 = plain decode) from measured costs and acceptance.

Speculation pays when the tokens a verify step emits per sequence outweigh how much slower it is
than a plain step at the same batch size. Three things decide it, each measured where it varies:

- **step cost** is a property of the hardware and the batch: the lower median of the last few step
  times per (batch-size bucket, D) (a median, because one slow step - a first launch, a page fault,
  a busy host - must not decide for many steps); plain steps are re-measured every
  ``baseline_every`` steps while speculating, because their cost drifts with context length;
- **the match length** of each sequence at this step: the longest suffix of its context that the
  corpus has seen followed by something (``NgramCorpus.match_length``, capped at ``MAX_MATCH``). It
  is free of history and strongly predicts acceptance: with no match the draft tree is padding and
  accepts nothing (on the embedded model, open-ended text has no match on about half its steps);
  a 4-token match accepts 3-5 drafts at D = 8;
- **acceptance given the match length**, modelled as a run: the first draft is accepted with
  probability f and each later draft on the path continues the accepted run with probability p,
  so a tree of D nodes and L levels below its root is expected to accept
  ``f * (1 + p + p^2 + ... + p^(min(D-1, L) - 1))`` drafts (L is learned per (D, match length):
  a BFS tree from a short match is wide, not deep). p is per match length and serves every
  width, so what a width-8 step learns prices width 16 (a per-width average could not see that a
  width accepting all its drafts is too narrow: a code edit accepting 3 of 3 at D = 4 stayed at
  D = 4). f is per (D, match length): a narrow tree's first level holds fewer candidates (from a
  1-token match, 3 at D = 4 against up to 10 at D = 16), and priced with the widest tree's f,
  width-4 steps on open-ended text at batch 8 on the CPU accepted 0.12 drafts where ~0.9 were
  priced (0.83x plain). Each rate is hits / (hits + stops) over recent samples, where a run that
  ran out of tree (its path ended at a leaf) is censored: it counts its hits but no stop. Two
  rates, not one, because runs are all or nothing more often than one rate allows (a code edit
  either copies on or departs from its source at once): with one rate, 0 and 15 accepted drafts
  in equal shares read as p = 0.94, which promises 9.3 from 15 levels instead of 7.5 (on the CPU,
  width-16 exploit steps at match length 4 were expected to accept 10-12 drafts and accepted ~5;
  with two rates 7.3 and 7.0). A per-sequence bias on f (its first drafts accepted beyond those
  predicted, per trial, shrunk towards 0) tells a copying code edit from a story at the same
  match length; added to a p near 1 instead, a small bias promised long runs.

Each step takes the width with the best expected tokens per second, and speculates only when that
beats plain decoding by ``margin`` (timings are noisy). The match lengths are probed only when some
width could win at all, and after a probe that found nothing worth verifying the next probes in that
batch bucket are skipped for ``bucket // 4`` steps, or for as many as keep the probes' measured host
time under ``probe_share`` of plain decoding, so that a plain stretch costs no more than plain
decoding. While plain wins, the best width is still re-tried now and then when some sequence has a
2-token match, so the table's entries for lengths >= 2 cannot get stuck below
the truth; the interval between re-tries keeps their cost under ``explore_overhead`` of plain
throughput (at least ``explore_every`` steps; ~100 steps for a batch of 32 on a GPU, where a verify
step costs three plain ones). With overlap scheduling a verify step's cost includes the chain it
breaks: its host work after its commit and what the plain step restarting the chain takes beyond a
plain step's time. Shadow drafts (``ngrammar.speculative.shadow``) teach acceptance at every match length
and width from plain steps at no device cost (``observe_shadow``); while they keep coming, re-tries
are skipped, except one per ``COST_REFRESH`` steps of a bucket to re-time its verify steps.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

MAX_MATCH = 4  # match lengths are probed up to this (longer ones are bucketed with it)
# The chance that a draft continues the accepted run, by match length 0..MAX_MATCH, before any is
# measured. The embedded model on the benchmark workload accepted 0.7, 1.3, 2.2, 4.5 drafts at
# D = 8 for lengths 1-4 (p = 0.41, 0.57, 0.71, 0.89); the priors sit a little below.
PRIOR_CONTINUE = (0.0, 0.35, 0.5, 0.65, 0.8)
PRIOR_TRIALS = 4.0  # the prior's weight, in run trials (drafts tried)
MAX_CONTINUE = 0.97  # p is capped: a few censored steps must not promise every width everything
GLOBAL_DECAY = 0.93  # per learning step (a verify step, or a plain step's shadow walks): ~14 steps of memory
SEQ_DECAY = 0.8  # per learning step of the sequence
SEQ_SHRINK = 4.0  # pseudo-trials pulling a sequence's bias towards 0 (its first steps are noisy)
OUTLOOK_ALPHA = 0.2  # per probe: a sequence's outlook follows its match lengths over ~5 steps
# Shadow walks (of the widest trees) since a bucket last skipped a re-try of a losing width that
# let it skip the next one ...
SHADOW_ENOUGH = 4
# ... unless no verify step ran in the bucket for this many of its steps: a re-try also re-times
# the verify steps, whose cost drifts with context length (and an early sample may be a first launch).
COST_REFRESH = 512
CRITICAL_SHARE = 0.9  # a draining batch's critical members: projected to need this share of the most steps


def _clamp(p: float) -> float:
    return min(max(p, 0.0), MAX_CONTINUE)


def _run(p: float, levels: float) -> float:
    """Accepted drafts expected from ``levels`` levels when each draft continues the run with
    chance p (clamped): p + p^2 + ... + p^levels."""
    return 0.0 if p <= 0.0 else p * (1.0 - p**levels) / (1.0 - p)


def _run2(first: float, p: float, levels: float) -> float:
    """Accepted drafts expected from ``levels`` levels when the first draft is accepted with
    chance ``first`` and each later one continues the run with chance ``p`` (both clamped)."""
    return 0.0 if levels <= 0.0 or first <= 0.0 else first * (1.0 + _run(p, levels - 1.0))


# Why ``choose`` picked its width: "fixed" (not adaptive), "time" (a width's cost is not known yet),
# "wait" (a probe found nothing worth verifying lately), "hopeless" (no width could win even at the
# best rates), "no match" (every tree would be padding), "baseline" (plain, re-timed
# while speculating), "exploit" (a width is expected to win), "explore" (re-trying a losing width),
# "plain" (plain is expected to win), "empty" (no sequences).
REASONS = (
    "fixed",
    "time",
    "wait",
    "hopeless",
    "no match",
    "baseline",
    "exploit",
    "explore",
    "plain",
    "empty",
)

Bucket = tuple[int, bool]  # (batch size rounded up to a power of two, whether a grammar constrains it)


def bucket_of(batch_size: int, constrained: bool) -> Bucket:
    # A constrained verify step also builds a grammar bitmask for every tree node on the host, so
    # it costs more than an unconstrained one of the same shape: timed apart.
    return 1 << max(batch_size - 1, 0).bit_length(), constrained


def _rate(cost: float | None, width: int, drafts: float) -> float:
    """Expected tokens per second per sequence of a step costing ``cost`` seconds (per bucket
    slot) at this width, given its mean accepted drafts."""
    return (1.0 + min(max(drafts, 0.0), width - 1)) / (cost or float("inf"))


@dataclass
class _Rate:
    """Decayed counts of hits and stops: p = hits / (hits + stops)."""

    hits: float
    stops: float

    def update(self, hits: float, stops: float, decay: float) -> None:
        self.hits = decay * self.hits + hits
        self.stops = decay * self.stops + stops

    @property
    def p(self) -> float:
        trials = self.hits + self.stops
        return self.hits / trials if trials > 0 else 0.0


def _prior(p: float) -> _Rate:
    return _Rate(PRIOR_TRIALS * p, PRIOR_TRIALS * (1 - p))


@dataclass
class _SeqBias:
    """A sequence's first drafts accepted beyond those its match lengths predicted, per trial
    (decayed sums)."""

    hits: float = 0.0
    predicted: float = 0.0
    trials: float = 0.0

    def update(self, hits: float, predicted: float, trials: float) -> None:
        self.hits = SEQ_DECAY * self.hits + hits
        self.predicted = SEQ_DECAY * self.predicted + predicted
        self.trials = SEQ_DECAY * self.trials + trials

    @property
    def value(self) -> float:
        return (self.hits - self.predicted) / (self.trials + SEQ_SHRINK)


@dataclass
class _Ema:
    value: float
    alpha: float = 0.3

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


@dataclass
class _Recent:
    """The lower median of the last ``size`` samples: robust to isolated slow steps."""

    size: int = 5
    samples: deque[float] = field(default_factory=deque)
    value: float | None = None  # kept current by update: it is read several times per step

    def update(self, x: float) -> None:
        self.samples.append(x)
        if len(self.samples) > self.size:
            self.samples.popleft()
        self.refresh()

    def refresh(self) -> None:
        ordered = sorted(self.samples)
        self.value = ordered[(len(ordered) - 1) // 2]


MatchLengths = Callable[[], Sequence[int]]  # the batch's match lengths, in seq_ids order (computed on demand)


@dataclass
class AdaptiveDraftPolicy:
    max_width: int
    adaptive: bool = True
    explore_every: int = 8  # fewest plain steps before the best draft width is re-tried
    explore_overhead: float = 0.02  # re-tries may cost at most this share of plain throughput
    baseline_every: int = 8  # plain steps are re-measured this often while speculating
    margin: float = 1.15  # speculate only when expected this much faster than plain
    probe_share: float = 0.02  # probes that find nothing may cost at most this share of plain steps
    probe_cost: dict[Bucket, float] = field(
        default_factory=dict
    )  # bucket -> host seconds per probe (``_probe_gap``)
    step_time: dict[tuple[Bucket, int], _Recent] = field(default_factory=dict)  # (bucket, width) -> s / step
    # (width, match length) -> the first draft's acceptance; match length -> the run's continuation
    first: dict[tuple[int, int], _Rate] = field(init=False)
    cont: list[_Rate] = field(init=False)
    seq_bias: dict[str, _SeqBias] = field(default_factory=dict)  # seq id -> continuation beyond prediction
    _lengths: dict[str, int] = field(default_factory=dict)  # seq id -> match length at its last probe
    _outlook: dict[str, float] = field(default_factory=dict)  # seq id -> drafts per step it tends to offer
    _depth: dict[tuple[int, int], _Ema] = field(default_factory=dict)  # (width, match length) -> tree depth
    _steps: dict[Bucket, int] = field(default_factory=dict)  # bucket -> decode steps observed
    _last: dict[tuple[Bucket, int], int] = field(default_factory=dict)  # (bucket, width) -> step it last ran
    _probe_at: dict[Bucket, int] = field(default_factory=dict)  # bucket -> first step a probe may run again
    _explore_at: dict[Bucket, int] = field(default_factory=dict)  # bucket -> first step exploring may run
    _verified: tuple[Bucket, int, int] | None = (
        None  # the last step observed, if a verify: bucket, width, step
    )
    _shadowed: int = 0  # shadow walks of the widest trees observed (``observe_shadow``)
    _shadow_mark: dict[Bucket, int] = field(
        default_factory=dict
    )  # bucket -> _shadowed when it last skipped a re-try
    # Read several times per step, changed only by observe (which clears them):
    _costs: dict[Bucket, dict[int, float | None]] = field(default_factory=dict)  # step_cost results
    _best_p: tuple[float, float] | None = None  # the highest first-draft and continuation rates
    _rates: dict[int, list[tuple[float, float]]] | None = (
        None  # width -> match length -> (first, continuation)
    )
    _depth_levels: dict[int, list[float]] | None = None  # width -> match length -> run levels (lazy)
    _gain_table: dict[int, list[tuple[float, float]]] | None = None  # width -> match length -> (f, gain)

    reason: str = ""  # why the last choose returned what it did (one of REASONS)
    # For the last exploit or explore decision: seq id -> (match length, accepted drafts expected)
    # at the width chosen (for calibration: ``benchmarks/bench_calibration.py``).
    priced: dict[str, tuple[int, float]] = field(default_factory=dict)

    # The policy runs on every decode step, so what it reads often is precomputed:
    widths: list[int] = field(init=False)  # 1 and the draft widths it may pick

    def __post_init__(self) -> None:
        out = {1, self.max_width}
        w = self.max_width // 2
        while w >= 4:
            out.add(w)
            w //= 2
        self.widths = sorted(out)
        self.first = {(w, n): _prior(p) for w in self.widths[1:] for n, p in enumerate(PRIOR_CONTINUE)}
        self.cont = [_prior(p) for p in PRIOR_CONTINUE]

    # ------------------------------------------------------------ decide
    def choose(
        self,
        seq_ids: Sequence[str],
        match_lengths: MatchLengths,
        constrained: bool = False,
        remaining: Callable[[], Sequence[int]] | None = None,
        ahead: bool = False,
    ) -> int:
        """The draft width for a decode step over these sequences (``constrained``: some have a grammar).

        ``remaining`` (tokens each sequence may still emit, computed on demand) is given when the
        batch is draining (nothing waits to join it): then only the members on its critical path
        count (``_drafts``). ``ahead``: a token per member is still in flight, so the lengths are
        one token old and each member is priced by what that token may make of it (``_expected``);
        such estimates do not feed the members' outlooks. ``reason`` says why (see ``REASONS``)."""
        width, self.reason = self._decide(seq_ids, match_lengths, constrained, remaining, ahead)
        return width

    def _decide(
        self,
        seq_ids: Sequence[str],
        match_lengths: MatchLengths,
        constrained: bool,
        remaining: Callable[[], Sequence[int]] | None,
        ahead: bool,
    ) -> tuple[int, str]:
        if not seq_ids:
            return 1, "empty"
        if not self.adaptive or self.max_width == 1:
            return self.max_width, "fixed"
        b = bucket_of(len(seq_ids), constrained)
        now = self._steps.get(b, 0)
        costs = self._bucket_costs(b)
        for w in self.widths:  # plain first, then each width with no cost known or borrowable, twice
            if costs[w] is None:
                if w > 1:
                    self._probe(seq_ids, match_lengths, ahead)
                return w, "time"
        plain = costs[1]
        assert plain is not None  # every width has a cost from here on
        if now < self._probe_at.get(b, 0):
            return 1, "wait"
        bar = self.margin * _rate(plain, 1, 0.0)  # a width must beat plain's tokens per second by the margin
        exploring = now >= self._explore_at.get(b, 0)
        if (
            exploring
            and self._shadowed - self._shadow_mark.get(b, 0) >= SHADOW_ENOUGH
            and now - max(self._last.get((b, w), -COST_REFRESH) for w in self.widths[1:]) < COST_REFRESH
        ):
            # Shadow walks kept the acceptance estimates current since the bucket last skipped a
            # re-try, and a verify step timed the bucket lately: no re-try is needed.
            self._shadow_mark[b] = self._shadowed
            self._explore_at[b] = now + self._explore_gap(b, self.widths[-1])
            exploring = False
        if not exploring:
            bias = max((self.seq_bias[s].value for s in seq_ids if s in self.seq_bias), default=0.0)
            if self._best_p is None:  # the best of each rate: an upper bound over widths and match lengths
                self._best_p = (max(r.p for r in self.first.values()), max(r.p for r in self.cont))
            first, p = _clamp(self._best_p[0] + max(bias, 0.0)), _clamp(self._best_p[1])
            if not any(_rate(costs[w], w, _run2(first, p, w - 1)) > bar for w in self.widths[1:]):
                return 1, "hopeless"  # no width could win even at the best match length: skip the probe
        probed = time.perf_counter()
        lengths, expected = self._probe(seq_ids, match_lengths, ahead)
        if expected is None:  # every tree would be padding: nothing to gain, nothing to explore
            self._probe_at[b] = now + self._probe_gap(b, len(seq_ids), plain, probed)
            return 1, "no match"
        rem = None if remaining is None else remaining()
        critical = None if rem is None else self._critical(seq_ids, rem)
        rates = {w: _rate(costs[w], w, self._drafts(expected[w], critical)) for w in self.widths[1:]}
        best = max(rates, key=rates.__getitem__)
        if rates[best] > bar:
            if now - self._last.get((b, 1), 0) >= self.baseline_every:
                return 1, "baseline"  # refresh the plain cost while speculating
            self.priced = dict(zip(seq_ids, zip(lengths, expected[best])))
            return best, "exploit"
        if exploring and max(lengths) >= 2:
            self.priced = dict(zip(seq_ids, zip(lengths, expected[best])))
            return (
                best,
                "explore",
            )  # plain is winning: re-try speculation now and then, where there is a match
        self._probe_at[b] = now + self._probe_gap(b, len(seq_ids), plain, probed)
        if exploring:
            self._explore_at[b] = now + self.explore_every
        return 1, "plain"

    def _probe_gap(self, bucket: Bucket, batch_size: int, plain: float, since: float) -> int:
        """After a probe (begun at ``since``, ``time.perf_counter``) that found nothing worth
        verifying, the next one in this bucket waits this many steps (0 and 1 both mean the next
        step; g > 1: one probe per g steps): ``bucket // 4``, or more where probing that often
        would take more than ``probe_share`` of plain decoding's time. ``plain``: the bucket's plain
        step cost (normalized to the bucket's size; always timed by then: ``_decide`` probes only
        once every width has a cost). A probe is host Python over every member
        (match lengths, then pricing each at every width: 51-92 µs per probing call at batch 8 on
        the 2-core CPU box, session 13), and where the host has little idle time it lengthens the
        step. Probe costs are kept per bucket: they grow with the batch."""
        seconds = time.perf_counter() - since
        old = self.probe_cost.get(bucket)
        # Host time only spikes upwards (a page fault, a GC pause): follow a cheaper sample at once.
        cost = self.probe_cost[bucket] = (
            seconds if old is None or seconds < old else old + 0.2 * (seconds - old)
        )
        need = cost / (self.probe_share * plain * batch_size / bucket[0])  # steps per probe at the share
        return max(bucket[0] // 4, math.ceil(need) if need > 1.0 else 0)

    def step_cost(self, bucket: Bucket, width: int) -> float | None:
        """Seconds per step at this bucket and width (normalized to the bucket size): measured
        (twice at least), else estimated from its plain cost and the verify / plain cost ratio of
        the nearest larger bucket measured at both, else None (to be measured). A batch that
        drains passes through every smaller bucket; timing verify steps afresh in each would cost
        several wasted verify steps per bucket. Only larger buckets lend their ratio: it grows
        with the batch (host drafting on a GPU, compute on a CPU), so theirs over-estimates."""
        costs = self._bucket_costs(bucket)
        return costs[width] if width in costs else self._step_cost(bucket, width)

    def _bucket_costs(self, bucket: Bucket) -> dict[int, float | None]:
        """width -> ``step_cost`` for every width the policy may pick (cached until the next observe)."""
        costs = self._costs.get(bucket)
        if costs is None:
            costs = self._costs[bucket] = {w: self._step_cost(bucket, w) for w in self.widths}
        return costs

    def _step_cost(self, bucket: Bucket, width: int) -> float | None:
        rec = self.step_time.get((bucket, width))
        if rec is not None and len(rec.samples) >= 2:
            return rec.value
        plain = self.step_time.get((bucket, 1))
        if width == 1 or plain is None or len(plain.samples) < 2 or plain.value is None:
            return None
        known = [
            b
            for (b, w), r in self.step_time.items()
            if w == width
            and b[1] == bucket[1]
            and b[0] > bucket[0]
            and len(r.samples) >= 2
            and (b, 1) in self.step_time
        ]
        if not known:
            return None
        near = min(known, key=lambda b: b[0])
        verify, base = self.step_time[(near, width)].value, self.step_time[(near, 1)].value
        return None if verify is None or not base else plain.value * verify / base

    def explore_interval(self, bucket: Bucket, width: int) -> int:
        """Steps between re-tries of a losing width: long enough that re-trying costs at most
        ``explore_overhead`` of plain throughput (a verify step of a large batch on a GPU costs
        several plain steps; on a CPU at batch 1 about 1.5)."""
        ratio = (self.step_cost(bucket, width) or 0.0) / (self.step_cost(bucket, 1) or float("inf"))
        return max(self.explore_every, math.ceil((ratio - 1.0) / self.explore_overhead))

    def _probe(
        self, seq_ids: Sequence[str], match_lengths: MatchLengths, ahead: bool = False
    ) -> tuple[Sequence[int], dict[int, list[float]] | None]:
        """The batch's match lengths, and the drafts each member is expected to accept per width
        (None when no member has a match, and never ``ahead``, where a length-0 member may reach
        length 1); updates each member's outlook unless ``ahead``."""
        lengths = match_lengths()
        self._lengths.update(zip(seq_ids, lengths))
        expected = self._expected(seq_ids, lengths, ahead=ahead) if ahead or any(lengths) else None
        if ahead:
            return lengths, expected
        widest = None if expected is None else expected[self.max_width]
        outlook = self._outlook
        for i, seq_id in enumerate(seq_ids):
            d = 0.0 if widest is None else widest[i]
            old = outlook.get(seq_id)
            outlook[seq_id] = d if old is None else old + OUTLOOK_ALPHA * (d - old)
        return lengths, expected

    def _expected(
        self,
        seq_ids: Sequence[str],
        lengths: Sequence[int],
        widths: Sequence[int] | None = None,
        ahead: bool = False,
    ) -> dict[int, list[float]]:
        """width -> accepted drafts expected from one verify step of each sequence at its match
        length, for ``widths`` (default: every draft width the policy picks): ``_run2`` of its
        first-draft and continuation rates (clamped once per member: this runs on most decode
        steps for every member of the batch, over every width).

        ``ahead``: the lengths are one token old (that token is in flight). A member at length n > 0
        reaches n + 1 if the token continues its match, which it does with the first-draft rate of
        length n (the same agreement of model and corpus that accepts a first draft); otherwise it is
        priced at length 1. That is exact from n <= 1 (a missed continuation leaves at most the
        token itself matched) and an approximation from n >= 2, where a shorter suffix followed by
        that token elsewhere in the corpus can leave up to n. From n = 0 the token reaches length 1
        at most: priced at 1. (Pricing every member at n + 1, the bound, broke the overlap chain for
        verify steps that the committed token then called off: 3 times per 64-token run of
        open-ended text at batch 1 on the H200.)"""
        bias = self.seq_bias
        widths = self.widths[1:] if widths is None else widths
        out = {w: [0.0] * len(seq_ids) for w in widths}
        columns = [(out[w], self._gains(w)) for w in widths]
        # Whether the token in flight continues a match: any continuation, as the widest tree's first level.
        widest = self._continuation(self.widths[-1])
        top = MAX_CONTINUE
        for i, (seq_id, n) in enumerate(zip(seq_ids, lengths)):
            own = bias.get(seq_id)
            shift = 0.0 if own is None else own.value
            # _run2(_clamp(f + shift), p, levels) == _clamp(f + shift) * gain (``_gains``), with
            # _clamp inlined: this loop runs for every member on most decode steps.
            if ahead:
                hit = min(max(widest[min(n, MAX_MATCH)][0] + shift, 0.0), top) if n else 0.0
                up = min(n + 1, MAX_MATCH)
                for column, gains in columns:
                    f_up, g_up = gains[up]
                    f_one, g_one = gains[1]
                    column[i] = (
                        hit * min(max(f_up + shift, 0.0), top) * g_up
                        + (1.0 - hit) * min(max(f_one + shift, 0.0), top) * g_one
                    )
                continue
            if not n:
                continue  # no match: a padding-only tree accepts nothing
            n = min(n, MAX_MATCH)
            for column, gains in columns:
                f, g = gains[n]
                column[i] = min(max(f + shift, 0.0), top) * g
        return out

    def _gains(self, width: int) -> list[tuple[float, float]]:
        """match length -> (first-draft rate f, gain g) at this width, where a run of first draft
        chance ``first`` is expected to accept ``first * g`` drafts: g = 1 + p + ... over the run's
        levels (``_run2`` with its ``first`` factored out; 0 without levels). Cached until the next
        observe."""
        if self._gain_table is None:
            self._gain_table = {}
        gains = self._gain_table.get(width)
        if gains is None:
            levels = self._levels(width)
            gains = self._gain_table[width] = [
                (f, 1.0 + _run(_clamp(p), levels[n] - 1.0) if levels[n] > 0.0 else 0.0)
                for n, (f, p) in enumerate(self._continuation(width))
            ]
        return gains

    def _continuation(self, width: int) -> list[tuple[float, float]]:
        """Each match length's first-draft and continuation rates at this width, the prior's where
        none was learned (cached until the next observe)."""
        if self._rates is None:
            self._rates = {}
        rates = self._rates.get(width)
        if rates is None:
            first = self.first
            rates = self._rates[width] = [
                (first[(width, n)].p if (width, n) in first else p, self.cont[n].p)
                for n, p in enumerate(PRIOR_CONTINUE)
            ]
        return rates

    def _levels(self, width: int) -> list[float]:
        """match length -> levels a run may take at this width: D - 1, or fewer where the trees of
        that width and match length were learned to be shallower (cached until the next observe)."""
        if self._depth_levels is None:
            self._depth_levels = {}
        levels = self._depth_levels.get(width)
        if levels is None:
            depth = self._depth
            levels = self._depth_levels[width] = [
                float(width - 1)
                if (width, n) not in depth
                else min(width - 1.0, max(depth[(width, n)].value, 0.0))
                for n in range(MAX_MATCH + 1)
            ]
        return levels

    def _critical(self, seq_ids: Sequence[str], remaining: Sequence[int]) -> list[int]:
        """A draining batch's critical members (indices): those projected to need at least
        ``CRITICAL_SHARE`` of the most steps (tokens left / (1 + the drafts their recent match
        lengths offer))."""
        outlook = self._outlook
        projected = [r / (1.0 + outlook.get(s, 0.0)) for s, r in zip(seq_ids, remaining)]
        cut = CRITICAL_SHARE * max(projected)
        return [i for i, steps in enumerate(projected) if steps >= cut]

    @staticmethod
    def _drafts(expected: list[float], critical: list[int] | None) -> float:
        """Accepted drafts per sequence per verify step that the batch's progress is worth.

        Without ``critical``: the batch mean (finished sequences are replaced, so throughput is
        what counts). With it, the batch drains: it ends with its last member, and a step costs
        about the same whoever is in it, so only its critical members count, and the step is
        worth the least any of them gains. Speculating for copying members while a member that
        matches little still has as far to go only makes every step dearer: that member finishes
        later, and the batch with it (on the H200 at batch 8, fixed-length code edits ran at
        0.91x plain with the remaining-weighted mean)."""
        if critical is None:
            return sum(expected) / len(expected)
        return min(expected[i] for i in critical)

    def expected_drafts(self, seq_id: str, match_length: int, width: int) -> float:
        """Accepted drafts expected from one verify step of ``seq_id`` at this match length and width."""
        return self._expected([seq_id], [max(match_length, 0)], (width,))[width][0]

    # ------------------------------------------------------------ learn
    def observe(
        self,
        batch_size: int,
        width: int,
        seconds: float,
        drafts: Mapping[str, int] | None = None,
        constrained: bool = False,
        censored: Collection[str] = (),
        depths: Mapping[str, int] | None = None,
        restart: float | None = None,
    ) -> None:
        """A decode step ran: its time, and for a verify step the drafts each sequence accepted.

        ``censored`` names the sequences whose accepted path ended at a leaf of its tree: their
        run did not stop at a rejection. A sequence accepting all ``width - 1`` drafts is
        censored whether named or not. ``depths``: how many levels each sequence's tree had
        below its root (a run can be no longer; unknown means a chain). ``restart``: this plain
        step restarts the overlap chain the verify step before it broke; the verify step's engine
        step spent that long on the host after its commit (``_charge_break``)."""
        b = bucket_of(batch_size, constrained)
        now = self._steps.get(b, 0)
        self._steps[b] = now + 1
        self._last[(b, width)] = now
        # Step time grows ~linearly with batch size inside a bucket: normalize to the bucket size.
        scale = b[0] / max(batch_size, 1)
        seconds *= scale
        verified, self._verified = self._verified, None
        if restart is not None and width == 1 and verified is not None and verified[0] == b:
            seconds = self._charge_break(verified, seconds, restart * scale)
        self.step_time.setdefault((b, width), _Recent()).update(seconds)
        self._costs.clear()
        if width > 1:
            self._verified = (b, width, now)
        if width == 1 or not drafts:
            return
        lengths = self._lengths
        self._learn(
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

    def observe_vetoed(self, batch_size: int, width: int, constrained: bool, seq_ids: Sequence[str]) -> None:
        """A verify step of ``width`` nodes was called off before its launch: the members' trees held
        no draft to verify, only padding or drafts their grammars forbid
        (``NgramSpecWorker._kept_nodes``), so each would have accepted nothing. That teaches
        acceptance as the step would have (a plain step runs instead and is timed as one), and a
        width that was re-tried waits for its next re-try."""
        self._learn(width, [(seq_id, self._lengths.get(seq_id, 0), 0, False, None) for seq_id in seq_ids])
        b = bucket_of(batch_size, constrained)
        self._defer_retry(b, self._steps.get(b, 0) + 1, width)

    def _defer_retry(self, bucket: Bucket, step: int, width: int) -> None:
        """A verify step of ``width`` just ran (or was called off) in ``bucket``: the next re-try
        of a losing width comes one interval after bucket step ``step``."""
        if self.adaptive:
            self._explore_at[bucket] = step + self._explore_gap(bucket, width)

    def observe_shadow(self, width: int, samples: Sequence[tuple[str, int, int, bool, int]]) -> None:
        """Walks of shadow trees of ``width`` nodes drafted during plain steps (``ShadowDrafts``),
        each (seq id, match length, accepted drafts, censored, tree depth): they teach acceptance
        as a verify step's would, and while they keep coming, re-trying a losing width to keep
        the estimates from getting stuck is not needed (``_decide``)."""
        if not samples:
            return
        widest = width == self.widths[-1]
        self._learn(width, samples, teach_bias=widest)
        if widest:  # (the narrower trees are walked at the same steps)
            self._shadowed += len(samples)

    def _learn(
        self, width: int, samples: Sequence[tuple[str, int, int, bool, int | None]], teach_bias: bool = True
    ) -> None:
        """One step's acceptance samples at this width: (seq id, match length at drafting,
        accepted drafts, censored, tree depth or None). ``teach_bias``: also update the members'
        biases (shadow walks come at every width at once; only the widest teaches them, so that
        one plain step does not count several times)."""
        counts = [[0.0] * 4 for _ in range(MAX_MATCH + 1)]  # first hits, first stops, hits, stops
        before = self._continuation(width)  # what the rates predicted (the bias is measured against it)
        for seq_id, n, accepted, censored, depth in samples:
            n = min(n, MAX_MATCH)
            if n == 0:
                continue  # nothing to learn: a padding-only tree
            stopped = 0.0 if accepted >= width - 1 or censored else 1.0
            if depth is not None:  # a new entry starts at its first sample
                self._depth.setdefault((width, n), _Ema(float(depth))).update(depth)
            c = counts[n]
            if accepted:
                c[0] += 1.0
                c[2] += accepted - 1
                c[3] += stopped
            else:
                c[1] += stopped
            if teach_bias:
                trial = 1.0 if accepted else stopped  # of the first draft: what the bias is about
                self.seq_bias.setdefault(seq_id, _SeqBias()).update(
                    min(accepted, 1), before[n][0] * trial, trial
                )
        for n in range(1, MAX_MATCH + 1):
            c = counts[n]
            if c[0] or c[1]:
                self.first.setdefault((width, n), _prior(PRIOR_CONTINUE[n])).update(c[0], c[1], GLOBAL_DECAY)
            if c[2] or c[3]:
                self.cont[n].update(c[2], c[3], GLOBAL_DECAY)
        self._best_p = self._rates = self._depth_levels = self._gain_table = None

    def _explore_gap(self, bucket: Bucket, width: int) -> int:
        return (
            self.explore_interval(bucket, width)
            if self.step_cost(bucket, 1) is not None
            else self.explore_every
        )

    def _charge_break(self, verified: tuple[Bucket, int, int], seconds: float, tail: float) -> float:
        """Charge a verify step for the chain it broke; returns the restarting plain step's time
        as a plain sample.

        With overlap scheduling a verify step breaks the chain: the host work after its commit
        (``tail`` seconds, normalized: the rest of its engine step) and the launch of the plain
        step that restarts the chain run while the device idles. That tail, and what the
        restarting step (``seconds``, normalized) took beyond a plain step, are added to the
        verify step's time sample, and the next exploration moves out to match. Uncharged,
        explorations ran more often than their budget allows: on the H200 at batch 8, one per
        64-token run, each costing the run 3-7% (session 11). The charge is at most the verify
        step's own time, and the restarting step is recorded at a plain step's cost (its excess is
        the verify's, not plain decoding's). Only the engine's overlap path passes a tail: without
        overlap nothing is broken, and on a CPU, where step times vary by tens of ms, a charge that
        is never negative would only bias the costs against speculating."""
        b, width, at = verified
        plain, rec = self.step_cost(b, 1), self.step_time.get((b, width))
        if plain is None or rec is None or not rec.samples:
            return seconds
        excess = max(seconds - plain, 0.0)
        rec.samples[-1] += min(tail + excess, rec.samples[-1])
        rec.refresh()
        self._costs.clear()
        if self.adaptive and b in self._explore_at:
            self._explore_at[b] = max(self._explore_at[b], at + 1 + self._explore_gap(b, width))
        return seconds - excess

    def forget(self, seq_ids: Sequence[str]) -> None:
        """Finished sequences: drop their state."""
        for seq_id in seq_ids:
            self.seq_bias.pop(seq_id, None)
            self._lengths.pop(seq_id, None)
            self._outlook.pop(seq_id, None)
