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

import logging
import os
import pickle
import sys
import traceback
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from ngrammar.server.core_messages import (
    Abort,
    Add,
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
    from ngrammar.config import EngineConfig
    from ngrammar.engine.engine import LLMEngine, Request
    from ngrammar.engine.sequence import Sequence
    from ngrammar.server.warmup import CompileCounter

log = logging.getLogger(__name__)

CONFIG_FILE = "config.pickle"
COMMANDS_SOCKET = "commands"
REPORTS_SOCKET = "reports"
_IDLE_POLL_MS = 50  # an idle core's longest wait for a command before it checks on its parent


class EngineCore:
    def __init__(self, engine: LLMEngine, compiles: CompileCounter) -> None:
        self.engine = engine
        self.compiles = compiles
        # Engine requests handed over while the scheduler waits on fewer sequences than this.
        self.feed_below = max(engine.config.max_running_requests, 1)
        self._pending: OrderedDict[str, deque[Add]] = OrderedDict()  # per group, served in turn
        self._pending_ids: dict[str, Add] = {}
        self._live: dict[str, Request] = {}  # handed to the engine, not finished
        self._sent: dict[str, list[int]] = {}  # output tokens reported so far, per sequence
        self._ended: dict[str, list[bool]] = {}  # whether each sequence's finish was reported
        self._failed: list[RequestFailed] = []

    @property
    def busy(self) -> bool:
        return bool(self._live or self._pending)

    def handle(self, command: Add | Abort) -> None:
        if isinstance(command, Add):
            self._pending.setdefault(command.group, deque()).append(command)
            self._pending_ids[command.request_id] = command
            return
        add = self._pending_ids.pop(command.request_id, None)
        if add is None:
            self.engine.abort(command.request_id)  # its last delta says "abort"
            return
        adds = self._pending[add.group]
        adds.remove(add)
        if not adds:
            del self._pending[add.group]
        self._failed.append(RequestFailed(add.request_id, "Aborted", "aborted before it started"))

    def turn(self) -> StepDelta | None:
        """Admit what fits, run one step if anything runs; the delta, or None if nothing changed."""
        changed = bool(self._failed)
        self._feed()
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
            return None
        requests = [d for rid in list(self._live) if (d := self._delta(rid)) is not None]
        failed, self._failed = self._failed, []
        return StepDelta(requests, failed, self.load(), seconds)

    def load(self) -> Load:
        e = self.engine
        pool = e.blocks.allocator
        waiting = len(e.scheduler.waiting) + len(self._pending_ids)
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
            group, adds = next(iter(self._pending.items()))
            add = adds.popleft()
            del self._pending_ids[add.request_id]
            del self._pending[group]
            if adds:
                self._pending[group] = adds  # to the back of the rotation
            self._admit(add)

    def _admit(self, add: Add) -> None:
        try:
            self.engine.add_request(add.prompt_ids, add.params, add.request_id, stream=False)
        except Exception as e:  # bad input the server's checks missed: this request only
            self._failed.append(RequestFailed(add.request_id, type(e).__name__, str(e)))
            return
        self._live[add.request_id] = self.engine.requests[add.request_id]
        self._sent[add.request_id] = [0] * add.params.n
        self._ended[add.request_id] = [False] * add.params.n

    def _delta(self, request_id: str) -> RequestDelta | None:
        req = self._live[request_id]
        sent, ended = self._sent[request_id], self._ended[request_id]
        seqs = [
            d for seq, n, e in zip(req.seqs, sent, ended) if not e and (d := _seq_delta(seq, n)) is not None
        ]
        if not seqs:
            return None
        for d in seqs:
            sent[d.index] += len(d.token_ids)
            ended[d.index] = d.finish_reason is not None
        if not req.finished:
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
            self._failed.append(RequestFailed(request_id, "EngineFailure", message))
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        del self._live[request_id], self._sent[request_id], self._ended[request_id]


def _seq_delta(seq: Sequence, sent: int) -> SeqDelta | None:
    """The sequence's tokens past the ``sent`` first outputs (and its finish), or None if none."""
    start = seq.num_prompt_tokens + sent
    new = seq.token_ids[start:]
    if not new and seq.finish_reason is None:
        return None
    lps = None
    if seq.logprobs is not None:
        lps = [(t, lp.logprob, list(lp.top)) for t, lp in zip(new, seq.logprobs[sent:])]
    if seq.finish_reason is None:
        return SeqDelta(seq.index, new, logprobs=lps)
    return SeqDelta(seq.index, new, seq.finish_reason, seq.error, seq.request_error, lps)


# ------------------------------------------------------------------ process


def core_main(folder: str, parent: int) -> None:
    """The engine-core process (``python -m ngrammar.server.core FOLDER PARENT_PID``, started by
    ``core_client.start_core``): its config is pickled in ``FOLDER``, where its sockets are too."""
    import zmq

    with open(os.path.join(folder, CONFIG_FILE), "rb") as f:
        config: EngineConfig = pickle.load(f)
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(f"ipc://{folder}/{COMMANDS_SOCKET}")
    reports = ctx.socket(zmq.PUSH)
    reports.connect(f"ipc://{folder}/{REPORTS_SOCKET}")
    try:
        from ngrammar.engine.engine import LLMEngine
        from ngrammar.server.warmup import CompileCounter, warm_up

        counter = CompileCounter().install()
        engine = LLMEngine(config)
        compiles = warm_up(engine, counter)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which refuses to start
        traceback.print_exc()
        reports.send(encoder.encode(StartFailed(f"{type(e).__name__}: {e}")))
        return
    reports.send(
        encoder.encode(
            Ready(
                engine.model_name,
                engine.max_model_len,
                engine.kv_capacity_tokens,
                engine.blocks.page_size,
                compiles,
            )
        )
    )
    try:
        _serve(EngineCore(engine, counter), commands, reports, parent)
    except BaseException as e:  # noqa: BLE001 - the core ends; the server fails its requests
        traceback.print_exc()
        print(f"ngrammar: the engine core failed: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    finally:
        engine.close()
        ctx.destroy(linger=0)


def _serve(core: EngineCore, commands: object, reports: object, parent: int) -> None:
    import zmq

    assert isinstance(commands, zmq.Socket) and isinstance(reports, zmq.Socket)
    while os.getppid() == parent:
        if not core.busy and not commands.poll(_IDLE_POLL_MS):
            continue
        while True:
            try:
                raw = commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            command = command_decoder.decode(raw)
            if isinstance(command, Stop):
                return
            core.handle(command)
        delta = core.turn()
        if delta is not None:
            reports.send(encoder.encode(delta), copy=False)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    core_main(sys.argv[1], int(sys.argv[2]))
