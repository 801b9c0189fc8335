"""Row-invariant linear layers for CUDA: a row's output does not depend on the rows beside it.

Why: cuBLAS picks its kernel (tile shape, split-K) by the row count M, and the one-token fused
kernel (``fused_linear``) sums on the CUDA cores, so the same token got different bf16 logits alone,
in a batch, in a verify tree or in a prefill chunk, and NGRAM's greedy output drifted from plain
decoding's. Here one tensor-core tiling serves every M: a program computes a ``BLOCK_M`` x
``BLOCK_N`` tile, walking K in ``BLOCK_K`` chunks in order, with the elementwise op that feeds the
projection (RMSNorm, residual add + RMSNorm, SiLU·mul) applied to each chunk as it is loaded. Rows
never meet inside a program, and the tiling, warp count and K order are constants (``TILES``), so
every row runs the same instructions in the same order whatever M is: bitwise row invariance.

The prologue rounds to the storage dtype where ``ngrammar.model.ops.TorchOps`` rounds (the sum, the
normalised row, its product with the norm weight, the SiLU, the SiLU·up product); the row's mean
square is summed over ``[BLOCK_M, BLOCK_K]`` chunks in the same fixed layout. With ADD_NORM the
programs of the first column block also write the rounded sum x + residual (the next residual
stream). float32 weights multiply in IEEE fp32 (no TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tcuda

from ngrammar.kernels.fused_linear import Prologue, _prologue_chunk, _row_inv_rms, check_linear_args


@dataclass(frozen=True)
class InvariantTiles:
    """The one launch shape of every row-invariant projection (changing it changes the numbers)."""

    block_m: int = 64
    block_n: int = 32
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


TILES = InvariantTiles()


@triton.jit(do_not_specialize=["M"])  # one binary for every row count
def _invariant_linear_kernel(
    x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_x, stride_r, stride_ro, stride_w, stride_o,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # grid = (column blocks, row blocks): the row blocks of one column block share its weight tile
    # through L2. M, N and K are runtime ints (no recompile per batch size).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = w_ptr.dtype.element_ty
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    r_rows = res_ptr + rows[:, None].to(tl.int64) * stride_r
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    HAS_NORM: tl.constexpr = PROLOGUE == 1 or PROLOGUE == 2
    HAS_RESIDUAL: tl.constexpr = PROLOGUE == 2
    if PDL:  # activations come from the kernel before
        tcuda.gdc_wait()
        tcuda.gdc_launch_dependents()

    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:
        # Pass 1: each row's mean square (and, in the first column block, the new residual stream).
        ro_rows = res_out_ptr + rows[:, None].to(tl.int64) * stride_ro
        inv = _row_inv_rms(
            x_rows, r_rows, ro_rows, row_ok, K, eps, pid_n == 0, HAS_RESIDUAL, BLOCK_M, BLOCK_K
        )

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = _prologue_chunk(x_rows, r_rows, norm_w_ptr, inv, kk, row_ok, K, dtype, PROLOGUE)
        w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & (kk < K)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    tl.store(out, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: Prologue = Prologue.NONE,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float | None = None,
    pdl: bool = False,
    tiles: InvariantTiles = TILES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(prologue(x) @ weight.T + bias [M, N], the new residual stream [M, K] for ADD_NORM else None);
    the arguments are ``fused_linear``'s. ``pdl``: programmatic dependent launch (sm_90+). ``tiles``:
    the benchmark's sweep only (the engine's numbers are ``TILES``')."""
    check_linear_args(x, weight, bias, prologue, norm_weight, residual, eps)
    m = x.shape[0]
    n, k = weight.shape
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    if m == 0:
        return out, res_out
    t = tiles
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
    _invariant_linear_kernel[grid](
        x, r, ro, norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out,
        m, n, k, x.stride(0), r.stride(0), ro.stride(0), weight.stride(0), out.stride(0), eps or 0.0,
        PROLOGUE=int(prologue), HAS_BIAS=bias is not None,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, IEEE=weight.dtype == torch.float32,
        PDL=pdl, num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return out, res_out


__all__ = ["TILES", "InvariantTiles", "invariant_linear"]
