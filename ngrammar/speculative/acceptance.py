"""How many drafts a verify step is expected to accept, learned per match length and width.

Acceptance is modelled as a run: the first draft is accepted with probability f and each later
draft on the path continues the accepted run with probability p, so a tree of D nodes and L levels
below its root is expected to accept ``f * (1 + p + p^2 + ... + p^(min(D-1, L) - 1))`` drafts (L is
learned per (D, match length): a BFS tree from a short match is wide, not deep). p is per match
length and serves every width, so what a width-8 step learns prices width 16 (a per-width average
could not see that a width accepting all its drafts is too narrow). f is per (D, match length): a
narrow tree's first level holds fewer candidates. Each rate is hits / (hits + stops) over recent
samples, where a run that ran out of tree (its path ended at a leaf) is censored: it counts its
hits but no stop. Two rates, not one, because runs are all or nothing more often than one rate
allows (a code edit either copies on or departs from its source at once). A per-sequence bias on
f (its first drafts accepted beyond those predicted, per trial, shrunk towards 0) tells a copying
code edit from a story at the same match length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ngrammar.speculative.policy_params import MAX_MATCH, AdaptiveParams

# (seq id, match length at drafting, accepted drafts, censored, tree depth or None)
Sample = tuple[str, int, int, bool, int | None]


def run_length(p: float, levels: float) -> float:
    """Accepted drafts expected from ``levels`` levels when each draft continues the run with
    chance p (clamped): p + p^2 + ... + p^levels."""
    return 0.0 if p <= 0.0 else p * (1.0 - p**levels) / (1.0 - p)


def run_length2(first: float, p: float, levels: float) -> float:
    """Accepted drafts expected from ``levels`` levels when the first draft is accepted with
    chance ``first`` and each later one continues the run with chance ``p`` (both clamped)."""
    return 0.0 if levels <= 0.0 or first <= 0.0 else first * (1.0 + run_length(p, levels - 1.0))


@dataclass
class Rate:
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


@dataclass
class SeqBias:
    """A sequence's first drafts accepted beyond those its match lengths predicted, per trial
    (decayed sums, shrunk towards 0 by ``shrink`` pseudo-trials)."""

    hits: float = 0.0
    predicted: float = 0.0
    trials: float = 0.0
    decay: float = 0.8
    shrink: float = 4.0

    def update(self, hits: float, predicted: float, trials: float) -> None:
        self.hits = self.decay * self.hits + hits
        self.predicted = self.decay * self.predicted + predicted
        self.trials = self.decay * self.trials + trials

    @property
    def value(self) -> float:
        return (self.hits - self.predicted) / (self.trials + self.shrink)


@dataclass
class Ema:
    value: float
    alpha: float = 0.3

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


class AcceptanceModel:
    """First-draft rates per (width, match length), continuation rates per match length, tree
    depths per (width, match length) and a bias per sequence; ``expected`` prices a batch."""

    def __init__(
        self, widths: Sequence[int], params: AdaptiveParams, prior: Sequence[float] | None = None
    ) -> None:
        self.params = params
        self.widths = list(widths)  # the draft widths (> 1), narrowest first
        # per match length, before any sample (``params.prior_continue`` by default)
        self.prior = tuple(params.prior_continue if prior is None else prior)
        self.first: dict[tuple[int, int], Rate] = {
            (w, n): self._prior(p) for w in self.widths for n, p in enumerate(self.prior)
        }
        self.cont: list[Rate] = [self._prior(p) for p in self.prior]
        self.seq_bias: dict[str, SeqBias] = {}
        self._depth: dict[tuple[int, int], Ema] = {}  # (width, match length) -> tree depth
        # Read several times per step, changed only by ``learn`` (which clears them):
        self._best: tuple[float, float] | None = None  # the highest first-draft and continuation rates
        self._rates: dict[int, list[tuple[float, float]]] = {}  # width -> match length -> (f, p)
        self._levels: dict[int, list[float]] = {}  # width -> match length -> run levels
        self._gains: dict[int, list[tuple[float, float]]] = {}  # width -> match length -> (f, gain)

    def _prior(self, p: float) -> Rate:
        return Rate(self.params.prior_trials * p, self.params.prior_trials * (1 - p))

    def clamp(self, p: float) -> float:
        return min(max(p, 0.0), self.params.max_continue)

    def best_rates(self, seq_ids: Sequence[str]) -> tuple[float, float]:
        """Upper bounds of the first-draft rate (with the batch's best bias) and of the continuation
        rate, over every width and match length: if a width cannot win at these, none can."""
        if self._best is None:
            self._best = (max(r.p for r in self.first.values()), max(r.p for r in self.cont))
        bias = max((self.seq_bias[s].value for s in seq_ids if s in self.seq_bias), default=0.0)
        return self.clamp(self._best[0] + max(bias, 0.0)), self.clamp(self._best[1])

    def expected(
        self,
        seq_ids: Sequence[str],
        lengths: Sequence[int],
        widths: Sequence[int] | None = None,
        ahead: bool = False,
        final: bool = False,
    ) -> dict[int, list[float]]:
        """width -> accepted drafts expected from one verify step of each sequence at its match
        length, for ``widths`` (default: every draft width).

        ``ahead``: the lengths are one token old (that token is in flight). A member at length n > 0
        reaches n + 1 if the token continues its match, which it does with the first-draft rate of
        length n (the same agreement of model and corpus that accepts a first draft); otherwise it is
        priced at length 1. That is exact from n <= 1 and an approximation from n >= 2, where a
        shorter suffix followed by that token elsewhere in the corpus can leave up to n. From n = 0
        the token reaches length 1 at most: priced at 1. ``final``: the trees are drafted before
        that token is known and only its branch is verified, so a token that breaks the match
        leaves nothing to accept: priced at 0 (and a member at length 0 too)."""
        bias = self.seq_bias
        widths = self.widths if widths is None else widths
        out = {w: [0.0] * len(seq_ids) for w in widths}
        columns = [(out[w], self.gains(w)) for w in widths]
        # Whether the token in flight continues a match: any continuation, as the widest tree's first level.
        widest = self.continuation(self.widths[-1])
        top = self.params.max_continue
        for i, (seq_id, n) in enumerate(zip(seq_ids, lengths)):
            own = bias.get(seq_id)
            shift = 0.0 if own is None else own.value
            # run_length2(clamp(f + shift), p, levels) == clamp(f + shift) * gain (``gains``), with
            # the clamp inlined: this loop runs for every member on most decode steps.
            if ahead:
                hit = min(max(widest[min(n, MAX_MATCH)][0] + shift, 0.0), top) if n else 0.0
                up = min(n + 1, MAX_MATCH)
                for column, gains in columns:
                    f_up, g_up = gains[up]
                    f_one, g_one = gains[1]
                    miss = 0.0 if final else min(max(f_one + shift, 0.0), top) * g_one
                    column[i] = hit * min(max(f_up + shift, 0.0), top) * g_up + (1.0 - hit) * miss
                continue
            if not n:
                continue  # no match: a padding-only tree accepts nothing
            n = min(n, MAX_MATCH)
            for column, gains in columns:
                f, g = gains[n]
                column[i] = min(max(f + shift, 0.0), top) * g
        return out

    def expected_drafts(self, seq_id: str, match_length: int, width: int) -> float:
        """Accepted drafts expected from one verify step of ``seq_id`` at this match length and width."""
        return self.expected([seq_id], [max(match_length, 0)], (width,))[width][0]

    def gains(self, width: int) -> list[tuple[float, float]]:
        """match length -> (first-draft rate f, gain g) at this width, where a run of first draft
        chance ``first`` is expected to accept ``first * g`` drafts: g = 1 + p + ... over the run's
        levels (0 without levels). Cached until the next ``learn``."""
        gains = self._gains.get(width)
        if gains is None:
            levels = self.levels(width)
            gains = self._gains[width] = [
                (f, 1.0 + run_length(self.clamp(p), levels[n] - 1.0) if levels[n] > 0.0 else 0.0)
                for n, (f, p) in enumerate(self.continuation(width))
            ]
        return gains

    def continuation(self, width: int) -> list[tuple[float, float]]:
        """Each match length's first-draft and continuation rates at this width, the prior's where
        none was learned (cached until the next ``learn``)."""
        rates = self._rates.get(width)
        if rates is None:
            first = self.first
            rates = self._rates[width] = [
                (first[(width, n)].p if (width, n) in first else p, self.cont[n].p)
                for n, p in enumerate(self.prior)
            ]
        return rates

    def levels(self, width: int) -> list[float]:
        """match length -> levels a run may take at this width: D - 1, or fewer where the trees of
        that width and match length were learned to be shallower (cached until the next ``learn``)."""
        levels = self._levels.get(width)
        if levels is None:
            depth = self._depth
            levels = self._levels[width] = [
                float(width - 1)
                if (width, n) not in depth
                else min(width - 1.0, max(depth[(width, n)].value, 0.0))
                for n in range(MAX_MATCH + 1)
            ]
        return levels

    def learn(self, width: int, samples: Sequence[Sample], teach_bias: bool = True) -> None:
        """One step's acceptance samples at this width. ``teach_bias``: also update the members'
        biases (shadow walks come at every width at once; only the widest teaches them, so that
        one plain step does not count several times)."""
        prm = self.params
        counts = [[0.0] * 4 for _ in range(MAX_MATCH + 1)]  # first hits, first stops, hits, stops
        before = self.continuation(width)  # what the rates predicted (the bias is measured against it)
        for seq_id, n, accepted, censored, depth in samples:
            n = min(n, MAX_MATCH)
            if n == 0:
                continue  # nothing to learn: a padding-only tree
            stopped = 0.0 if accepted >= width - 1 or censored else 1.0
            if depth is not None:  # a new entry starts at its first sample
                self._depth.setdefault((width, n), Ema(float(depth))).update(depth)
            c = counts[n]
            if accepted:
                c[0] += 1.0
                c[2] += accepted - 1
                c[3] += stopped
            else:
                c[1] += stopped
            if teach_bias:
                trial = 1.0 if accepted else stopped  # of the first draft: what the bias is about
                bias = self.seq_bias.get(seq_id)
                if bias is None:
                    bias = self.seq_bias[seq_id] = SeqBias(decay=prm.seq_decay, shrink=prm.seq_shrink)
                bias.update(min(accepted, 1), before[n][0] * trial, trial)
        for n in range(1, MAX_MATCH + 1):
            c = counts[n]
            if c[0] or c[1]:
                rate = self.first.setdefault((width, n), self._prior(self.prior[n]))
                rate.update(c[0], c[1], prm.global_decay)
            if c[2] or c[3]:
                self.cont[n].update(c[2], c[3], prm.global_decay)
        self._best = None
        self._rates.clear()
        self._levels.clear()
        self._gains.clear()

    def forget(self, seq_ids: Sequence[str]) -> None:
        for seq_id in seq_ids:
            self.seq_bias.pop(seq_id, None)
