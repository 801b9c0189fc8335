"""Weight-only 4-bit projections on the CPU (ngrammar/model/quant.py).

The int4 kernel's zero-point convention, GGUF Q4_0 / Q4_1 blocks round-tripping, every kernel's
form against the dequantized weights (a max abs error bound), the notice for a model without 4-bit
weights, perplexity within 1% of the float32 model, and losslessness stated for low-precision
kernels: NGRAM may leave plain decoding only where plain's top-2 logits are closer than the
kernels' rounding bound.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ngrammar import LLM, SamplingParams
from ngrammar.model.loader import Checkpoint, load_gguf_q4
from ngrammar.model.quant import (
    KERNELS,
    KernelTable,
    Q4Weight,
    build_form,
    candidate_kernels,
    parse_kernel_table,
    q4_from_blocks,
    q4_to_blocks,
    quantize_q4_1,
    run_form,
    set_kernel_table,
)
from ngrammar.runner.model_runner import StepInput, resolve_quantization

ALL_FORMS = "1:int4,2:int4_bf16,4:fp16,8:bf16"  # every low-precision kernel's form is built
# One-row steps on torch's int4 kernel with bf16 activations, wider ones on fp16 weights: the two
# kernels round differently, so batched and one-row logits differ (as on an AMX machine's default).
MIXED = KernelTable((1, 64), (("int4_bf16", "fp16"), ("fp16",)))
# The kernels' rounding bound on a logit (test_kernels_logits_agree_within_half_the_bound checks each
# kernel within half of it of the float32 model): bf16-rounded activations (int4_bf16, bf16) move
# SmolLM2's logits by about half a logit; fp32 activations on the int4 codes by a few hundredths.
LOGIT_BOUND = 2.0
LOW_PRECISION = [k for k in candidate_kernels(True) if k != "fp32"]


def random_q4(n: int, k: int, seed: int = 0) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
    zero = (torch.randn(n, k // 32, generator=g) * 0.05).half().float() + 8 * scale
    return Q4Weight(codes, scale, zero)


def test_int4_kernel_computes_q_minus_8_times_scale_plus_zero() -> None:
    w = random_q4(64, 128)
    x = torch.randn(3, 128)
    packed, sz = build_form("int4", w.dequantize(), w)
    out = torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    q = w.codes.float().view(64, 4, 32)
    ref = x @ ((q - 8) * w.scale[..., None] + w.zero[..., None]).view(64, 128).T
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()
    wrong = x @ (q * w.scale[..., None] + w.zero[..., None]).view(64, 128).T  # zero as the code-0 value
    assert (out - wrong).abs().max() > 0.1


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


# Relative rounding of each form against the dequantized weights: fp32 exact; int4 codes exact with
# fp32 scales; bf16 activations, scales and weights 2^-8 each; fp16 weights 2^-11.
FORM_EPS = {"int4": 1e-5, "int4_bf16": 2**-6, "fp16": 2**-10, "bf16": 2**-7, "fp32": 1e-5}


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_matches_the_dequantized_weights(checkpoint: Checkpoint, kernel: str) -> None:
    if kernel not in candidate_kernels(True):
        pytest.skip(f"{kernel} is not in this torch build")
    q4 = load_gguf_q4(checkpoint)["model.layers.0.mlp.gate_proj.weight"]
    dense = q4.dequantize()
    x = torch.randn(5, dense.shape[1])
    out = run_form(kernel, build_form(kernel, dense, q4), x)
    ref = x.double() @ dense.double().T
    # |error| <= eps * sum_k |x_k| (|q - 8| scale + |zero|): each term's rounding, summed.
    mag = (q4.codes.float() - 8).abs().view(dense.shape[0], -1, 32) * q4.scale[..., None]
    mag = (mag + q4.zero.abs()[..., None]).view_as(dense)
    bound = FORM_EPS[kernel] * (x.abs().double() @ mag.double().T) + 1e-5
    assert ((out.double() - ref).abs() <= bound).all(), (out.double() - ref).abs().max()


def test_kernel_table_parsing_and_choice() -> None:
    t = parse_kernel_table("1:int4,16:bf16,64:fp16")
    assert t.kernels_for(1)[0] == "int4" and t.kernels_for(9)[0] == "bf16" and t.kernels_for(500)[0] == "fp16"
    assert t.kernels_for(1)[1] == "bf16"  # a weight without codes (the LM head) runs the first dense kernel
    with pytest.raises(ValueError):
        parse_kernel_table("16:fp16,1:int4")
    with pytest.raises(ValueError):
        parse_kernel_table("1:int3")


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
    assert auto.engine.runner.kernel_table is None
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
    assert q.engine.runner.kernel_table is not None
    ref, out = logits(auto, IDS), logits(q, IDS)
    cosine = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0)
    assert 0.98 < cosine < 1  # 4-bit weights of random ones: close, not equal


@pytest.fixture(scope="module")
def quant_llms(monkeypatch_module: pytest.MonkeyPatch) -> tuple[LLM, LLM]:
    """The embedded model's 4-bit weights: plain with every low-precision kernel's form, and NGRAM
    verifying every step with MIXED's forms."""
    monkeypatch_module.setenv("NGRAMMAR_CPU_KERNELS", ALL_FORMS)
    plain = LLM(device="cpu", kv_cache_tokens=2048, quantization="auto")
    monkeypatch_module.setenv("NGRAMMAR_CPU_KERNELS", "1:int4_bf16,64:fp16")  # MIXED's forms only
    spec = LLM(
        device="cpu",
        kv_cache_tokens=2048,
        quantization="auto",
        speculative="ngram",
        num_draft_tokens=8,
        spec_policy="fixed",
    )
    return plain, spec


@pytest.fixture(scope="module")
def monkeypatch_module():  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        yield mp


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


@pytest.mark.slow  # two engines with every kernel form: run with `pytest -m slow`
def test_perplexity_within_one_percent_of_float32(llm: LLM, quant_llms: tuple[LLM, LLM]) -> None:
    q = quant_llms[0]
    ids = text_ids(llm)
    ref = perplexity(all_logits(llm, ids), ids)
    model = q.engine.runner.model
    try:
        for kernel in LOW_PRECISION:
            set_kernel_table(model, KernelTable.fixed(kernel))
            ppl = perplexity(all_logits(q, ids), ids)
            print(f"perplexity fp32 {ref:.4f} {kernel} {ppl:.4f} ({ppl / ref - 1:+.3%})")
            assert abs(ppl / ref - 1) < 0.01, kernel
    finally:
        set_kernel_table(model, parse_kernel_table(ALL_FORMS))


@pytest.mark.slow  # two engines with every kernel form: run with `pytest -m slow`
def test_kernels_logits_agree_within_half_the_bound(llm: LLM, quant_llms: tuple[LLM, LLM]) -> None:
    """Each kernel's logits within LOGIT_BOUND / 2 of the float32 model's (the same weights,
    dequantized), so two kernels' logits differ by less than LOGIT_BOUND."""
    q = quant_llms[0]
    ids = text_ids(q, 128)
    ref = all_logits(llm, ids)
    model = q.engine.runner.model
    try:
        for kernel in LOW_PRECISION:
            set_kernel_table(model, KernelTable.fixed(kernel))
            worst = (all_logits(q, ids) - ref).abs().max().item()
            print(f"max |logit - float32 model's| {kernel}: {worst:.4f}")
            assert worst < LOGIT_BOUND / 2, kernel
    finally:
        set_kernel_table(model, parse_kernel_table(ALL_FORMS))


@pytest.mark.slow  # two engines with every kernel form: run with `pytest -m slow`
def test_ngram_diverges_from_plain_only_at_near_ties(quant_llms: tuple[LLM, LLM]) -> None:
    """With one-row steps on one kernel and verify steps on another, greedy NGRAM may leave plain
    decoding only where plain's top-2 logits differ by less than the kernels' rounding bound."""
    from test_spec_engine import PROMPTS

    plain, spec = quant_llms
    for llm in quant_llms:
        set_kernel_table(llm.engine.runner.model, MIXED)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    try:
        ref = plain.generate(PROMPTS, params, use_tqdm=False)
        got = spec.generate(PROMPTS, params, use_tqdm=False)
    finally:
        set_kernel_table(plain.engine.runner.model, parse_kernel_table(ALL_FORMS))
    identical = 0
    for r, g in zip(ref, got):
        if r.token_ids == g.token_ids:
            identical += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(r.token_ids, g.token_ids)) if a != b)
        assert r.logprobs is not None
        step = r.logprobs[i]
        others = [lp for t, lp in step.top if t != step.token_id]
        gap = step.logprob - max(others)  # logprob gaps are logit gaps
        print(f"divergence at token {i}: plain's top-2 gap {gap:.4f}")
        assert gap < LOGIT_BOUND
    print(f"NGRAM identical to plain on {identical}/{len(PROMPTS)} prompts")
    assert spec.engine.stats.spec_steps > 0
