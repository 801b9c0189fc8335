"""AsyncEngine: the (thread-unsafe) LLMEngine driven by one background thread, fed from asyncio.

Threading contract:
- Every call into the engine's mutable state (add_request, abort, step) happens on the loop
  thread. Handlers only enqueue commands on a thread-safe queue, which the loop drains between
  steps, so requests from all connections join the same continuous batch.
- Outputs travel back through ``loop.call_soon_threadsafe`` into the ``asyncio.Queue`` of the
  handler's ``RequestGroup``; only the event loop touches that queue.
- Readers on other threads see engine state only through ``snapshot``, an immutable value the loop
  thread replaces after every iteration.

Admission is bounded by sequences (prompts x n): ``max_queue`` caps accepted-but-unfinished ones;
``submit`` raises ``QueueFull`` beyond it, so overload turns into fast 503s rather than unbounded
memory, and a request larger than the whole cap is refused as invalid (it could never fit).

Fairness: submitted requests wait in per-request-group queues on the loop thread and are handed to
the engine round-robin, one engine request per group in turn, only while the engine's own waiting
queue is short; so a fan-out request (many prompts, large n) cannot put all its sequences ahead of
a request that arrives after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ngrammar.engine.engine import EngineStats, LLMEngine
from ngrammar.outputs import RequestOutput
from ngrammar.sampling_params import SamplingParams
from ngrammar.server.admission import RoundRobin, check_fits

if TYPE_CHECKING:
    from ngrammar.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # how long an idle loop blocks on the command queue before refreshing its snapshot
_FAILURE_BACKOFF_S = 0.05  # pause after a failed step, so a persistently broken engine cannot spin


class QueueFull(Exception):
    """More requests are in flight than the server admits; the client should retry later."""

    def __init__(self, limit: int, retry_after_s: int = 1) -> None:
        super().__init__(f"the server is at capacity ({limit} sequences in flight); retry later")
        self.retry_after_s = retry_after_s


class EngineUnavailable(RuntimeError):
    """The engine loop is not running (not started yet, stopped, or failed)."""


class EngineFailure(RuntimeError):
    """The engine raised while running this request; the request was aborted."""


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences queued in the scheduler plus engine requests not handed to it yet
    num_inflight: int  # sequences (prompts x n) admitted by ``submit`` and not finished
    kv_pages_free: int  # (cached prefix pages nobody reads count as free: evicted on demand)
    kv_pages_total: int
    kv_pages_cached: int
    kv_usage: float
    stats: EngineStats
    taken_at: float


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    group: RequestGroup
    on_admitted: Callable[[], None] | None = None  # called on the loop thread once it left the queue


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Wake:
    """Sent by ``stop`` so a blocked loop notices the stop flag at once."""


_Command = _Add | _Abort | _Wake
_Item = RequestOutput | BaseException


class _Aborts(Protocol):
    def abort(self, request_id: str) -> None: ...


class ClientDisconnected(Exception):
    """The HTTP client went away while its request was running."""


class RequestGroup:
    """The engine requests of one HTTP request (one per prompt) and their latest outputs.

    Lives on the event loop. Engine outputs are cumulative (full text so far), so updates that
    queue up while a client is slow can be folded into the newest one without losing anything.
    """

    def __init__(self, owner: _Aborts, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.latest: dict[str, RequestOutput] = {}
        self._owner = owner
        self._queue: asyncio.Queue[tuple[str, _Item]] = asyncio.Queue()
        self._open = set(request_ids)

    @property
    def done(self) -> bool:
        return not self._open

    def push(self, request_id: str, item: _Item) -> None:
        """Called on the event loop (via call_soon_threadsafe) by the engine thread."""
        self._queue.put_nowait((request_id, item))

    @property
    def num_tokens(self) -> int:
        """Output tokens of every request of the group so far."""
        return sum(len(c.token_ids) for out in self.latest.values() for c in out.outputs)

    def disconnected(self) -> None:
        """The client went away: the waiting handler raises ``ClientDisconnected``."""
        self._queue.put_nowait(("", ClientDisconnected()))

    async def wait_update(self, timeout_s: float | None = None) -> bool:
        """Wait (up to ``timeout_s``, or until something arrives) for progress and fold in every
        queued update.

        Returns whether anything arrived; re-raises an error the engine reported for a request.
        """
        if timeout_s is None:
            first = await self._queue.get()
        else:
            try:
                first = await asyncio.wait_for(self._queue.get(), timeout_s)
            except TimeoutError:
                return False
        self._apply(first)
        while not self._queue.empty():
            self._apply(self._queue.get_nowait())
        return True

    def _apply(self, entry: tuple[str, _Item]) -> None:
        request_id, item = entry
        if isinstance(item, BaseException):
            self._open.discard(request_id)
            raise item
        self.latest[request_id] = item
        if item.finished:
            self._open.discard(request_id)

    def abort(self) -> None:
        """Abort what has not finished (idempotent; the engine frees their KV pages)."""
        for request_id in self._open:
            self._owner.abort(request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int = 256, metrics: ServerMetrics | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be positive, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue  # sequences; read at each submit, so it may be changed while running
        self.metrics = metrics
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _inflight and _weights, shared by handlers and the loop
        self._inflight = 0  # sequences
        self._weights: dict[str, int] = {}  # sequences (n) of each unfinished engine request
        # Submitted, not yet handed to the engine: one FIFO per group, served round-robin (loop thread).
        self._pending: RoundRobin[_Add] = RoundRobin()
        # Engine requests handed over while the scheduler waits on fewer sequences than this.
        self.feed_below = max(engine.config.max_running_requests, 1)
        self._step_started: float | None = None  # monotonic start of the step running now
        self._groups: dict[str, RequestGroup] = {}  # loop thread only
        self._emitted: dict[str, int] = {}  # tokens counted into metrics so far; loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.snapshot = self._take_snapshot()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the loop thread; call from the event loop that will consume the outputs."""
        if self.alive:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="ngrammar-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        self._commands.put(_Wake())
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def step_running_for(self) -> float:
        """Seconds the engine step now running has taken so far (0 between steps): a step that does
        not finish means an engine that cannot make progress."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

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
        """Queue one engine request per (already validated) prompt, with its params; raises
        QueueFull (try later), InvalidRequestError (a batch that can never fit) or EngineUnavailable.

        ``on_admitted`` is called on the loop thread once per prompt, when its engine request was
        added (or failed, or was aborted before it was)."""
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if not self.alive:
            raise EngineUnavailable("the engine loop is not running")
        seqs = sum(p.n for p in params)
        self.check_fits(seqs)
        ids = [f"{prefix}-{uuid.uuid4().hex}" for _ in prompts]
        with self._lock:
            if self._inflight + seqs > self.max_queue:
                raise QueueFull(self.max_queue)
            self._inflight += seqs
            for request_id, p in zip(ids, params):
                self._weights[request_id] = p.n
        group = RequestGroup(self, ids)
        for request_id, prompt_ids, p in zip(ids, prompts, params):
            self._commands.put(_Add(request_id, prompt_ids, p, group, on_admitted))
        return group

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ----------------------------------------------------------- loop thread
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain_commands(block=not self.engine.has_unfinished() and not self._pending)
            self._feed()
            if self.engine.has_unfinished():
                self._step()
            self._publish()
        self._drop_pending(EngineUnavailable("the server is shutting down"))
        self._fail_all(EngineUnavailable("the server is shutting down"))
        self._publish()

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: _Command) -> None:
        if isinstance(command, _Add):
            self._pending.push(command.group, command.request_id, command)
        elif isinstance(command, _Abort):
            add = self._pending.remove(command.request_id)
            if add is None:
                self.engine.abort(command.request_id)
                return
            self._release(add.request_id)  # never reached the engine: nobody waits for an output
            self._admitted(add)

    def _feed(self) -> None:
        """Hand queued engine requests to the engine, one group at a time in turn, while the
        scheduler's waiting queue is short (see the module docstring)."""
        while self._pending and len(self.engine.scheduler.waiting) < self.feed_below:
            self._admit(self._pending.pop())

    def _drop_pending(self, error: BaseException) -> None:
        for add in self._pending.items():
            self._pending.remove(add.request_id)
            self._release(add.request_id)
            self._admitted(add)
            self._deliver(add.group, add.request_id, error)

    @staticmethod
    def _admitted(add: _Add) -> None:
        if add.on_admitted is not None:
            try:
                add.on_admitted()
            except Exception:
                log.exception("on_admitted of %s failed", add.request_id)

    def _admit(self, add: _Add) -> None:
        try:
            self.engine.add_request(add.prompt_ids, add.params, add.request_id)
        except Exception as e:  # bad input the handler's checks missed: fail this request only
            self._release(add.request_id)
            self._deliver(add.group, add.request_id, e)
            return
        finally:
            self._admitted(add)
        self._groups[add.request_id] = add.group
        if self.metrics is not None:
            self.metrics.observe_admitted(len(add.prompt_ids))

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:  # an engine bug must not take the server down: fail what was running
            log.exception("engine step failed; aborting %d requests", len(self._groups))
            self._fail_all(EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))
            time.sleep(_FAILURE_BACKOFF_S)
            return
        finally:
            self._step_started = None
        # Only requests still served count: after a failed step the engine reports the aborts of
        # requests already failed and released (counting them re-created their entry, for good).
        new_tokens = sum(self._count_new_tokens(out) for out in outputs if out.request_id in self._groups)
        if self.metrics is not None:
            self.metrics.observe_step(self.engine.stats.last_step_seconds, new_tokens)
        for out in outputs:
            self._dispatch(out)

    def _count_new_tokens(self, out: RequestOutput) -> int:
        total = sum(len(c.token_ids) for c in out.outputs)
        before = self._emitted.get(out.request_id, 0)
        self._emitted[out.request_id] = total
        return max(total - before, 0)

    def _dispatch(self, out: RequestOutput) -> None:
        group = self._groups.get(out.request_id)
        if group is None:  # already failed and released; the engine is reporting the abort
            return
        if out.finished:
            self._release(out.request_id)
            if self.metrics is not None:
                self.metrics.observe_finished(out)
        self._deliver(group, out.request_id, out)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, group in list(self._groups.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort of %s failed", request_id)
            self._release(request_id)
            self._deliver(group, request_id, error)

    def _release(self, request_id: str) -> None:
        self._groups.pop(request_id, None)
        self._emitted.pop(request_id, None)
        with self._lock:
            self._inflight -= self._weights.pop(request_id, 0)

    def _deliver(self, group: RequestGroup, request_id: str, item: _Item) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(group.push, request_id, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _publish(self) -> None:
        self.snapshot = self._take_snapshot()
        if self.metrics is not None:
            self.metrics.set_gauges(self.snapshot, self.snapshot.num_inflight)

    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        pool = e.blocks.allocator
        return EngineSnapshot(
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting) + self._commands.qsize() + len(self._pending),
            num_inflight=self._inflight,
            kv_pages_free=pool.num_free,
            kv_pages_total=pool.num_pages,
            kv_pages_cached=pool.num_cached,
            kv_usage=e.kv_usage(),
            stats=dataclasses.replace(e.stats),
            taken_at=time.time(),
        )
