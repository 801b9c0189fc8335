"""Adaptive draft width: pick D per batch (1 = plain decode) from measured costs and acceptance.

Speculation pays when the tokens a verify step emits per sequence outweigh how much slower it is
than a plain step at the same batch size. The two halves are measured separately because they vary
for different reasons:

- step cost is a property of the hardware and the batch: the lower median of the last few step times
  per (batch-size bucket, D), shared by all requests (a median, because one slow step - a first
  launch, a page fault, a busy host - must not decide for many steps); plain steps are re-measured
  every ``baseline_every`` steps because their cost drifts with context length;
- acceptance is a property of each request's text (a code edit copies long runs, a story does not):
  a moving average of accepted drafts per verify step per (sequence, D), seeded with a prior. A
  sequence not yet verified at D starts from its own figure at another D, and a new sequence from
  ``prior_drafts``, so every new request is tried with speculation instead of inheriting the last
  request's luck.

Each step takes the width with the best expected tokens per second, and speculates only when that
beats plain decoding by ``margin`` (timings are noisy). While plain decoding wins, the best draft width
is re-tried every ``explore_every`` steps, doubling the interval (up to ``max_backoff`` times) while it
keeps losing, so a batch whose text turns to copying is noticed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence


def _bucket(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()  # 1, 2, 4, 8, ...


@dataclass
class _Ema:
    value: float | None = None
    alpha: float = 0.3

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


@dataclass
class _Recent:
    """The lower median of the last ``size`` samples: robust to isolated slow steps."""

    size: int = 5
    samples: deque[float] = field(default_factory=deque)

    def update(self, x: float) -> None:
        self.samples.append(x)
        if len(self.samples) > self.size:
            self.samples.popleft()

    @property
    def value(self) -> float | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return ordered[(len(ordered) - 1) // 2]


@dataclass
class AdaptiveDraftPolicy:
    max_width: int
    adaptive: bool = True
    explore_every: int = 8  # plain steps before the best draft width is re-tried
    max_backoff: int = 2  # the re-try interval doubles at most this many times (8 -> 32 steps)
    baseline_every: int = 8  # plain steps are re-measured this often while speculating
    margin: float = 1.15  # speculate only when expected this much faster than plain
    prior_drafts: float = 1.0  # accepted drafts per verify step assumed for an untried sequence
    step_time: dict[tuple[int, int], _Recent] = field(default_factory=dict)  # (bucket, width) -> s / step
    seq_drafts: dict[tuple[str, int], _Ema] = field(default_factory=dict)  # (seq id, width) -> drafts
    _latest: dict[str, float] = field(default_factory=dict)  # seq id -> its last measured drafts, any width
    _since: dict[tuple[int, int], int] = field(default_factory=dict)  # steps since (bucket, width) last ran
    _backoff: dict[int, int] = field(default_factory=dict)  # bucket -> doublings of the re-try interval

    @property
    def widths(self) -> list[int]:
        out = {1, self.max_width}
        w = self.max_width // 2
        while w >= 4:
            out.add(w)
            w //= 2
        return sorted(out)

    # ------------------------------------------------------------ decide
    def choose(self, seq_ids: Sequence[str]) -> int:
        """The draft width for a decode step over these sequences."""
        if not self.adaptive or self.max_width == 1 or not seq_ids:
            return self.max_width if seq_ids else 1
        b = _bucket(len(seq_ids))
        for w in sorted(self.widths, reverse=True):  # time every width twice (a first step can be slow)
            if len(self.step_time.get((b, w), _Recent()).samples) < 2:
                return w
        best = max(self.widths[1:], key=lambda w: self.expected_rate(b, w, seq_ids))
        if self.expected_rate(b, best, seq_ids) > self.margin * self.expected_rate(b, 1, seq_ids):
            if self._since.get((b, 1), 0) >= self.baseline_every:
                return 1  # refresh the plain cost while speculating
            return best
        if min(self._since.get((b, w), 0) for w in self.widths[1:]) >= self.explore_every << self._backoff.get(b, 0):
            return best  # plain is winning: re-try speculation now and then
        return 1

    def expected_rate(self, bucket: int, width: int, seq_ids: Sequence[str]) -> float:
        """Expected tokens per second per sequence at this width."""
        t = self.step_time[(bucket, width)].value or float("inf")
        if width == 1:
            return 1.0 / t
        drafts = sum(self._drafts(s, width) for s in seq_ids) / len(seq_ids)
        return (1.0 + min(drafts, width - 1)) / t

    def _drafts(self, seq_id: str, width: int) -> float:
        ema = self.seq_drafts.get((seq_id, width))
        if ema is not None and ema.value is not None:
            return ema.value
        return self._latest.get(seq_id, self.prior_drafts)

    # ------------------------------------------------------------ learn
    def observe(self, batch_size: int, width: int, seconds: float, drafts: Mapping[str, int] | None = None) -> None:
        """A decode step ran: its time, and for a verify step the drafts each sequence accepted."""
        b = _bucket(batch_size)
        # Step time grows ~linearly with batch size inside a bucket: normalize to the bucket size.
        self.step_time.setdefault((b, width), _Recent()).update(seconds * b / max(batch_size, 1))
        for w in self.widths:
            self._since[(b, w)] = 0 if w == width else self._since.get((b, w), 0) + 1
        if width == 1 or drafts is None:
            return
        for seq_id, n in drafts.items():
            # The prior is the first sample, so one unlucky step does not condemn a new request
            # (acceptance comes in bursts: a copied span, then free text, then another span).
            ema = self.seq_drafts.setdefault((seq_id, width), _Ema(self._drafts(seq_id, width)))
            ema.update(float(n))
            self._latest[seq_id] = ema.value or 0.0
        if self.adaptive and all((b, w) in self.step_time for w in self.widths):
            seq_ids = list(drafts)
            won = self.expected_rate(b, width, seq_ids) > self.margin * self.expected_rate(b, 1, seq_ids)
            self._backoff[b] = 0 if won else min(self._backoff.get(b, 0) + 1, self.max_backoff)

    def forget(self, seq_ids: Sequence[str]) -> None:
        """Finished sequences: drop their acceptance state."""
        gone = set(seq_ids)
        for key in [k for k in self.seq_drafts if k[0] in gone]:
            del self.seq_drafts[key]
        for seq_id in gone:
            self._latest.pop(seq_id, None)
