"""The row-invariant CUDA kernels (and the attention's fast launches) compile for Hopper (sm_90) on a machine without a GPU: Triton's
own compiler and ptxas, ahead of time, so a kernel that would not build fails here, not on the
first GPU that runs it."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter's kernels are not compiled", allow_module_level=True)
pytest.importorskip("triton.backends.nvidia")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def compile_kernel(
    fn: object,
    types: dict[str, str],
    constexprs: dict[str, object],
    warps: int,
    stages: int = 2,
    target: GPUTarget = HOPPER,
) -> object:
    """The compiled kernel; every argument not in ``constexprs`` typed by ``types`` (default i32)."""
    names = fn.arg_names  # type: ignore[attr-defined]
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})


def compile_for_hopper(
    fn: object, types: dict[str, str], constexprs: dict[str, object], warps: int, stages: int = 2
) -> str:
    """The kernel's PTX for sm_90."""
    return str(compile_kernel(fn, types, constexprs, warps, stages).asm["ptx"])  # type: ignore[attr-defined]


def invariant_linear_constexprs(block_m: int, block_n: int, ieee: bool, pdl: bool) -> dict[str, object]:
    from ngrammar.kernels.invariant_linear import BLOCK_K

    return {
        "HAS_BIAS": True,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": BLOCK_K,
        "IEEE": ieee,
        "PDL": pdl,
    }


@pytest.mark.parametrize("m", [1, 100, 300])
def test_the_invariant_linear_compiles_to_wgmma(m: int) -> None:
    """Each tiling ``choose_tiles`` picks, as the engine launches it."""
    from ngrammar.kernels.invariant_linear import _invariant_linear_kernel, choose_tiles

    t = choose_tiles(m)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    cex = invariant_linear_constexprs(t.block_m, t.block_n, ieee=False, pdl=True)
    assert "wgmma" in compile_for_hopper(_invariant_linear_kernel, types, cex, t.num_warps, t.num_stages)


AMPERE_SMEM = 101376  # sm_86 / sm_89: 99 KiB of shared memory per block (opt-in)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("m", [1, 100, 300])
def test_the_invariant_linear_fits_a_smaller_gpu(m: int, dtype: str) -> None:
    """With the prefetch depth ``fit_stages`` gives, every tiling fits an sm_86 card's shared memory,
    float32 weights included (six stages of a float32 tile would not)."""
    from ngrammar.kernels.invariant_linear import _invariant_linear_kernel, choose_tiles, fit_stages

    t = choose_tiles(m)
    stages = fit_stages(t, 2 if dtype == "bf16" else 4, AMPERE_SMEM)
    types = dict.fromkeys(("x_ptr", "w_ptr", "bias_ptr", "out_ptr"), f"*{dtype}")
    cex = invariant_linear_constexprs(t.block_m, t.block_n, ieee=dtype == "fp32", pdl=False)
    kernel = compile_kernel(
        _invariant_linear_kernel, types, cex, t.num_warps, stages, GPUTarget("cuda", 86, 32)
    )
    assert kernel.metadata.shared <= AMPERE_SMEM, (t, stages, kernel.metadata.shared)  # type: ignore[attr-defined]


def test_fit_stages_keeps_hopper_tilings_and_cuts_only_what_does_not_fit() -> None:
    from ngrammar.kernels.invariant_linear import InvariantTiles, choose_tiles, fit_stages

    hopper = 232448
    for m in (1, 100, 300):
        assert fit_stages(choose_tiles(m), 2, hopper) == choose_tiles(m).num_stages
        assert fit_stages(choose_tiles(m), 4, hopper) == choose_tiles(m).num_stages
    assert fit_stages(InvariantTiles(64, 32, num_stages=6), 2, AMPERE_SMEM) == 6
    assert fit_stages(InvariantTiles(64, 32, num_stages=6), 4, AMPERE_SMEM) == 3
    assert fit_stages(InvariantTiles(128, 64, num_warps=8), 4, AMPERE_SMEM) == 1


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
@pytest.mark.parametrize(
    "tree,varlen", [(False, False), (True, False), (False, True)], ids=["causal", "tree", "varlen"]
)
def test_the_attention_compiles(tree: bool, varlen: bool, invariant: bool) -> None:
    from ngrammar.attention.triton import INVARIANT_SPLIT_TILES, _paged_attention_kernel

    types = {
        **{n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")},
        "part_o_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
        "counter_ptr": "*i32",
        **{n: "*i64" for n in ("q_start_ptr", "q_lens_ptr", "kv_lens_ptr", "page_table_ptr")},
        "tree_mask_ptr": "*u8",
        "qk_scale": "fp32",
    }
    cex = dict(
        GROUP=3, HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, PAGE_SIZE=16, MIN_TILES=2, SPLIT_OUTPUT=True,
        MERGE_IN_KERNEL=invariant, HAS_TREE=tree, IEEE_DOT=False, PDL=False, INVARIANT=invariant,
        SPLIT_TILES=INVARIANT_SPLIT_TILES if invariant else 0, TREE_POW2=16 if tree and invariant else 1,
        VARLEN=varlen,
    )  # fmt: skip
    assert compile_for_hopper(_paged_attention_kernel, types, cex, 4)
