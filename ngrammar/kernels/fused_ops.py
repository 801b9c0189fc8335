"""Fused elementwise kernels of the decoder layer: residual add + RMSNorm, RoPE on q and k, SiLU·mul.

Why: at batch 1 a decode step of a small model is a chain of ~40 tiny kernels per layer when these
ops run as separate torch ops (RMSNorm alone is seven), and on an H200 each costs ~2 µs even inside a
CUDA graph. Fused, a layer is ~11 kernels. Each Triton kernel rounds exactly where the torch reference
(``ngrammar.model.llama``) rounds, so results agree to the last bit of the storage dtype up to fp32
contraction differences.

Kernels take the storage dtype (bf16 / fp16 / fp32) and compute in fp32. Rows are the packed tokens
of a step; one program per row (per row and column block for SiLU·mul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # out = w * norm(x [+ res]); with a residual, res_out = x + res (rounded to the storage dtype, as
    # torch's ``h = h + out`` is) and the norm is taken of that rounded sum.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * inv).to(dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(dtype), mask=ok)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr,
    stride_xt, stride_xh, stride_ct, stride_st,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    # In place, rotate-half RoPE of every head of token t: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    d_ok = d < HALF
    ok = (h < num_heads)[:, None] & d_ok[None, :]
    c = tl.load(cos_ptr + t * stride_ct + d, mask=d_ok, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_st + d, mask=d_ok, other=0.0)[None, :]
    p1 = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(p1, mask=ok, other=0.0)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0)
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, (a * c - b * s).to(dtype), mask=ok)
    tl.store(p1 + HALF, (b * c + a * s).to(dtype), mask=ok)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    # out = silu(gate) * up with gate = x[:, :n], up = x[:, n:]; silu is rounded to the storage dtype
    # before the product, as torch's ``F.silu(gate) * up`` does.
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0)
    dtype = g.dtype
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(dtype), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, n] (unit stride along n) -> (w * norm(x + residual), x + residual or None)."""
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    if t:
        r = residual if residual is not None else x
        ro = res_out if res_out is not None else out
        _rms_norm_kernel[(t,)](
            x, r, weight, out, ro, x.stride(0), r.stride(0), out.stride(0), ro.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
            num_warps=4 if n <= 4096 else 8,
        )  # fmt: skip
    return out, res_out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: x [T, H, d] (unit stride along d; heads may be strided views of a fused qkv row),
    cos / sin [T, 1, d/2] or [T, d/2] fp32."""
    t, heads, d = x.shape
    if not t:
        return
    half = d // 2
    _rope_kernel[(t,)](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), heads,
        HALF=half, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half),
    )  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2n] (gate | up) -> [T, n]."""
    t, n2 = x.shape
    n = n2 // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = min(triton.next_power_of_2(n), 2048)
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out



class TritonOps:
    """``ngrammar.model.ops.ElementwiseOps`` with the kernels above."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return rms_norm(x, weight, eps, residual)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _adjacent_heads(q, k):
            # k's heads follow q's in the fused qkv row: one launch over both.
            rope_(q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride()), cos, sin)
        else:
            rope_(q, cos, sin)
            rope_(k, cos, sin)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether k [T, Hkv, d] is the continuation of q [T, Hq, d] in memory (same row stride)."""
    # The token stride only matters with more than one token (a [1, H, d] view may report any).
    return (
        q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and (q.shape[0] == 1 or q.stride(0) == k.stride(0))
        and q.stride(1) == k.stride(1)
        and q.stride(2) == k.stride(2) == 1
        and q.shape[0] == k.shape[0]
        and q.shape[2] == k.shape[2]
        and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size()
    )


__all__ = ["TritonOps", "rms_norm", "rope_", "silu_and_mul"]
