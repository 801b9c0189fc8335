"""Fused elementwise kernels of the decoder layer (residual add + RMSNorm, SiLU·mul) and ``TritonOps``.

Why: at batch 1 a decode step of a small model is a chain of ~40 tiny kernels per layer when these
ops run as separate torch ops (RMSNorm alone is seven), and each costs microseconds of launch latency
even inside a CUDA graph. With these kernels a layer is ~11 kernels; with the norm and SiLU·mul folded into the
projections of one-token steps (``ngrammar.kernels.fused_linear``) and RoPE into the K/V write
(``ngrammar.attention.triton``), 6 (two more with Qwen3's q/k norms). Each Triton kernel
rounds exactly where the torch reference (``ngrammar.model.ops.TorchOps``) rounds, so results agree
to the last bit of the storage dtype up to fp32 contraction differences.

Kernels take the storage dtype (bf16 / fp16 / fp32) and compute in fp32. Rows are the packed tokens
of a step; one program per row (per row and column block for SiLU·mul).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import cuda as tcuda

from ngrammar.kernels.device_info import pdl_for_step
from ngrammar.kernels.fused_linear import Prologue, fused_linear, use_fused_linear
from ngrammar.kernels.invariant_linear import invariant_linear


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # out = w * norm(x [+ res]); with a residual, res_out = x + res (rounded to the storage dtype, as
    # torch's ``h = h + out`` is) and the norm is taken of that rounded sum.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)  # a weight: loaded before the PDL wait
    if PDL:
        tcuda.gdc_wait()
        tcuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * inv).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(dtype), mask=ok)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # out = silu(gate) * up with gate = x[:, :n], up = x[:, n:]; silu is rounded to the storage dtype
    # before the product, as torch's ``F.silu(gate) * up`` does.
    if PDL:
        tcuda.gdc_wait()
        tcuda.gdc_launch_dependents()
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
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, n] (unit stride along n) -> (w * norm(x + residual), x + residual or None); ``pdl``:
    programmatic dependent launch (``device_info.pdl_for_step``)."""
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    if t:
        r = residual if residual is not None else x
        ro = res_out if res_out is not None else out
        _rms_norm_kernel[(t,)](
            x, r, weight, out, ro, x.stride(0), r.stride(0), out.stride(0), ro.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n), PDL=pdl,
            num_warps=4 if n <= 4096 else 8, launch_pdl=pdl,
        )  # fmt: skip
    return out, res_out


def silu_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x [T, 2n] (gate | up) -> [T, n]; ``pdl`` as in ``rms_norm``."""
    t, n2 = x.shape
    n = n2 // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = min(triton.next_power_of_2(n), 2048)
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
            x, out, x.stride(0), out.stride(0), n, BLOCK=block, PDL=pdl, launch_pdl=pdl
        )
    return out


class TritonOps:
    """``ngrammar.model.ops.LayerOps`` with Triton kernels.

    Where ``use_fused_linear`` says it pays (one-token steps, small weights) each projection is one
    kernel with its elementwise prologue fused in (``ngrammar.kernels.fused_linear``); elsewhere the
    elementwise kernels above run, then cuBLAS. ``fuse_linear=False`` keeps the unfused path for
    every step (benchmarks compare). ``pdl``: launch the kernels with programmatic dependent launch;
    None: in one-token steps on devices that support it (``device_info.pdl_for_step``).
    """

    def __init__(self, fuse_linear: bool = True, pdl: bool | None = None) -> None:
        self.fuse_linear = fuse_linear
        self.pdl = pdl

    def _fused(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.fuse_linear and use_fused_linear(x.shape[0], weight)

    def _pdl(self, x: torch.Tensor) -> bool:
        return pdl_for_step(x.device, x.shape[0]) if self.pdl is None else self.pdl

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return rms_norm(x, weight, eps, residual, self._pdl(x))

    def norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._fused(x, weight):
            prologue = Prologue.NORM if residual is None else Prologue.ADD_NORM
            return fused_linear(
                x,
                weight,
                bias,
                prologue=prologue,
                norm_weight=norm_weight,
                residual=residual,
                eps=eps,
                pdl=self._pdl(x),
            )
        normed, summed = rms_norm(x, norm_weight, eps, residual, self._pdl(x))
        return F.linear(normed, weight, bias), summed

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._fused(x, weight):
            return fused_linear(x, weight, prologue=Prologue.SILU_MUL, pdl=self._pdl(x))[0]
        return F.linear(silu_and_mul(x, self._pdl(x)), weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._fused(x, weight):
            return fused_linear(x, weight, bias, pdl=self._pdl(x))[0]
        return F.linear(x, weight, bias)


class InvariantOps(TritonOps):
    """``ngrammar.model.ops.LayerOps`` whose every output row is independent of the rows beside it:
    the norm and SiLU·mul kernels above (one program per row and column block, so per row), then
    ``invariant_linear`` (one K order for every row count). ``pdl`` as in ``TritonOps``."""

    def __init__(self, pdl: bool | None = None) -> None:
        super().__init__(fuse_linear=False, pdl=pdl)

    def norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pdl = self._pdl(x)
        normed, summed = rms_norm(x, norm_weight, eps, residual, pdl)
        return invariant_linear(normed, weight, bias, pdl=pdl), summed

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        pdl = self._pdl(x)
        return invariant_linear(silu_and_mul(x, pdl), weight, pdl=pdl)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return invariant_linear(x, weight, bias, pdl=self._pdl(x))


__all__ = ["InvariantOps", "TritonOps", "rms_norm", "silu_and_mul"]
