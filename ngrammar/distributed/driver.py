"""Rank 0 of a tensor-parallel engine: start the other ranks, then drive them step by step.

Rank 0 is the engine's own process: it owns the scheduler, the corpus, drafting, grammars and
sampling, and its runner (``DriverRunner``) broadcasts each ``StepInput`` to the other ranks
before running its own share of the same forward; only rank 0 reads results back. Accepted
draft paths' KV moves are broadcast likewise (each rank moves its own KV shard).

Start-up checks each rank as it joins and loads (a rank that dies raises here, with its exit
code); afterwards a watchdog thread ends the engine process with a message as soon as a rank
process dies, since no collective can complete without it (NCCL would wait forever).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import sys
import threading
import time
from multiprocessing.connection import wait as wait_sentinels
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ngrammar.attention.factory import attention_backend
from ngrammar.attention.metadata import AttentionBackend
from ngrammar.config import EngineConfig
from ngrammar.distributed.channel import StepChannel, tensor_spec
from ngrammar.distributed.ranks import RankSpec, connect_store, init_group, rank_main
from ngrammar.model.loader import Checkpoint, resolve_checkpoint
from ngrammar.model.parallel import (
    MULTICAST_OFF_ENV,
    ParallelConfigError,
    TensorParallel,
    check_tensor_parallel,
)
from ngrammar.processes import spawn
from ngrammar.runner.model_runner import ModelRunner, StepInput, resolve_device, resolve_dtype

_POLL_S = 0.05


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or did not join in time; the message names it."""


class RankProcesses:
    """This node's rank processes, and the watchdog that ends the engine if one dies."""

    def __init__(self, threads: int, procs: dict[int, BaseProcess]) -> None:
        self.threads = threads  # rank 0's CPU threads before the ranks took their shares (restored at stop)
        self.procs = procs
        self.closing = threading.Event()
        self._watchdog: threading.Thread | None = None

    def first_dead(self) -> tuple[int, BaseProcess] | None:
        for rank, p in self.procs.items():
            if not p.is_alive():
                return rank, p
        return None

    def arm(self) -> None:
        """From now on a rank that exits ends this process (a step could never complete)."""
        if self.procs:
            self._watchdog = threading.Thread(target=self._watch, name="ngrammar-rank-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: (rank, p) for rank, p in self.procs.items()}
        ready = wait_sentinels(list(by_sentinel))
        if self.closing.is_set():
            return
        rank, p = by_sentinel[ready[0]]  # type: ignore[index]
        p.join(1.0)
        print(
            f"ngrammar: tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}; "
            "the engine cannot run a step without it and exits",
            file=sys.stderr,
            flush=True,
        )
        os._exit(70)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.closing.set()
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.terminate()
                p.join(1.0)
        torch.set_num_threads(self.threads)


class DriverRunner(ModelRunner):
    """Rank 0's runner: every forward, KV move and graph set-up is first sent to the other ranks."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int,
        page_size: int,
        backend: AttentionBackend,
        tp: TensorParallel,
        channel: StepChannel,
        ranks: RankProcesses,
    ) -> None:
        super().__init__(checkpoint, device, dtype, num_pages, page_size, backend, tp=tp)
        self.channel = channel
        self.ranks = ranks
        self._closed = False

    def forward(self, step: StepInput) -> torch.Tensor:
        ids = step.input_ids
        self.channel.send(
            ("forward", dataclasses.replace(step, input_ids=None), None if ids is None else tuple(ids.shape))
        )
        if ids is not None:  # sampled on this device, never read back: the ranks get it device to device
            self.channel.send_tensor(ids.to(torch.int64))
        return super().forward(step)

    def compact_accepted_kv(self, slots: torch.Tensor, nodes: torch.Tensor, lens: torch.Tensor) -> None:
        self.channel.send(("compact", tuple(slots.shape), tensor_spec(nodes), tensor_spec(lens)))
        self.channel.send_tensor(nodes)
        self.channel.send_tensor(lens)
        super().compact_accepted_kv(slots, nodes, lens)

    def attach_graphs(
        self,
        widths: list[int],
        max_batch_size: int,
        kv_len_bound: int,
        dummy_page: int,
        capture: bool,
        acceptor: Any = None,
    ) -> None:
        if acceptor is not None:
            raise ValueError("with tensor parallelism the acceptor runs eagerly (every rank moves its KV)")
        kwargs = dict(
            widths=widths,
            max_batch_size=max_batch_size,
            kv_len_bound=kv_len_bound,
            dummy_page=dummy_page,
            capture=capture,
        )
        self.channel.send(("graphs", kwargs))
        super().attach_graphs(**kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)  # the exit hook would keep this runner (weights, KV) alive
        super().close()
        self.ranks.closing.set()
        try:
            self.channel.send(("stop",))
        except RuntimeError:  # a rank is gone already (its failure was reported): stop the rest
            pass
        finally:
            self.ranks.stop()
            if dist.is_initialized():
                dist.destroy_process_group()


def start_tensor_parallel(
    config: EngineConfig, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype, num_pages: int
) -> DriverRunner:
    """Spawn this node's other ranks (one process each, ``torch.multiprocessing``), rendezvous over a
    TCP store at ``dist_init_addr`` (default: a free local port), and build rank 0's runner. Ranks
    on other nodes are started there by ``run_node``. Raises ``RankFailure`` if a rank dies or does
    not join within ``dist_timeout_s``; nothing is left running then."""
    if dist.is_initialized():  # torch.distributed has one default group per process
        raise ParallelConfigError(
            "this process already runs a tensor-parallel engine (or another torch.distributed group); "
            "close it first (LLM.close(), or build it in a `with LLM(...) as llm:` block)"
        )
    os.environ.update(MULTICAST_OFF_ENV)  # inherited by every process spawned below
    size = config.tensor_parallel_size
    per_node = size // config.nnodes
    host, port = _address(config.dist_init_addr)
    base = RankSpec(
        rank=0,
        size=size,
        host=host,
        port=port,
        checkpoint=checkpoint,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        num_pages=num_pages,
        page_size=config.page_size,
        attention_backend=_backend_name(config.attention_backend, device),
        timeout_s=config.dist_timeout_s,
        threads=_rank_threads(device, per_node),
        parent_pid=os.getpid(),
    )
    threads = torch.get_num_threads()
    if device.type == "cpu":  # rank 0 too takes only its share of the cores (OpenMP threads spin)
        torch.set_num_threads(base.threads)
    store = connect_store(base, is_master=True)
    store.set("num_pages", str(num_pages))  # ranks on other nodes cannot size the pool themselves
    ranks = RankProcesses(threads, _spawn(base, range(1, per_node), device, device.index or 0, per_node))
    try:
        _wait_for(store, "joined", size - 1, ranks, config.dist_timeout_s, "join")
        tp, channel = init_group(base, device, store)
        runner = DriverRunner(
            checkpoint,
            device,
            dtype,
            num_pages,
            config.page_size,
            attention_backend(base.attention_backend, device),
            tp,
            channel,
            ranks,
        )
        _wait_for(store, "loaded", size - 1, ranks, config.dist_timeout_s, "load its shard")
    except BaseException:
        ranks.stop(timeout_s=0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    ranks.arm()
    atexit.register(runner.close)
    return runner


def run_node(config: EngineConfig) -> int:
    """Node ``node_rank`` > 0 of a multi-node engine (same flags as node 0, plus ``--node-rank``):
    run this node's ranks until rank 0 stops them; returns the worst exit code."""

    os.environ.update(MULTICAST_OFF_ENV)
    device = resolve_device(config.device)
    checkpoint = resolve_checkpoint(config.model)
    size, per_node = config.tensor_parallel_size, config.tensor_parallel_size // config.nnodes
    check_tensor_parallel(checkpoint.config, size, device, config.nnodes)
    host, port = _address(config.dist_init_addr)
    base = RankSpec(
        rank=0,
        size=size,
        host=host,
        port=port,
        checkpoint=checkpoint,
        device=str(device),
        dtype=str(resolve_dtype(config.dtype, device)).removeprefix("torch."),
        num_pages=0,  # rank 0's, read from the store
        page_size=config.page_size,
        attention_backend=_backend_name(config.attention_backend, device),
        timeout_s=config.dist_timeout_s,
        threads=_rank_threads(device, per_node),
        parent_pid=os.getpid(),
    )
    first = config.node_rank * per_node
    procs = _spawn(base, range(first, first + per_node), device, 0, per_node)
    for p in procs.values():
        p.join()
    return max(abs(p.exitcode or 0) for p in procs.values())


def _spawn(
    base: RankSpec, ranks: range, device: torch.device, first_device: int, per_node: int
) -> dict[int, BaseProcess]:
    """One process per rank; on CUDA rank r takes the node's device ``first_device + r % per_node``."""
    ctx = mp.get_context("spawn")
    procs: dict[int, BaseProcess] = {}
    for rank in ranks:
        dev = f"cuda:{first_device + rank % per_node}" if device.type == "cuda" else "cpu"
        spec = dataclasses.replace(base, rank=rank, device=dev)
        # Not daemonic: a replica process (``--dp``) that spawns ranks is itself a child.
        procs[rank] = spawn(ctx, rank_main, (spec,), f"ngrammar-tp-rank-{rank}", daemon=False)
    return procs


def _wait_for(
    store: dist.TCPStore, key: str, count: int, ranks: RankProcesses, timeout_s: float, what: str
) -> None:
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < count:
        dead = ranks.first_dead()
        if dead is not None:
            rank, p = dead
            raise RankFailure(
                f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode} before it could "
                f"{what}; its error is printed above"
            )
        if time.monotonic() > deadline:
            raise RankFailure(
                f"only {store.add(key, 0)} of {count} tensor-parallel ranks managed to {what} "
                f"within {timeout_s:.0f} s (--dist-timeout-s)"
            )
        time.sleep(_POLL_S)


def _rank_threads(device: torch.device, per_node: int) -> int:
    """A CPU rank's share of this process's threads (torch's default: the cores, or
    ``OMP_NUM_THREADS``); 0 on CUDA (left as it is). Oversubscribed OpenMP threads spin."""
    return max(1, torch.get_num_threads() // per_node) if device.type == "cpu" else 0


def _address(addr: str | None) -> tuple[str, int]:
    if addr is not None:
        host, _, port = addr.rpartition(":")
        return host or "127.0.0.1", int(port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1", int(s.getsockname()[1])


def _backend_name(name: str, device: torch.device) -> str:
    return ("triton" if device.type == "cuda" else "sdpa") if name == "auto" else name
