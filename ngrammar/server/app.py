"""The HTTP server: OpenAI-compatible and native endpoints over an engine core (its own process, or
an engine instance's loop thread), the routes and the handlers' shared logic (``_Server``).

Request path: the edge (``http.Guard``: API key, then body size; uvicorn's protocol: header timeout,
connection cap) -> parse (pydantic, strict types, raw depth and surrogate checks) -> check the model
name and the counts (prompts, n, sequences) -> on the prepare pool (``prepare.py``): the grammar's
size, then its compilation started on the grammar pool, then each prompt's size before it is
tokenized -> the compiled grammar, within the compile budget -> ``submit`` (``CoreClient`` or
``AsyncEngine``) -> wait for, or stream (``rendering.py``), the outputs; errors: ``errors.py``. Cheap checks come before expensive work, and nothing slow runs on the event loop.
Whatever way a handler ends (done, error, client gone, cancelled), it aborts its unfinished
engine requests, so their KV pages return to the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ngrammar.args import engine_kwargs
from ngrammar.engine.engine import LLMEngine
from ngrammar.grammar import GrammarError
from ngrammar.llm import build_engine_config
from ngrammar.server.config import ServerConfig
from ngrammar.server.corpora import install_corpus_routes
from ngrammar.server.engine_loop import (
    AsyncEngine,
    ClientDisconnected,
    RequestGroup,
)
from ngrammar.server.errors import APIError, as_api_error, install_error_handlers
from ngrammar.server.http import SSE_DONE, DrainingServer, Guard, sse, uvicorn_kwargs
from ngrammar.server.metrics import CONTENT_TYPE, ServerMetrics
from ngrammar.server.prepare import grammar_spec, prepare
from ngrammar.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    sent_field,
)
from ngrammar.server.rendering import (
    ChatStream,
    CompletionStream,
    GenerateStream,
    Renderer,
    chat_response,
    completion_response,
    generate_response,
    indexed_choices,
    raise_completion_error,
    to_json,
)

if TYPE_CHECKING:
    import argparse

    from ngrammar.server.core_client import CoreClient
    from ngrammar.server.front import EngineFront


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


# ------------------------------------------------------------------ server


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
            self.prepare_pool, grammar_spec, kwargs, self.config.max_grammar_bytes
        )
        backend = self.engine.grammar_backend
        compiling = None if spec is None else backend.compile_async(spec)  # meanwhile, tokenize
        try:
            ids, params = await loop.run_in_executor(
                self.prepare_pool,
                prepare,
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
        for _, c in indexed_choices(group, 1):
            raise_completion_error(c)

    def stream(self, request: Request, group: RequestGroup, renderer: Renderer) -> StreamingResponse:
        return StreamingResponse(
            self._events(request, group, renderer),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(
        self, request: Request, group: RequestGroup, renderer: Renderer
    ) -> AsyncIterator[bytes]:
        # Cancellation (the client went away) lands in ``finally`` too, which aborts the requests.
        try:
            for payload in renderer.start(len(group.request_ids)):
                yield sse(payload)
            sent, interval = 0, self.config.stream_interval
            async for _ in self._progress(request, group):
                if interval > 1 and sent and not group.done and group.num_tokens - sent < interval:
                    continue  # (the first tokens go at once: the time to the first token is not batched)
                sent = group.num_tokens
                for payload in renderer.update(group):
                    yield sse(payload)
            for payload in renderer.finish(group):
                yield sse(payload)
            yield SSE_DONE
        except ClientDisconnected:
            return
        except Exception as e:  # headers are sent: report the error in-band, OpenAI style
            error = as_api_error(e)
            if error.status >= 500:
                log.error("stream failed", exc_info=e)
            yield sse(json.dumps(ErrorResponse(error=error.info).model_dump()).encode())
            yield SSE_DONE
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
    renderer: Callable[[], Renderer],
    response: Callable[[], BaseModel],
) -> Response:
    """Stream the group as SSE, or wait for it and answer with one JSON body (499: client left)."""
    if stream:
        return s.stream(request, group, renderer())
    try:
        await s.collect(request, group)
    except ClientDisconnected:
        return Response(status_code=499)
    return Response(to_json(response()), media_type="application/json")


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
        return Response(to_json(ModelList(data=[card])), media_type="application/json")

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
            lambda: ChatStream(s.model_name, s.tokenizer, rid, body),
            lambda: chat_response(s.model_name, s.tokenizer, rid, body, group),
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
            lambda: CompletionStream(s.model_name, s.tokenizer, rid, body),
            lambda: completion_response(s.model_name, s.tokenizer, rid, body, group),
        )

    @app.post("/generate")
    async def generate(request: Request, body: GenerateRequest) -> Response:
        started = time.perf_counter()
        sp = body.sampling_params.sampling_kwargs()
        max_tokens = sp.pop("max_tokens")
        sent = sent_field(body.sampling_params, ("max_new_tokens",))
        group = await s.submit(body.prompts(), sp, max_tokens, sent, "gen")
        if body.stream:
            return s.stream(request, group, GenerateStream(started))
        try:
            await s.collect(request, group)
        except ClientDisconnected:
            return Response(status_code=499)
        results = [generate_response(group.latest[r], started).model_dump() for r in group.request_ids]
        return JSONResponse(results if body.is_batch else results[0])

    @app.get("/server_info")
    async def server_info() -> Response:
        return JSONResponse(s.server_info())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(s.metrics.render(), media_type=CONTENT_TYPE)

    install_corpus_routes(app, s)


# ------------------------------------------------------------------ public


def create_app(
    engine: LLMEngine | Mapping[str, Any] | None = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    config: ServerConfig | None = None,
    connect: Callable[[ServerMetrics], tuple[EngineFront, CoreClient]] | None = None,
) -> FastAPI:
    """An app serving ``engine`` (or a new engine built from keyword arguments, as ``LLM`` takes),
    or the engine cores ``connect`` reaches (one of ``--api-server-count`` processes).

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
    if connect is not None:
        front, client = connect(metrics)
        server = _Server(front, client, metrics, config)  # type: ignore[arg-type]
    else:
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
    install_error_handlers(app)
    _install_routes(app, server)
    return app


def _serving(
    engine: LLMEngine | Mapping[str, Any] | None, config: ServerConfig, metrics: ServerMetrics
) -> _Server:
    """An engine instance is served in this process (its loop on a thread); engines built here from
    keyword arguments run in engine-core processes (``server/core.py``): one, or one per ``--dp``
    replica, each with its ``--tp`` ranks."""
    if isinstance(engine, LLMEngine):
        _ = engine.grammar_backend  # build it now: handler threads must share one, not race to create it
        return _Server(engine, AsyncEngine(engine, config.max_queue, metrics), metrics, config)
    from ngrammar.server.core_client import start_cores

    front, client = start_cores(build_engine_config(**dict(engine or {})), config.max_queue, metrics)
    return _Server(front, client, metrics, config)  # type: ignore[arg-type]


def serve(args: argparse.Namespace) -> int:
    """``ngrammar serve``: build the engine from the CLI flags and run uvicorn until interrupted."""
    import uvicorn

    from ngrammar.args import config_kwargs
    from ngrammar.server.process import tune_server_process

    tune_server_process()
    config = ServerConfig(**config_kwargs(args, ServerConfig))
    app = create_app(engine_kwargs(args), config=config)
    DrainingServer(uvicorn.Config(app, log_level="info", **uvicorn_kwargs(config))).run()
    return 0
