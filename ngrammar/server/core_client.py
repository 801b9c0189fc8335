"""The API server's side of the engine core: ``CoreClient``, with ``AsyncEngine``'s interface.

The engine runs in its own process (``core.core_main``); this process keeps the HTTP work: it
sends each prepared request once (``Add``), reads one ``StepDelta`` per engine step on the event
loop (no thread, no per-output hand-off), and rebuilds each request's ``RequestOutput`` in place
from the new token ids: incremental detokenization, stop strings (held back while they may still
match, cut where the engine stopped), logprobs, usage. Handlers see the same ``RequestGroup`` as
with an in-process engine.

The core's exit is noticed without polling (a pidfd of its process on the event loop): every request
it held fails with ``EngineFailure`` (a 500, or an in-band error on a stream), later ones get 503,
and /health fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from ngrammar.engine.stats import EngineStats
from ngrammar.model.tokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, Tokenizer
from ngrammar.outputs import CompletionOutput, RequestOutput, TokenLogprob
from ngrammar.sampling_params import InvalidRequestError, SamplingParams
from ngrammar.server.core_messages import (
    Abort,
    Add,
    Load,
    Ready,
    RequestDelta,
    RequestFailed,
    StartFailed,
    StepDelta,
    Stop,
    encoder,
    report_decoder,
)
from ngrammar.server.engine_loop import (
    EngineFailure,
    EngineSnapshot,
    EngineUnavailable,
    QueueFull,
    RequestGroup,
)

if TYPE_CHECKING:
    from ngrammar.config import EngineConfig
    from ngrammar.server.router import ReplicaFront
    from ngrammar.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 1800.0
_STOP_TIMEOUT_S = 30.0


class CoreStartError(RuntimeError):
    """The engine core could not build its engine; the server does not start."""


class _SeqText:
    """One completion's text, rebuilt from its token ids as the engine's ``Sequence`` builds it."""

    def __init__(self, tokenizer: Tokenizer, context: list[int], stop: tuple[str, ...]) -> None:
        self.ids = list(context)  # the prompt's last tokens, then the output
        self.detok = IncrementalDetokenizer.after_prompt(tokenizer, len(context))
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add(self, tokens: list[int], finish_reason: str | None) -> str:
        """The text safe to show after ``tokens``: a possible stop string's start is held back
        while running, and a stop string that finished the sequence is cut with what follows."""
        if tokens:
            self.ids.extend(tokens)
            self.detok.step(self.ids)
        text = self.detok.text
        if finish_reason is None:
            return text[: max(len(text) - self.holdback, 0)] if self.holdback else text
        if finish_reason == "stop" and self.stop:
            hits = [i for s in self.stop if (i := text.find(s)) >= 0]
            if hits:
                return text[: min(hits)]
        return text


class _Assembly:
    """One engine request's ``RequestOutput``, updated in place from the core's deltas."""

    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer
    ) -> None:
        lps = params.logprobs is not None
        self.output = RequestOutput(
            request_id,
            prompt_ids,
            [CompletionOutput(i, "", [], None, [] if lps else None) for i in range(params.n)],
            False,
            {"prompt_tokens": len(prompt_ids)},
        )
        context = prompt_ids[-PROMPT_CONTEXT_TOKENS:]
        self.texts = [_SeqText(tokenizer, context, params.stop) for _ in range(params.n)]
        self.weight = params.n

    def apply(self, delta: RequestDelta) -> int:
        """Fold in one step's delta; returns the tokens it adds."""
        added = 0
        for d in delta.seqs:
            c = self.output.outputs[d.index]
            c.token_ids.extend(d.token_ids)
            added += len(d.token_ids)
            if d.logprobs is not None and c.logprobs is not None:
                c.logprobs.extend(
                    TokenLogprob(t, lp, tuple((a, v) for a, v in top)) for t, lp, top in d.logprobs
                )
            c.text = self.texts[d.index].add(d.token_ids, d.finish_reason)
            c.finish_reason, c.error, c.request_error = d.finish_reason, d.error, d.request_error
        if delta.finished:
            self.output.finished = True
            self.output.metrics = {**self.output.metrics, **(delta.metrics or {})}
        return added


class CoreClient:
    """One engine-core process seen from the event loop (``AsyncEngine``'s interface)."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        commands: zmq.Socket[bytes],
        reports: zmq.Socket[bytes],
        ready: Ready,
        tokenizer: Tokenizer,
        max_queue: int,
        metrics: ServerMetrics | None,
        cleanup: Callable[[], None],
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be positive, got {max_queue}")
        self.process = process
        self.ready = ready
        self.tokenizer = tokenizer
        self.max_queue = max_queue  # sequences; read at each submit, so it may be changed while running
        self.metrics = metrics
        self._commands = commands
        self._send_lock = threading.Lock()  # ``stop`` sends from another thread
        self._sync_reports = reports
        self._reports: zmq.asyncio.Socket | None = None
        self._cleanup = cleanup
        self._groups: dict[str, RequestGroup] = {}
        self._assemblies: dict[str, _Assembly] = {}
        self._inflight = 0  # sequences
        self._load: Load | None = None
        self._heard = time.monotonic()  # when the core last reported, or was sent work while idle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self._exited = False
        self._exit_fd: int | None = None
        self.snapshot = self._take_snapshot()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start reading the core's reports; call from the event loop that serves the handlers."""
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reports = zmq.asyncio.Socket.from_socket(self._sync_reports)
        self._reader = self._loop.create_task(self._read())
        self._exit_fd = os.pidfd_open(self.process.pid)  # readable once the process ended
        self._loop.add_reader(self._exit_fd, self._on_exit)

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """Stop the core and wait for it (terminated if it does not stop); thread-safe."""
        self._stopping = True
        if self.process.poll() is None:
            self._send(Stop())
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._detach)
            except RuntimeError:  # the loop closed meanwhile
                pass
        self._cleanup()

    @property
    def alive(self) -> bool:
        return self._reader is not None and not self._stopping and not self._exited

    def step_running_for(self) -> float:
        """Seconds the core has gone without reporting while it holds requests (0 when idle)."""
        return time.monotonic() - self._heard if self._assemblies else 0.0

    # ------------------------------------------------------ handler-side API
    def check_fits(self, num_sequences: int) -> None:
        """Raise InvalidRequestError for a request of ``num_sequences`` that no wait would admit."""
        if num_sequences > self.max_queue:
            raise InvalidRequestError(
                f"the request asks for {num_sequences} sequences (prompts x n), more than the server's "
                f"queue of {self.max_queue} holds; send fewer prompts or a smaller n"
            )

    def submit(
        self,
        prompts: list[list[int]],
        params: Sequence[SamplingParams],
        prefix: str = "req",
        on_admitted: Callable[[], None] | None = None,
    ) -> RequestGroup:
        """``AsyncEngine.submit``'s contract; ``on_admitted`` runs once per prompt when it was sent."""
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if not self.alive:
            raise EngineUnavailable("the engine core is not running")
        seqs = sum(p.n for p in params)
        self.check_fits(seqs)
        if self._inflight + seqs > self.max_queue:
            raise QueueFull(self.max_queue)
        ids = [f"{prefix}-{uuid.uuid4().hex}" for _ in prompts]
        group = RequestGroup(self, ids)
        if not self._assemblies:
            self._heard = time.monotonic()  # an idle core's stall clock starts now
        self._inflight += seqs
        for request_id, prompt_ids, p in zip(ids, prompts, params):
            self._groups[request_id] = group
            self._assemblies[request_id] = _Assembly(request_id, prompt_ids, p, self.tokenizer)
            try:
                self._send(Add(request_id, ids[0], prompt_ids, p))
            finally:
                if on_admitted is not None:
                    on_admitted()
            if self.metrics is not None:
                self.metrics.observe_admitted(len(prompt_ids))
        return group

    def abort(self, request_id: str) -> None:
        if request_id in self._assemblies and self.alive:
            self._send(Abort(request_id))

    def _send(self, command: Add | Abort | Stop) -> None:
        with self._send_lock:
            self._commands.send(encoder.encode(command), copy=False)

    # ------------------------------------------------------------ event loop
    async def _read(self) -> None:
        assert self._reports is not None
        while True:
            raw = await self._reports.recv(copy=False)
            try:
                report = report_decoder.decode(raw.buffer)
            except msgspec.DecodeError:
                log.exception("an unreadable report from the engine core")
                continue
            if isinstance(report, StepDelta):
                self._on_step(report)

    def _on_step(self, delta: StepDelta) -> None:
        self._heard = time.monotonic()
        new_tokens = 0
        for d in delta.requests:
            assembly = self._assemblies.get(d.request_id)
            if assembly is None:
                continue
            new_tokens += assembly.apply(d)
            if d.finished:
                self._release(d.request_id)
                if self.metrics is not None:
                    self.metrics.observe_finished(assembly.output)
            group = self._groups.pop(d.request_id) if d.finished else self._groups[d.request_id]
            group.push(d.request_id, assembly.output)
        for f in delta.failed:
            self._on_failed(f)
        self._load = delta.load
        if self.metrics is not None and delta.step_seconds is not None:
            self.metrics.observe_step(delta.step_seconds, new_tokens)
        self._publish()

    def _on_failed(self, failed: RequestFailed) -> None:
        if failed.request_id not in self._assemblies:
            return
        self._release(failed.request_id)
        group = self._groups.pop(failed.request_id)
        if failed.kind != "Aborted":  # (an abort's handler is gone: nobody waits for it)
            group.push(failed.request_id, _rebuild_error(failed.kind, failed.message))

    def _on_exit(self) -> None:
        """The core's process ended (its pidfd became readable)."""
        assert self._loop is not None and self._exit_fd is not None
        self._loop.remove_reader(self._exit_fd)
        os.close(self._exit_fd)
        self._exited = True
        if self._stopping:
            error: BaseException = EngineUnavailable("the server is shutting down")
        else:
            code = self.process.wait()
            why = f"the engine core (pid {self.process.pid}) exited with code {code}"
            log.error("%s; failing its %d requests", why, len(self._assemblies))
            error = EngineFailure(f"{why} while serving this request")
        for request_id in list(self._assemblies):
            self._release(request_id)
            self._groups.pop(request_id).push(request_id, error)
        self._publish()

    def _detach(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if not self._exited:
            self._on_exit()

    def _release(self, request_id: str) -> None:
        assembly = self._assemblies.pop(request_id)
        self._inflight -= assembly.weight

    def _publish(self) -> None:
        self.snapshot = self._take_snapshot()
        if self.metrics is not None:
            self.metrics.set_gauges(self.snapshot)
            if self._load is not None:
                self.metrics.set_compiles(self._load.compiles)

    def _take_snapshot(self) -> EngineSnapshot:
        load = self._load
        if load is None or self._exited:
            return EngineSnapshot(0, 0, self._inflight, 0, 0, 0, 0.0, EngineStats(), time.time())
        free, total = load.kv_pages_free, load.kv_pages_total
        return EngineSnapshot(
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_inflight=self._inflight,
            kv_pages_free=free,
            kv_pages_total=total,
            kv_pages_cached=load.kv_pages_cached,
            kv_usage=1.0 - free / total if total else 0.0,
            stats=load.stats,
            taken_at=time.time(),
        )


def _rebuild_error(name: str, text: str) -> BaseException:
    """The core's refusal of a request, as the exception type the handlers map to a status."""
    from ngrammar.grammar import GrammarError

    if name == "InvalidRequestError":
        return InvalidRequestError(text)
    if name == "GrammarError":
        return GrammarError(text)
    if name == "EngineFailure":
        return EngineFailure(text)
    return EngineFailure(f"the engine failed: {name}: {text}")


def start_core(
    config: EngineConfig, max_queue: int, metrics: ServerMetrics | None
) -> tuple[ReplicaFront, CoreClient]:
    """Start the engine-core process and wait until its engine is built and warmed up; raises
    ``CoreStartError`` (the process stopped) otherwise. The front holds the tokenizer, the limits
    and a grammar compiler for the handlers."""
    from ngrammar.server.replica import ReplicaInfo
    from ngrammar.server.router import ReplicaFront
    from ngrammar.model.loader import resolve_checkpoint
    from ngrammar.server.core import COMMANDS_SOCKET, CONFIG_FILE, REPORTS_SOCKET

    resolve_checkpoint(config.model)  # converts a GGUF once, before the core reads it
    folder = tempfile.mkdtemp(prefix="ngrammar-core-")  # private (0700): the sockets and the config
    with open(os.path.join(folder, CONFIG_FILE), "wb") as f:
        pickle.dump(config, f)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    commands = ctx.socket(zmq.PUSH)
    commands.bind(f"ipc://{folder}/{COMMANDS_SOCKET}")
    reports = ctx.socket(zmq.PULL)
    reports.bind(f"ipc://{folder}/{REPORTS_SOCKET}")

    def cleanup() -> None:
        commands.close(linger=0)
        reports.close(linger=0)
        shutil.rmtree(folder, ignore_errors=True)

    # A fresh interpreter (not multiprocessing's spawn, which re-imports the caller's __main__).
    process = subprocess.Popen([sys.executable, "-m", "ngrammar.server.core", folder, str(os.getpid())])
    try:
        ready = _wait_ready(process, reports)
    except BaseException:
        process.kill()
        process.wait()
        cleanup()
        raise
    info = ReplicaInfo(ready.model_name, ready.max_model_len, ready.kv_capacity_tokens, ready.page_size)
    front = ReplicaFront(config, info, ready.kv_capacity_tokens)
    return front, CoreClient(process, commands, reports, ready, front.tokenizer, max_queue, metrics, cleanup)


def _wait_ready(process: subprocess.Popen[bytes], reports: zmq.Socket[bytes]) -> Ready:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not reports.poll(200):
        if process.poll() is not None:
            raise CoreStartError(
                f"the engine core exited with code {process.returncode} while starting; its error is printed above"
            )
        if time.monotonic() > deadline:
            raise CoreStartError(f"the engine core did not start in {_START_TIMEOUT_S} s")
    report: Any = report_decoder.decode(reports.recv())
    if isinstance(report, StartFailed):
        raise CoreStartError(f"the engine core could not start: {report.message}")
    assert isinstance(report, Ready)
    return report
