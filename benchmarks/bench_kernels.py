"""GPU kernel benchmark: the fused small-step linear kernel and whole decode / verify steps.

Part 1 (``linear``): every projection shape of SmolLM2-135M and of Llama-3-8B at 1-16 tokens, timed
inside a CUDA graph of back-to-back calls (as the model runs them): the fused kernel with the tiles
``choose_tiles`` picks, the best tiles of a small sweep, and the unfused pair it replaces (Triton
RMSNorm or SiLU·mul, then cuBLAS). Prints µs per call and the weight bandwidth it reaches.
Part ``invariant``: the row-invariant projection's candidate tilings against the fast path.
Part 2 (``steps``): random-weight models of both shapes, one decode (q = 1) or verify (q = 16) step
as a CUDA graph, per kernel set: unfused, fused projections, fused with PDL, and the row-invariant
numerics (``--numerics invariant``); ms per step and tok/s of decoding.

    python -m benchmarks.gpu_bench --parts kernels --out $OUT/kernels.json
    python -m benchmarks.gpu_bench --parts kernel_steps --out $OUT/kernels.json   (steps only)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import print_table
from ngrammar.model.config import ModelConfig

SMOLLM2_SHAPE = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position=8192,
    tie_word_embeddings=True,
)


def graph_us(fn: Callable[[], Any], calls: int = 50, replays: int = 20) -> float:
    """Median µs per call of ``fn`` captured ``calls`` times back to back in one CUDA graph."""
    from benchmarks.gpu_bench import cuda_seconds

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return cuda_seconds(graph.replay, replays) * 1e6 / calls


def _projections(c: ModelConfig) -> list[tuple[str, int, int, Any]]:
    from ngrammar.kernels.fused_linear import Prologue

    return [
        ("qkv", c.q_size + 2 * c.kv_size, c.hidden_size, Prologue.ADD_NORM),
        ("o", c.hidden_size, c.q_size, Prologue.NONE),
        ("gate_up", 2 * c.intermediate_size, c.hidden_size, Prologue.ADD_NORM),
        ("down", c.hidden_size, c.intermediate_size, Prologue.SILU_MUL),
    ]


def _sweep(m: int) -> list[Any]:
    from ngrammar.kernels.fused_linear import LinearTiles

    block_m = 1 << (min(m, 4) - 1).bit_length()
    return [
        LinearTiles(block_m, bn, bk, w)
        for bn, bk, w in itertools.product((2, 4, 8), (256, 512, 1024), (1, 2, 4))
        if block_m * bk <= 1024
    ]


def bench_linear(shapes: dict[str, ModelConfig], ms: tuple[int, ...] = (1, 2, 4, 16)) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from ngrammar.kernels.device_info import pdl_supported
    from ngrammar.kernels.fused_linear import Prologue, choose_tiles, fused_linear
    from ngrammar.kernels.fused_ops import rms_norm, silu_and_mul

    dev, dt = torch.device("cuda"), torch.bfloat16
    pdl = pdl_supported(dev)
    rows = []
    for model, cfg in shapes.items():
        for name, n, k, prologue in _projections(cfg):
            w = torch.randn(n, k, device=dev, dtype=dt) * k**-0.5
            g = torch.ones(k, device=dev, dtype=dt)
            for m in ms:
                x = torch.randn(m, 2 * k if prologue == Prologue.SILU_MUL else k, device=dev, dtype=dt)
                res = torch.randn(m, k, device=dev, dtype=dt) if prologue == Prologue.ADD_NORM else None
                norm_w = g if prologue == Prologue.ADD_NORM else None

                def fused(tiles: Any = None, pdl: bool = False) -> Any:
                    return fused_linear(
                        x,
                        w,
                        prologue=prologue,
                        norm_weight=norm_w,
                        residual=res,
                        eps=1e-5,
                        tiles=tiles,
                        pdl=pdl,
                    )

                def unfused() -> Any:
                    if prologue == Prologue.ADD_NORM:
                        return F.linear(rms_norm(x, g, 1e-5, res)[0], w)
                    if prologue == Prologue.SILU_MUL:
                        return F.linear(silu_and_mul(x), w)
                    return F.linear(x, w)

                chosen = choose_tiles(m, n, k)
                best_us, best = graph_us(fused), chosen
                sweep = _sweep(m) if m == 1 else []
                for tiles in sweep:
                    try:
                        us = graph_us(lambda t=tiles: fused(t), calls=20, replays=10)
                    except Exception:  # a tile that does not fit (shared memory, registers) is skipped
                        continue
                    if us < best_us:
                        best_us, best = us, tiles
                chosen_us = graph_us(fused)
                # Back-to-back calls in one graph: with PDL each call's weight load overlaps the last call.
                pdl_us = graph_us(lambda: fused(pdl=True)) if pdl else None
                cublas_us = graph_us(unfused)
                wbytes = n * k * 2
                rows.append(
                    {
                        "model": model,
                        "proj": name,
                        "m": m,
                        "n": n,
                        "k": k,
                        "chosen_us": chosen_us,
                        "pdl_us": pdl_us,
                        "chosen": repr(chosen),
                        "best_us": min(best_us, chosen_us),
                        "best": repr(best),
                        "unfused_us": cublas_us,
                        "chosen_gb_s": wbytes / chosen_us / 1e3,
                        "unfused_gb_s": wbytes / cublas_us / 1e3,
                    }
                )
    print_table(
        "fused linear vs unfused (elementwise kernel + cuBLAS), µs per call in a CUDA graph",
        ["model", "proj", "m", "fused", "fused+PDL", "best sweep", "unfused", "fused GB/s", "best tiles"],
        [
            [
                r["model"],
                r["proj"],
                r["m"],
                r["chosen_us"],
                r["pdl_us"] or "",
                r["best_us"],
                r["unfused_us"],
                r["chosen_gb_s"],
                r["best"],
            ]
            for r in rows
        ],
    )
    return rows


def bench_invariant_linear(
    shapes: dict[str, ModelConfig], ms: tuple[int, ...] = (1, 16, 64, 512)
) -> list[dict[str, Any]]:
    """Each projection with its norm or SiLU·mul through ``InvariantOps`` (row-invariant) against
    ``TritonOps`` (the fast path: the fused kernel at one token, else Triton norm / SiLU·mul +
    cuBLAS), µs per call in a CUDA graph; then the bare invariant GEMM under other tilings, marked
    "=" where its output is bitwise that of ``choose_tiles``' tiling (the claim the kernel rests on)."""
    from ngrammar.kernels.fused_linear import Prologue
    from ngrammar.kernels.fused_ops import InvariantOps, TritonOps
    from ngrammar.kernels.invariant_linear import InvariantTiles, invariant_linear

    candidates = [
        InvariantTiles(16, 32),
        InvariantTiles(16, 64),
        InvariantTiles(32, 32),
        InvariantTiles(64, 16),
        InvariantTiles(64, 16, num_stages=6),
        InvariantTiles(64, 32, num_stages=6),
        InvariantTiles(64, 32),
        InvariantTiles(64, 64),
        InvariantTiles(128, 64, num_warps=8),
        InvariantTiles(128, 128, num_warps=8),
    ]
    dev, dt = torch.device("cuda"), torch.bfloat16
    ops = {"fast": TritonOps(), "invariant": InvariantOps()}
    rows = []
    for model, cfg in shapes.items():
        for name, n, k, prologue in _projections(cfg):
            w = torch.randn(n, k, device=dev, dtype=dt) * k**-0.5
            g = torch.ones(k, device=dev, dtype=dt)
            for m in ms:
                x = torch.randn(m, 2 * k if prologue == Prologue.SILU_MUL else k, device=dev, dtype=dt)
                res = torch.randn(m, k, device=dev, dtype=dt) if prologue == Prologue.ADD_NORM else None
                row: dict[str, Any] = {"model": model, "proj": name, "m": m}
                for label, op in ops.items():

                    def call(op: Any = op) -> Any:
                        if prologue == Prologue.ADD_NORM:
                            return op.norm_linear(x, res, g, 1e-5, w, None)
                        if prologue == Prologue.SILU_MUL:
                            return op.silu_mul_linear(x, w)
                        return op.linear(x, w)

                    row[f"{label}_us"] = graph_us(call)
                a = torch.randn(m, k, device=dev, dtype=dt)
                want = invariant_linear(a, w)
                for t in candidates:
                    try:
                        us = graph_us(lambda t=t: invariant_linear(a, w, tiles=t), calls=20, replays=10)
                        row[repr(t)] = (
                            f"{us:.1f}{'=' if torch.equal(invariant_linear(a, w, tiles=t), want) else '≠'}"
                        )
                    except Exception as e:  # a tiling that does not fit is reported, not fatal
                        row[repr(t)] = f"{type(e).__name__}"
                rows.append(row)
    names = [repr(t) for t in candidates]
    print_table(
        "row-invariant projection (InvariantOps) vs the fast path (TritonOps), µs per call in a CUDA "
        "graph; then the bare invariant GEMM per tiling (block_m,block_n,warps,stages), = bitwise as chosen",
        [
            "model",
            "proj",
            "m",
            "fast",
            "invariant",
            *[f"{t.block_m},{t.block_n},{t.num_warps},{t.num_stages}" for t in candidates],
        ],
        [
            [r["model"], r["proj"], r["m"], r["fast_us"], r["invariant_us"], *[r[c] for c in names]]
            for r in rows
        ],
    )
    return rows


def bench_steps(
    shapes: dict[str, ModelConfig],
    batches: tuple[int, ...] = (1, 8, 32),
    qs: tuple[int, ...] = (1, 16),
    ctx: int = 512,
    kv_len_bound: int = 8192,
) -> dict[str, Any]:
    """Plans are built for kv_len_bound, as the engine's CUDA graphs are (SmolLM2's context is 8192).
    Variants: unfused, fused projections, fused with programmatic dependent launch (PDL: each
    Triton kernel starts, and loads its weights, while the one before finishes), and the
    row-invariant numerics (``--numerics invariant``: ``InvariantOps`` and the attention's invariant
    launches, PDL as the engine sets it)."""
    from benchmarks.gpu_bench import random_model, step_time
    from ngrammar.attention.triton import TritonAttentionBackend
    from ngrammar.kernels.device_info import pdl_supported
    from ngrammar.kernels.fused_ops import InvariantOps, TritonOps

    variants: list[tuple[str, Callable[[], tuple[Any, Any]]]] = [
        ("unfused", lambda: (TritonOps(fuse_linear=False, pdl=False), TritonAttentionBackend(pdl=False))),
        ("fused", lambda: (TritonOps(fuse_linear=True, pdl=False), TritonAttentionBackend(pdl=False))),
    ]
    if pdl_supported(torch.device("cuda")):
        variants.append(("fused+PDL", lambda: (TritonOps(pdl=True), TritonAttentionBackend(pdl=True))))
    variants.append(("invariant", lambda: (InvariantOps(), TritonAttentionBackend(invariant=True))))
    res: dict[str, Any] = {}
    rows = []
    for model_name, cfg in shapes.items():
        for label, build in variants:
            model, backend = random_model(cfg, *build())
            for bs in batches:
                for q in qs:
                    if bs * q > 512:
                        continue
                    ms = step_time(model, backend, cfg, bs, q, ctx, kv_len_bound) * 1e3
                    res[f"{model_name}/{label}/b{bs}/q{q}_ms"] = ms
                    rows.append([model_name, label, bs, q, ms, bs / ms * 1e3])
            del model
            torch.cuda.empty_cache()
    print_table(
        f"decode (q=1) / verify (q=16) step, random weights, context {ctx}, plan for {kv_len_bound}",
        ["model", "kernels", "batch", "q", "ms", "decode tok/s (q=1)"],
        rows,
    )
    return res


def bench_decode_splits(
    cfg: ModelConfig,
    caps: tuple[int, ...] = (4, 8, 16, 64),
    contexts: tuple[int, ...] = (128, 512, 1024, 2048, 4096),
    q: int = 1,
) -> dict[str, Any]:
    """Batch-1 step of q tokens per request (1: decode; more: a tree verify) against the context
    length with the split-KV count capped: how the attention's serial tile loop trades against
    the merge (the last split's at q = 1, the merge kernel's for tree verify)."""
    from benchmarks.gpu_bench import random_model, step_time
    from ngrammar.attention.triton import TritonAttentionBackend

    res: dict[str, Any] = {}
    rows = []
    for cap in caps:
        model, backend = random_model(cfg, backend=TritonAttentionBackend(max_kv_splits=cap))
        row: list[Any] = [cap]
        for ctx in contexts:
            ms = step_time(model, backend, cfg, 1, q, ctx, 8192) * 1e3
            res[f"cap{cap}/ctx{ctx}_ms"] = ms
            row.append(ms)
        rows.append(row)
        del model
        torch.cuda.empty_cache()
    print_table(
        f"batch-1 step of {q} token(s) per request, ms by split cap (rows) and context (columns)",
        ["max splits"] + [str(c) for c in contexts],
        rows,
    )
    return res


def run(parts: tuple[str, ...] = ("linear", "steps")) -> dict[str, Any]:
    from benchmarks.gpu_bench import LLAMA3_8B

    shapes = {"smollm2": SMOLLM2_SHAPE, "llama3_8b": LLAMA3_8B}
    out: dict[str, Any] = {}
    if "linear" in parts:
        out["linear"] = bench_linear(shapes)
    if "steps" in parts:
        out["steps"] = bench_steps(shapes)
    if "invariant" in parts:
        out["invariant_linear"] = bench_invariant_linear(shapes)
    if "splits" in parts:
        out["splits"] = bench_decode_splits(SMOLLM2_SHAPE)
    if "verify_splits" in parts:
        out["verify_splits"] = bench_decode_splits(SMOLLM2_SHAPE, caps=(1, 2, 4, 8, 16, 64), q=16)
    return out
