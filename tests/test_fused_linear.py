"""The fused small-step linear kernel (``ngrammar.kernels.fused_linear``) against unfused torch ops.

On a CUDA machine: ``pytest -m gpu tests/test_fused_linear.py``; without a GPU, under Triton's CPU
interpreter: ``NGRAMMAR_TRITON_INTERPRET=1 pytest -m gpu tests/test_fused_linear.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEVICE, INTERPRET

from ngrammar.kernels.fused_linear import LinearTiles, Prologue, choose_tiles, fused_linear, use_fused_linear
from ngrammar.model.ops import TorchOps

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
REF = TorchOps()


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * max(want.float().abs().max().item(), 1.0), err


def _reference(
    prologue: Prologue,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    g: torch.Tensor | None,
    res: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    summed = None
    if prologue == Prologue.SILU_MUL:
        a = REF.silu_and_mul(x)
    elif prologue == Prologue.NONE:
        a = x
    else:
        assert g is not None
        a, summed = REF.rms_norm(x, g, 1e-5, res)
    return F.linear(a, w, b), summed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", list(Prologue))
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (3, 100, 200), (8, 96, 64), (16, 70, 130)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_linear_matches_unfused_ops(
    dtype: torch.dtype, prologue: Prologue, m: int, n: int, k: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(m * n + k + int(prologue))
    x_cols = 2 * k if prologue == Prologue.SILU_MUL else k
    x = (torch.randn(m, x_cols, generator=gen) * 2).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if with_bias else None
    g = (torch.rand(k, generator=gen) + 0.5).to(DEVICE, dtype)
    res = torch.randn(m, k, generator=gen).to(DEVICE, dtype) if prologue == Prologue.ADD_NORM else None
    has_norm = prologue in (Prologue.NORM, Prologue.ADD_NORM)
    got, got_sum = fused_linear(
        x, w, b, prologue=prologue, norm_weight=g if has_norm else None, residual=res, eps=1e-5
    )
    want, want_sum = _reference(prologue, x, w, b, g, res)
    _close(got, want, dtype)
    if prologue == Prologue.ADD_NORM:
        assert got_sum is not None and want_sum is not None
        assert torch.equal(got_sum, want_sum)  # one rounding of the same fp32 sum
    else:
        assert got_sum is None


@pytest.mark.parametrize(
    "tiles", [LinearTiles(1, 4, 64, 4), LinearTiles(2, 16, 256, 2), LinearTiles(4, 64, 32, 4)]
)
def test_every_tiling_gives_the_same_result(tiles: LinearTiles) -> None:
    """Column blocks narrower or wider than N, K split over several loads, rows padded to a tile."""
    gen = torch.Generator().manual_seed(7)
    m, n, k = 2, 50, 300
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    res = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    g = torch.rand(k, generator=gen).to(DEVICE)
    got, got_sum = fused_linear(
        x, w, prologue=Prologue.ADD_NORM, norm_weight=g, residual=res, eps=1e-6, tiles=tiles
    )
    want, want_sum = _reference(Prologue.ADD_NORM, x, w, None, g, res)
    _close(got, want, torch.float32)
    assert got_sum is not None and want_sum is not None and torch.equal(got_sum, want_sum)


def test_bad_shapes_raise() -> None:
    x = torch.zeros(1, 8, device=DEVICE)
    w = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="needs 16"):
        fused_linear(x, w, prologue=Prologue.SILU_MUL)
    with pytest.raises(ValueError, match="norm_weight"):
        fused_linear(x, w, prologue=Prologue.NORM)
    g = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="eps"):
        fused_linear(
            x, w, prologue=Prologue.NORM, norm_weight=g
        )  # eps = 0 would divide by zero on a zero row
    with pytest.raises(ValueError, match="residual"):
        fused_linear(x, w, prologue=Prologue.NORM, norm_weight=g, residual=x, eps=1e-5)
    with pytest.raises(ValueError, match="residual must be"):
        fused_linear(
            x,
            w,
            prologue=Prologue.ADD_NORM,
            norm_weight=g,
            residual=torch.zeros(2, 8, device=DEVICE),
            eps=1e-5,
        )
    with pytest.raises(ValueError, match="norm_weight must be"):
        fused_linear(x, w, prologue=Prologue.NORM, norm_weight=torch.ones(4, device=DEVICE), eps=1e-5)
    with pytest.raises(ValueError, match="bias must be"):
        fused_linear(x, w, torch.zeros(8, device=DEVICE))


def test_empty_step_launches_nothing() -> None:
    out, _ = fused_linear(torch.zeros(0, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))
    assert out.shape == (0, 4)


def test_tile_choice_and_when_to_fuse() -> None:
    t = choose_tiles(1, 960, 576)
    assert t.block_m == 1 and t.block_k >= 576  # the whole hidden row in one load
    assert -(-960 // t.block_n) >= 132  # enough programs to cover an H200's SMs
    assert choose_tiles(3, 960, 576).block_m == 4
    small, big = torch.empty(960, 576, device="meta"), torch.empty(6144, 4096, device="meta")
    assert use_fused_linear(1, small)
    assert not use_fused_linear(2, small)  # one-token steps only (2 tokens: mixed; 4+: cuBLAS wins)
    assert not use_fused_linear(1, big)  # and for an 8B model's weights
