"""Row-invariant linear layers for CUDA: a row's output does not depend on the rows beside it.

Why: cuBLAS picks its kernel (tile shape, split-K) by the row count M, and the one-token fused
kernel (``fused_linear``) sums on the CUDA cores, so the same token got different bf16 logits alone,
in a batch, in a verify tree or in a prefill chunk, and NGRAM's greedy output drifted from plain
decoding's. Here every M runs the same tensor-core dot over K in ``BLOCK_K``-deep chunks, in order,
with fp32 accumulation: a program computes a ``block_m`` x ``block_n`` tile and rows never meet, so a
row's sums are the same instructions in the same order whatever M is. On the GPU the tile's rows,
columns, warps and prefetch depth only split and schedule the work, so each row count may take the
tiling that runs it fastest (``choose_tiles``); ``BLOCK_K`` is what fixes the numbers. The GPU tests
check both bitwise (tests/test_invariant_kernels.py). Under Triton's CPU interpreter a dot is numpy's
matmul, whose sums depend on the tile's shape: there only tilings numpy sums alike agree (16-wide
tiles do not agree with wider ones). float32 weights multiply in IEEE fp32 (no TF32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tcuda

from ngrammar.kernels.device_info import max_shared_memory

# The depth of each dot in K: changing it changes the numbers.
BLOCK_K = 64


@dataclass(frozen=True)
class InvariantTiles:
    """How one launch splits its work (not its numbers on the GPU): rows and columns per program,
    warps, and how many K chunks are loaded ahead (``num_stages``)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


def choose_tiles(m: int) -> InvariantTiles:
    """The tiling for m rows: narrow column blocks (more programs) and a deep prefetch of K (its loop
    is short and latency-bound) for decode-sized steps, wider tiles (fewer weight re-reads) for
    prefill-sized ones."""
    if m <= 64:
        # 64x16 tiles ran 2.5% faster on an H100 but sum otherwise than 64x64 under the interpreter
        # CI runs the kernel tests with (see the module docstring)
        return InvariantTiles(64, 32, num_stages=6)
    if m <= 256:
        return InvariantTiles(64, 64)
    return InvariantTiles(128, 64, num_warps=8)


# Shared memory kept aside for what is not the K pipeline (the epilogue's layout conversions).
SMEM_RESERVE = 16 << 10


def fit_stages(tiles: InvariantTiles, elem_bytes: int, smem_bytes: int) -> int:
    """The tiling's prefetch depth, cut so its buffers (an x tile and a weight tile per stage) fit the
    device's shared memory: float32 weights or a smaller GPU than Hopper hold fewer stages. The
    depth changes when loads issue, never the sums."""
    per_stage = (tiles.block_m + tiles.block_n) * BLOCK_K * elem_bytes
    return max(1, min(tiles.num_stages, (smem_bytes - SMEM_RESERVE) // per_stage))


@functools.cache
def _launch_stages(tiles: InvariantTiles, elem_bytes: int, device: torch.device) -> int:
    """``fit_stages`` for this device, once per (tiling, element size, device): not per launch."""
    if device.type != "cuda":  # Triton's interpreter: no shared memory to fit
        return tiles.num_stages
    return fit_stages(tiles, elem_bytes, max_shared_memory(device))


@triton.jit(do_not_specialize=["M"])  # one binary per tiling, whatever the row count
def _invariant_linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_x, stride_w, stride_o,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # grid = (column blocks, row blocks): the row blocks of one column block share its weight tile
    # through L2.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    if PDL:  # x comes from the kernel before
        tcuda.gdc_wait()
        tcuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = (kk < K)[None, :]
        a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
    tiles: InvariantTiles | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in weight's dtype; x and weight with unit stride along
    K. ``pdl``: programmatic dependent launch (sm_90+). ``tiles``: a benchmark's override of
    ``choose_tiles`` (any tiling gives the same numbers on the GPU); its prefetch depth is cut to
    what the device's shared memory holds (``fit_stages``)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(
            f"need x [M, K] and weight [N, K] with unit stride along K, got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] vector, got {tuple(bias.shape)}")
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    if m == 0:
        return out
    t = tiles or choose_tiles(m)
    stages = _launch_stages(t, weight.element_size(), x.device)
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
    _invariant_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=BLOCK_K,
        IEEE=weight.dtype == torch.float32, PDL=pdl, num_warps=t.num_warps, num_stages=stages,
        launch_pdl=pdl,
    )  # fmt: skip
    return out


__all__ = ["BLOCK_K", "InvariantTiles", "choose_tiles", "fit_stages", "invariant_linear"]
