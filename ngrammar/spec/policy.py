"""Adaptive draft width: pick D per batch (1 = plain decode) from measured costs and acceptance.

Speculation pays when the tokens a verify step emits per sequence outweigh how much slower it is
than a plain step at the same batch size. Both are measured online: step time per (batch-size
bucket, D) and accepted length per D, as exponential moving averages. Each step takes the width with
the best expected tokens/second; options not tried recently are re-measured now and then so the
choice follows the workload (grounded text accepts long runs, open-ended text does not).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _bucket(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()  # 1, 2, 4, 8, ...


@dataclass
class _Ema:
    value: float | None = None
    alpha: float = 0.3

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


@dataclass
class AdaptiveDraftPolicy:
    max_width: int
    adaptive: bool = True
    explore_every: int = 16  # steps between re-measurements of a non-chosen draft width
    baseline_every: int = 8  # plain steps are re-measured more often: step costs drift with context
    margin: float = 1.15  # speculate only when expected this much faster than plain: timings are noisy
    step_time: dict[tuple[int, int], _Ema] = field(default_factory=dict)
    accept_len: dict[tuple[int, int], _Ema] = field(default_factory=dict)  # per (bucket, width)
    _since_tried: dict[tuple[int, int], int] = field(default_factory=dict)
    _backoff: dict[tuple[int, int], int] = field(default_factory=dict)  # doublings of a losing width's interval

    @property
    def widths(self) -> list[int]:
        out = {1, self.max_width}
        w = self.max_width // 2
        while w >= 4:
            out.add(w)
            w //= 2
        return sorted(out)

    def choose(self, batch_size: int) -> int:
        if not self.adaptive or self.max_width == 1:
            return self.max_width
        b = _bucket(batch_size)
        for w in sorted(self.widths, reverse=True):  # measure every width once, widest first
            if (b, w) not in self.step_time:
                return w
        stale = [w for w in self.widths if self._since_tried.get((b, w), 0) >= self._interval(b, w)]
        if stale:
            return max(stale, key=lambda w: self._since_tried[(b, w)] / self._interval(b, w))
        return self._best(b)

    def _best(self, bucket: int) -> int:
        best = max(self.widths, key=lambda w: self._expected_rate(bucket, w))
        return best if self._expected_rate(bucket, best) > self.margin * self._expected_rate(bucket, 1) else 1

    def _interval(self, bucket: int, width: int) -> int:
        if width == 1:
            return self.baseline_every
        return self.explore_every << self._backoff.get((bucket, width), 0)

    def _expected_rate(self, bucket: int, width: int) -> float:
        t = self.step_time[(bucket, width)].value or float("inf")
        a = 1.0 if width == 1 else (self.accept_len.get((bucket, width), _Ema()).value or 1.0)
        return a / t

    def observe(self, batch_size: int, width: int, seconds: float, mean_accept_len: float) -> None:
        b = _bucket(batch_size)
        # Step time grows ~linearly with batch size inside a bucket: normalize to the bucket size.
        self.step_time.setdefault((b, width), _Ema()).update(seconds * b / max(batch_size, 1))
        if width > 1:
            self.accept_len.setdefault((b, width), _Ema()).update(mean_accept_len)
        for key in [k for k in self.step_time if k[0] == b]:
            self._since_tried[key] = 0 if key[1] == width else self._since_tried.get(key, 0) + 1
        if width > 1 and len([k for k in self.step_time if k[0] == b]) == len(self.widths):
            # A draft width that still loses after being re-measured is re-tried less and less often.
            lost = self._best(b) != width
            self._backoff[(b, width)] = min(self._backoff.get((b, width), 0) + 1, 4) if lost else 0
