"""Responses and streams: a request group's outputs as OpenAI / SGLang bodies and SSE chunks (bytes)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from pydantic import BaseModel

from ngrammar.outputs import CompletionOutput, RequestOutput, TokenLogprob
from ngrammar.sampling_params import InvalidRequestError
from ngrammar.server.engine_loop import EngineFailure, RequestGroup
from ngrammar.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    GenerateMetaInfo,
    GenerateResponse,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)

if TYPE_CHECKING:
    from ngrammar.model.tokenizer import Tokenizer


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text for logprobs: its bytes as UTF-8, or, for a token holding part of a character,
    OpenAI's ``bytes:\\xe2\\x80`` form (decoding it alone would give U+FFFD and merge distinct tokens)."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _finite_top(top: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """Alternatives a grammar masked out have logprob -inf; they are not alternatives at all."""
    return [(t, lp) for t, lp in top if math.isfinite(lp)]


def chat_logprobs(tokenizer: Tokenizer, lps: Sequence[TokenLogprob]) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(
            token=_token_text(tokenizer, token_id),
            logprob=logprob,
            bytes=list(tokenizer.token_bytes(token_id)),
        )

    content = []
    for lp in lps:
        top = [entry(tid, v) for tid, v in _finite_top(lp.top)]
        content.append(ChatTokenLogprob(**entry(lp.token_id, lp.logprob).model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


@dataclasses.dataclass
class TextOffsets:
    """Where each token of a completion starts in its text (characters), from the tokens' bytes: a
    token inside a multi-byte character starts where that character does, and special tokens,
    which the text leaves out, add nothing."""

    chars: int = 0  # characters of the bytes taken, up to the last complete character
    tail: bytes = b""  # the bytes after it: the start of a character later tokens complete

    def take(self, tokenizer: Tokenizer, token_id: int) -> int:
        offset = self.chars + len(self.tail.decode("utf-8", "replace").rstrip("\ufffd"))
        if token_id not in tokenizer.special_token_ids:
            self.tail += tokenizer.token_bytes(token_id)
            text = self.tail.decode("utf-8", "replace")
            if not text.endswith("\ufffd"):
                self.chars, self.tail = self.chars + len(text), b""
        return offset


def completion_logprobs(
    tokenizer: Tokenizer, lps: Sequence[TokenLogprob], offsets: TextOffsets
) -> CompletionLogprobs:
    """OpenAI's legacy shape; ``offsets`` holds the bytes of the choice's tokens given before."""
    out = CompletionLogprobs()
    for lp in lps:
        text = _token_text(tokenizer, lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for tid, v in _finite_top(lp.top):  # best first: of tokens with one text (byte fallback's
            top.setdefault(_token_text(tokenizer, tid), v)  # "e" and <0x65>) the best one stays
        top.setdefault(text, lp.logprob)  # the sampled token is always listed (logprobs + 1 entries at most)
        out.top_logprobs.append(top)
        out.text_offset.append(offsets.take(tokenizer, lp.token_id))
    return out


def indexed_choices(group: RequestGroup, n: int) -> Iterator[tuple[int, CompletionOutput]]:
    """(OpenAI choice index, completion) over the group's latest outputs: prompt-major, then n."""
    for p, request_id in enumerate(group.request_ids):
        out = group.latest.get(request_id)
        if out is not None:
            for c in out.outputs:
                yield p * n + c.index, c


def outputs_usage(outputs: Sequence[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(int(o.metrics.get("cached_tokens", 0)) for o in outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def group_usage(group: RequestGroup) -> Usage:
    return outputs_usage([group.latest[r] for r in group.request_ids if r in group.latest])


def raise_completion_error(c: CompletionOutput) -> None:
    if c.error is not None:
        raise InvalidRequestError(c.error) if c.request_error else EngineFailure(c.error)


def to_json(model: BaseModel, exclude: set[str] | None = None) -> str:
    """A response body with its null fields, as OpenAI sends them (``finish_reason: null``...)."""
    return model.model_dump_json(exclude=exclude)


_encode = msgspec.json.Encoder().encode


class Renderer(Protocol):
    """Turns a group's progress into SSE payloads (JSON bytes) for one endpoint's stream format."""

    def start(self, num_prompts: int) -> list[bytes]: ...

    def update(self, group: RequestGroup) -> list[bytes]: ...

    def finish(self, group: RequestGroup) -> list[bytes]: ...


@dataclasses.dataclass
class _Cursor:
    """What one streamed choice has sent so far."""

    text: int = 0
    logprobs: int = 0
    offsets: TextOffsets = dataclasses.field(default_factory=TextOffsets)
    finished: bool = False

    def take(self, c: CompletionOutput) -> tuple[str, list[TokenLogprob], str | None] | None:
        """The unsent part of ``c`` (text delta, new logprobs, finish reason), or None if nothing."""
        if self.finished:
            return None
        delta = c.text[self.text :] if len(c.text) > self.text else ""
        lps = list((c.logprobs or [])[self.logprobs :])
        finish = c.finish_reason
        if not delta and not lps and finish is None:
            return None
        self.text += len(delta)
        self.logprobs += len(lps)
        self.finished = finish is not None
        return delta, lps, finish


class _ChunkStream:
    """An OpenAI stream's chunks, rendered as bytes around a prefix fixed per stream: a chunk is one
    ``msgspec`` encode of its choices (plain dicts), no pydantic model per token. Usage is null
    until the last chunk when the client asked for it (``stream_options.include_usage``), and
    absent otherwise, as OpenAI sends it."""

    object_name = ""

    def __init__(self, model_name: str, tokenizer: Tokenizer, rid: str, n: int, include_usage: bool) -> None:
        self.tokenizer = tokenizer
        self.n = n
        self.include_usage = include_usage
        self.cursors: dict[int, _Cursor] = {}
        head = {
            "id": rid,
            "object": self.object_name,
            "created": int(time.time()),
            "model": model_name,
        }
        self.head = _encode(head)[:-1] + b',"choices":'
        self.tail = b',"usage":null}' if include_usage else b"}"

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        return self.head + _encode(choices) + self.tail

    def _choice(
        self, index: int, cursor: _Cursor, delta: str, lps: list[TokenLogprob], finish: str | None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def start(self, num_prompts: int) -> list[bytes]:
        return []

    def update(self, group: RequestGroup) -> list[bytes]:
        choices = []
        for index, c in indexed_choices(group, self.n):
            cursor = self.cursors.setdefault(index, _Cursor())
            part = cursor.take(c)
            if part is None:
                continue
            raise_completion_error(c)
            choices.append(self._choice(index, cursor, *part))
        return [self._chunk(choices)] if choices else []

    def finish(self, group: RequestGroup) -> list[bytes]:
        if not self.include_usage:
            return []
        usage = group_usage(group).model_dump_json().encode()
        return [self.head + b'[],"usage":' + usage + b"}"]


class ChatStream(_ChunkStream):
    object_name = "chat.completion.chunk"

    def __init__(self, model_name: str, tokenizer: Tokenizer, rid: str, body: ChatCompletionRequest) -> None:
        super().__init__(model_name, tokenizer, rid, body.n, body.include_usage)
        self.want_logprobs = body.logprobs

    def start(self, num_prompts: int) -> list[bytes]:
        opening = {"role": "assistant", "content": ""}
        return [self._chunk([_chat_choice(i, opening) for i in range(num_prompts * self.n)])]

    def _choice(
        self, index: int, cursor: _Cursor, delta: str, lps: list[TokenLogprob], finish: str | None
    ) -> dict[str, Any]:
        logprobs = None
        if self.want_logprobs and lps:
            logprobs = chat_logprobs(self.tokenizer, lps).model_dump()
        return _chat_choice(index, {"content": delta} if delta else {}, logprobs, finish)


def _chat_choice(
    index: int, delta: dict[str, str], logprobs: Any = None, finish: str | None = None
) -> dict[str, Any]:
    """A chat chunk's choice. Unlike the other bodies, which send their null fields as OpenAI does, a
    delta carries only what it adds: the role once, then content, then nothing."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


class CompletionStream(_ChunkStream):
    object_name = "text_completion"

    def __init__(self, model_name: str, tokenizer: Tokenizer, rid: str, body: CompletionRequest) -> None:
        super().__init__(model_name, tokenizer, rid, body.n, body.include_usage)
        self.want_logprobs = body.logprobs is not None

    def _choice(
        self, index: int, cursor: _Cursor, delta: str, lps: list[TokenLogprob], finish: str | None
    ) -> dict[str, Any]:
        logprobs = None
        if self.want_logprobs and lps:
            logprobs = completion_logprobs(self.tokenizer, lps, cursor.offsets).model_dump()
        return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}


class GenerateStream:
    """SGLang's streaming shape: every event carries the cumulative text and ids so far."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.sent_tokens = -1

    def start(self, num_prompts: int) -> list[bytes]:
        return []

    def update(self, group: RequestGroup) -> list[bytes]:
        out = group.latest.get(group.request_ids[0])
        if out is None or (len(out.token_ids) == self.sent_tokens and not out.finished):
            return []
        raise_completion_error(out.outputs[0])
        self.sent_tokens = len(out.token_ids)
        return [to_json(generate_response(out, self.started)).encode()]

    def finish(self, group: RequestGroup) -> list[bytes]:
        return []


def generate_response(out: RequestOutput, started: float) -> GenerateResponse:
    c = out.outputs[0]
    m = out.metrics
    finish: dict[str, Any] | None = None
    if c.finish_reason is not None:
        finish = {"type": c.finish_reason, **({"message": c.error} if c.error else {})}
    meta = GenerateMetaInfo(
        id=out.request_id,
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=len(c.token_ids),
        finish_reason=finish,
        e2e_latency=time.perf_counter() - started,
        ttft=m.get("ttft_s"),
        spec_verify_steps=int(m.get("spec_verify_steps", 0)),
        spec_accept_length=m.get("spec_accept_length"),
        spec_accept_rate=m.get("spec_accept_rate"),
    )
    return GenerateResponse(text=c.text, output_ids=list(c.token_ids), meta_info=meta)


def chat_response(
    model_name: str, tokenizer: Tokenizer, rid: str, body: ChatCompletionRequest, group: RequestGroup
) -> ChatCompletionResponse:
    choices = []
    for index, c in indexed_choices(group, body.n):
        logprobs = chat_logprobs(tokenizer, c.logprobs) if body.logprobs and c.logprobs is not None else None
        choices.append(
            ChatChoice(
                index=index,
                message=AssistantMessage(content=c.text),
                logprobs=logprobs,
                finish_reason=c.finish_reason,
            )
        )
    return ChatCompletionResponse(id=rid, model=model_name, choices=choices, usage=group_usage(group))


def completion_response(
    model_name: str, tokenizer: Tokenizer, rid: str, body: CompletionRequest, group: RequestGroup
) -> CompletionResponse:
    choices = []
    for index, c in indexed_choices(group, body.n):
        logprobs = None
        if body.logprobs is not None and c.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, c.logprobs, TextOffsets())
        choices.append(
            CompletionChoice(index=index, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason)
        )
    return CompletionResponse(
        id=rid, created=int(time.time()), model=model_name, choices=choices, usage=group_usage(group)
    )
