"""The HTTP server: OpenAI-compatible and native endpoints over one background engine loop.

Request path: the edge (``http.Guard``: API key, then body size; uvicorn's protocol: header timeout,
connection cap) -> parse (pydantic, strict types, raw depth and surrogate checks) -> check the model
name and the counts (prompts, n, sequences) -> on the prepare pool: the grammar's size, then its
compilation started on the grammar pool, then each prompt's size before it is tokenized ->
the compiled grammar, within the compile budget -> ``AsyncEngine.submit`` -> wait for, or stream,
the outputs. Cheap checks come before expensive work, and nothing slow runs on the event loop.
Whatever way a handler ends (done, error, client gone, cancelled), it aborts its unfinished
engine requests, so their KV pages return to the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ngrammar.args import engine_kwargs
from ngrammar.engine.engine import LLMEngine
from ngrammar.grammar import GrammarError, GrammarSpec, grammar_spec_from_request
from ngrammar.llm import build_engine_config
from ngrammar.outputs import CompletionOutput, RequestOutput, TokenLogprob
from ngrammar.sampling_params import InvalidRequestError, SamplingParams
from ngrammar.server.config import ServerConfig
from ngrammar.server.engine_loop import (
    AsyncEngine,
    ClientDisconnected,
    EngineFailure,
    EngineUnavailable,
    QueueFull,
    RequestGroup,
)
from ngrammar.server.http import DrainingServer, Guard, uvicorn_kwargs
from ngrammar.server.metrics import CONTENT_TYPE, ServerMetrics
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
    DraftCorpusRequest,
    ErrorInfo,
    ErrorResponse,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    Usage,
    sent_field,
)

if TYPE_CHECKING:
    import argparse

    from ngrammar.model.tokenizer import Tokenizer
    from ngrammar.speculative.external import DraftCorpora

log = logging.getLogger(__name__)

DEFAULT_MODEL_ALIAS = "default"
_ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
        "/generate",
        "/server_info",
        "/metrics",
        "/v1/draft_corpora",
    }
)


# ------------------------------------------------------------------ errors


class APIError(Exception):
    """An error answered in OpenAI's error shape with the given HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type_, param=param, code=code)
        self.headers = dict(headers or {})

    def response(self) -> Response:
        # ASCII-escaped JSON: a message can never fail to encode (a lone surrogate would).
        body = json.dumps(ErrorResponse(error=self.info).model_dump())
        return Response(body, status_code=self.status, headers=self.headers, media_type="application/json")


def _as_api_error(exc: BaseException) -> APIError:
    """Classify any exception a handler can meet; unknown ones are server errors (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (InvalidRequestError, GrammarError)):
        return APIError(400, str(exc))
    from ngrammar.speculative.external import DraftCorpusError

    if isinstance(exc, DraftCorpusError):
        return APIError(400, str(exc))
    if isinstance(exc, QueueFull):
        return APIError(
            503,
            str(exc),
            "server_overloaded",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), "service_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, EngineFailure):
        return APIError(500, str(exc), "server_error")
    return APIError(500, f"internal error: {type(exc).__name__}", "server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":  # (its loc is a character offset, not a parameter)
        reason = (first.get("ctx") or {}).get("error", "decode error")
        return APIError(400, f"the request body is not valid JSON: {reason} at character {''.join(loc) or 0}")
    param = ".".join(loc) or None
    # pydantic prefixes messages raised by our own validators; the client needs only the reason.
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def _http_error(exc: StarletteHTTPException) -> APIError:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), kind, headers=exc.headers)


def _install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc).response()

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return _http_error(exc).response()

    async def on_known(_: Request, exc: Exception) -> Response:
        return _as_api_error(exc).response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return _as_api_error(exc).response()

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for kind in (APIError, InvalidRequestError, GrammarError, QueueFull, EngineUnavailable, EngineFailure):
        app.add_exception_handler(kind, on_known)
    app.add_exception_handler(Exception, on_unexpected)


# -------------------------------------------------------------- middleware


class _CountRequests:
    """Counts answered requests by endpoint and status (pure ASGI, so streaming is untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees if the app raises before starting a response

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            path = scope.get("path", "")
            if path.startswith("/v1/draft_corpora/"):  # DELETE /v1/draft_corpora/{name}
                path = "/v1/draft_corpora"
            self.metrics.observe_http(path if path in _ENDPOINTS else "other", status)


# --------------------------------------------------------------- rendering


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


def _chat_logprobs(tokenizer: Tokenizer, lps: Sequence[TokenLogprob]) -> ChatLogprobs:
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
class _TextOffsets:
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


def _completion_logprobs(
    tokenizer: Tokenizer, lps: Sequence[TokenLogprob], offsets: _TextOffsets
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


def _choices(group: RequestGroup, n: int) -> Iterator[tuple[int, CompletionOutput]]:
    """(OpenAI choice index, completion) over the group's latest outputs: prompt-major, then n."""
    for p, request_id in enumerate(group.request_ids):
        out = group.latest.get(request_id)
        if out is not None:
            for c in out.outputs:
                yield p * n + c.index, c


def _usage(outputs: Sequence[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(int(o.metrics.get("cached_tokens", 0)) for o in outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _group_usage(group: RequestGroup) -> Usage:
    return _usage([group.latest[r] for r in group.request_ids if r in group.latest])


def _raise_completion_error(c: CompletionOutput) -> None:
    if c.error is not None:
        raise InvalidRequestError(c.error) if c.request_error else EngineFailure(c.error)


def _json(model: BaseModel, exclude: set[str] | None = None) -> str:
    """A response body with its null fields, as OpenAI sends them (``finish_reason: null``...)."""
    return model.model_dump_json(exclude=exclude)


def _sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


class _Renderer(Protocol):
    """Turns a group's progress into SSE payloads (JSON bytes) for one endpoint's stream format."""

    def start(self, num_prompts: int) -> list[bytes]: ...

    def update(self, group: RequestGroup) -> list[bytes]: ...

    def finish(self, group: RequestGroup) -> list[bytes]: ...


@dataclasses.dataclass
class _Cursor:
    """What one streamed choice has sent so far."""

    text: int = 0
    logprobs: int = 0
    offsets: _TextOffsets = dataclasses.field(default_factory=_TextOffsets)
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

    def __init__(self, server: _Server, rid: str, n: int, include_usage: bool) -> None:
        self.server = server
        self.n = n
        self.include_usage = include_usage
        self.cursors: dict[int, _Cursor] = {}
        head = {
            "id": rid,
            "object": self.object_name,
            "created": int(time.time()),
            "model": server.model_name,
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
        for index, c in _choices(group, self.n):
            cursor = self.cursors.setdefault(index, _Cursor())
            part = cursor.take(c)
            if part is None:
                continue
            _raise_completion_error(c)
            choices.append(self._choice(index, cursor, *part))
        return [self._chunk(choices)] if choices else []

    def finish(self, group: RequestGroup) -> list[bytes]:
        if not self.include_usage:
            return []
        usage = _group_usage(group).model_dump_json().encode()
        return [self.head + b'[],"usage":' + usage + b"}"]


class _ChatStream(_ChunkStream):
    object_name = "chat.completion.chunk"

    def __init__(self, server: _Server, rid: str, body: ChatCompletionRequest) -> None:
        super().__init__(server, rid, body.n, body.include_usage)
        self.want_logprobs = body.logprobs

    def start(self, num_prompts: int) -> list[bytes]:
        opening = {"role": "assistant", "content": ""}
        return [self._chunk([_chat_choice(i, opening) for i in range(num_prompts * self.n)])]

    def _choice(
        self, index: int, cursor: _Cursor, delta: str, lps: list[TokenLogprob], finish: str | None
    ) -> dict[str, Any]:
        logprobs = None
        if self.want_logprobs and lps:
            logprobs = _chat_logprobs(self.server.tokenizer, lps).model_dump()
        return _chat_choice(index, {"content": delta} if delta else {}, logprobs, finish)


def _chat_choice(
    index: int, delta: dict[str, str], logprobs: Any = None, finish: str | None = None
) -> dict[str, Any]:
    """A chat chunk's choice (``protocol.ChatChunkChoice``'s fields; the delta without nulls)."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


class _CompletionStream(_ChunkStream):
    object_name = "text_completion"

    def __init__(self, server: _Server, rid: str, body: CompletionRequest) -> None:
        super().__init__(server, rid, body.n, body.include_usage)
        self.want_logprobs = body.logprobs is not None

    def _choice(
        self, index: int, cursor: _Cursor, delta: str, lps: list[TokenLogprob], finish: str | None
    ) -> dict[str, Any]:
        logprobs = None
        if self.want_logprobs and lps:
            logprobs = _completion_logprobs(self.server.tokenizer, lps, cursor.offsets).model_dump()
        return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}


class _GenerateStream:
    """SGLang's streaming shape: every event carries the cumulative text and ids so far."""

    def __init__(self, server: _Server, started: float) -> None:
        self.server = server
        self.started = started
        self.sent_tokens = -1

    def start(self, num_prompts: int) -> list[bytes]:
        return []

    def update(self, group: RequestGroup) -> list[bytes]:
        out = group.latest.get(group.request_ids[0])
        if out is None or (len(out.token_ids) == self.sent_tokens and not out.finished):
            return []
        _raise_completion_error(out.outputs[0])
        self.sent_tokens = len(out.token_ids)
        return [_json(_generate_response(out, self.started)).encode()]

    def finish(self, group: RequestGroup) -> list[bytes]:
        return []


def _generate_response(out: RequestOutput, started: float) -> GenerateResponse:
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


# ------------------------------------------------------------------ server


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


def _grammar_spec(kwargs: dict[str, Any], max_bytes: int) -> GrammarSpec | None:
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


def _prepare(
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


def _swallow(f: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned future's outcome, so asyncio does not log it as never retrieved."""
    if not f.cancelled():
        f.exception()


class _Server:
    """Handler logic shared by the routes; one per app."""

    def __init__(
        self, engine: LLMEngine, loop: AsyncEngine, metrics: ServerMetrics, config: ServerConfig
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.metrics = metrics
        self.config = config
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        # logprobs read it: built here (~0.1 s), not inside a response; its longest entry bounds the
        # characters a token can cover (prompt sizes are checked against it before tokenizing).
        self.max_token_chars = max(1, max(len(b) for b in self.tokenizer.vocab_bytes))
        # Tokenizing and checking requests: bounded, and apart from the grammar compile pool and
        # from asyncio's default executor, so neither slow compiles nor huge prompts starve others.
        self.prepare_pool = ThreadPoolExecutor(config.prepare_threads, thread_name_prefix="prepare")
        self.started = time.time()

    def check_model(self, name: str | None) -> None:
        if name in (None, "", self.model_name, DEFAULT_MODEL_ALIAS):
            return
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {self.model_name!r}",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )

    def check_counts(self, num_prompts: int, n: int) -> None:
        """The request's shape against the server's limits, before any work (400 if over)."""
        c = self.config
        if num_prompts > c.max_prompts:
            raise APIError(
                400,
                f"the request has {num_prompts} prompts; the server's limit is {c.max_prompts}",
                param="prompt",
            )
        if n > c.max_n:
            raise APIError(400, f"n is {n}; the server's limit is {c.max_n}", param="n")
        self.loop.check_fits(num_prompts * n)

    async def submit(
        self,
        prompts: Sequence[Any],
        kwargs: dict[str, Any],
        max_tokens: int | None,
        sent: str | None,
        prefix: str,
    ) -> RequestGroup:
        self.check_counts(len(prompts), int(kwargs.get("n", 1)))
        loop = asyncio.get_running_loop()
        spec = await loop.run_in_executor(
            self.prepare_pool, _grammar_spec, kwargs, self.config.max_grammar_bytes
        )
        backend = self.engine.grammar_backend
        compiling = None if spec is None else backend.compile_async(spec)  # meanwhile, tokenize
        try:
            ids, params = await loop.run_in_executor(
                self.prepare_pool,
                _prepare,
                self.engine,
                prompts,
                kwargs,
                max_tokens,
                sent,
                self.max_token_chars,
            )
            compiled = None if compiling is None else await self._compiled(compiling)
        except BaseException:
            if compiling is not None:
                compiling.cancel()  # only a compilation still queued stops; a running one is cached
            raise
        if spec is None or compiled is None:
            return self.loop.submit(ids, params, prefix)
        # Pinned until each prompt's engine request was added: the engine looks the grammar up
        # again then, and must find it whatever other compilations evicted meanwhile.
        backend.pin(spec, compiled, len(ids))
        try:
            return self.loop.submit(ids, params, prefix, on_admitted=lambda: backend.unpin(spec))
        except BaseException:
            for _ in ids:
                backend.unpin(spec)
            raise

    async def _compiled(self, compiling: Future[Any]) -> Any:
        """The compiled grammar, or a 400 when it is not ready within the compile budget (counted
        from the compile's submission): 503 instead if it never started (the pool is busy)."""
        budget = self.config.grammar_compile_timeout_s
        waiting = asyncio.wrap_future(compiling)
        done, _ = await asyncio.wait({waiting}, timeout=budget)
        if done:
            return waiting.result()
        waiting.add_done_callback(_swallow)
        if compiling.cancel():
            raise APIError(
                503,
                f"the server is busy compiling other grammars and could not start this one within {budget:g} s; "
                "retry later",
                "server_overloaded",
                code="grammar_queue_full",
                headers={"Retry-After": str(max(1, int(budget)))},
            )
        raise GrammarError(
            f"compiling the grammar takes longer than the server's budget of {budget:g} s "
            "(--grammar-compile-timeout-s); send a smaller or simpler grammar"
        )

    async def _progress(self, request: Request, group: RequestGroup) -> AsyncIterator[None]:
        """Yields after each batch of engine progress; raises ClientDisconnected if the client left
        (noticed by one task waiting for the disconnect message: no polling, no timer per token)."""
        watcher = asyncio.ensure_future(_watch_disconnect(request, group))
        try:
            while not group.done:
                await group.wait_update()
                yield
        finally:
            watcher.cancel()

    async def collect(self, request: Request, group: RequestGroup) -> None:
        """Wait until every request of the group finished (aborting them if we stop early)."""
        try:
            async for _ in self._progress(request, group):
                pass
        finally:
            group.abort()
        for _, c in _choices(group, 1):
            _raise_completion_error(c)

    def stream(self, request: Request, group: RequestGroup, renderer: _Renderer) -> StreamingResponse:
        return StreamingResponse(
            self._events(request, group, renderer),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(
        self, request: Request, group: RequestGroup, renderer: _Renderer
    ) -> AsyncIterator[bytes]:
        # Cancellation (the client went away) lands in ``finally`` too, which aborts the requests.
        try:
            for payload in renderer.start(len(group.request_ids)):
                yield _sse(payload)
            sent, interval = 0, self.config.stream_interval
            async for _ in self._progress(request, group):
                if interval > 1 and sent and not group.done and group.num_tokens - sent < interval:
                    continue  # (the first tokens go at once: the time to the first token is not batched)
                sent = group.num_tokens
                for payload in renderer.update(group):
                    yield _sse(payload)
            for payload in renderer.finish(group):
                yield _sse(payload)
            yield _SSE_DONE
        except ClientDisconnected:
            return
        except Exception as e:  # headers are sent: report the error in-band, OpenAI style
            error = _as_api_error(e)
            if error.status >= 500:
                log.error("stream failed", exc_info=e)
            yield _sse(json.dumps(ErrorResponse(error=error.info).model_dump()).encode())
            yield _SSE_DONE
        finally:
            group.abort()

    def server_info(self) -> dict[str, Any]:
        snap = self.loop.snapshot
        stats = dataclasses.asdict(snap.stats)
        stats["avg_spec_accept_length"] = snap.stats.avg_spec_accept_length
        stats["avg_step_seconds"] = snap.stats.step_seconds / snap.stats.steps if snap.stats.steps else 0.0
        return {
            "model": self.model_name,
            "served_model_names": [self.model_name, DEFAULT_MODEL_ALIAS],
            "max_model_len": self.engine.max_model_len,
            "max_queue": self.loop.max_queue,
            "engine_alive": self.loop.alive,
            "step_running_s": self.loop.step_running_for(),
            "grammar_cache_bytes": self.engine.grammar_backend.cache_bytes,
            "limits": _jsonable({k: v for k, v in dataclasses.asdict(self.config).items() if k != "api_key"}),
            "uptime_s": time.time() - self.started,
            "num_running": snap.num_running,
            "num_waiting": snap.num_waiting,
            "num_inflight": snap.num_inflight,
            "kv_pages_free": snap.kv_pages_free,
            "kv_pages_total": snap.kv_pages_total,
            "kv_page_size": self.engine.blocks.page_size,
            "kv_usage": snap.kv_usage,
            "avg_spec_accept_length": snap.stats.avg_spec_accept_length,
            "prefix_cache": {
                "enabled": self.engine.config.prefix_cache,
                "hit_tokens": snap.stats.prefix_cache_hit_tokens,
                "query_tokens": snap.stats.prefix_cache_query_tokens,
                "hit_rate": snap.stats.prefix_cache_hit_rate,
                "cached_pages": snap.kv_pages_cached,
            },
            "stats": stats,
            "config": _jsonable(dataclasses.asdict(self.engine.config)),
        }


async def _watch_disconnect(request: Request, group: RequestGroup) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    group.disconnected()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# ------------------------------------------------------------------ routes


async def _respond(
    s: _Server,
    request: Request,
    group: RequestGroup,
    stream: bool,
    renderer: Callable[[], _Renderer],
    response: Callable[[], BaseModel],
) -> Response:
    """Stream the group as SSE, or wait for it and answer with one JSON body (499: client left)."""
    if stream:
        return s.stream(request, group, renderer())
    try:
        await s.collect(request, group)
    except ClientDisconnected:
        return Response(status_code=499)
    return Response(_json(response()), media_type="application/json")


def _install_routes(app: FastAPI, s: _Server) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not s.loop.alive:
            raise APIError(503, "the engine loop is not running", "service_unavailable")
        stuck = s.loop.step_running_for()
        if stuck > s.config.stall_timeout_s:
            raise APIError(
                503,
                f"the engine is not making progress: its current step has run for {stuck:.0f} s "
                f"(limit {s.config.stall_timeout_s:g} s, --stall-timeout-s)",
                "service_unavailable",
            )
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=s.model_name, created=int(s.started), max_model_len=s.engine.max_model_len)
        return Response(_json(ModelList(data=[card])), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest) -> Response:
        s.check_model(body.model)
        messages = body.template_messages()
        sent = sent_field(body, ("max_completion_tokens", "max_tokens"))
        group = await s.submit(
            [messages], body.sampling_kwargs(), body.requested_max_tokens, sent, "chatcmpl"
        )
        rid = group.request_ids[0]
        return await _respond(
            s,
            request,
            group,
            body.stream,
            lambda: _ChatStream(s, rid, body),
            lambda: _chat_response(s, rid, body, group),
        )

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        s.check_model(body.model)
        sent = sent_field(body, ("max_tokens",))
        group = await s.submit(body.prompts(), body.sampling_kwargs(), body.max_tokens, sent, "cmpl")
        rid = group.request_ids[0]
        return await _respond(
            s,
            request,
            group,
            body.stream,
            lambda: _CompletionStream(s, rid, body),
            lambda: _completion_response(s, rid, body, group),
        )

    @app.post("/generate")
    async def generate(request: Request, body: GenerateRequest) -> Response:
        started = time.perf_counter()
        sp = body.sampling_params.sampling_kwargs()
        max_tokens = sp.pop("max_tokens")
        sent = sent_field(body.sampling_params, ("max_new_tokens",))
        group = await s.submit(body.prompts(), sp, max_tokens, sent, "gen")
        if body.stream:
            return s.stream(request, group, _GenerateStream(s, started))
        try:
            await s.collect(request, group)
        except ClientDisconnected:
            return Response(status_code=499)
        results = [_generate_response(group.latest[r], started).model_dump() for r in group.request_ids]
        return JSONResponse(results if body.is_batch else results[0])

    @app.get("/server_info")
    async def server_info() -> Response:
        return JSONResponse(s.server_info())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(s.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/draft_corpora")
    async def list_draft_corpora() -> Response:
        return JSONResponse({"data": _draft_corpora(s).info()})

    @app.post("/v1/draft_corpora")
    async def add_draft_corpus(body: DraftCorpusRequest) -> Response:
        from starlette.concurrency import run_in_threadpool

        corpora = _draft_corpora(s)
        path = None if body.path is None else _corpus_path(s.config.draft_corpus_dir, body.path)
        # Tokenizing and indexing run on a worker thread; the engine keeps stepping meanwhile.
        info = await run_in_threadpool(corpora.add, body.name, path, body.documents, body.replace)
        return JSONResponse(info.as_dict())

    @app.delete("/v1/draft_corpora/{name}")
    async def remove_draft_corpus(name: str) -> Response:
        from ngrammar.speculative.external import DraftCorpusError

        try:  # one call: a corpus removed meanwhile is a 404 too
            _draft_corpora(s).remove(name)
        except DraftCorpusError:
            raise APIError(404, f"unknown draft corpus {name!r}", "not_found_error") from None
        return JSONResponse({"name": name, "removed": True})


def _corpus_path(root: str | None, path: str) -> str:
    """A file an HTTP client may have indexed: only inside ``--draft-corpus-dir`` (a client must
    not read the server's other files into a corpus whose n-grams speculation statistics reveal)."""
    from pathlib import Path

    if root is None:
        raise APIError(
            403,
            "indexing server files is off: send the documents, or start the server with --draft-corpus-dir",
            "permission_error",
        )
    base = Path(root).resolve()
    full = (base / path).resolve()
    if not full.is_relative_to(base) or not full.is_file():
        raise APIError(400, "path must name a file inside --draft-corpus-dir", param="path")
    return str(full)


def _draft_corpora(s: _Server) -> DraftCorpora:
    """The engine's external draft corpora."""
    if not isinstance(s.engine, LLMEngine):  # ``server.router.ReplicaFront``: no engine here
        raise APIError(400, "draft corpora are not served with --dp / --tp (each replica drafts on its own)")
    spec = s.engine.ngram
    if spec is None or spec.proposer.corpora is None:
        raise APIError(400, "draft corpora need a server started with --speculative ngram")
    return spec.proposer.corpora


def _chat_response(
    s: _Server, rid: str, body: ChatCompletionRequest, group: RequestGroup
) -> ChatCompletionResponse:
    choices = []
    for index, c in _choices(group, body.n):
        logprobs = (
            _chat_logprobs(s.tokenizer, c.logprobs) if body.logprobs and c.logprobs is not None else None
        )
        choices.append(
            ChatChoice(
                index=index,
                message=AssistantMessage(content=c.text),
                logprobs=logprobs,
                finish_reason=c.finish_reason,
            )
        )
    return ChatCompletionResponse(id=rid, model=s.model_name, choices=choices, usage=_group_usage(group))


def _completion_response(
    s: _Server, rid: str, body: CompletionRequest, group: RequestGroup
) -> CompletionResponse:
    choices = []
    for index, c in _choices(group, body.n):
        logprobs = None
        if body.logprobs is not None and c.logprobs is not None:
            logprobs = _completion_logprobs(s.tokenizer, c.logprobs, _TextOffsets())
        choices.append(
            CompletionChoice(index=index, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason)
        )
    return CompletionResponse(
        id=rid, created=int(time.time()), model=s.model_name, choices=choices, usage=_group_usage(group)
    )


# ------------------------------------------------------------------ public


def create_app(
    engine: LLMEngine | Mapping[str, Any] | None = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    config: ServerConfig | None = None,
) -> FastAPI:
    """An app serving ``engine`` (or a new engine built from keyword arguments, as ``LLM`` takes).

    ``config`` holds the server's key and limits; ``api_key`` and ``max_queue``, when given,
    override its fields. The engine loop thread starts with the app's lifespan and stops with it.
    ``app.state.server`` exposes the engine, the loop (``.loop``, whose ``max_queue`` may be changed
    live) and metrics.
    """
    config = config or ServerConfig()
    if api_key is not None:
        config = dataclasses.replace(config, api_key=api_key)
    if max_queue is not None:
        config = dataclasses.replace(config, max_queue=max_queue)
    metrics = ServerMetrics()
    server = _serving(engine, config, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.loop.stop)
            server.prepare_pool.shutdown(wait=False, cancel_futures=True)

    docs: dict[str, Any] = {} if config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="ngrammar", lifespan=lifespan, **docs)
    app.state.server = server
    app.add_middleware(Guard, config=config)  # inside the counter: refusals are counted too
    app.add_middleware(_CountRequests, metrics=metrics)
    _install_error_handlers(app)
    _install_routes(app, server)
    return app


def _serving(
    engine: LLMEngine | Mapping[str, Any] | None, config: ServerConfig, metrics: ServerMetrics
) -> _Server:
    """An engine instance is served in this process (its loop on a thread); one built here from
    keyword arguments runs in an engine-core process (``server/core.py``), or, with ``--dp`` /
    ``--tp``, in replica processes behind a router (``server/router.py``)."""
    if isinstance(engine, LLMEngine):
        _ = engine.grammar_backend  # build it now: handler threads must share one, not race to create it
        return _Server(engine, AsyncEngine(engine, config.max_queue, metrics), metrics, config)
    engine_config = build_engine_config(**dict(engine or {}))
    if engine_config.data_parallel_size > 1 or engine_config.tensor_parallel_size > 1:
        from ngrammar.server.router import start_replicas

        front, router = start_replicas(engine_config, config.max_queue, metrics)
        return _Server(front, router, metrics, config)  # type: ignore[arg-type]
    from ngrammar.server.core_client import start_core

    front, client = start_core(engine_config, config.max_queue, metrics)
    return _Server(front, client, metrics, config)  # type: ignore[arg-type]


def serve(args: argparse.Namespace) -> int:
    """``ngrammar serve``: build the engine from the CLI flags and run uvicorn until interrupted."""
    import uvicorn

    from ngrammar.args import config_kwargs

    config = ServerConfig(**config_kwargs(args, ServerConfig))
    app = create_app(engine_kwargs(args), config=config)
    DrainingServer(uvicorn.Config(app, log_level="info", **uvicorn_kwargs(config))).run()
    return 0
