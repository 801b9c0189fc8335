"""Preparing a request once, on the prepare pool: sizes checked before tokenizing, the grammar parsed and
bounded, the prompts tokenized, the sampling params built and validated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ngrammar.engine.engine import LLMEngine
from ngrammar.grammar import GrammarError, GrammarSpec, grammar_spec_from_request
from ngrammar.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    pass


def _tokenize(engine: LLMEngine, prompt: Any) -> list[int]:
    """Tokens of one prompt; template and tokenizer failures are the request's fault (400)."""
    from jinja2 import TemplateError

    try:
        return engine.tokenize(prompt)
    except InvalidRequestError:
        raise
    except (ValueError, TypeError, TemplateError) as e:
        raise InvalidRequestError(f"cannot tokenize the prompt: {e}") from None


def _prompt_chars(prompt: Any) -> int:
    """Characters of a text prompt or of a chat's contents (0 for token ids)."""
    if isinstance(prompt, str):
        return len(prompt)
    if prompt and isinstance(prompt[0], dict):
        return sum(len(m.get("content") or "") for m in prompt)
    return 0


def _check_prompt_size(prompt: Any, room: int, max_token_chars: int) -> None:
    """Refuse a prompt that cannot fit before tokenizing it: a token covers at most
    ``max_token_chars`` characters, so a text of C characters has at least C / max_token_chars."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        if len(prompt) >= room:
            raise InvalidRequestError(f"the prompt is {len(prompt)} tokens; a request may hold {room} tokens")
        return
    least = -(-_prompt_chars(prompt) // max_token_chars)
    if least >= room:
        raise InvalidRequestError(
            f"the prompt is at least {least} tokens long; a request may hold {room} tokens "
            "(the context or the KV cache, the smaller); shorten the prompt"
        )


def grammar_spec(kwargs: dict[str, Any], max_bytes: int) -> GrammarSpec | None:
    """The request's grammar (parsed and checked: size first, then depth and references)."""
    for key in ("json_schema", "regex", "ebnf"):
        value = kwargs.get(key)
        if isinstance(value, str) and len(value) > max_bytes:
            raise GrammarError(
                f"the {key} is {len(value)} characters; the server's limit is {max_bytes} bytes"
            )
    spec = grammar_spec_from_request(
        kwargs.get("json_schema"), kwargs.get("regex"), kwargs.get("ebnf"), kwargs.get("json_object", False)
    )
    if spec is not None and len(spec.source.encode()) > max_bytes:
        raise GrammarError(
            f"the {spec.kind} is {len(spec.source.encode())} bytes; the server's limit is {max_bytes} bytes "
            "(--max-grammar-kb)"
        )
    return spec


def prepare(
    engine: LLMEngine,
    prompts: Sequence[Any],
    kwargs: dict[str, Any],
    max_tokens: int | None,
    sent: str | None,
    max_token_chars: int,
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Check each prompt's size, tokenize it, and build and validate its params.

    ``max_tokens``: the output limit, which the client sent as the field named ``sent``, or the
    endpoint's default (``sent`` None), or None for none. As in vLLM, a prompt and a limit the client
    sent must fit the context (and here the KV pool, which may be smaller), or the request is
    refused; a default limit is capped to that room, and without a limit each prompt may run to its
    end. Runs on the prepare pool: tokenizer encode and ``validate`` are safe there (pure functions
    of the tokenizer and config).
    """
    room = min(engine.max_model_len, engine.kv_capacity_tokens)
    for p in prompts:
        _check_prompt_size(p, room, max_token_chars)
    ids = [_tokenize(engine, p) for p in prompts]
    all_params = []
    for prompt_ids in ids:
        left = max(room - len(prompt_ids), 1)
        budget = left if max_tokens is None else max_tokens if sent is not None else min(max_tokens, left)
        params = SamplingParams(max_tokens=budget, **kwargs)
        engine.validate(prompt_ids, params)
        if len(prompt_ids) + budget > room:
            raise InvalidRequestError(
                f"the prompt is {len(prompt_ids)} tokens and {sent} asks for {budget} more, past the {room} "
                f"tokens a request may hold (context {engine.max_model_len}, KV cache "
                f"{engine.kv_capacity_tokens}); reduce the prompt or {sent}"
            )
        all_params.append(params)
    return ids, all_params
