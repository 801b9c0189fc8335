"""Draft policies whose decisions do not depend on how fast (or how busy) the machine is.

The adaptive policy prices every width from measured step times, so on a loaded machine it may
verify nothing at all. Tests that need both kinds of step feed it fixed times instead: then what
it decides depends on the tokens alone.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any


def pin_step_costs(llm: Any, plain: float = 0.010, per_node: float = 0.0002) -> None:
    """Teach ``llm``'s draft policy a fixed time per step (``plain`` seconds per member, plus
    ``per_node`` per extra tree node) in place of each measured one; a chain break is not charged."""
    worker = llm.engine.ngram
    assert worker is not None, "pin_step_costs needs an engine with speculation"
    policy = worker.policy
    observe = policy.observe

    def fixed(
        batch_size: int,
        width: int,
        seconds: float,
        drafts: Mapping[str, int] | None = None,
        constrained: bool = False,
        censored: Collection[str] = (),
        depths: Mapping[str, int] | None = None,
        restart: float | None = None,
        lengths: Mapping[str, int] | None = None,
    ) -> None:
        cost = batch_size * (plain + per_node * (width - 1))
        observe(batch_size, width, cost, drafts, constrained, censored, depths, None, lengths)

    policy.observe = fixed
