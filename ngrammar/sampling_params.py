"""Per-request decoding parameters, validated at construction (a bad value fails that request only)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
# Below this temperature a request decodes greedily: dividing fp32 logits by a smaller one can
# overflow to inf, and softmax of inf is NaN (1e-40 sampled token 0 over and over).
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1
_INT64 = 2**63  # seeds and top_k travel to the device as int64


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the offending input."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: chosen token plus k alternatives
    json_schema: dict[str, Any] | bool | str | None = None  # (the type the core's decoder checks)
    regex: str | None = None
    ebnf: str | None = None
    json_object: bool = False
    # Speculation, per request (engines with NGRAM on): False never verifies drafts for this
    # request (its batch decodes plainly while it runs); num_draft_tokens caps its draft tree
    # (root included); draft_corpora names the external corpora it drafts from (None: all).
    speculative: bool = True
    num_draft_tokens: int | None = None
    draft_corpora: tuple[str, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # None means none, as in vLLM; a malformed value is the request's error, not a TypeError.
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        try:
            stop, ids = tuple(stop), tuple(ids)  # any iterable: a list, a set, a numpy array
        except TypeError:
            raise InvalidRequestError(
                f"stop and stop_token_ids must be sequences, got {self.stop!r} / {ids!r}"
            ) from None
        if not all(map(_is_int, ids)):
            raise InvalidRequestError(f"stop_token_ids must be integers, got {ids!r}")
        if self.draft_corpora is not None:
            names = (self.draft_corpora,) if isinstance(self.draft_corpora, str) else self.draft_corpora
            try:
                object.__setattr__(self, "draft_corpora", tuple(names))
            except TypeError:
                raise InvalidRequestError(
                    f"draft_corpora must be a list of corpus names, got {self.draft_corpora!r}"
                ) from None
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        t = self.temperature
        if not _is_number(t) or not (math.isfinite(t) and t >= 0):
            fail(f"temperature must be a finite number >= 0, got {t!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            fail(
                f"top_k must be -1, 0 (disabled) or a positive integer up to {MAX_TOP_K}, got {self.top_k!r}"
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.n) or not 1 <= self.n <= 64:
            fail(f"n must be an integer in [1, 64], got {self.n!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            fail(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail(f"stop strings must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool) or not isinstance(self.json_object, bool):
            fail("ignore_eos and json_object must be booleans")
        # The n completions draw with seeds seed .. seed + n - 1.
        if self.seed is not None and (not _is_int(self.seed) or not -_INT64 <= self.seed <= _INT64 - self.n):
            fail(f"seed must be an integer in [-2**63, 2**63 - n], got {self.seed!r}")
        if any(g is not None and not isinstance(g, str) for g in (self.regex, self.ebnf)):
            fail("regex and ebnf must be strings")
        if self.json_schema is not None and not isinstance(self.json_schema, (str, dict, bool)):
            fail(
                f"json_schema must be a JSON schema (an object, a boolean or its JSON text), got {self.json_schema!r}"
            )
        if not isinstance(self.speculative, bool):
            fail(f"speculative must be a boolean, got {self.speculative!r}")
        if self.num_draft_tokens is not None and (
            not _is_int(self.num_draft_tokens) or not 1 <= self.num_draft_tokens <= 64
        ):
            fail(f"num_draft_tokens must be an integer in [1, 64], got {self.num_draft_tokens!r}")
        if self.draft_corpora is not None and not all(isinstance(n, str) for n in self.draft_corpora):
            fail(f"draft_corpora must be corpus names, got {self.draft_corpora!r}")
        grammars = [
            self.json_schema is not None,
            self.regex is not None,
            self.ebnf is not None,
            self.json_object,
        ]
        if sum(grammars) > 1:
            fail("only one of json_schema, regex, ebnf, json_object may be set")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below ``GREEDY_TEMPERATURE``."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def grammar_kind(self) -> str | None:
        """The kind of output grammar asked for (``GrammarSpec.kind``), None without one."""
        if self.json_schema is not None:
            return "json_schema"
        if self.regex is not None:
            return "regex"
        if self.ebnf is not None:
            return "ebnf"
        return "json_object" if self.json_object else None

    @property
    def has_grammar(self) -> bool:
        return (
            self.json_schema is not None
            or self.regex is not None
            or self.ebnf is not None
            or self.json_object
        )
