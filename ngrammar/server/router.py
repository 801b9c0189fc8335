"""Data-parallel serving: N replica processes (``--dp N``, each a whole engine, possibly ``--tp``)
behind the one HTTP server.

``ReplicaRouter`` has ``AsyncEngine``'s interface (``start`` / ``stop`` / ``alive`` / ``check_fits`` /
``submit`` / ``abort`` / ``snapshot`` / ``step_running_for`` / ``max_queue``, admission counted in
sequences, prompts x n), so the app's handlers do not know how many engines serve them. Each prompt
goes to the live replica with the fewest sequences in flight; a reader thread per
replica turns its messages into the handlers' updates and the server's metrics (counters fed as
outputs arrive, gauges from the replicas' loads summed). A replica whose process ends (killed,
crashed) is reported once, its requests fail with ``EngineFailure`` naming it, and the others keep
serving; with none left the server answers 503 and /health fails.

``ReplicaFront`` stands in for the engine where the handlers tokenize, validate and compile
grammars (in the server process, which holds no model weights).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch.multiprocessing as mp
from prometheus_client import Gauge

from ngrammar.config import EngineConfig
from ngrammar.engine.engine import EngineStats
from ngrammar.engine.requests import tokenize_prompt, validate_prompt
from ngrammar.model.loader import resolve_checkpoint
from ngrammar.model.parallel import MULTICAST_OFF_ENV
from ngrammar.model.tokenizer import Message, Tokenizer
from ngrammar.outputs import RequestOutput
from ngrammar.processes import spawn
from ngrammar.sampling_params import InvalidRequestError, SamplingParams
from ngrammar.server.engine_loop import (
    EngineFailure,
    EngineSnapshot,
    EngineUnavailable,
    QueueFull,
    RequestGroup,
)
from ngrammar.server.metrics import ServerMetrics
from ngrammar.server.replica import ReplicaInfo, ReplicaLoad, replica_main

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 1800.0


class ReplicaStartError(RuntimeError):
    """A replica could not build its engine; the server does not start."""


@dataclass(frozen=True)
class _Pages:
    page_size: int


class ReplicaFront:
    """The engine's request-side surface (``_Server`` reads it): tokenizer, limits, grammar compiler."""

    def __init__(self, config: EngineConfig, info: ReplicaInfo, kv_capacity_tokens: int) -> None:
        checkpoint = resolve_checkpoint(config.model)
        self.config = config
        self.model_config = checkpoint.config
        self.model_name = info.model_name
        self.tokenizer = Tokenizer(checkpoint.tokenizer_dir, checkpoint.config.eos_token_ids)
        self.max_model_len = info.max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens  # the smallest replica's pool
        self.blocks = _Pages(info.page_size)
        from ngrammar.grammar import GrammarBackend

        # Compiles (and so checks) each request's grammar within the server's budget before it is
        # routed; the replica compiles it again for its own matchers (its cache is its own).
        self.grammar_backend = GrammarBackend(
            self.tokenizer,
            checkpoint.config.vocab_size,
            config.grammar_cache_size,
            cache_max_bytes=config.grammar_cache_mb << 20,
        )

    def tokenize(self, prompt: str | list[int] | Sequence[Message]) -> list[int]:
        return tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, self.max_model_len, self.kv_capacity_tokens)


class Replica:
    """One replica process and what the server knows of it."""

    def __init__(self, index: int, process: BaseProcess, conn: Connection) -> None:
        self.index = index
        self.process = process
        self.conn = conn
        self.send_lock = threading.Lock()
        self.requests: dict[str, RequestGroup] = {}  # in flight there; guarded by the router's lock
        self.sequences = 0  # sequences (n of each request) in flight there; guarded likewise
        self.heard = time.monotonic()  # when it last reported, or was sent a request while idle
        self.load: ReplicaLoad | None = None
        self.routed = 0  # requests sent to it so far
        self.alive = True
        self.error: str | None = None  # why it stopped serving

    def send(self, command: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.conn.send(command)


class ReplicaRouter:
    def __init__(self, replicas: list[Replica], max_queue: int, metrics: ServerMetrics | None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be positive, got {max_queue}")
        self.replicas = replicas
        self.max_queue = max_queue
        self.metrics = metrics
        self._lock = threading.Lock()  # guards every replica's ``requests`` and ``_emitted``
        self._emitted: dict[str, int] = {}  # tokens counted into metrics so far, per request
        self._weights: dict[str, int] = {}  # sequences (n) of each request in flight
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._alive_gauge = (
            None
            if metrics is None
            else Gauge(
                "ngrammar_dp_replicas_alive", "Data-parallel replicas serving", registry=metrics.registry
            )
        )
        self.snapshot = self._take_snapshot()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._readers:
            return
        self._loop = asyncio.get_running_loop()
        for r in self.replicas:
            t = threading.Thread(
                target=self._read, args=(r,), name=f"ngrammar-replica-{r.index}", daemon=True
            )
            t.start()
            self._readers.append(t)
        self._publish()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        for r in self.replicas:
            if r.alive:
                try:
                    r.send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + timeout_s
        for r in self.replicas:
            r.process.join(max(deadline - time.monotonic(), 0.0))
            if r.process.is_alive():
                r.process.terminate()
        self._fail(
            [r for r in self.replicas], EngineUnavailable("the server is shutting down"), mark_dead=False
        )

    @property
    def alive(self) -> bool:
        return bool(self._readers) and not self._stopping.is_set() and any(r.alive for r in self.replicas)

    def step_running_for(self) -> float:
        """Seconds the slowest busy replica has gone without reporting a step (0 when none is busy):
        what ``AsyncEngine.step_running_for`` is for one engine (/health's stall check)."""
        now = time.monotonic()
        with self._lock:
            busy = [now - r.heard for r in self.replicas if r.alive and r.requests]
        return max(busy, default=0.0)

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
        """Queue each prompt on the live replica with the fewest sequences in flight
        (``AsyncEngine.submit``'s contract; ``on_admitted`` runs once per prompt when it was sent)."""
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if not self.alive:
            raise EngineUnavailable("no data-parallel replica is running")
        seqs = sum(p.n for p in params)
        self.check_fits(seqs)
        ids = [f"{prefix}-{uuid.uuid4().hex}" for _ in prompts]
        group = RequestGroup(self, ids)  # type: ignore[arg-type]
        routed = []
        with self._lock:
            if self._inflight() + seqs > self.max_queue:
                raise QueueFull(self.max_queue)
            for request_id, p in zip(ids, params):
                live = [r for r in self.replicas if r.alive]
                if not live:
                    raise EngineUnavailable("no data-parallel replica is running")
                replica = min(live, key=lambda r: (r.sequences, r.index))
                if not replica.requests:
                    replica.heard = time.monotonic()  # an idle replica's stall clock starts now
                replica.requests[request_id] = group
                replica.sequences += p.n
                self._weights[request_id] = p.n
                replica.routed += 1
                routed.append(replica)
        for replica, request_id, prompt_ids, p in zip(routed, ids, prompts, params):
            try:
                replica.send(("add", request_id, prompt_ids, p))
            except OSError:  # it died in between: its reader fails what it held, this one included
                pass
            finally:
                if on_admitted is not None:
                    on_admitted()
            if self.metrics is not None:
                self.metrics.observe_admitted(len(prompt_ids))
        return group

    def abort(self, request_id: str) -> None:
        with self._lock:
            replica = next((r for r in self.replicas if request_id in r.requests), None)
        if replica is not None and replica.alive:
            try:
                replica.send(("abort", request_id))
            except OSError:
                pass

    def _inflight(self) -> int:
        return sum(r.sequences for r in self.replicas)

    def _forget(self, replica: Replica, request_id: str) -> RequestGroup | None:
        """Drop a request that ended there (caller holds the lock); its group, if it was held."""
        group = replica.requests.pop(request_id, None)
        replica.sequences -= self._weights.pop(request_id, 0)
        self._emitted.pop(request_id, None)
        return group

    # --------------------------------------------------------- reader threads
    def _read(self, replica: Replica) -> None:
        while True:
            try:
                message = replica.conn.recv()
            except (EOFError, OSError):
                break
            self._on_message(replica, message)
        if self._stopping.is_set():
            return
        replica.process.join(5.0)
        why = f"data-parallel replica {replica.index} (pid {replica.process.pid}) exited with code {replica.process.exitcode}"
        log.error("%s; failing its %d requests, the other replicas keep serving", why, len(replica.requests))
        self._fail([replica], EngineFailure(f"{why} while serving this request"), mark_dead=True)

    def _on_message(self, replica: Replica, message: tuple[Any, ...]) -> None:
        kind = message[0]
        replica.heard = time.monotonic()
        if kind == "step":
            _, outputs, seconds, load = message
            replica.load = load
            new_tokens = 0
            for out in outputs:
                new_tokens += self._dispatch(replica, out)
            if self.metrics is not None and seconds is not None:
                self.metrics.observe_step(seconds, new_tokens)
            self._publish()
        elif kind == "error":
            _, request_id, name, text = message
            error = _rebuild_error(name, text)
            with self._lock:
                group = self._forget(replica, request_id)
            if group is not None:
                self._deliver(group, request_id, error)

    def _dispatch(self, replica: Replica, out: RequestOutput) -> int:
        """Deliver one output; returns the tokens it adds (for the metrics)."""
        total = sum(len(c.token_ids) for c in out.outputs)
        with self._lock:
            group = replica.requests.get(out.request_id)
            if group is None:
                return 0
            before = self._emitted.get(out.request_id, 0)
            self._emitted[out.request_id] = total
            if out.finished:
                self._forget(replica, out.request_id)
        if out.finished and self.metrics is not None:
            self.metrics.observe_finished(out)
        self._deliver(group, out.request_id, out)
        return max(total - before, 0)

    def _fail(self, replicas: list[Replica], error: BaseException, mark_dead: bool) -> None:
        for replica in replicas:
            with self._lock:
                if mark_dead:
                    replica.alive = False
                    replica.error = str(error)
                held = dict(replica.requests)
                for request_id in held:
                    self._forget(replica, request_id)
            for request_id, group in held.items():
                self._deliver(group, request_id, error)
        self._publish()

    def _deliver(self, group: RequestGroup, request_id: str, item: RequestOutput | BaseException) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(group.push, request_id, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # --------------------------------------------------------------- snapshot
    def _publish(self) -> None:
        self.snapshot = self._take_snapshot()
        if self.metrics is not None:
            self.metrics.set_gauges(self.snapshot)
        if self._alive_gauge is not None:
            self._alive_gauge.set(sum(r.alive for r in self.replicas))

    def _take_snapshot(self) -> EngineSnapshot:
        """The live replicas' loads summed (the server's gauges and /server_info)."""
        loads = [r.load for r in self.replicas if r.alive and r.load is not None]
        free = sum(x.kv_pages_free for x in loads)
        total = sum(x.kv_pages_total for x in loads)
        with self._lock:
            inflight = self._inflight()
        return EngineSnapshot(
            num_running=sum(x.num_running for x in loads),
            num_waiting=sum(x.num_waiting for x in loads),
            num_inflight=inflight,
            kv_pages_free=free,
            kv_pages_total=total,
            kv_pages_cached=sum(x.kv_pages_cached for x in loads),
            kv_usage=1.0 - free / total if total else 0.0,
            stats=_sum_stats([x.stats for x in loads]),
            taken_at=time.time(),
        )


def _sum_stats(stats: list[EngineStats]) -> EngineStats:
    out = EngineStats()
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if values and f.name != "gap_start":  # (a replica's own clock reading: no sum)
            setattr(out, f.name, max(values) if f.name == "last_step_seconds" else sum(values))
    return out


def _rebuild_error(name: str, text: str) -> BaseException:
    """A replica's refusal of a request, as the exception type the handlers map to a status."""
    from ngrammar.grammar import GrammarError

    if name == "InvalidRequestError":
        return InvalidRequestError(text)
    if name == "GrammarError":
        return GrammarError(text)
    return EngineFailure(f"the engine failed: {name}: {text}")


def start_replicas(
    config: EngineConfig, max_queue: int, metrics: ServerMetrics | None
) -> tuple[ReplicaFront, ReplicaRouter]:
    """Spawn ``data_parallel_size`` replica processes (each ``tensor_parallel_size`` ranks) and wait
    until every one has built its engine; raises ``ReplicaStartError`` (all stopped) otherwise.
    Tensor-parallel sizes are checked here first, before any process starts."""
    import os

    from ngrammar.model.parallel import check_tensor_parallel
    from ngrammar.runner.model_runner import resolve_device

    if config.nnodes > 1:
        raise ValueError("the server runs one node's replicas; start other nodes' ranks with --node-rank")
    checkpoint = resolve_checkpoint(config.model)  # converts a GGUF once, before the replicas read it
    device = resolve_device(config.device)
    check_tensor_parallel(checkpoint.config, config.tensor_parallel_size, device)
    if device.type == "cuda":
        import torch

        need = config.data_parallel_size * config.tensor_parallel_size
        if torch.cuda.device_count() < need:
            raise ValueError(
                f"--dp {config.data_parallel_size} x --tp {config.tensor_parallel_size} needs {need} CUDA "
                f"devices, but {torch.cuda.device_count()} are visible"
            )
    os.environ.update(MULTICAST_OFF_ENV)
    ctx = mp.get_context("spawn")
    replicas = []
    for index in range(config.data_parallel_size):
        parent_conn, child_conn = ctx.Pipe()
        p = spawn(ctx, replica_main, (index, config, child_conn), f"ngrammar-dp-{index}", daemon=False)
        child_conn.close()
        replicas.append(Replica(index, p, parent_conn))
    try:
        infos = [_wait_ready(r) for r in replicas]
    except BaseException:
        for r in replicas:
            r.process.terminate()
        raise
    front = ReplicaFront(config, infos[0], min(i.kv_capacity_tokens for i in infos))
    return front, ReplicaRouter(replicas, max_queue, metrics)


def _wait_ready(replica: Replica) -> ReplicaInfo:
    if not replica.conn.poll(_START_TIMEOUT_S):
        raise ReplicaStartError(
            f"data-parallel replica {replica.index} did not start in {_START_TIMEOUT_S} s"
        )
    try:
        message = replica.conn.recv()
    except EOFError:
        replica.process.join(5.0)
        raise ReplicaStartError(
            f"data-parallel replica {replica.index} exited with code {replica.process.exitcode} while "
            "starting; its error is printed above"
        ) from None
    if message[0] == "failed":
        raise ReplicaStartError(f"data-parallel replica {replica.index} could not start: {message[1]}")
    info = message[1]
    assert isinstance(info, ReplicaInfo)
    return info
