"""What the engine asks of speculative decoding, and the object that answers for none.

``LLMEngine.speculator`` is an ``NgramSpecWorker`` (``engine/verify_step.py``) when the config
names ``speculative``, else ``NoSpeculation``: every step calls the same methods either way, and a
width of 1 (a plain step) is all ``NoSpeculation`` ever chooses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ngrammar.sampling_params import InvalidRequestError

if TYPE_CHECKING:
    from ngrammar.engine.sequence import Sequence
    from ngrammar.engine.verify_step import PendingVerify, VerifyResult
    from ngrammar.speculative.replay import ReplayTarget


class Speculator(Protocol):
    replay: ReplayTarget | None  # benchmarks: recorded outputs decide acceptance

    @property
    def reason(self) -> str: ...  # why the last width was chosen (``policy.REASONS``; "" for none)

    @property
    def final_ok(self) -> bool: ...  # the last width chosen ``final`` pays without a drain (policy)

    def graph_widths(self) -> list[int]: ...

    def acceptor(self, one_rank: bool) -> Callable[..., Any] | None: ...

    def set_step_profile(self, profile: Mapping[tuple[int, int], float]) -> None: ...

    def chain_after_verify(self, seqs: list[Sequence]) -> bool: ...

    def check_corpora(self, names: tuple[str, ...]) -> None: ...

    def on_admit(self, seq: Sequence) -> None: ...

    def on_finish(self, seqs: list[Sequence]) -> None: ...

    def index_plain_step(self, seqs: list[Sequence], read_wait: float) -> None: ...

    def choose_width(
        self, seqs: list[Sequence], draining: bool, ahead: bool = False, final: bool = False
    ) -> int: ...

    def observe_step(
        self,
        batch_size: int,
        width: int,
        seconds: float,
        restart: float | None = None,
        result: VerifyResult | None = None,
    ) -> None: ...

    def launch_verify(
        self,
        seqs: list[Sequence],
        width: int,
        launched: float,
        prepare: bool = False,
        chain: bool = False,
        drained: bool = False,
    ) -> PendingVerify | None: ...


class NoSpeculation:
    """Plain decoding: every step is one token wide, nothing is drafted, indexed or learned."""

    def __init__(self) -> None:
        self.replay: ReplayTarget | None = None

    @property
    def reason(self) -> str:
        return ""

    @property
    def final_ok(self) -> bool:
        return False

    def graph_widths(self) -> list[int]:
        return [1]

    def acceptor(self, one_rank: bool) -> Callable[..., Any] | None:
        return None

    def set_step_profile(self, profile: Mapping[tuple[int, int], float]) -> None:
        pass

    def chain_after_verify(self, seqs: list[Sequence]) -> bool:
        return False

    def check_corpora(self, names: tuple[str, ...]) -> None:
        if names:
            raise InvalidRequestError("draft_corpora needs an engine with speculative decoding")

    def on_admit(self, seq: Sequence) -> None:
        pass

    def on_finish(self, seqs: list[Sequence]) -> None:
        pass

    def index_plain_step(self, seqs: list[Sequence], read_wait: float) -> None:
        pass

    def choose_width(
        self, seqs: list[Sequence], draining: bool, ahead: bool = False, final: bool = False
    ) -> int:
        return 1

    def observe_step(
        self,
        batch_size: int,
        width: int,
        seconds: float,
        restart: float | None = None,
        result: VerifyResult | None = None,
    ) -> None:
        pass

    def launch_verify(
        self,
        seqs: list[Sequence],
        width: int,
        launched: float,
        prepare: bool = False,
        chain: bool = False,
        drained: bool = False,
    ) -> PendingVerify | None:
        return None
