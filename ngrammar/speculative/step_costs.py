"""Measured decode-step costs per (batch-size bucket, grammar class, draft width).

A step's cost is a property of the hardware and the batch: the lower median of the last few step
times per (bucket, width), a median because one slow step (a first launch, a page fault, a busy
host) must not decide for many steps. Times are normalized to the bucket's size (step time grows
about linearly with the batch inside a bucket). An untimed width borrows the verify / plain ratio
of the nearest larger bucket timed at both, else the ratio of the start-up profile (each CUDA
graph's device time, ``set_profile``) applied to the bucket's measured plain cost; once a width
is timed in a bucket its own steps decide, and keep re-deciding as they change, capped by what any
wider width costs (``_monotone``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# A batch's grammar class: NO_GRAMMAR, the one grammar kind its constrained members share
# (``SamplingParams.grammar_kind``: json_schema, regex, ebnf, json_object), or MIXED_GRAMMARS.
NO_GRAMMAR = "none"
MIXED_GRAMMARS = "mixed"
Bucket = tuple[int, str]  # (batch size rounded up to a power of two, its grammar class)


def grammar_class(kinds: Iterable[str | None]) -> str:
    """The grammar class of a batch whose members have these grammar kinds (None: no grammar)."""
    found = {k for k in kinds if k is not None}
    if not found:
        return NO_GRAMMAR
    return found.pop() if len(found) == 1 else MIXED_GRAMMARS


def bucket_of(batch_size: int, grammar: str = NO_GRAMMAR) -> Bucket:
    # A constrained step also settles, fills and checks grammar rows on the host (a verify step
    # one per tree node), at a cost that differs by kind (a regex's rows are cheap, any-JSON's
    # dear): each grammar class is timed apart, so a verify step is priced at its own kind's cost.
    return 1 << max(batch_size - 1, 0).bit_length(), grammar


@dataclass
class Recent:
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


class StepCosts:
    """Seconds per step per (bucket, width), normalized to the bucket's size."""

    def __init__(self, widths: Sequence[int]) -> None:
        self.widths = list(widths)  # 1 and the draft widths a policy may pick
        self.step_time: dict[tuple[Bucket, int], Recent] = {}
        self._costs: dict[Bucket, dict[int, float | None]] = {}  # ``bucket_costs``, until the next record
        self._profile: dict[tuple[int, int], float] = {}  # (bucket size, width) -> device seconds

    def set_profile(self, profile: Mapping[tuple[int, int], float]) -> None:
        """Device seconds of one step per (batch-size bucket, width), measured at start-up
        (``CUDAGraphRunner.profile``): the verify / plain ratios that price a width before its own
        steps are timed in a bucket without a grammar (a grammar's host cost is not in them, so
        constrained buckets are timed as before)."""
        self._profile = dict(profile)
        self._costs.clear()

    def record(self, bucket: Bucket, width: int, seconds: float) -> None:
        """One step's time, already normalized to the bucket's size."""
        self.step_time.setdefault((bucket, width), Recent()).update(seconds)
        self._costs.clear()

    def add_to_last(self, bucket: Bucket, width: int, extra: float) -> bool:
        """Add ``extra`` seconds to the last sample of (bucket, width); False if it has none."""
        rec = self.step_time.get((bucket, width))
        if rec is None or not rec.samples:
            return False
        rec.samples[-1] += extra
        rec.refresh()
        self._costs.clear()
        return True

    def last(self, bucket: Bucket, width: int) -> float | None:
        rec = self.step_time.get((bucket, width))
        return rec.samples[-1] if rec is not None and rec.samples else None

    def cost(self, bucket: Bucket, width: int) -> float | None:
        """Seconds per step at this bucket and width (normalized to the bucket size): measured
        (twice at least), else estimated from its plain cost and the verify / plain cost ratio of
        the nearest larger bucket measured at both, else None (to be measured). A batch that
        drains passes through every smaller bucket; timing verify steps afresh in each would cost
        several wasted verify steps per bucket. Only larger buckets lend their ratio: it grows
        with the batch (host drafting on a GPU, compute on a CPU), so theirs over-estimates."""
        costs = self.bucket_costs(bucket)
        return costs[width] if width in costs else self._estimate(bucket, width)

    def plain_seconds(self, batch_size: int, grammar: str = NO_GRAMMAR) -> float | None:
        """A plain step's measured time at this batch size (not normalized), or None while untimed."""
        bucket = bucket_of(batch_size, grammar)
        plain = self.cost(bucket, 1)
        return None if plain is None else plain * batch_size / bucket[0]

    def bucket_costs(self, bucket: Bucket) -> dict[int, float | None]:
        """width -> ``cost`` for every width a policy may pick (cached until the next record)."""
        costs = self._costs.get(bucket)
        if costs is None:
            costs = self._costs[bucket] = _monotone({w: self._estimate(bucket, w) for w in self.widths})
        return costs

    def _estimate(self, bucket: Bucket, width: int) -> float | None:
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
            return self._profiled(bucket, width, plain.value)
        near = min(known, key=lambda b: b[0])
        return _scaled(plain.value, self.step_time[(near, width)].value, self.step_time[(near, 1)].value)

    def _profiled(self, bucket: Bucket, width: int, plain: float) -> float | None:
        """The bucket's measured plain cost times the start-up profile's width / plain ratio."""
        if bucket[1] != NO_GRAMMAR:
            return None
        return _scaled(plain, self._profile.get((bucket[0], width)), self._profile.get((bucket[0], 1)))


def _monotone(costs: dict[int, float | None]) -> dict[int, float | None]:
    """Each width's cost capped at the least cost of any wider one (plain included): a step of fewer
    nodes costs no more. Samples taken while the host was busy would otherwise price a width out for
    good, as a width not chosen is never timed again. Untimed widths stay None (to be timed)."""
    bound: float | None = None
    for w in sorted(costs, reverse=True):
        c = costs[w]
        if c is not None:
            bound = c if bound is None else min(bound, c)
            costs[w] = bound
    return costs


def _scaled(plain: float, verify: float | None, base: float | None) -> float | None:
    """``plain`` times the ratio verify / base of another measurement, where it has both."""
    return None if verify is None or not base else plain * verify / base
