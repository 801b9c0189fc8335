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
- **acceptance given the match length**: a moving average of accepted drafts per verify step per
  (D, match length) over all sequences, seeded with ``PRIOR_DRAFTS``, plus a per-sequence bias (how
  many more drafts than predicted this request's text has been accepting: a code edit copies more
  than a story at the same match length).

Each step takes the width with the best expected tokens per second, and speculates only when that
beats plain decoding by ``margin`` (timings are noisy). The match lengths are probed only when some
width could win at all, and after a probe that found nothing worth verifying the next probes in that
batch bucket are skipped for ``bucket // 4`` steps, so that a plain stretch of a large batch costs
no more than plain decoding. While plain wins, the best width is still re-tried now and then when
some sequence has a 2-token match, so the table's entries for lengths >= 2 cannot get stuck below
the truth (length 1 can: a batch whose matches are all length 1 is never re-tried); the
interval between re-tries keeps their cost under ``explore_overhead`` of plain throughput (at
least ``explore_every`` steps; ~100 steps for a batch of 32 on a GPU, where a verify step costs
three plain ones).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

MAX_MATCH = 4  # match lengths are probed up to this (longer ones are bucketed with it)
# Accepted drafts per verify step by match length 0..MAX_MATCH before any are measured (the
# embedded model on the benchmark workload at D = 8: 0, 0.7, 1.3, 2.2, 4.5 measured).
PRIOR_DRAFTS = (0.0, 0.5, 1.0, 2.0, 3.0)


Bucket = tuple[int, bool]  # (batch size rounded up to a power of two, whether a grammar constrains it)


def _bucket(batch_size: int, constrained: bool) -> Bucket:
    # A constrained verify step also builds a grammar bitmask for every tree node on the host, so
    # it costs more than an unconstrained one of the same shape: timed apart.
    return 1 << max(batch_size - 1, 0).bit_length(), constrained


@dataclass
class _Ema:
    value: float
    alpha: float = 0.3

    def update(self, x: float) -> None:
        self.value = (1 - self.alpha) * self.value + self.alpha * x


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
    step_time: dict[tuple[Bucket, int], _Recent] = field(default_factory=dict)  # (bucket, width) -> s / step
    accept: dict[tuple[int, int], _Ema] = field(default_factory=dict)  # (width, match length) -> drafts
    seq_bias: dict[str, _Ema] = field(default_factory=dict)  # seq id -> drafts accepted beyond prediction
    _lengths: dict[str, int] = field(default_factory=dict)  # seq id -> match length at its last probe
    _steps: dict[Bucket, int] = field(default_factory=dict)  # bucket -> decode steps observed
    _last: dict[tuple[Bucket, int], int] = field(default_factory=dict)  # (bucket, width) -> step it last ran
    _probe_at: dict[Bucket, int] = field(default_factory=dict)  # bucket -> first step a probe may run again
    _explore_at: dict[Bucket, int] = field(default_factory=dict)  # bucket -> first step exploring may run

    # The policy runs on every decode step, so what it reads often is precomputed:
    widths: list[int] = field(init=False)  # 1 and the draft widths it may pick
    _table: dict[int, list[float]] = field(default_factory=dict)  # width -> predicted drafts by match length

    def __post_init__(self) -> None:
        out = {1, self.max_width}
        w = self.max_width // 2
        while w >= 4:
            out.add(w)
            w //= 2
        self.widths = sorted(out)

    # ------------------------------------------------------------ decide
    def choose(
        self,
        seq_ids: Sequence[str],
        match_lengths: MatchLengths,
        constrained: bool = False,
        remaining: Callable[[], Sequence[int]] | None = None,
    ) -> int:
        """The draft width for a decode step over these sequences (``constrained``: some have a grammar).

        ``remaining`` (tokens each sequence may still emit, computed on demand) is given when the
        batch is draining (nothing waits to join it): then sequences count in proportion to what
        they have left (``_drafts``)."""
        if not seq_ids:
            return 1
        if not self.adaptive or self.max_width == 1:
            return self.max_width
        b = _bucket(len(seq_ids), constrained)
        now = self._steps.get(b, 0)
        for w in self.widths:  # plain first, then each width with no cost known or borrowable, twice
            if self.step_cost(b, w) is None:
                if w > 1:
                    self._probe(seq_ids, match_lengths)
                return w
        if now < self._probe_at.get(b, 0):
            return 1
        plain = self._rate(b, 1, 0.0)
        exploring = now >= self._explore_at.get(b, 0)
        if not exploring:
            bias = max((self.seq_bias[s].value for s in seq_ids if s in self.seq_bias), default=0.0)
            if not any(self._rate(b, w, self._best_case(w) + max(bias, 0.0)) > self.margin * plain
                       for w in self.widths[1:]):
                return 1  # no width could win even at the best match length: skip the probe
        lengths = self._probe(seq_ids, match_lengths)
        if not any(lengths):  # every tree would be padding: nothing to gain, nothing to explore
            self._probe_at[b] = now + b[0] // 4
            return 1
        rem = None if remaining is None else remaining()
        rates = {w: self._rate(b, w, self._drafts(seq_ids, lengths, w, rem)) for w in self.widths[1:]}
        best = max(rates, key=rates.__getitem__)
        if rates[best] > self.margin * plain:
            if now - self._last.get((b, 1), 0) >= self.baseline_every:
                return 1  # refresh the plain cost while speculating
            return best
        if exploring and max(lengths) >= 2:
            return best  # plain is winning: re-try speculation now and then, where there is a match
        self._probe_at[b] = now + b[0] // 4
        if exploring:
            self._explore_at[b] = now + self.explore_every
        return 1

    def step_cost(self, bucket: Bucket, width: int) -> float | None:
        """Seconds per step at this bucket and width (normalized to the bucket size): measured
        (twice at least), else estimated from its plain cost and the verify / plain cost ratio of
        the nearest larger bucket measured at both, else None (to be measured). A batch that
        drains passes through every smaller bucket; timing verify steps afresh in each would cost
        several wasted verify steps per bucket. Only larger buckets lend their ratio: it grows
        with the batch (host drafting on a GPU, compute on a CPU), so theirs over-estimates."""
        rec = self.step_time.get((bucket, width))
        if rec is not None and len(rec.samples) >= 2:
            return rec.value
        plain = self.step_time.get((bucket, 1))
        if width == 1 or plain is None or len(plain.samples) < 2 or plain.value is None:
            return None
        known = [b for (b, w), r in self.step_time.items()
                 if w == width and b[1] == bucket[1] and b[0] > bucket[0] and len(r.samples) >= 2
                 and (b, 1) in self.step_time]
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

    def _best_case(self, width: int) -> float:
        """The most drafts any match length is expected to accept at this width (before the bias)."""
        return max(self._predictions(width))

    def _predictions(self, width: int) -> list[float]:
        """Accepted drafts predicted at this width for match lengths 0..MAX_MATCH (cached until learned)."""
        table = self._table.get(width)
        if table is None:
            table = [0.0]
            for n in range(1, MAX_MATCH + 1):
                ema = self.accept.get((width, n))
                table.append(min(PRIOR_DRAFTS[n], width - 1) if ema is None else ema.value)
            self._table[width] = table
        return table

    def _probe(self, seq_ids: Sequence[str], match_lengths: MatchLengths) -> Sequence[int]:
        lengths = match_lengths()
        self._lengths.update(zip(seq_ids, lengths))
        return lengths

    def _rate(self, bucket: Bucket, width: int, drafts: float) -> float:
        """Expected tokens per second per sequence at this width, given mean accepted drafts."""
        t = self.step_cost(bucket, width) or float("inf")
        return (1.0 + min(max(drafts, 0.0), width - 1)) / t

    def _drafts(
        self, seq_ids: Sequence[str], lengths: Sequence[int], width: int, remaining: Sequence[int] | None
    ) -> float:
        """Accepted drafts per sequence per verify step that the batch's progress is worth.

        Without ``remaining``: the batch mean (finished sequences are replaced, so throughput is
        what counts). With it, the batch drains and ends with its last member, so each sequence
        counts in proportion to what it has left: a copying member about to finish adds little.
        (This step's match length is not a sequence's future: judging the batch by its slowest
        member at this step would decode plainly whenever any member has no match, which at
        batch 8 is most steps of open text, and finish later than the mean does.)"""
        predicted = self._predictions(width)
        bias, cap = self.seq_bias, width - 1
        expected = []
        for seq_id, n in zip(seq_ids, lengths):
            d = 0.0  # no match: a padding-only tree accepts nothing
            if n:
                ema = bias.get(seq_id)
                d = min(max(predicted[min(n, MAX_MATCH)] + (0.0 if ema is None else ema.value), 0.0), cap)
            expected.append(d)
        if remaining is None:
            return sum(expected) / len(expected)
        total = sum(remaining)
        return sum(r * d for r, d in zip(remaining, expected)) / total if total > 0 else 0.0

    def expected_drafts(self, seq_id: str, match_length: int, width: int) -> float:
        """Accepted drafts expected from one verify step of ``seq_id`` at this match length and width."""
        return self._drafts([seq_id], [match_length], width, None)

    # ------------------------------------------------------------ learn
    def observe(
        self,
        batch_size: int,
        width: int,
        seconds: float,
        drafts: Mapping[str, int] | None = None,
        constrained: bool = False,
    ) -> None:
        """A decode step ran: its time, and for a verify step the drafts each sequence accepted."""
        b = _bucket(batch_size, constrained)
        now = self._steps.get(b, 0)
        self._steps[b] = now + 1
        self._last[(b, width)] = now
        # Step time grows ~linearly with batch size inside a bucket: normalize to the bucket size.
        self.step_time.setdefault((b, width), _Recent()).update(seconds * b[0] / max(batch_size, 1))
        if width == 1 or not drafts:
            return
        for seq_id, accepted in drafts.items():
            n = min(self._lengths.get(seq_id, 0), MAX_MATCH)
            if n == 0:
                continue  # nothing to learn: a padding-only tree
            ema = self.accept.setdefault((width, n), _Ema(min(PRIOR_DRAFTS[n], width - 1)))
            predicted = ema.value
            ema.update(float(accepted))
            self.seq_bias.setdefault(seq_id, _Ema(0.0)).update(accepted - predicted)
        self._table.pop(width, None)
        if self.adaptive:
            timed = self.step_cost(b, 1) is not None
            self._explore_at[b] = now + 1 + (self.explore_interval(b, width) if timed else self.explore_every)

    def forget(self, seq_ids: Sequence[str]) -> None:
        """Finished sequences: drop their state."""
        for seq_id in seq_ids:
            self.seq_bias.pop(seq_id, None)
            self._lengths.pop(seq_id, None)
