"""The data plane: owns the model and the KV pool, turns a host step description into one forward.

The control plane (scheduler, corpus, grammar) describes a step as a ``StepInput`` of plain Python
values; ``ModelRunner`` copies it host->device (never the other way), runs the model and returns
logits on the device. All device->host reads of a step go through ``to_host`` (one sync).
"""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ngrammar.attention.metadata import AttentionBackend, AttentionMetadata, shift_rows
from ngrammar.attention.sdpa import TorchSDPABackend
from ngrammar.model.config import ModelConfig
from ngrammar.model.llama import LlamaForCausalLM
from ngrammar.model.loader import (
    Checkpoint,
    fill_dummy_weights,
    iter_weights,
    load_gguf_q4,
    release_freed_memory,
)
from ngrammar.model.ops import default_ops
from ngrammar.model.parallel import local_model_config
from ngrammar.model.quant import apply_quantization
from ngrammar.model.sharding import iter_shard_weights
from ngrammar.runner.cuda_graph import CUDAGraphRunner, page_table
from ngrammar.runner.mixed_graphs import MixedGraphs
from ngrammar.runner.transfer import to_device

if TYPE_CHECKING:
    from ngrammar.model.parallel import TensorParallel


@dataclass(frozen=True)
class StepInput:
    """One forward over B sequences, each bringing ``len(tokens[b])`` new tokens.

    ``starts[b]`` is the kv index of the first new token (tokens before it are cached);
    ``tree_mask`` ([B, Q, Q] bool, all q equal) replaces the causal mask for tree verify.
    ``input_ids`` ([total tokens] int64, on the device, packed as ``tokens``) is set only for a
    chained step (overlap scheduling): its decode rows' input tokens were sampled by the step before
    and are not on the host yet, so ``tokens`` holds placeholders there and the forward reads these
    instead (a device->device copy; a chained mixed step's prompt chunks are uploaded into it).
    ``offsets`` ([B] int64, on the device; one token per row) is set only for a plain step chained
    out of a verify step: each row's accepted length, not on the host yet, is added to its position
    and kv length on the device (``shift_rows``), and ``max_offset`` bounds it; the page tables
    already cover ``starts[b] + max_offset + 1`` tokens.
    ``device_positions`` ([total tokens] int64) and ``device_tree_mask`` ([B, Q, Q] bool), on the
    device, are set only for a verify step chained out of a plain step still in flight: its trees
    were picked on the device by that step's tokens (``input_ids``), so ``tokens``, ``positions``
    and ``tree_mask`` hold placeholders of the right shapes and the forward reads these instead.
    """

    tokens: list[list[int]]
    positions: list[list[int]]
    starts: list[int]
    page_tables: list[list[int]]
    logits_rows: list[int]  # rows of the packed token batch whose logits are wanted
    tree_mask: np.ndarray | None = None
    input_ids: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    max_offset: int = 0
    device_positions: torch.Tensor | None = None
    device_tree_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.tokens)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return table[dtype]


def resolve_quantization(quantization: str, dtype: str, device: torch.device) -> str:
    """``EngineConfig.quantization`` for this device: ``none``, ``auto`` (the model's own 4-bit
    weights when it has any) or ``int4`` (those, else quantized at load). ``auto`` quantizes only on a
    CPU with ``dtype`` auto: an explicit dtype (``float32`` for the equivalence tests) keeps the
    checkpoint's weights."""
    if quantization == "int4" and device.type != "cpu":
        raise ValueError("quantization int4 runs on the CPU only (its kernels are torch's CPU ones)")
    if quantization == "auto" and (device.type != "cpu" or dtype != "auto"):
        return "none"
    return quantization


def resolve_numerics(config_numerics: str, attention_backend: str, device: torch.device, tp: int) -> bool:
    """Whether the CUDA kernels run row-invariant (``EngineConfig.numerics``): auto means yes on one
    CUDA device with Triton attention. On a CPU the question does not arise (its kernels are)."""
    if device.type != "cuda" or config_numerics == "fast":
        return False
    return config_numerics == "invariant" or (tp == 1 and attention_backend != "sdpa")


@dataclass(frozen=True)
class StepArrays:
    """A step's per-request and per-token attention inputs on the host."""

    q_lens: np.ndarray  # [B] new tokens per request
    kv_lens: np.ndarray  # [B] cached length after the step
    q_start: np.ndarray  # [B + 1] exclusive prefix sum of q_lens
    table: np.ndarray  # [B, pages] page tables, padded with 0
    slots: np.ndarray  # [T] each new token's cache slot, in packed token order


def step_arrays(step: StepInput, page_size: int) -> StepArrays:
    q_lens = np.fromiter(map(len, step.tokens), np.int64, step.batch_size)
    starts = np.asarray(step.starts, dtype=np.int64)
    table = page_table(step.page_tables)
    q_start = np.concatenate([[0], np.cumsum(q_lens)])
    # each new token's row and kv index
    rows = np.repeat(np.arange(step.batch_size), q_lens)
    index = np.arange(q_start[-1]) - np.repeat(q_start[:-1] - starts, q_lens)
    slots = table[rows, index // page_size] * page_size + index % page_size
    return StepArrays(q_lens, starts + q_lens, q_start, table, slots)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return config.num_layers * 2 * config.kv_size * torch.tensor([], dtype=dtype).element_size()


class PendingRead:
    """Host tensors that a started device->host copy fills; ``wait`` returns them once landed."""

    def __init__(
        self, host: list[torch.Tensor], event: torch.cuda.Event | None, hook: Callable[[], None] | None
    ) -> None:
        self._host = host
        self._event = event
        self._hook = hook  # ModelRunner.on_to_host: the test hook sees the read when it is waited on

    def wait(self) -> list[torch.Tensor]:
        if self._hook is not None:
            self._hook()
        if self._event is not None:
            self._event.synchronize()
        return self._host


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero KV pool. On a CPU its memory is an anonymous mapping of its own, whose pages the OS
    maps (zeroed) on first write: the resident size follows the pages in use, not the pool's
    capacity. (``torch.zeros`` writes every byte up front; calloc usually maps fresh pages too, but
    may hand back heap memory it must clear first, which made a whole pool resident in a test run.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8) if nbytes else np.zeros(0, np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)  # (the array keeps the mapping alive)


class ModelRunner:
    def __init__(
        self,
        checkpoint: Checkpoint,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int,
        page_size: int,
        backend: AttentionBackend | None = None,
        quantization: str = "none",
        tp: TensorParallel | None = None,
        dummy: bool = False,
        invariant: bool = False,
    ) -> None:
        """``quantization``: as ``resolve_quantization`` returns it (``none`` with ``tp``);
        ``dummy``: seeded random weights instead of the checkpoint's (``load_format`` dummy);
        ``invariant``: the row-invariant CUDA layer ops (``resolve_numerics``; the backend's
        attention must match)."""
        if tp is not None and quantization != "none":
            raise ValueError("4-bit weights are not sharded for tensor parallelism (quantization none)")
        self.config = checkpoint.config  # the whole model's (vocab_size: the logits' width)
        self.device = device
        self.dtype = dtype
        self.page_size = page_size
        self.backend = backend or TorchSDPABackend()
        self.tp = tp
        self.invariant = invariant
        c = self.config
        weights = iter_weights(checkpoint)
        if tp is not None:  # this rank's heads, KV heads, MLP columns and vocabulary rows only
            c = local_model_config(c, tp.size)
            weights = iter_shard_weights(checkpoint, tp.rank, tp.size)
        with torch.device("meta"):
            model = LlamaForCausalLM(c, self.backend, default_ops(device, invariant), tp)
        model = model.to_empty(device=device).to(dtype)
        model.rotary.__init__(c)  # type: ignore[misc]  # buffers were created on meta; rebuild them for real
        model.rotary.to(device)
        if dummy:
            fill_dummy_weights(model)
        else:
            model.load_hf_weights(weights)
        # Whether the projections and the LM head run on 4-bit weights (model/quant.py).
        self.quantized = quantization != "none" and apply_quantization(
            model, {} if dummy else load_gguf_q4(checkpoint), quantization
        )
        self.model = model.eval()
        if device.type == "cpu":
            release_freed_memory()
        self.kv_cache = zeroed_pool(
            (c.num_layers, 2, num_pages, page_size, c.num_kv_heads, c.head_dim), dtype, device
        )
        self.on_forward: Callable[[], None] | None = None  # test hook: called when a forward is launched
        self.on_to_host: Callable[[], None] | None = None  # test hook: called on every device->host read
        self.graphs: CUDAGraphRunner | None = None  # set by the engine: serves uniform decode/verify steps
        self.mixed: MixedGraphs | None = None  # set by the engine: serves prefill and mixed steps
        # Slot mapping of the last eager forward; None after a graph-served one (or none yet).
        self._last_slots: torch.Tensor | None = None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def attach_graphs(
        self,
        widths: list[int],
        max_batch_size: int,
        kv_len_bound: int,
        dummy_page: int,
        capture: bool,
        acceptor: Callable[..., Any] | None = None,
    ) -> None:
        """Serve uniform decode / verify steps from a ``CUDAGraphRunner``'s static buffers (captured
        here when ``capture``). Tensor-parallel ranks all build the same graphs, in the same order."""
        graphs = CUDAGraphRunner(
            self,
            widths,
            max_batch_size=max_batch_size,
            kv_len_bound=kv_len_bound,
            dummy_page=dummy_page,
            capture=capture,
            acceptor=acceptor,
        )
        if capture:
            graphs.capture_all()
        self.graphs = graphs

    def attach_mixed_graphs(self, max_tokens: int, max_seqs: int, kv_len_bound: int, dummy_page: int) -> None:
        """Serve prefill and mixed steps of up to ``max_tokens`` tokens over ``max_seqs`` requests
        from CUDA graphs, captured here."""
        mixed = MixedGraphs(
            self.model, self.backend, self.kv_cache, max_tokens, max_seqs, kv_len_bound, dummy_page
        )
        mixed.capture_all()
        self.mixed = mixed

    def close(self) -> None:
        """Free the KV pool and the captured graphs now, not when the last reference goes (the
        ranks too with TP); the runner cannot run a step afterwards."""
        self.graphs = None
        self.mixed = None
        self.kv_cache = self.kv_cache.new_empty(0)

    def _tensor(self, values: Sequence[int] | np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def metadata(self, step: StepInput, arrays: StepArrays | None = None) -> AttentionMetadata:
        """The step's attention metadata, built with numpy (no Python loop over tokens: a mixed
        step carries hundreds); ``arrays``: the step's ``step_arrays`` when already built."""
        a = arrays if arrays is not None else step_arrays(step, self.page_size)
        tree = step.device_tree_mask
        if tree is None and step.tree_mask is not None:
            tree = self._tensor(step.tree_mask, torch.bool)
        return AttentionMetadata(
            slot_mapping=self._tensor(a.slots),
            page_table=self._tensor(a.table),
            kv_lens=self._tensor(a.kv_lens),
            q_lens=self._tensor(a.q_lens),
            q_start=self._tensor(a.q_start),
            max_q_len=int(a.q_lens.max()),
            max_kv_len=int(a.kv_lens.max()) + step.max_offset,
            page_size=self.page_size,
            tree_mask=tree,
        )

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Launch the forward of ``step``; returns logits [len(logits_rows), V] float32 (device).

        Uniform steps go through the graph runner when one is set, prefill and mixed steps through
        the mixed-step graphs where they fit (their logits are views that the next step
        overwrites); everything else runs eagerly.
        """
        if self.graphs is not None and self.graphs.accepts(step):
            if self.on_forward is not None:
                self.on_forward()
            self._last_slots = None  # the graph runner's static slots (``last_slots``)
            return self.graphs.forward(step)
        arrays = None
        if self.mixed is not None and step.tree_mask is None:
            arrays = step_arrays(step, self.page_size)
            max_kv_len = int(arrays.kv_lens.max()) + step.max_offset
            if self.mixed.accepts(len(arrays.slots), step.batch_size, max_kv_len, arrays.table.shape[1]):
                return self._mixed_forward(step, arrays, max_kv_len)
        meta = self.metadata(step, arrays)
        self._last_slots = meta.slot_mapping
        if step.input_ids is not None:
            ids = step.input_ids
        else:
            ids = self._tensor([t for toks in step.tokens for t in toks])
        if step.device_positions is not None:
            pos = step.device_positions
        else:
            pos = self._tensor([p for ps in step.positions for p in ps])
        if step.offsets is not None:
            shift_rows(step.offsets, pos, meta.kv_lens, meta.slot_mapping, meta.page_table, self.page_size)
        rows = self._tensor(step.logits_rows)
        if self.on_forward is not None:
            self.on_forward()
        hidden = self.model(ids, pos, self.kv_cache, self.backend.plan(meta))
        return self.model.compute_logits(hidden.index_select(0, rows))

    def _mixed_forward(self, step: StepInput, a: StepArrays, max_kv_len: int) -> torch.Tensor:
        assert self.mixed is not None
        t = len(a.slots)
        ids = np.fromiter(itertools.chain.from_iterable(step.tokens), np.int64, t)
        positions = np.fromiter(itertools.chain.from_iterable(step.positions), np.int64, t)
        rows = self._tensor(step.logits_rows)
        if self.on_forward is not None:
            self.on_forward()
        hidden = self.mixed.forward(
            ids, positions, a.slots, a.q_lens, a.kv_lens, a.table, step.input_ids, step.offsets, max_kv_len
        )
        self._last_slots = self.mixed.last_slots(t)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """The step's one device->host read: copies into (pinned) host memory, waited on at once."""
        return self.to_host_async(*tensors).wait()

    def to_host_async(self, *tensors: torch.Tensor) -> PendingRead:
        """Start the step's one device->host read (non-blocking copies into pinned memory, then an
        event); ``wait`` on the result blocks until the copies land (an event wait, not a device sync)."""
        if self.device.type != "cuda":
            return PendingRead([t.detach() for t in tensors], None, self.on_to_host)
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for dst, src in zip(out, tensors):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingRead(out, event, self.on_to_host)

    def last_slots(self) -> torch.Tensor:
        """[tokens] int64 (device): the flat KV slot each new token of the last forward wrote, in
        packed token order; valid until the next forward (a view of the graph runner's static
        buffer when a graph served it)."""
        if self._last_slots is None:
            assert self.graphs is not None, "no forward has run"
            return self.graphs.last_slots()
        return self._last_slots

    @torch.inference_mode()
    def compact_accepted_kv(self, slots: torch.Tensor, nodes: torch.Tensor, lens: torch.Tensor) -> None:
        """``compact_path_kv`` on this runner's KV pool."""
        compact_path_kv(self.kv_cache, slots, nodes, lens)


@torch.inference_mode()
def compact_path_kv(
    kv_cache: torch.Tensor, slots: torch.Tensor, nodes: torch.Tensor, lens: torch.Tensor
) -> None:
    """Move each request's accepted draft path to the slots right after its prefix, on the device.

    slots [B, W] int64: the KV slot of tree node i of request b in the last verify step (node i
    sits at kv index start + i, so slot j is also where path position j belongs); nodes [B, P]
    (P <= W, at least the longest path): the accepted path's node indices, root first (-1 past
    the path); lens [B]: accepted drafts + 1, so path positions 0..lens-1 are the root and the
    accepted drafts. Afterwards slot slots[b, j] holds the KV of node nodes[b, j] for
    1 <= j < lens[b]; the root is in place already. (A request that keeps fewer tokens - EOS, a
    stop string - has moved KV past its length, which nothing reads.)

    Fixed shapes and no host read: each of the first P positions moves, the ones off the path
    onto themselves (a real row's slots are distinct and never another row's, and all reads
    happen before any write). CUDA-graph padding rows all use the same dummy-page slots, so
    those are written more than once, in no set order; nothing reads the dummy page.

    One gather and one scatter over every layer's K and V at once: the pool viewed as
    [layers * 2, slots, row] indexed on its middle dimension (faster than ``index_select`` /
    ``index_copy_`` on dim 2 of [layers, 2, slots, heads, d])."""
    dst = slots[:, : nodes.shape[1]]
    j = torch.arange(dst.shape[1], device=slots.device)
    on_path = (j >= 1) & (j < lens[:, None])
    src = torch.where(on_path, slots.gather(1, nodes.clamp(min=0)), dst)
    move_kv_slots(kv_cache, dst, src)


@torch.inference_mode()
def move_kv_slots(kv_cache: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the KV at slots ``src`` to slots ``dst`` (same shape, int64) in every layer of
    ``kv_cache`` [layers, 2, pages, page size, kv heads, head dim]; all reads happen before any
    write. (The one-launch acceptor kernel computes ``src`` itself.)"""
    rows = kv_cache.view(kv_cache.shape[0] * 2, kv_cache.shape[2] * kv_cache.shape[3], -1)
    rows[:, dst.reshape(-1)] = rows[:, src.reshape(-1)]
