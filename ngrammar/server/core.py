"""The engine core: the engine's busy loop in its own process, one batched delta per step.

``EngineCore`` is the loop's body, free of any transport: it takes ``Add`` / ``Abort`` commands,
hands requests to the engine round-robin by HTTP request (so a fan-out request cannot put all its
sequences ahead of a later one), steps, and turns the step into one ``StepDelta``: the new token
ids of every request that progressed, read off the engine's sequences (requests are added with
``stream=False``, so the engine builds no per-step ``RequestOutput``), with finish reasons, logprobs,
metrics and the load. ``core_main`` runs it in a spawned process between two ZeroMQ sockets; the
process exits when its parent is gone (checked every turn), so no engine outlives its server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from ngrammar.config import EngineConfig
from ngrammar.server.admission import RoundRobin
from ngrammar.server.core_messages import (
    Abort,
    Add,
    CorpusCall,
    CorpusReply,
    Load,
    Ready,
    RequestDelta,
    RequestFailed,
    SeqDelta,
    StartFailed,
    StepDelta,
    Stop,
    command_decoder,
    encoder,
)

if TYPE_CHECKING:
    from ngrammar.engine.engine import LLMEngine, Request
    from ngrammar.engine.sequence import Sequence
    from ngrammar.server.warmup import CompileCounter

log = logging.getLogger(__name__)

CONFIG_FILE = "config.pickle"
COMMANDS_SOCKET = "commands"
REPORTS_SOCKET = "reports"
_IDLE_POLL_MS = 50  # an idle core's longest wait for a command before it checks on its parent
_COMPILING_POLL_MS = 1  # ... while grammars compile and nothing steps: how often it checks on them


class EngineCore:
    def __init__(self, engine: LLMEngine, compiles: CompileCounter, index: int = 0) -> None:
        self.engine = engine
        self.index = index
        self.compiles = compiles
        # Engine requests handed over while the scheduler waits on fewer sequences than this.
        self.feed_below = max(engine.config.max_running_requests, 1)
        self._pending: RoundRobin[Add] = RoundRobin()
        # Requests whose grammar compiles on the grammar backend's threads: they join ``_pending``
        # once it is done, so a new grammar never stalls the steps of the requests running.
        self._compiling: dict[str, tuple[Add, Future[Any]]] = {}
        self._live: dict[str, _Live] = {}  # handed to the engine, not finished
        self._failed: list[tuple[int, RequestFailed]] = []  # (client, refusal)
        # Corpus calls tokenize and index on a worker thread; the loop sends their replies.
        self._corpus_pool = ThreadPoolExecutor(1, thread_name_prefix="draft-corpora")
        self._calls: list[tuple[CorpusCall, Future[Any]]] = []

    @property
    def busy(self) -> bool:
        """Requests not finished: stepping, queued, or waiting for their grammar to compile."""
        return bool(self._live or self._pending or self._compiling)

    @property
    def stepping(self) -> bool:
        """Requests the next turn steps or admits (not those whose grammar still compiles)."""
        return bool(self._live or self._pending)

    def handle(self, command: Add | Abort) -> None:
        if isinstance(command, Add):
            compiling = self._compile(command)
            if compiling is None or compiling.done():
                self._pending.push(command.group, command.request_id, command)
            else:
                self._compiling[command.request_id] = (command, compiling)
            return
        held = self._compiling.pop(command.request_id, None)
        add = held[0] if held is not None else self._pending.remove(command.request_id)
        if add is None:
            self.engine.abort(command.request_id)  # its last delta says "abort"
            return
        self._failed.append(
            (add.client, RequestFailed(add.request_id, "Aborted", "aborted before it started"))
        )

    def _compile(self, add: Add) -> Future[Any] | None:
        """The request's grammar compiling on the backend's threads (a cache hit: a done future);
        None without a grammar, or with one its admission refuses (the engine raises the error)."""
        try:
            spec = self.engine.grammar_spec(add.params)
        except Exception:
            return None
        return None if spec is None else self.engine.grammar_backend.compile_async(spec)

    def _compiled(self) -> None:
        """Requests whose grammar is done join the queue (a failed compile too: their admission
        raises the compile's error, the request's 400, as the engine's compile cache misses)."""
        for request_id, (add, compiling) in list(self._compiling.items()):
            if compiling.done():
                del self._compiling[request_id]
                self._pending.push(add.group, request_id, add)

    def refuse_unreadable(self, raw: bytes, error: Exception) -> None:
        """A command this core cannot decode (a type the API side let through): an ``Add`` is
        refused as bad input (400) in this turn's delta; anything else is logged. The core lives on."""
        try:
            fields = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            fields = None
        # (an Add travels as [tag, *fields] in Add's field order)
        rid, cid = (1 + Add.__struct_fields__.index(f) for f in ("request_id", "client"))
        if (
            isinstance(fields, list)
            and len(fields) > rid
            and fields[0] == "Add"
            and isinstance(fields[rid], str)
        ):
            client = fields[cid] if len(fields) > cid and isinstance(fields[cid], int) else 0
            message = f"the engine core could not read the request: {error}"
            self._failed.append((client, RequestFailed(fields[rid], "InvalidRequestError", message)))
            return
        log.error("engine core %d: an unreadable command, ignored: %s", self.index, error)

    def call_corpora(self, call: CorpusCall) -> None:
        self._calls.append((call, self._corpus_pool.submit(self._run_corpus_call, call)))

    def corpus_replies(self) -> list[tuple[int, CorpusReply]]:
        """(client, reply) of the corpus calls that finished since the last time."""
        done = [(call, f) for call, f in self._calls if f.done()]
        if not done:
            return []
        self._calls = [(call, f) for call, f in self._calls if not f.done()]
        replies = []
        for call, f in done:
            error = f.exception()
            if error is None:
                replies.append((call.client, CorpusReply(self.index, call.call, f.result())))
            else:
                replies.append((call.client, CorpusReply(self.index, call.call, error=f"{error}")))
        return replies

    def _run_corpus_call(self, call: CorpusCall) -> Any:
        from ngrammar.speculative.external import DraftCorpusError

        spec = self.engine.ngram
        if spec is None or spec.proposer.corpora is None:
            raise DraftCorpusError("draft corpora need a server started with --speculative ngram")
        corpora = spec.proposer.corpora
        if call.op == "list":
            return corpora.info()
        assert call.name is not None
        if call.op == "add":
            return corpora.add(call.name, call.path, call.documents, call.replace).as_dict()
        corpora.remove(call.name)
        return None

    def turn(self, clients: int = 1) -> list[StepDelta]:
        """Admit what fits, run one step if anything runs; then one delta per API server process
        (``clients`` of them: each gets its own requests' progress and refusals, and every one the
        load), or none if nothing changed."""
        self._compiled()
        self._feed()
        changed = bool(self._failed)  # (refusals of requests just fed included)
        seconds = None
        if self._live:
            changed = True
            try:
                self.engine.step()
                seconds = self.engine.stats.last_step_seconds
            except Exception as e:  # an engine bug fails what was running, not the core
                log.exception("engine step failed; failing %d requests", len(self._live))
                self._fail_all(f"the engine failed: {type(e).__name__}: {e}")
        if not changed:
            return []
        load = self.load()
        deltas = [StepDelta(self.index, [], [], load, seconds if c == 0 else None) for c in range(clients)]
        # (per live request per step at every concurrency: kept to a few attribute reads each)
        for rid, live in list(self._live.items()):
            if (d := self._delta(rid, live)) is not None:
                deltas[live.client].requests.append(d)
        for client, failed in self._failed:
            deltas[client].failed.append(failed)
        self._failed = []
        return deltas

    def load(self) -> Load:
        e = self.engine
        pool = e.blocks.allocator
        waiting = len(e.scheduler.waiting) + len(self._pending) + len(self._compiling)
        return Load(
            len(e.scheduler.running),
            waiting,
            pool.num_free,
            pool.num_pages,
            pool.num_cached,
            e.stats,
            self.compiles.count,
        )

    def _feed(self) -> None:
        while self._pending and len(self.engine.scheduler.waiting) < self.feed_below:
            self._admit(self._pending.pop())

    def _admit(self, add: Add) -> None:
        try:
            self.engine.add_request(add.prompt_ids, add.params, add.request_id, stream=False)
        except Exception as e:  # bad input the server's checks missed: this request only
            self._failed.append((add.client, RequestFailed(add.request_id, type(e).__name__, str(e))))
            return
        self._live[add.request_id] = _Live(self.engine.requests[add.request_id], add.client)

    def _delta(self, request_id: str, live: _Live) -> RequestDelta | None:
        req, reported, ended = live.request, live.reported, live.ended
        seqs: list[SeqDelta] = []
        ending = False
        for i, seq in enumerate(req.seqs):
            if ended[i]:
                continue
            start, end = reported[i], len(seq.token_ids)
            # (a finish reason is set exactly when a sequence finishes: ``Sequence.finish``)
            done = seq.finish_reason is not None
            if end == start and not done:
                continue
            seqs.append(_seq_delta(seq, start, end))
            reported[i] = end
            if done:
                ended[i] = ending = True
        if not seqs:
            return None
        if not (ending and all(ended)):
            return RequestDelta(request_id, seqs)
        self._forget(request_id)
        metrics = req.seqs[0].metrics()
        if len(req.seqs) > 1:
            metrics["completion_tokens"] = sum(s.num_output_tokens for s in req.seqs)
        return RequestDelta(request_id, seqs, True, metrics)

    def _fail_all(self, message: str) -> None:
        failed = list(self._live)
        try:
            self.engine.abort_and_release(failed)
        except Exception:
            log.exception("releasing the failed requests failed")
        for request_id in failed:
            self._failed.append(
                (self._live[request_id].client, RequestFailed(request_id, "EngineFailure", message))
            )
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        del self._live[request_id]


class _Live:
    """A request handed to the engine: its API server process and what its deltas have reported."""

    __slots__ = ("client", "ended", "reported", "request")

    def __init__(self, request: Request, client: int) -> None:
        self.request = request
        self.client = client
        # Per sequence: the end of its ``token_ids`` reported so far (the prompt's end at first),
        # and whether its finish was reported.
        self.reported = [seq.num_prompt_tokens for seq in request.seqs]
        self.ended = [False] * len(request.seqs)


def _seq_delta(seq: Sequence, start: int, end: int) -> SeqDelta:
    """The sequence's tokens ``token_ids[start:end]`` (and its finish, once finished)."""
    new = seq.token_ids[start:end]
    lps = None
    if seq.logprobs is not None:
        first = start - seq.num_prompt_tokens
        lps = [(t, lp.logprob, list(lp.top)) for t, lp in zip(new, seq.logprobs[first:])]
    if seq.finish_reason is None:
        return SeqDelta(seq.index, new, logprobs=lps)
    return SeqDelta(seq.index, new, seq.finish_reason, seq.error, seq.request_error, lps)


# ------------------------------------------------------------------ process


@dataclass(frozen=True)
class CoreSpec:
    """What an engine-core process is started with (pickled into its folder)."""

    config: EngineConfig  # its own engine's: one replica (``replica_config``)
    index: int
    replicas: int  # the server's --dp
    # One folder per API server process (``--api-server-count``), in client order: each binds its
    # report socket there and a command socket per core (``commands-<index>``).
    clients: tuple[str, ...]
    control: str | None = None  # the supervisor's folder (its ``Stop``), when API servers are processes


def command_socket(index: int) -> str:
    """The file name of core ``index``'s command socket in a client's (or the supervisor's) folder."""
    return f"{COMMANDS_SOCKET}-{index}"


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica ``index``'s engine: one replica, and on CUDA its own ``tp`` devices."""
    device = config.device
    if device in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():
            device = f"cuda:{index * config.tensor_parallel_size}"
    return dataclasses.replace(config, data_parallel_size=1, device=device, dist_init_addr=None)


def core_main(folder: str, parent: int) -> None:
    """The engine-core process (``python -m ngrammar.server.core FOLDER PARENT_PID``, started by
    ``core_client.launch_cores``): its ``CoreSpec`` is pickled in ``FOLDER``."""
    import zmq

    from ngrammar.server.process import tune_server_process

    tune_server_process()

    with open(os.path.join(folder, CONFIG_FILE), "rb") as f:
        spec: CoreSpec = pickle.load(f)
    shutil.rmtree(folder, ignore_errors=True)  # (its own: nothing else reads it)
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)  # fair-queued from every client (and the supervisor)
    for folder_ in (*spec.clients, *([spec.control] if spec.control else [])):
        commands.connect(f"ipc://{folder_}/{command_socket(spec.index)}")
    reports = [report_socket(ctx, folder_) for folder_ in spec.clients]
    try:
        from ngrammar.engine.engine import LLMEngine
        from ngrammar.server.warmup import CompileCounter, warm_up

        if spec.replicas > 1 and not spec.config.device.startswith("cuda"):
            import torch

            # CPU replicas share the cores rather than oversubscribe them (torch's default: all of them)
            torch.set_num_threads(max(1, torch.get_num_threads() // spec.replicas))
        counter = CompileCounter().install()
        engine = LLMEngine(spec.config)
        compiles = warm_up(engine, counter)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which refuses to start
        traceback.print_exc()
        for push in reports:
            push.send(encoder.encode(StartFailed(spec.index, f"{type(e).__name__}: {e}")))
        ctx.destroy(linger=1000)
        return
    core = EngineCore(engine, counter, spec.index)
    ready = Ready(
        spec.index,
        engine.model_name,
        engine.max_model_len,
        engine.kv_capacity_tokens,
        engine.blocks.page_size,
        compiles,
        core.load(),
    )
    for push in reports:
        push.send(encoder.encode(ready))
    try:
        profiled(lambda: _serve(core, commands, reports, parent), os.environ.get(PROFILE_ENV), spec.index)
    except BaseException as e:  # noqa: BLE001 - the core ends; the server fails its requests
        traceback.print_exc()
        print(f"ngrammar: engine core {spec.index} failed: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    finally:
        engine.close()
        ctx.destroy(linger=0)


# Diagnostics: a path prefix; each core writes cProfile stats of its loop to PREFIX.<index>.prof as
# it stops (what a core does per step under a real server, where an offline run cannot show it).
PROFILE_ENV = "NGRAMMAR_CORE_PROFILE"


def profiled(run: Callable[[], None], prefix: str | None, index: int) -> None:
    """``run()``, under cProfile when ``prefix`` is set: the calling thread only, stats written
    when it returns or raises (not when a signal kills the process); a failed write is a warning."""
    if not prefix:
        run()
        return
    import cProfile

    profile = cProfile.Profile()
    try:
        profile.runcall(run)
    finally:
        try:
            profile.dump_stats(f"{prefix}.{index}.prof")
        except OSError as e:
            print(f"ngrammar: engine core {index}: {PROFILE_ENV} not written: {e}", file=sys.stderr)


def report_socket(ctx: Any, folder: str) -> Any:
    """The PUSH socket of one API server process's reports. No send limit: at ZeroMQ's default
    (1,000 messages) a core whose API process had stopped reading (gone, or shutting down with
    requests still running) blocked in ``send`` and never read its ``Stop``."""
    import zmq

    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(f"ipc://{folder}/{REPORTS_SOCKET}")
    return push


def _serve(core: EngineCore, commands: object, reports: list[Any], parent: int) -> None:
    import zmq

    assert isinstance(commands, zmq.Socket)
    while os.getppid() == parent:
        wait = _COMPILING_POLL_MS if core.busy else _IDLE_POLL_MS
        if core.stepping or commands.poll(wait) or core.busy:
            while True:
                try:
                    raw = commands.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    command = command_decoder.decode(raw)
                except msgspec.DecodeError as e:  # (ValidationError included)
                    core.refuse_unreadable(raw, e)
                    continue
                if isinstance(command, Stop):
                    return
                if isinstance(command, CorpusCall):
                    core.call_corpora(command)
                else:
                    core.handle(command)
            for push, delta in zip(reports, core.turn(len(reports))):
                push.send(encoder.encode(delta), copy=False)
        for client, reply in core.corpus_replies():
            reports[client].send(encoder.encode(reply))


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group: the API server drains its requests, then stops this
    # core (``Stop``); a core whose parent is gone exits on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO)
    core_main(sys.argv[1], int(sys.argv[2]))
