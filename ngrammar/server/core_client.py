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
import dataclasses
import itertools
import logging
import os
import pickle
import select
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
from ngrammar.server.admission import InflightCount, check_fits
from ngrammar.server.core import CONFIG_FILE, REPORTS_SOCKET, command_socket
from ngrammar.server.core_messages import (
    Abort,
    Add,
    CorpusCall,
    CorpusReply,
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
from ngrammar.server.front import EngineFront
from ngrammar.server.metrics import engine_gauge

if TYPE_CHECKING:
    from ngrammar.config import EngineConfig
    from ngrammar.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 1800.0
_STOP_TIMEOUT_S = 30.0
_CONTEXT: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()


class CoreStartError(RuntimeError):
    """The engine core could not build its engine; the server does not start."""


class _SeqText:
    """One completion's text, rebuilt from its token ids as the engine's ``Sequence`` builds it."""

    def __init__(self, tokenizer: Tokenizer, context: list[int], params: SamplingParams) -> None:
        self.ids = list(context)  # the prompt's last tokens, then the output
        self.detok = IncrementalDetokenizer.after_prompt(tokenizer, len(context))
        self.stop = params.stop
        self.stop_ids = frozenset(params.stop_token_ids)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def add(self, tokens: list[int], finish_reason: str | None) -> str:
        """The text safe to show after ``tokens``: a possible stop string's start is held back
        while running, a stop string that finished the sequence is cut with what follows, and a
        stop token id's text is left out (``Sequence._check_stop``)."""
        if tokens:
            self.ids.extend(tokens)
            stop_id = finish_reason == "stop" and self.ids[-1] in self.stop_ids
            self.detok.step(self.ids[:-1] if stop_id else self.ids)
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
        self.texts = [_SeqText(tokenizer, context, params) for _ in range(params.n)]
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


class CoreProcess:
    """One engine-core process (the engine, or one ``--dp`` replica) and what this API server
    process knows of it. ``popen`` is set where this process started it (one API server process);
    with ``--api-server-count`` the supervisor did, and this process knows only its pid."""

    def __init__(
        self,
        index: int,
        name: str,
        pid: int,
        commands: zmq.Socket[bytes],
        popen: subprocess.Popen[bytes] | None,
    ) -> None:
        self.index = index
        self.name = name  # in errors: "the engine core" or "data-parallel replica 1"
        self.pid = pid
        self.popen = popen
        self.commands = commands
        self.send_lock = threading.Lock()  # ``stop`` sends from another thread
        self.requests: set[str] = set()  # in flight there
        self.sequences = 0  # sequences (n of each request) in flight there
        self.load: Load | None = None
        self.heard = time.monotonic()  # when it last reported, or was sent work while idle
        self.routed = 0  # requests sent to it so far
        self.alive = True
        self.exit_fd: int | None = os.pidfd_open(pid)  # readable once the process ended
        self.calls: dict[int, asyncio.Future[CorpusReply]] = {}  # corpus calls awaiting its reply

    def send(self, command: Add | Abort | CorpusCall | Stop | bytes, flags: int = 0) -> None:
        """Send ``command`` (or its encoding)."""
        raw = command if isinstance(command, bytes) else encoder.encode(command)
        with self.send_lock:
            self.commands.send(raw, flags, copy=False)

    def stop(self, command: Stop) -> None:
        """Send ``Stop`` without waiting for a peer (a core that is gone has none)."""
        self.send(command, zmq.NOBLOCK)

    def exited(self) -> bool:
        if not self.alive:
            return True
        return self.exit_fd is not None and bool(select.select([self.exit_fd], [], [], 0)[0])

    def exit_text(self) -> str:
        code = None if self.popen is None else self.popen.wait()
        return f"{self.name} (pid {self.pid}) exited" + ("" if code is None else f" with code {code}")


class CoreClient:
    """The engine-core processes seen from the event loop (``AsyncEngine``'s interface). Each prompt
    goes to the live core with the fewest sequences in flight (``--dp``); a core that dies fails
    only its own requests, and with none left the server answers 503."""

    def __init__(
        self,
        replicas: list[CoreProcess],
        reports: zmq.Socket[bytes],
        tokenizer: Tokenizer,
        max_queue: int,
        metrics: ServerMetrics | None,
        folder: str,
        client: int = 0,
        admitted: InflightCount | None = None,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be positive, got {max_queue}")
        self.replicas = replicas
        self.folder = folder  # this process's sockets (removed at the end)
        self.client = client  # this API server process's index (``--api-server-count``)
        # Sequences admitted and unfinished: this process's count, or every API server process's
        self.admitted = admitted if admitted is not None else InflightCount()
        self.tokenizer = tokenizer
        self.max_queue = max_queue  # sequences; read at each submit, so it may be changed while running
        self.metrics = metrics
        self._sync_reports = reports  # every core pushes its reports here
        self._groups: dict[str, RequestGroup] = {}
        self._assemblies: dict[str, _Assembly] = {}
        self._homes: dict[str, CoreProcess] = {}  # the core serving each request
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self._call_ids = itertools.count()
        self._alive_gauge = (
            None
            if metrics is None
            else engine_gauge("ngrammar_dp_replicas_alive", "Engine-core processes serving", metrics.registry)
        )
        self._snapshot = self._take_snapshot()

    @property
    def snapshot(self) -> EngineSnapshot:
        """The loads last reported, with the admitted count read now: with ``--api-server-count``
        another process's requests change it (finishing) without any report to this one."""
        snap, count = self._snapshot, self.admitted.count
        return snap if snap.num_inflight == count else dataclasses.replace(snap, num_inflight=count)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start reading the cores' reports; call from the event loop that serves the handlers."""
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read(zmq.asyncio.Socket.from_socket(self._sync_reports)))
        for core in self.replicas:
            if core.exit_fd is not None:
                self._loop.add_reader(core.exit_fd, self._on_exit, core)
        self._publish()

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """Stop the cores this process started and wait for them (killed if they do not stop; the
        supervisor stops those it started); thread-safe."""
        self._stopping = True
        owned = [c for c in self.replicas if c.popen is not None]
        stop_cores([c.popen for c in owned if c.popen], [c.stop for c in owned if not c.exited()], timeout_s)
        if self._loop is not None and not self._loop.is_closed():
            try:  # the sockets close on the loop, where the reader uses them
                self._loop.call_soon_threadsafe(self._detach)
                return
            except RuntimeError:  # the loop closed meanwhile
                pass
        self._close()

    @property
    def alive(self) -> bool:
        return self._reader is not None and not self._stopping and any(c.alive for c in self.replicas)

    def step_running_for(self) -> float:
        """Seconds the slowest busy core has gone without reporting (0 when none holds a request):
        what ``AsyncEngine.step_running_for`` is for one engine (/health's stall check)."""
        now = time.monotonic()
        return max((now - c.heard for c in self.replicas if c.alive and c.requests), default=0.0)

    # ------------------------------------------------------ handler-side API
    def check_fits(self, num_sequences: int) -> None:
        """Raise InvalidRequestError for a request of ``num_sequences`` that no wait would admit."""
        check_fits(num_sequences, self.max_queue)

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
            raise EngineUnavailable("no engine core is running")
        seqs = sum(p.n for p in params)
        self.check_fits(seqs)
        ids = [f"{prefix}-{uuid.uuid4().hex}" for _ in prompts]
        # Encoded before anything is counted: a value msgpack cannot carry (an integer past 64 bits
        # in a JSON schema) is the request's error, and leaves no admission or request behind.
        try:
            adds = [
                encoder.encode(Add(r, ids[0], t, p, self.client)) for r, t, p in zip(ids, prompts, params)
            ]
        except (OverflowError, TypeError, msgspec.EncodeError) as e:
            raise InvalidRequestError(f"the request holds a value the engine cannot take: {e}") from None
        if not self.admitted.take(seqs, self.max_queue):
            raise QueueFull(self.max_queue)
        group = RequestGroup(self, ids)
        for request_id, prompt_ids, p, add in zip(ids, prompts, params, adds):
            core = min((c for c in self.replicas if c.alive), key=lambda c: (c.sequences, c.index))
            if not core.requests:
                core.heard = time.monotonic()  # an idle core's stall clock starts now
            core.requests.add(request_id)
            core.sequences += p.n
            core.routed += 1
            self._homes[request_id] = core
            self._groups[request_id] = group
            self._assemblies[request_id] = _Assembly(request_id, prompt_ids, p, self.tokenizer)
            try:
                core.send(add)
            finally:
                if on_admitted is not None:
                    on_admitted()
            if self.metrics is not None:
                self.metrics.observe_admitted(len(prompt_ids))
        return group

    def abort(self, request_id: str) -> None:
        core = self._homes.get(request_id)
        if core is not None and core.alive and not self._stopping:
            core.send(Abort(request_id))

    # ------------------------------------------------------------ event loop
    async def _read(self, reports: zmq.asyncio.Socket) -> None:
        while True:
            raw = await reports.recv(copy=False)
            try:
                report = report_decoder.decode(raw.buffer)
            except msgspec.DecodeError:
                log.exception("an unreadable report from an engine core")
                continue
            if isinstance(report, StepDelta):
                self._on_step(report)
            elif isinstance(report, CorpusReply):
                call = self.replicas[report.core].calls.pop(report.call, None)
                if call is not None and not call.done():
                    call.set_result(report)

    async def corpus_call(self, op: str, **fields: Any) -> Any:
        """``op`` on every live core's draft corpora (each drafts on its own); core 0's result.
        Raises ``DraftCorpusError`` if a core refused it, ``EngineUnavailable`` if none runs."""
        from ngrammar.speculative.external import DraftCorpusError

        live = [c for c in self.replicas if c.alive]
        if not live or not self.alive:
            raise EngineUnavailable("no engine core is running")
        assert self._loop is not None
        call = next(self._call_ids)
        waits = []
        for core in live:
            future: asyncio.Future[CorpusReply] = self._loop.create_future()
            core.calls[call] = future
            core.send(CorpusCall(call, op, **fields, client=self.client))
            waits.append(future)
        replies = await asyncio.gather(*waits)
        refused = next((r.error for r in replies if r.error is not None), None)
        if refused is not None:
            raise DraftCorpusError(refused)
        return replies[0].result

    def _on_step(self, delta: StepDelta) -> None:
        core = self.replicas[delta.core]
        core.heard = time.monotonic()
        new_tokens = 0
        for d in delta.requests:
            assembly = self._assemblies.get(d.request_id)
            if assembly is None:
                continue
            new_tokens += assembly.apply(d)
            group = self._groups[d.request_id]
            if d.finished:
                self._release(d.request_id)
                if self.metrics is not None:
                    self.metrics.observe_finished(assembly.output)
            group.push(d.request_id, assembly.output)
        for f in delta.failed:
            self._on_failed(f)
        core.load = delta.load
        if self.metrics is not None and (delta.step_seconds is not None or new_tokens):
            # (with --api-server-count, one process times each step; each counts its own tokens)
            self.metrics.observe_step(delta.step_seconds, new_tokens)
        self._publish()

    def _on_failed(self, failed: RequestFailed) -> None:
        if failed.request_id not in self._assemblies:
            return
        group = self._groups[failed.request_id]
        self._release(failed.request_id)
        if failed.kind != "Aborted":  # (an abort's handler is gone: nobody waits for it)
            group.push(failed.request_id, _rebuild_error(failed.kind, failed.message))

    def _on_exit(self, core: CoreProcess) -> None:
        """A core's process ended (its pidfd became readable)."""
        assert self._loop is not None and core.exit_fd is not None
        self._loop.remove_reader(core.exit_fd)
        os.close(core.exit_fd)
        core.exit_fd = None
        core.alive = False
        if self._stopping:
            error: BaseException = EngineUnavailable("the server is shutting down")
        else:
            why = core.exit_text()
            log.error("%s; failing its %d requests", why, len(core.requests))
            error = EngineFailure(f"{why} while serving this request")
        for request_id in list(core.requests):
            group = self._groups[request_id]
            self._release(request_id)
            group.push(request_id, error)
        for call in core.calls.values():
            if not call.done():
                call.set_exception(error)
        core.calls.clear()
        self._publish()

    def _detach(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for core in self.replicas:
            if core.exit_fd is not None:
                self._on_exit(core)
        self._close()

    def _close(self) -> None:
        for core in self.replicas:
            core.commands.close(linger=0)
            if core.exit_fd is not None:
                os.close(core.exit_fd)
                core.exit_fd = None
        self._sync_reports.close(linger=0)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _release(self, request_id: str) -> None:
        assembly = self._assemblies.pop(request_id)
        del self._groups[request_id]
        core = self._homes.pop(request_id)
        core.requests.discard(request_id)
        core.sequences -= assembly.weight
        self.admitted.give(assembly.weight)

    def _publish(self) -> None:
        self._snapshot = self._take_snapshot()
        if self.metrics is None:
            return
        self.metrics.set_gauges(self.snapshot, self.admitted.own, engine_counters=self.client == 0)
        self.metrics.set_compiles(sum(c.load.compiles for c in self.replicas if c.load is not None))
        if self._alive_gauge is not None:
            self._alive_gauge.set(sum(c.alive for c in self.replicas))

    def _take_snapshot(self) -> EngineSnapshot:
        """The live cores' loads summed (the server's gauges and /server_info)."""
        loads = [c.load for c in self.replicas if c.alive and c.load is not None]
        free = sum(x.kv_pages_free for x in loads)
        total = sum(x.kv_pages_total for x in loads)
        return EngineSnapshot(
            num_running=sum(x.num_running for x in loads),
            num_waiting=sum(x.num_waiting for x in loads),
            num_inflight=self.admitted.count,
            kv_pages_free=free,
            kv_pages_total=total,
            kv_pages_cached=sum(x.kv_pages_cached for x in loads),
            kv_usage=1.0 - free / total if total else 0.0,
            stats=_sum_stats([x.stats for x in loads]),
            taken_at=time.time(),
        )


def _sum_stats(stats: list[EngineStats]) -> EngineStats:
    if len(stats) == 1:
        return stats[0]
    out = EngineStats()
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if values and f.name != "gap_start":  # (a core's own clock reading: no sum)
            setattr(out, f.name, max(values) if f.name == "last_step_seconds" else sum(values))
    return out


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


def check_cores(config: EngineConfig) -> None:
    """Sizes checked (and a GGUF converted once) before any engine-core process starts."""
    from ngrammar.engine.builder import engine_checkpoint
    from ngrammar.model.parallel import MULTICAST_OFF_ENV, check_tensor_parallel
    from ngrammar.runner.model_runner import resolve_device

    if config.nnodes > 1:
        raise ValueError("the server runs one node's replicas; start other nodes' ranks with --node-rank")
    checkpoint = engine_checkpoint(config)  # (a GGUF converted once, before the cores read it)
    device = resolve_device(config.device)
    check_tensor_parallel(checkpoint.config, config.tensor_parallel_size, device)
    dp = config.data_parallel_size
    if device.type == "cuda":
        import torch

        need = dp * config.tensor_parallel_size
        if torch.cuda.device_count() < need:
            raise ValueError(
                f"--dp {dp} x --tp {config.tensor_parallel_size} needs {need} CUDA devices, but "
                f"{torch.cuda.device_count()} are visible"
            )
    os.environ.update(MULTICAST_OFF_ENV)  # inherited by every process started after this


def launch_cores(
    config: EngineConfig, clients: Sequence[str], control: str | None = None
) -> list[subprocess.Popen[bytes]]:
    """Start ``data_parallel_size`` engine-core processes (each ``tensor_parallel_size`` ranks),
    reporting to the API server processes whose folders ``clients`` are; ``control`` is the
    supervisor's folder, from which it sends ``Stop``."""
    from ngrammar.server.core import CoreSpec, replica_config

    dp = config.data_parallel_size
    started: list[subprocess.Popen[bytes]] = []
    try:
        for index in range(dp):
            folder = tempfile.mkdtemp(prefix=f"ngrammar-core-{index}-")  # private (0700)
            with open(os.path.join(folder, CONFIG_FILE), "wb") as f:
                pickle.dump(CoreSpec(replica_config(config, index), index, dp, tuple(clients), control), f)
            # A fresh interpreter (not multiprocessing's spawn, which re-imports the caller's __main__);
            # it deletes its folder once it read its spec.
            started.append(
                subprocess.Popen([sys.executable, "-m", "ngrammar.server.core", folder, str(os.getpid())])
            )
    except BaseException:
        stop_cores(started, [], 0)
        raise
    return started


def stop_cores(
    popens: Sequence[subprocess.Popen[bytes]], stops: Sequence[Callable[[Stop], None]], timeout_s: float
) -> None:
    """Send ``Stop`` through each of ``stops``, then wait for the processes (killed past the timeout)."""
    for send in stops:
        try:
            send(Stop())
        except zmq.ZMQError:  # (zmq.Again: no peer, the core is gone)
            pass
    deadline = time.monotonic() + timeout_s
    for popen in popens:
        try:
            popen.wait(max(deadline - time.monotonic(), 0.1) if timeout_s > 0 else 0.01)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def bind_client(folder: str, cores: int) -> tuple[zmq.Socket[bytes], list[zmq.Socket[bytes]]]:
    """An API server process's sockets in ``folder``: the report socket every core pushes to, and
    one command socket per core."""
    reports: zmq.Socket[bytes] = _CONTEXT.socket(zmq.PULL)
    reports.bind(f"ipc://{folder}/{REPORTS_SOCKET}")
    commands = []
    for index in range(cores):
        push: zmq.Socket[bytes] = _CONTEXT.socket(zmq.PUSH)
        push.bind(f"ipc://{folder}/{command_socket(index)}")
        commands.append(push)
    return reports, commands


def connect_cores(
    config: EngineConfig,
    folder: str,
    pids: Sequence[int],
    max_queue: int,
    metrics: ServerMetrics | None,
    client: int = 0,
    popens: Sequence[subprocess.Popen[bytes]] | None = None,
    admitted: InflightCount | None = None,
) -> tuple[EngineFront, CoreClient]:
    """This API server process's view of the engine cores ``pids`` (in core order): its sockets
    bound in ``folder``, every core's ``Ready`` awaited (``CoreStartError`` otherwise), then the
    front (tokenizer, limits, grammar compiler) and the client the handlers use."""
    reports, commands = bind_client(folder, len(pids))
    dp = len(pids)
    cores = [
        CoreProcess(
            i,
            "the engine core" if dp == 1 else f"data-parallel replica {i}",
            pid,
            commands[i],
            None if popens is None else popens[i],
        )
        for i, pid in enumerate(pids)
    ]
    try:
        readies = _wait_ready(cores, reports)
    except BaseException:
        for core in cores:
            core.commands.close(linger=0)
            if core.exit_fd is not None:
                os.close(core.exit_fd)
        reports.close(linger=0)
        raise
    for core, ready in zip(cores, readies):
        core.load = ready.load
    first = readies[0]
    kv_tokens = min(r.kv_capacity_tokens for r in readies)  # the smallest pool bounds every request
    front = EngineFront(config, first.model_name, first.max_model_len, kv_tokens, first.page_size)
    return front, CoreClient(cores, reports, front.tokenizer, max_queue, metrics, folder, client, admitted)


def start_cores(
    config: EngineConfig, max_queue: int, metrics: ServerMetrics | None
) -> tuple[EngineFront, CoreClient]:
    """The engine cores of one API server process (this one): started, and awaited until each has
    built and warmed up its engine; raises ``CoreStartError`` (all stopped) otherwise."""
    check_cores(config)
    folder = tempfile.mkdtemp(prefix="ngrammar-api-")  # private (0700)
    popens = launch_cores(config, [folder])
    try:
        return connect_cores(config, folder, [p.pid for p in popens], max_queue, metrics, popens=popens)
    except BaseException:
        stop_cores(popens, [], 0)
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _wait_ready(cores: list[CoreProcess], reports: zmq.Socket[bytes]) -> list[Ready]:
    """Every core's ``Ready``, in core order (they report in any order)."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    readies: dict[int, Ready] = {}
    while len(readies) < len(cores):
        if not reports.poll(200):
            for core in cores:
                if core.exited():
                    raise CoreStartError(f"{core.exit_text()} while starting; its error is printed above")
            if time.monotonic() > deadline:
                raise CoreStartError(f"the engine cores did not start in {_START_TIMEOUT_S} s")
            continue
        report: Any = report_decoder.decode(reports.recv())
        if isinstance(report, StartFailed):
            raise CoreStartError(f"{cores[report.core].name} could not start: {report.message}")
        assert isinstance(report, Ready)
        readies[report.core] = report
    return [readies[i] for i in range(len(cores))]
