"""Linear layers of one-token steps, with the elementwise op that feeds them fused in.

Why: at batch 1 every kernel of a small model's decoder layer is bound by launch latency, not by
bytes (SmolLM2's largest weight is 3.5 MB, under a microsecond of HBM time on an H200, yet each
kernel costs microseconds of launch latency even inside a CUDA graph). Folding the residual add + RMSNorm into the projection
that consumes it (q/k/v, gate/up) and SiLU·mul into the down projection takes three of the layer's
kernels away. Every program recomputes its rows' norm from the whole input row (hidden-size elements
per row, read from L2), which costs far less than a launch.

One kernel, ``y = prologue(x) @ W.T (+ bias)`` with W [N, K] row-major (nn.Linear's layout):

- ``Prologue.NONE``: prologue(x) = x, x [M, K];
- ``Prologue.NORM``: w_norm * rms_norm(x), x [M, K];
- ``Prologue.ADD_NORM``: w_norm * rms_norm(x + residual); the rounded sum x + residual (the next
  residual stream) is also written, by the programs of the first column block;
- ``Prologue.SILU_MUL``: silu(x[:, :K]) * x[:, K:], x [M, 2K] (gate | up).

The prologue rounds to the storage dtype exactly where ``ngrammar.model.ops.TorchOps`` rounds (the
sum, the normalised row, its product with the norm weight, the SiLU, the SiLU·up product); the
product accumulates in fp32 like cuBLAS, so results agree with the unfused ops up to summation order.

Grid: (column blocks, row blocks). A program multiplies by broadcasting and reducing over K on the
CUDA cores: with no tensor-core tile minimum, column blocks are 4 rows of W wide and a one-token
step's grid covers the SMs several times over.

Where it pays (H200, bf16, ``python -m benchmarks.gpu_bench --parts kernels``): one token and weights
of a few MB, where each projection is faster than the elementwise kernel + cuBLAS pair it replaces. Two tokens are mixed (three of SmolLM2's four projections faster, gate/up slower); with
4-16 tokens, or with an 8B model's weights, cuBLAS wins. ``use_fused_linear`` serves one-token
steps only, which is what the engine was measured with.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tcuda

# The fused kernel serves steps of this many tokens (one-token decode) and weights of at most this
# many elements (SmolLM2's largest is 1.8 M; an 8B model's smallest is 16.8 M).
FUSED_MAX_TOKENS = 1
FUSED_MAX_WEIGHT_ELEMENTS = 4 << 20


class Prologue(enum.IntEnum):
    NONE = 0
    NORM = 1
    ADD_NORM = 2
    SILU_MUL = 3


@triton.jit
def _load_summed(x_rows, r_rows, kk, ok, HAS_RESIDUAL: tl.constexpr):
    """x [+ residual] for columns kk of the block's rows, rounded to the storage dtype."""
    x = tl.load(x_rows + kk[None, :], mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_rows + kk[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _chunk_product(
    x_rows, r_rows, norm_w_ptr, w, inv, kk, row_ok, K, dtype,
    PROLOGUE: tl.constexpr,
):  # fmt: skip
    """prologue(x)[:, kk] @ w.T for one K chunk: [BLOCK_M, BLOCK_N] fp32 (w: [BLOCK_N, BLOCK_K])."""
    k_ok = kk < K
    ok = row_ok[:, None] & k_ok[None, :]
    if PROLOGUE == 3:
        gate = tl.load(x_rows + kk[None, :], mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + kk[None, :], mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        a = (act.to(tl.float32) * up).to(dtype)
    elif PROLOGUE == 1 or PROLOGUE == 2:
        xs = _load_summed(x_rows, r_rows, kk, ok, PROLOGUE == 2)
        normed = (xs.to(tl.float32) * inv[:, None]).to(dtype)
        g = tl.load(norm_w_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        a = (g[None, :] * normed.to(tl.float32)).to(dtype)
    else:
        a = tl.load(x_rows + kk[None, :], mask=ok, other=0.0).to(dtype)
    # [BLOCK_M, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K] summed over K.
    return tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _small_m_linear_kernel(
    x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_x, stride_r, stride_ro, stride_w, stride_o,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
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
    HAS_NORM: tl.constexpr = PROLOGUE == 1 or PROLOGUE == 2
    HAS_RESIDUAL: tl.constexpr = PROLOGUE == 2

    # The first K chunk of this program's weight rows (all of W for K <= BLOCK_K) is loaded before
    # anything else: no kernel writes weights, so under PDL this load overlaps the previous kernel.
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    w_first = tl.load(w_rows + offs_k[None, :], mask=col_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    if PDL:
        # Everything below reads activations the previous kernel wrote, or writes what it may read.
        tcuda.gdc_wait()
        tcuda.gdc_launch_dependents()

    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:
        # Pass 1: the mean square of each row (and, once per row block, the new residual stream).
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            ok = row_ok[:, None] & (kk < K)[None, :]
            xs = _load_summed(x_rows, r_rows, kk, ok, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                if pid_n == 0:
                    ro = res_out_ptr + rows[:, None].to(tl.int64) * stride_ro + kk[None, :]
                    tl.store(ro, xs, mask=ok)
            xf = xs.to(tl.float32)
            sum_sq += tl.sum(xf * xf, axis=1)
        inv = tl.rsqrt(sum_sq / K + eps)

    acc = _chunk_product(x_rows, r_rows, norm_w_ptr, w_first, inv, offs_k, row_ok, K, dtype, PROLOGUE)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + offs_k
        w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & (kk < K)[None, :], other=0.0)
        acc += _chunk_product(x_rows, r_rows, norm_w_ptr, w, inv, kk, row_ok, K, dtype, PROLOGUE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    tl.store(out, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class LinearTiles:
    """Launch shape of one fused linear; every field is a plain int (fixed per CUDA-graph bucket)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def choose_tiles(m: int, n: int, k: int) -> LinearTiles:
    """Four W rows per program and up to 1024 columns of K per load (one load for a 576-wide
    hidden size); two warps for wide outputs. The best of the benchmark's sweep for every SmolLM2
    projection at one token, within run-to-run noise."""
    block_m = _pow2_at_least(min(m, 4))
    block_k = max(16, min(_pow2_at_least(k), 1024 // block_m))
    return LinearTiles(block_m, block_n=4, block_k=block_k, num_warps=2 if n >= 2048 else 4)


def use_fused_linear(m: int, weight: torch.Tensor) -> bool:
    """Whether a step of m tokens through ``weight`` is faster fused (see the module docstring)."""
    return m <= FUSED_MAX_TOKENS and weight.numel() <= FUSED_MAX_WEIGHT_ELEMENTS


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: Prologue = Prologue.NONE,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float | None = None,
    tiles: LinearTiles | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(prologue(x) @ weight.T + bias [M, N], the new residual stream [M, K] for ADD_NORM else None).

    x [M, K] ([M, 2K] for SILU_MUL) with unit stride along its last axis; weight [N, K] contiguous;
    norm_weight [K] and eps for NORM / ADD_NORM; residual [M, K] for ADD_NORM. ``tiles`` overrides the launch
    shape (benchmarks sweep it). ``pdl``: launch with programmatic dependent launch, so the weight
    load overlaps the previous kernel. The caller decides (``TritonOps`` asks
    ``device_info.pdl_for_step``); the instructions need sm_90 or newer.
    """
    m = x.shape[0]
    n, k = weight.shape
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("fused_linear needs unit stride along K")
    want_k = 2 * k if prologue == Prologue.SILU_MUL else k
    if x.shape[1] != want_k:
        raise ValueError(
            f"x has {x.shape[1]} columns, the {prologue.name} prologue of a [{n}, {k}] weight needs {want_k}"
        )
    has_norm = prologue in (Prologue.NORM, Prologue.ADD_NORM)
    if has_norm and (norm_weight is None or eps is None):
        raise ValueError(f"{prologue.name} needs norm_weight and eps")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.stride(0) != 1):
        raise ValueError(f"norm_weight must be a contiguous [{k}] vector, got {tuple(norm_weight.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] vector, got {tuple(bias.shape)}")
    if (prologue == Prologue.ADD_NORM) != (residual is not None):
        raise ValueError("residual is given exactly with ADD_NORM")
    if residual is not None and (residual.shape != (m, k) or residual.stride(-1) != 1):
        raise ValueError(f"residual must be [{m}, {k}] with unit stride along K, got {tuple(residual.shape)}")
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    if m == 0:
        return out, res_out
    t = tiles or choose_tiles(m, n, k)
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
    _small_m_linear_kernel[grid](
        x, r, ro, norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out,
        m, n, k, x.stride(0), r.stride(0), ro.stride(0), weight.stride(0), out.stride(0), eps or 0.0,
        PROLOGUE=int(prologue), HAS_BIAS=bias is not None,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, PDL=pdl, num_warps=t.num_warps,
        launch_pdl=pdl,
    )  # fmt: skip
    return out, res_out


__all__ = ["LinearTiles", "Prologue", "choose_tiles", "fused_linear", "use_fused_linear"]
