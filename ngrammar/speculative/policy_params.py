"""The adaptive draft policy's tuned constants, in one frozen dataclass (``AdaptiveParams``)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_MATCH = 4  # match lengths are probed up to this (longer ones are bucketed with it)


@dataclass(frozen=True)
class AdaptiveParams:
    # The chance that a draft continues the accepted run, by match length 0..MAX_MATCH, before any
    # is measured. The embedded model accepted 0.7, 1.3, 2.2, 4.5 drafts at D = 8 for lengths 1-4
    # (p = 0.41, 0.57, 0.71, 0.89); the priors sit a little below.
    prior_continue: tuple[float, ...] = (0.0, 0.35, 0.5, 0.65, 0.8)
    # The same for constrained sequences (a grammar: JSON's structure is predictable, and the trees
    # drop forbidden drafts and add forced text): the embedded model's JSON-schema outputs accepted
    # 3.4, 1.6, 2.4 drafts at D = 8 for lengths 1-3 (first drafts 0.84, 0.93, 0.98); below that.
    prior_continue_constrained: tuple[float, ...] = (0.0, 0.7, 0.7, 0.75, 0.8)
    prior_trials: float = 4.0  # the prior's weight, in run trials (drafts tried)
    max_continue: float = 0.97  # p is capped: a few censored steps must not promise every width everything
    global_decay: float = 0.93  # per learning step (a verify step, or a plain step's shadow walks)
    seq_decay: float = 0.8  # per learning step of the sequence
    seq_shrink: float = 4.0  # pseudo-trials pulling a sequence's bias towards 0 (its first steps are noisy)
    outlook_alpha: float = 0.2  # per probe: a sequence's outlook follows its match lengths over ~5 steps
    # Shadow walks (of the widest trees) since a bucket last skipped a re-try of a losing width that
    # let it skip the next one ...
    shadow_enough: int = 4
    # ... unless no verify step ran in the bucket for this many of its steps: a re-try also re-times
    # the verify steps, whose cost drifts with context length.
    cost_refresh: int = 512
    critical_share: float = 0.9  # a draining batch's critical members need this share of the most steps
    explore_every: int = 8  # fewest plain steps before the best draft width is re-tried
    explore_overhead: float = 0.02  # re-tries may cost at most this share of plain throughput
    baseline_every: int = 8  # plain steps are re-measured this often while speculating
    margin: float = 1.15  # speculate only when expected this much faster than plain
    # A width whose verify step costs at most this many plain steps (a pipelined verify step can)
    # is verified whenever a member has a draft: an accepted draft is profit, a rejected one ~free.
    parity: float = 1.05
    probe_share: float = 0.02  # probes that find nothing may cost at most this share of plain steps
    # ... but never wait longer than this many steps: a probe's cost is re-sampled only by the next
    # probe, and a first (cold) probe's cost must not lock probing out for the rest of a run.
    max_probe_gap: int = 64

    def __post_init__(self) -> None:
        for name in ("prior_continue", "prior_continue_constrained"):
            if len(getattr(self, name)) != MAX_MATCH + 1:
                raise ValueError(f"{name} needs {MAX_MATCH + 1} entries (match lengths 0..{MAX_MATCH})")
