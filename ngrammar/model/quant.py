"""Weight-only quantized projections on the CPU: a GGUF's 4-bit blocks run as they are.

A GGUF Q4_1 block is 32 weights of one row, ``w = d * q + m`` (q in 0..15; d and m fp16); a Q4_0
block is ``w = d * (q - 8)``. torch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``, group 32)
computes ``w = (q - 8) * scale + zero`` per group (checked by tests/test_quant.py), so a Q4_1 block
maps onto ``scale = d, zero = m + 8 d`` and a Q4_0 block onto ``scale = d, zero = 0``.

A projection's weight is a ``PackedWeight``: the same 4-bit weights in the forms its kernels read
(``int4``: the packed codes; ``fp16``: FBGEMM's packed fp16 of their dequantized values; ``bf16`` /
``fp32``: dense dequantized), and a ``KernelTable`` that names the cheapest kernel per row count,
measured on this machine (``measure_kernels``). Which kernel is cheapest depends on the CPU: on an
AMX / AVX-512 Xeon the int4 kernel wins one-row steps and bf16 wins wide ones; on an AVX2-only CPU
the int4 kernel has no fast path and FBGEMM's fp16 GEMM wins at every width.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ngrammar.model.llama import LlamaForCausalLM

GROUP = 32  # weights per block / per int4 group
KERNELS = ("int4", "int4_bf16", "fp16", "bf16", "fp32")
WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # row-count buckets of the kernel table (wider steps use the last)


@dataclass(frozen=True)
class Q4Weight:
    """A [N, K] weight as 4-bit codes in groups of 32 along K: ``w = (codes - 8) * scale + zero``."""

    codes: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // 32] float32
    zero: torch.Tensor  # [N, K // 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        n, k = self.shape
        q = self.codes.view(n, k // GROUP, GROUP).float() - 8.0
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def rows(self, perm: np.ndarray) -> Q4Weight:
        index = torch.from_numpy(perm)
        return Q4Weight(self.codes[index], self.scale[index], self.zero[index])

    @staticmethod
    def cat(parts: Sequence[Q4Weight]) -> Q4Weight:
        """Stacked along N (the groups run along K, so fused q/k/v or gate/up keep their blocks)."""
        return Q4Weight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )


def q4_from_blocks(data: np.ndarray, kind: str, rows: int, cols: int) -> Q4Weight:
    """GGUF Q4_0 / Q4_1 blocks ([rows, cols // 32 * bytes] uint8) -> ``Q4Weight``.

    A block holds d (fp16), for Q4_1 also m (fp16), then 16 bytes: byte j's low nibble is weight j,
    its high nibble weight j + 16."""
    head = {"Q4_0": 2, "Q4_1": 4}[kind]
    blocks = np.ascontiguousarray(data).reshape(rows, cols // GROUP, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d  # d * q + m = (q - 8) * d + (m + 8 d)
    else:
        zero = np.zeros_like(d)
    return Q4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero))


def q4_to_blocks(w: Q4Weight) -> np.ndarray:
    """``Q4Weight`` -> GGUF Q4_1 blocks [N, K // 32 * 20] uint8 (d = scale, m = zero - 8 scale, in fp16)."""
    n, k = w.shape
    codes = w.codes.numpy().reshape(n, k // GROUP, GROUP)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    d = w.scale.numpy().astype(np.float16)[..., None].view(np.uint8)
    m = (w.zero - 8 * w.scale).numpy().astype(np.float16)[..., None].view(np.uint8)
    return np.concatenate([d, m, qs], axis=-1).reshape(n, -1)


def quantize_q4_1(w: torch.Tensor) -> Q4Weight:
    """[N, K] float -> 4-bit groups of 32 as llama.cpp's Q4_1 (minimum and step per group)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"a 4-bit weight needs K divisible by {GROUP}, got {k}")
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    # Q4_1 stores d and m in fp16: round them the same way, so a quantized folder matches its GGUF.
    d, lo = d.half().float(), lo.half().float()
    return Q4Weight(codes, d, lo + 8 * d)


@dataclass(frozen=True)
class KernelTable:
    """Kernels by preference (cheapest first) per row-count bucket; a weight runs the first one it
    has a form for."""

    widths: tuple[int, ...]
    order: tuple[tuple[str, ...], ...]  # per bucket

    def kernels_for(self, rows: int) -> tuple[str, ...]:
        for width, order in zip(self.widths, self.order):
            if rows <= width:
                return order
        return self.order[-1]

    def first_choices(self) -> set[str]:
        return {o[0] for o in self.order}

    @staticmethod
    def fixed(kernel: str) -> KernelTable:
        """``kernel`` at every width (a weight without that form, as the LM head without codes, runs
        the first dense form it has)."""
        return KernelTable((1,), ((kernel, "fp16", "bf16", "fp32"),))

    def describe(self) -> str:
        return ", ".join(f"<={w}: {o[0]}" for w, o in zip(self.widths, self.order))


def _int4_form(w: Q4Weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 1)  # [N, K / 2] uint8
    scales_zeros = torch.stack([w.scale, w.zero], -1).transpose(0, 1).contiguous().to(dtype)  # [K/32, N, 2]
    return packed, scales_zeros


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def build_form(kernel: str, dense: torch.Tensor, q4: Q4Weight | None) -> Any:
    """The form ``kernel`` reads of a weight: ``dense`` [N, K] float32 (the dequantized values) and,
    for ``int4`` kernels, its 4-bit codes."""
    if kernel in ("int4", "int4_bf16"):
        assert q4 is not None
        return _int4_form(q4, torch.float32 if kernel == "int4" else torch.bfloat16)
    if kernel == "fp16":
        return torch.ops.quantized.linear_prepack_fp16(dense.float().contiguous(), None)
    if kernel == "bf16":
        return dense.to(torch.bfloat16).t().contiguous().t()  # column-major: the GEMM reads it untransposed
    if kernel == "fp32":
        return dense.float().t().contiguous().t()
    raise ValueError(f"unknown kernel {kernel!r}; one of {KERNELS}")


def run_form(kernel: str, form: Any, x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> x @ w.T [T, N], in x's dtype."""
    if kernel == "int4":
        return torch._weight_int4pack_mm_for_cpu(x.float(), form[0], GROUP, form[1]).to(x.dtype)
    if kernel == "int4_bf16":
        return torch._weight_int4pack_mm_for_cpu(x.bfloat16(), form[0], GROUP, form[1]).to(x.dtype)
    if kernel == "fp16":
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), form).to(x.dtype)
    return F.linear(x.to(form.dtype), form).to(x.dtype)


class PackedWeight:
    """One projection's weight [N, K] in the forms its kernels read; ``__call__`` picks the cheapest
    kernel for the step's row count (``KernelTable``)."""

    def __init__(self, forms: dict[str, Any], table: KernelTable, shape: tuple[int, int]) -> None:
        self.forms = forms
        self.table = table
        self.shape = shape

    def kernel_for(self, rows: int) -> str:
        return next(k for k in self.table.kernels_for(rows) if k in self.forms)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kernel = self.kernel_for(x.shape[0])
        out = run_form(kernel, self.forms[kernel], x)
        return out if bias is None else out + bias


def project(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] -> x @ weight.T + bias: a dense weight through ``F.linear``, a packed one its kernel."""
    if isinstance(weight, PackedWeight):
        return weight(x, bias)
    return F.linear(x, weight, bias)


def candidate_kernels(int4: bool) -> tuple[str, ...]:
    """The kernels this torch build offers (FBGEMM's fp16 GEMM is x86-only); int4 ones need 4-bit codes."""
    out = [k for k in KERNELS if int4 or not k.startswith("int4")]
    return tuple(k for k in out if k != "fp16" or fbgemm_available())


_TABLES: dict[tuple[Any, ...], KernelTable] = {}


def measure_kernels(
    sample: Sequence[tuple[torch.Tensor, Q4Weight | None]],
    dtype: torch.dtype,
    kernels: Sequence[str],
    widths: Sequence[int] = WIDTHS,
    repeats: int = 5,
) -> KernelTable:
    """Rank the kernels at every width by their cost on ``sample`` (one layer's projections: dense
    [N, K] and codes), best of ``repeats``. Timed on one thread in thread CPU time, so other processes
    on a shared machine do not skew the ranking. ``$NGRAMMAR_CPU_KERNELS`` (e.g. ``1:int4,64:fp16``:
    the kernel up to each width) overrides it. Cached per process by shapes, dtype and kernels, so
    engines of one process run the same kernels. A kernel 4x slower than the best at a width is
    not timed wider."""
    spec = os.environ.get("NGRAMMAR_CPU_KERNELS")
    if spec:
        return parse_kernel_table(spec)
    key = (tuple(d.shape for d, _ in sample), dtype, tuple(kernels), tuple(widths))
    if key in _TABLES:
        return _TABLES[key]
    forms = {k: [build_form(k, d, q) for d, q in sample] for k in kernels}
    alive = list(kernels)
    order = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for width in widths:
            xs = [torch.randn(width, d.shape[1], dtype=dtype) for d, _ in sample]
            costs = {}
            for k in alive:
                costs[k] = _best_seconds(lambda: [run_form(k, f, x) for f, x in zip(forms[k], xs)], repeats)
            best = min(costs.values())
            alive = [k for k in alive if costs[k] <= 4 * best]
            order.append(tuple(sorted(costs, key=costs.__getitem__)))
    finally:
        torch.set_num_threads(threads)
    table = KernelTable(tuple(widths), tuple(order))
    _TABLES[key] = table
    return table


def parse_kernel_table(spec: str) -> KernelTable:
    """``1:int4,64:fp16`` -> the kernel for up to 1 row, then up to 64 (and wider)."""
    try:
        pairs = [(int(w), k.strip()) for w, k in (p.split(":") for p in spec.split(","))]
    except ValueError as e:
        raise ValueError(f"NGRAMMAR_CPU_KERNELS={spec!r}: want WIDTH:KERNEL,... ({e})") from e
    bad = [k for _, k in pairs if k not in KERNELS]
    if bad or [w for w, _ in pairs] != sorted(w for w, _ in pairs):
        raise ValueError(f"NGRAMMAR_CPU_KERNELS={spec!r}: widths ascending, kernels among {KERNELS}")
    # A weight without 4-bit codes (the LM head) falls back to the first dense kernel named.
    dense = next((k for _, k in pairs if not k.startswith("int4")), "fp32")
    return KernelTable(tuple(w for w, _ in pairs), tuple((k, dense) for _, k in pairs))


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def notice(message: str) -> None:
    """A one-line notice on stderr (a choice the user did not spell out, never silent)."""
    print(f"ngrammar: {message}", file=sys.stderr, flush=True)


def pack_weights(
    weights: Iterable[tuple[str, torch.Tensor, Q4Weight | None]], table: KernelTable
) -> dict[str, PackedWeight]:
    """Build each weight's forms for the kernels that are first choice at some width (and, for a
    weight without codes, the cheapest dense kernel at each width)."""
    out = {}
    for name, dense, q4 in weights:
        wanted = {
            next(k for k in order if q4 is not None or not k.startswith("int4")) for order in table.order
        }
        forms = {k: build_form(k, dense, q4) for k in wanted}
        out[name] = PackedWeight(forms, table, (dense.shape[0], dense.shape[1]))
    return out


def set_kernel_table(model: LlamaForCausalLM, table: KernelTable) -> None:
    """Run every packed weight of ``model`` by ``table`` (each must hold the forms it names)."""
    weights = [m.weight for m in model.projections().values()] + [model.packed_head]
    for w in weights:
        if isinstance(w, PackedWeight):
            w.table = table


def apply_quantization(
    model: LlamaForCausalLM, q4: dict[str, Q4Weight], mode: str, dtype: torch.dtype
) -> KernelTable | None:
    """Replace the projections' weights (and the LM head's) by ``PackedWeight``s, in place.

    ``q4``: the checkpoint's 4-bit weights (Hugging Face names). ``mode`` ``int4``: projections
    without them are quantized at load (Q4_1-style groups); ``auto``: they run dense, and a model
    without any stays as it is. Either way a one-line notice says what happened. Returns the kernel
    table (None: nothing was quantized)."""
    linears = model.projections()
    codes = {n: w for n, w in model.fuse_q4(q4).items() if n in linears}
    missing = [n for n in linears if n not in codes]
    if missing and mode == "int4":
        notice(f"quantizing {len(missing)} of {len(linears)} projections to 4-bit groups of 32 at load")
        codes.update({n: quantize_q4_1(linears[n].weight.detach()) for n in missing})
    elif not codes:
        notice(
            "the model has no 4-bit (Q4_0 / Q4_1) weights: running its own weights unquantized "
            "(--quantization int4 quantizes them at load)"
        )
        return None
    elif missing:
        notice(f"{len(missing)} of {len(linears)} projections have no 4-bit weights and run unquantized")

    def dense(n: str) -> torch.Tensor:  # [N, K] float32: the values every kernel computes with
        return codes[n].dequantize() if n in codes else linears[n].weight.detach().float()

    first = [n for n in linears if n.startswith("layers.0.")]
    sample = [(dense(n), codes.get(n)) for n in first]
    table = measure_kernels(sample, dtype, candidate_kernels(all(q is not None for _, q in sample)))
    del sample
    for n, module in linears.items():  # one weight at a time: no second copy of the model in memory
        packed = pack_weights([(n, dense(n), codes.get(n))], table)[n]
        del module.weight  # the dense parameter goes; the module keeps its bias
        module.weight = packed  # type: ignore[assignment]
    model.packed_head = pack_weights([("head", model.head_weight().detach().float(), None)], table)["head"]
    return table
