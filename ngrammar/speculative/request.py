"""How the drafting library sees a request: the few fields of a sequence that drafting reads.

``engine.sequence.Sequence`` satisfies this structurally; speculative/ never imports the engine,
so drafting stays a library below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ngrammar.grammar import GrammarMatcher
    from ngrammar.sampling_params import SamplingParams


class DraftRequest(Protocol):
    """One completion being drafted for; ``token_ids`` = ``prompt_token_ids`` + ``output_token_ids``."""

    seq_id: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: GrammarMatcher | None

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def is_finished(self) -> bool: ...

    @property
    def remaining_tokens(self) -> int:
        """Tokens it may still emit before it finishes at its length limit."""
        ...

    def settle_grammar(self) -> bool:
        """Let the grammar accept the tokens committed masked; False if it rejected one."""
        ...
