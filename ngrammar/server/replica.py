"""One data-parallel replica: a whole engine (itself possibly tensor-parallel) in its own process.

The server talks to it over a ``multiprocessing`` pipe. Server -> replica: ("add", request id,
prompt ids, params), ("abort", request id), ("stop",). Replica -> server: ("ready", ReplicaInfo)
once the engine is built (or ("failed", message) if it cannot be), then after every loop turn that
did something ("step", outputs, step seconds or None, ReplicaLoad), and ("error", request id, kind,
message) for a request the engine refused. The replica exits when the server goes away (its pipe
closes or its parent pid changes) and ends with a message if its engine fails; the server then
fails only the requests it held (``router.ReplicaRouter``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ngrammar.config import EngineConfig
from ngrammar.engine.engine import EngineStats
from ngrammar.model.parallel import MULTICAST_OFF_ENV

_IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class ReplicaInfo:
    """What the server's front needs of an engine it does not hold: the request limits."""

    model_name: str
    max_model_len: int
    kv_capacity_tokens: int
    page_size: int


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's state after a loop turn (the server sums them into its snapshot and gauges)."""

    num_running: int
    num_waiting: int
    kv_pages_free: int  # (cached prefix pages nobody reads count as free)
    kv_pages_total: int
    kv_pages_cached: int
    stats: EngineStats


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica ``index``'s engine: one replica, and on CUDA its own ``tp`` devices."""
    device = config.device
    if device in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():
            device = f"cuda:{index * config.tensor_parallel_size}"
    return dataclasses.replace(config, data_parallel_size=1, device=device, dist_init_addr=None)


def replica_main(index: int, config: EngineConfig, conn: Connection) -> None:
    """Entry point of replica ``index`` (spawned by the router)."""
    os.environ.update(MULTICAST_OFF_ENV)
    parent = os.getppid()
    try:
        from ngrammar.engine.engine import LLMEngine

        own = replica_config(config, index)
        if not own.device.startswith("cuda"):  # the replicas share the threads rather than oversubscribe
            import torch

            # torch's default: the cores, or OMP_NUM_THREADS (inherited from the server)
            torch.set_num_threads(max(1, torch.get_num_threads() // config.data_parallel_size))
        engine = LLMEngine(own)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which refuses to start
        traceback.print_exc()
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    a = engine.blocks
    conn.send(
        (
            "ready",
            ReplicaInfo(engine.model_name, engine.max_model_len, engine.kv_capacity_tokens, a.page_size),
        )
    )
    try:
        _serve(engine, conn, parent)
    except (EOFError, OSError):  # the server is gone
        pass
    except BaseException as e:  # noqa: BLE001 - the replica ends; the server fails its requests
        traceback.print_exc()
        print(f"ngrammar: data-parallel replica {index} failed: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        engine.close()
        os._exit(1)
    engine.close()


def _serve(engine: object, conn: Connection, parent: int) -> None:
    from ngrammar.engine.engine import LLMEngine

    assert isinstance(engine, LLMEngine)
    while os.getppid() == parent:
        busy = engine.has_unfinished()
        if conn.poll(0 if busy else _IDLE_WAIT_S):
            while conn.poll():
                command = conn.recv()
                if command[0] == "stop":
                    return
                _handle(engine, conn, command)
        elif not busy:
            continue
        outputs, seconds = [], None
        if engine.has_unfinished():
            outputs = engine.step()
            seconds = engine.stats.last_step_seconds
        conn.send(("step", outputs, seconds, _load(engine)))


def _handle(engine: object, conn: Connection, command: tuple[object, ...]) -> None:
    from ngrammar.engine.engine import LLMEngine

    assert isinstance(engine, LLMEngine)
    if command[0] == "add":
        _, request_id, prompt_ids, params = command
        try:
            engine.add_request(prompt_ids, params, request_id)  # type: ignore[arg-type]
        except Exception as e:  # bad input the server's checks missed: this request only
            conn.send(("error", request_id, type(e).__name__, str(e)))
    elif command[0] == "abort":
        engine.abort(command[1])  # type: ignore[arg-type]
    else:
        raise RuntimeError(f"unknown command from the server: {command[0]!r}")


def _load(engine: object) -> ReplicaLoad:
    from ngrammar.engine.engine import LLMEngine

    assert isinstance(engine, LLMEngine)
    pool = engine.blocks.allocator
    return ReplicaLoad(
        len(engine.scheduler.running),
        len(engine.scheduler.waiting),
        pool.num_free,
        pool.num_pages,
        pool.num_cached,
        dataclasses.replace(engine.stats),
    )
