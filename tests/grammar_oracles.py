"""Test oracles over ``GrammarMatcher``: operations the engine never needs, written from its public calls."""

from __future__ import annotations

from collections.abc import Sequence

from ngrammar.grammar import GrammarBackend, GrammarMatcher, GrammarSpec


def commit(matcher: GrammarMatcher, tokens: Sequence[int]) -> tuple[int, bool]:
    """Accept tokens in order; returns (number retained, rejected?).

    Stops right after the token that terminates the grammar (retained; the rest are past the end,
    not a rejection), or before the first forbidden token (rejected). A terminated matcher retains nothing."""
    if matcher.is_terminated():
        return 0, False
    for i, token in enumerate(tokens):
        if not matcher.accept_token(int(token)):
            return i, True
        if matcher.is_terminated():
            return i + 1, False
    return len(tokens), False


def fork(matcher: GrammarMatcher) -> GrammarMatcher:
    """An independent copy of the matcher's current state (same compiled grammar)."""
    return GrammarMatcher(matcher.xgrammar_matcher.fork(), matcher.vocab_size, matcher.stop_token_ids)


def is_completed(matcher: GrammarMatcher) -> bool:
    """Whether the text so far is a complete match (a stop token would be accepted now)."""
    return bool(matcher.xgrammar_matcher.is_completed())


def cached_specs(backend: GrammarBackend) -> list[GrammarSpec]:
    """The backend's cached specs, least recently used first."""
    with backend._lock:
        return list(backend._cache)
