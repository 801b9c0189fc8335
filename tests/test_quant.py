"""Weight-only 4-bit projections on the CPU (ngrammar/model/quant.py).

GGUF Q4_0 / Q4_1 / Q8_0 blocks round-tripping, the packed weight against the dequantized one (the
bound of its int8 activations), the notice for a model without 4-bit
weights, perplexity within 1% of the float32 model. Row invariance: tests/test_row_invariance.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ngrammar import LLM
from ngrammar.model.loader import Checkpoint, load_gguf_q4
from ngrammar.model.quant import (
    PackedWeight,
    q4_from_blocks,
    q4_to_blocks,
    quantize_q4_1,
    quantize_q8_0,
)
from ngrammar.runner.model_runner import StepInput, resolve_quantization

# The rounding bound on a logit of the 4-bit model against the float32 one (the same weights,
# dequantized): int8 activation blocks into the projections (int16 into the head) move SmolLM2's
# logits by up to about 1.2.
LOGIT_BOUND = 2.0


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_as_gguf_does_and_round_trip(kind: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    rows, cols = 8, 96
    head = 2 if kind == "Q4_0" else 4
    blocks = rng.integers(0, 256, (rows, cols // 32, head + 16), dtype=np.uint8)
    d = (rng.random((rows, cols // 32)) * 0.02).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    if kind == "Q4_1":
        blocks[..., 2:4] = (
            (rng.standard_normal((rows, cols // 32)) * 0.1).astype(np.float16)[..., None].view(np.uint8)
        )
    data = blocks.reshape(rows, -1)
    w = q4_from_blocks(data, kind, rows, cols)
    ref = dequantize(data, GGMLQuantizationType[kind]).reshape(rows, cols)
    assert np.abs(w.dequantize().numpy() - ref).max() <= 1e-6 * np.abs(ref).max()
    if kind == "Q4_1":
        assert np.array_equal(q4_to_blocks(w), data)  # d and m come back bit for bit


def test_quantize_q4_1_error_is_half_a_step_and_blocks_round_trip() -> None:
    w = torch.randn(16, 128)
    q = quantize_q4_1(w)
    step = q.scale.repeat_interleave(32, 1)
    assert ((q.dequantize() - w).abs() <= step * 0.5 + 2e-3 * w.abs().amax(1, keepdim=True)).all()
    back = q4_from_blocks(q4_to_blocks(q), "Q4_1", 16, 128)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scale, q.scale)
    assert torch.allclose(back.zero, q.zero, rtol=0, atol=1e-3 * q.scale.max().item())


def activation_bound(x: torch.Tensor, w_abs: torch.Tensor) -> torch.Tensor:
    """|block_linear(x) - x @ w.T| bound for weights |w| [N, K]: each activation is off by at most
    half its block's step (amax / 127 / 2) once quantized to int8; plus float32 rounding."""
    m, k = x.shape
    half_step = (x.abs().view(m, -1, 32).amax(-1) / 254).repeat_interleave(32, 1)
    return half_step.double() @ w_abs.double().T + 1e-5 * (x.abs().double() @ w_abs.double().T) + 1e-6


def test_packed_weight_matches_the_dequantized_weights(checkpoint: Checkpoint) -> None:
    q4 = load_gguf_q4(checkpoint)["model.layers.0.mlp.gate_proj.weight"]
    dense = q4.dequantize()
    x = torch.randn(5, dense.shape[1])
    out = PackedWeight(q4)(x)
    ref = x.double() @ dense.double().T
    err = (out.double() - ref).abs()
    assert (err <= activation_bound(x, dense.abs())).all(), err.max()


def test_q8_0_blocks_round_trip_and_run_as_their_blocks() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rows, cols = 16, 128
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    blocks = quantize(w, GGMLQuantizationType.Q8_0)
    gguf_w = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(rows, cols))
    codes, d = quantize_q8_0(gguf_w)
    back = (codes.float().view(rows, -1, 32) * d[..., None]).view(rows, cols)
    assert torch.equal(back, gguf_w)  # the GGUF's own blocks, bit for bit
    x = torch.randn(3, cols)
    head = PackedWeight.q8_0(codes, d)
    err = (head(x).double() - x.double() @ gguf_w.double().T).abs()
    assert (err <= activation_bound(x, gguf_w.abs())).all(), err.max()
    assert head.shape == (rows, cols)


def test_quantization_is_resolved_per_device() -> None:
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", "auto", cpu) == "auto"
    assert resolve_quantization("auto", "float32", cpu) == "none"  # an explicit dtype keeps the weights
    assert resolve_quantization("int4", "float32", cpu) == "int4"
    assert resolve_quantization("auto", "auto", torch.device("meta")) == "none"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int4", "auto", torch.device("cuda"))


def test_a_model_without_4bit_weights_says_so(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from test_hf_folder import IDS, build, logits

    folder = build(tmp_path / "m")
    capfd.readouterr()
    auto = LLM(model=str(folder), device="cpu", kv_cache_tokens=256, quantization="auto")
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("ngrammar:")]
    assert len(lines) == 1 and "no 4-bit" in lines[0] and "--quantization int4" in lines[0]
    assert not auto.engine.runner.quantized
    LLM(model=str(folder), device="cpu", dtype="float32", kv_cache_tokens=256, quantization="auto")
    assert "ngrammar:" not in capfd.readouterr().err  # an explicit dtype asks for no quantization
    LLM(model=str(folder), device="cpu", kv_cache_tokens=256, quantization="none")
    assert "ngrammar:" not in capfd.readouterr().err  # none asks for nothing
    LLM(model=str(folder), device="cpu", kv_cache_tokens=256)  # the default is auto: the notice again
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("ngrammar:")]
    assert len(lines) == 1 and "no 4-bit" in lines[0]
    q = LLM(model=str(folder), device="cpu", kv_cache_tokens=256, quantization="int4")
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("ngrammar:")]
    assert len(lines) == 1 and "quantizing 8 of 8 projections" in lines[0]
    assert q.engine.runner.quantized
    ref, out = logits(auto, IDS), logits(q, IDS)
    cosine = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0)
    assert 0.98 < cosine < 1  # 4-bit weights of random ones: close, not equal


@pytest.fixture(scope="module")
def quant_llm() -> LLM:
    """The embedded model on its 4-bit weights (the CPU default)."""
    return LLM(device="cpu", kv_cache_tokens=2048, quantization="auto")


def text_ids(llm: LLM, n: int = 256) -> list[int]:
    text = (Path(__file__).parent.parent / "docs" / "ARCHITECTURE.md").read_text()
    return llm.engine.tokenizer.encode(text)[:n]


def all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    blocks = llm.engine.blocks
    pages = blocks.allocator.allocate(-(-len(ids) // blocks.page_size))
    try:
        step = StepInput([ids], [list(range(len(ids)))], [0], [pages], list(range(len(ids))))
        return llm.engine.runner.forward(step).float()
    finally:
        blocks.allocator.free(pages)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1].double(), -1)
    return math.exp(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


@pytest.mark.slow  # a second engine: run with `pytest -m slow`
def test_perplexity_within_one_percent_of_float32(llm: LLM, quant_llm: LLM) -> None:
    ids = text_ids(llm)
    ref = perplexity(all_logits(llm, ids), ids)
    ppl = perplexity(all_logits(quant_llm, ids), ids)
    print(f"perplexity fp32 {ref:.4f} int4 {ppl:.4f} ({ppl / ref - 1:+.3%})")
    assert abs(ppl / ref - 1) < 0.01


@pytest.mark.slow  # a second engine: run with `pytest -m slow`
def test_logits_within_the_bound_of_float32(llm: LLM, quant_llm: LLM) -> None:
    ids = text_ids(quant_llm, 128)
    worst = (all_logits(quant_llm, ids) - all_logits(llm, ids)).abs().max().item()
    print(f"max |logit - float32 model's|: {worst:.4f}")
    assert worst < LOGIT_BOUND
