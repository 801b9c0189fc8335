"""The tensor-parallel ranks other than 0: join the group, load their shard, run what rank 0 sends.

A rank owns no scheduler, corpus, grammar or sampler: it holds its shard of the weights and of the
KV pool, runs each forward rank 0 broadcasts (the same collectives in the same order), moves its
KV shard as rank 0's accepted paths say, and never reads anything back. Any failure ends the
process with a message naming the rank; rank 0's watchdog then stops the engine.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ngrammar.attention.factory import attention_backend
from ngrammar.distributed.channel import StepChannel
from ngrammar.model.loader import Checkpoint
from ngrammar.model.parallel import MULTICAST_OFF_ENV, TensorParallel
from ngrammar.runner.model_runner import ModelRunner, resolve_dtype


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to join the group and build its share of the engine."""

    rank: int
    size: int
    host: str
    port: int
    checkpoint: Checkpoint
    device: str  # "cpu" or "cuda:N"
    dtype: str  # torch dtype name, e.g. "float32"
    num_pages: int  # 0: rank 0's, read from the store (another node)
    page_size: int
    attention_backend: str  # "sdpa" or "triton"
    timeout_s: float
    threads: int  # CPU threads (0: leave torch's default)
    parent_pid: int | None  # exit when this process is gone (None: launched by hand, on another node)


def backend_name(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(spec: RankSpec, device: torch.device, store: dist.Store) -> tuple[TensorParallel, StepChannel]:
    """Join the default process group (NCCL on CUDA, gloo on CPU) and, on CUDA, a gloo group for the
    commands. Communicators are created here, eagerly: a CUDA graph must not capture their set-up."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    dist.init_process_group(
        backend_name(device), store=store, rank=spec.rank, world_size=spec.size, timeout=timeout
    )
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else None
    dist.all_reduce(torch.zeros(1, device=device))
    vocab = spec.checkpoint.config.vocab_size
    return TensorParallel(spec.rank, spec.size, vocab), StepChannel(cpu_group, None, device)


def connect_store(spec: RankSpec, is_master: bool) -> dist.TCPStore:
    return dist.TCPStore(
        spec.host,
        spec.port,
        spec.size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
        wait_for_workers=False,
    )


def rank_main(spec: RankSpec) -> None:
    """Entry point of a rank process (spawned by rank 0, or by ``run_node`` on another node)."""
    os.environ.update(MULTICAST_OFF_ENV)
    if spec.parent_pid is not None:
        _exit_with_parent(spec.parent_pid, spec.rank)
    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        _serve(spec)
    except BaseException as e:  # noqa: BLE001 - any failure ends this rank, loudly
        traceback.print_exc()
        print(f"ngrammar: tensor-parallel rank {spec.rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: a collective in flight could block it


def _serve(spec: RankSpec) -> None:

    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = connect_store(spec, is_master=False)
    store.add("joined", 1)
    tp, channel = init_group(spec, device, store)
    runner = ModelRunner(
        spec.checkpoint,
        device,
        resolve_dtype(spec.dtype, device),
        spec.num_pages or int(store.get("num_pages")),
        spec.page_size,
        attention_backend(spec.attention_backend, device),
        tp=tp,
    )
    store.add("loaded", 1)
    serve_steps(runner, channel)
    dist.destroy_process_group()


@torch.inference_mode()
def serve_steps(runner: object, channel: StepChannel) -> None:
    """Run rank 0's commands until it says stop (``channel`` lists them)."""
    assert isinstance(runner, ModelRunner)
    while True:
        command = channel.recv()
        kind = command[0]
        if kind == "forward":
            step, ids_shape = command[1], command[2]
            if ids_shape is not None:
                step = dataclasses.replace(step, input_ids=channel.recv_tensor(ids_shape, "torch.int64"))
            runner.forward(step)  # the logits are rank 0's to read
        elif kind == "compact":
            slots_shape, (nodes_shape, nodes_dtype), (lens_shape, lens_dtype) = command[1:]
            nodes = channel.recv_tensor(nodes_shape, nodes_dtype)
            lens = channel.recv_tensor(lens_shape, lens_dtype)
            runner.compact_accepted_kv(runner.last_slots().view(slots_shape), nodes, lens)
        elif kind == "graphs":
            runner.attach_graphs(**command[1])
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown command from rank 0: {kind!r}")


def _exit_with_parent(parent_pid: int, rank: int) -> None:
    """A rank whose engine process vanished (killed, crashed) ends too, instead of waiting forever."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                print(
                    f"ngrammar: tensor-parallel rank {rank}: rank 0 (pid {parent_pid}) is gone; exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    threading.Thread(target=watch, name="ngrammar-parent-watch", daemon=True).start()
