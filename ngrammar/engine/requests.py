"""Requests as the engine holds them: prompt checks, the per-request record and its outputs."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ngrammar.engine.sequence import Sequence
from ngrammar.engine.stats import EngineStats
from ngrammar.model.tokenizer import Message, Tokenizer
from ngrammar.outputs import CompletionOutput, RequestOutput, TokenLogprob
from ngrammar.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from ngrammar.grammar import GrammarBackend


def tokenize_prompt(
    tokenizer: Tokenizer, vocab_size: int, prompt: str | list[int] | Seq[Message]
) -> list[int]:
    """A prompt's token ids: text (encoded), chat messages (templated) or ids (range-checked)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        return tokenizer.encode_prompt(prompt)
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Iterable):
        raise InvalidRequestError(
            f"a prompt is text, a list of token ids or a list of chat messages, got {type(prompt).__name__}"
        )
    items: list[Any] = list(prompt)  # (a numpy array or a tensor of ids has no single truth value)
    if items and all(isinstance(m, dict) for m in items):
        for m in items:  # (a message the template cannot render failed inside jinja)
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"a chat message needs a string role and content, got {m!r}")
        return tokenizer.apply_chat_template(items)
    ids = [_token_id(t) for t in items]
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError("prompt token ids must be in [0, vocab_size)")
    return ids


def _token_id(value: Any) -> int:
    """A prompt token id: an integer (numpy's or a 0-d tensor's too), never a float, bool or text,
    which ``int()`` would silently turn into another token."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InvalidRequestError(f"prompt token ids must be integers, got {value!r}")


def validate_prompt(prompt_ids: list[int], max_model_len: int, kv_capacity_tokens: int) -> None:
    """A prompt must be non-empty, leave room for one output in the context and fit the KV pool."""
    if not prompt_ids:
        raise InvalidRequestError("prompt is empty")
    if len(prompt_ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt is {len(prompt_ids)} tokens; the model's context is {max_model_len} tokens"
        )
    if len(prompt_ids) + 1 > kv_capacity_tokens:
        raise InvalidRequestError(
            f"prompt is {len(prompt_ids)} tokens; the KV cache holds {kv_capacity_tokens} tokens"
        )


def validate_request(
    prompt_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    kv_capacity_tokens: int,
    vocab_size: int,
) -> None:
    """What only the model can check of a request: its prompt (``validate_prompt``) and that its stop
    token ids are in the vocabulary (one outside could never match, and the request would run to
    max_tokens unasked)."""
    validate_prompt(prompt_ids, max_model_len, kv_capacity_tokens)
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size}), got {bad}")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    reported: list[int] = field(default_factory=list)  # token counts already reported, per seq
    stream: bool = True  # report every step's progress, not only the final output

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        seed: int,
        max_len: int,
        grammar: tuple[GrammarBackend, Any] | None,
        stream: bool = True,
    ) -> Request:
        """A request of ``params.n`` sequences, sequence i seeded ``seed + i``, each with its own
        matcher of a compiled grammar (``grammar``: the backend that compiled it, and the grammar)."""
        seqs = [
            Sequence(
                request_id,
                i,
                prompt_ids,
                params,
                tokenizer,
                seed=seed + i,
                max_len=max_len,
                grammar=None if grammar is None else grammar[0].new_matcher(grammar[1]),
            )
            for i in range(params.n)
        ]
        return cls(request_id, prompt_ids, params, seqs, [0] * params.n, stream)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        completions = []
        for s in self.seqs:
            lps = s.logprobs
            if lps is not None:
                lps = [TokenLogprob(t, lp.logprob, lp.top) for t, lp in zip(s.output_token_ids, lps)]
            completions.append(
                CompletionOutput(
                    s.index,
                    s.visible_text(),
                    list(s.output_token_ids),
                    s.finish_reason,
                    lps,
                    s.error,
                    s.request_error,
                )
            )
        metrics = self.seqs[0].metrics()
        if len(self.seqs) > 1:
            metrics["completion_tokens"] = sum(s.num_output_tokens for s in self.seqs)
        return RequestOutput(self.request_id, self.prompt_token_ids, completions, self.finished, metrics)


def collect_outputs(requests: dict[str, Request], stats: EngineStats) -> list[RequestOutput]:
    """The outputs of requests that progressed (streaming) or finished since the last call;
    finished requests leave ``requests``."""
    outputs = []
    for rid in list(requests):
        req = requests[rid]
        if not req.stream and not req.finished:
            continue
        lens = [len(s.token_ids) for s in req.seqs]
        if lens == req.reported and not req.finished:
            continue
        req.reported = lens
        outputs.append(req.output())
        if req.finished:
            del requests[rid]
            stats.finished_requests += 1
    return outputs
