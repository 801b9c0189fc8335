"""Fused Triton elementwise kernels (``ngrammar.kernels.fused_ops``) against the torch reference ops.

On a CUDA machine: ``pytest -m gpu tests/test_fused_ops.py``; without a GPU, under Triton's CPU
interpreter: ``NGRAMMAR_TRITON_INTERPRET=1 pytest -m gpu tests/test_fused_ops.py`` (the variable must
be set before Triton is imported). Anywhere else the module is skipped.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, INTERPRET

from ngrammar.attention.metadata import AttentionMetadata
from ngrammar.attention.sdpa import TorchSDPABackend
from ngrammar.attention.triton import TritonAttentionBackend
from ngrammar.kernels.fused_ops import TritonOps, silu_and_mul
from ngrammar.model.config import ModelConfig
from ngrammar.model.llama import LlamaForCausalLM
from ngrammar.model.ops import TorchOps

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]
# Max abs error relative to the reference's largest magnitude: one or two storage-dtype ulps, since the
# kernels round where the reference rounds and differ only by fp32 contraction.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
REF, FUSED = TorchOps(), TritonOps()


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * max(want.float().abs().max().item(), 1.0), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,n", [(1, 576), (7, 64), (33, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype: torch.dtype, tokens: int, n: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(tokens * n)
    x = torch.randn(tokens, n, generator=g).to(DEVICE, dtype) * 3
    res = torch.randn(tokens, n, generator=g).to(DEVICE, dtype) if with_residual else None
    w = (torch.rand(n, generator=g) + 0.5).to(DEVICE, dtype)
    got, got_sum = FUSED.rms_norm(x, w, 1e-5, res)
    want, want_sum = REF.rms_norm(x, w, 1e-5, res)
    _close(got, want, dtype)
    if with_residual:
        assert got_sum is not None and want_sum is not None
        assert torch.equal(got_sum, want_sum)  # one rounding of the same fp32 sum: bit-identical
    else:
        assert got_sum is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,n", [(1, 1536), (5, 100), (3, 5000)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, tokens: int, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(tokens, 2 * n, generator=g) * 4).to(DEVICE, dtype)
    _close(silu_and_mul(x), REF.silu_and_mul(x), dtype)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("tokens", [1, 21])
@pytest.mark.parametrize("fuse_linear", [True, False])
def test_whole_model_logits_match_torch_ops(qk_norm: bool, tokens: int, fuse_linear: bool) -> None:
    """The decoder with fused ops and Triton attention (RoPE fused into the K/V write) gives the
    reference decoder's logits (fp32, random weights), with the projections' prologues fused (one
    token) or not (21 tokens, or fusion off)."""
    config = ModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=64,
        qk_norm=qk_norm,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    ref = LlamaForCausalLM(config, TorchSDPABackend(), REF).to(DEVICE)
    for p in ref.parameters():
        torch.nn.init.normal_(p, 0.0, 0.2)
    fused = LlamaForCausalLM(config, TritonAttentionBackend(), TritonOps(fuse_linear=fuse_linear)).to(DEVICE)
    fused.load_state_dict(ref.state_dict())
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens, device=DEVICE),
        page_table=torch.arange(3, device=DEVICE)[None],
        kv_lens=torch.tensor([tokens], device=DEVICE),
        q_lens=torch.tensor([tokens], device=DEVICE),
        q_start=torch.tensor([0, tokens], device=DEVICE),
        max_q_len=tokens,
        max_kv_len=tokens,
        page_size=8,
    )
    ids = torch.randint(0, 97, (tokens,), device=DEVICE)
    pos = torch.arange(tokens, device=DEVICE)
    out = []
    for model in (ref, fused):
        cache = torch.zeros(3, 2, 3, 8, 2, 16, device=DEVICE)
        with torch.inference_mode():
            out.append(
                model.compute_logits(model(ids, pos, cache, model.layers[0].self_attn.backend.plan(meta)))
            )
    _close(out[1], out[0], torch.float32)


def test_one_token_decode_after_a_long_prefix_matches_torch_ops() -> None:
    """The fused one-token path where it matters: a decode step at position 230 after a prefill,
    with real RoPE angles, a qkv bias, an untied head and the kv range split three ways (merged by
    the last split), against the torch reference decoder."""
    config = ModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=True,
    )
    torch.manual_seed(1)
    ref = LlamaForCausalLM(config, TorchSDPABackend(), REF).to(DEVICE)
    for p in ref.parameters():
        torch.nn.init.normal_(p, 0.0, 0.2)
    fused = LlamaForCausalLM(config, TritonAttentionBackend(num_kv_splits=3), TritonOps()).to(DEVICE)
    fused.load_state_dict(ref.state_dict())
    prefix, page_size = 230, 16
    pages = torch.arange(-(-(prefix + 1) // page_size), device=DEVICE)[None]
    ids = torch.randint(0, 97, (prefix + 1,), device=DEVICE)

    def meta(start: int, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.arange(start, start + n, device=DEVICE),
            page_table=pages,
            kv_lens=torch.tensor([start + n], device=DEVICE),
            q_lens=torch.tensor([n], device=DEVICE),
            q_start=torch.tensor([0, n], device=DEVICE),
            max_q_len=n,
            max_kv_len=start + n,
            page_size=page_size,
        )

    out = []
    for model in (ref, fused):
        backend = model.layers[0].self_attn.backend
        cache = torch.zeros(2, 2, pages.shape[1], page_size, 2, 16, device=DEVICE)
        with torch.inference_mode():
            model(ids[:prefix], torch.arange(prefix, device=DEVICE), cache, backend.plan(meta(0, prefix)))
            step = backend.plan(meta(prefix, 1))
            out.append(
                model.compute_logits(model(ids[prefix:], torch.tensor([prefix], device=DEVICE), cache, step))
            )
    _close(out[1], out[0], torch.float32)


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="PDL runs on a CUDA device only")
def test_pdl_decode_graph_replays_equal_serial_ones() -> None:
    """Programmatic dependent launch changes when kernels start, never what they compute: a captured
    one-token decode step (16 layers, every projection fused, kv split 4 ways and merged in the
    kernel) replayed with PDL gives bit for bit the logits and K/V cache of the same step launched
    serially, over replays with new tokens and positions. A kernel touching activations before its
    wait would race and break this."""
    from ngrammar.kernels.device_info import pdl_supported

    if not pdl_supported(DEVICE):
        pytest.skip("PDL needs sm_90 or newer")
    config = ModelConfig(
        vocab_size=4096,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=16,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position=2048,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(2)
    prefix, page_size = 700, 16
    pages = torch.arange(-(-(prefix + 8) // page_size), device=DEVICE)[None]
    results = []
    for pdl in (False, True):
        torch.manual_seed(2)
        backend = TritonAttentionBackend(num_kv_splits=4, pdl=pdl)
        model = LlamaForCausalLM(config, backend, TritonOps(pdl=pdl)).to(DEVICE, torch.bfloat16)
        model.rotary.__init__(config)  # RoPE tables stay fp32
        model.rotary.to(DEVICE)
        for p in model.parameters():
            torch.nn.init.normal_(p, 0.0, 0.05)
        cache = torch.randn(16, 2, pages.shape[1], page_size, 3, 64, device=DEVICE).to(torch.bfloat16)
        ids = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        pos = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        meta = AttentionMetadata(
            slot_mapping=pos.clone(),
            page_table=pages,
            kv_lens=torch.ones(1, dtype=torch.int64, device=DEVICE),
            q_lens=torch.ones(1, dtype=torch.int64, device=DEVICE),
            q_start=torch.tensor([0, 1], device=DEVICE),
            max_q_len=1,
            max_kv_len=prefix + 8,
            page_size=page_size,
        )
        plan = backend.plan(meta, kv_len_bound=prefix + 8)
        logits = torch.empty(1, config.vocab_size, dtype=torch.float32, device=DEVICE)

        def step() -> None:
            logits.copy_(model.compute_logits(model(ids, pos, cache, plan)))

        with torch.inference_mode():
            step()  # compile and size the plan's scratch
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            seen = []
            for i in range(6):
                ids.fill_(17 * i + 3)
                pos.fill_(prefix + i)
                meta.slot_mapping.fill_(prefix + i)
                meta.kv_lens.fill_(prefix + i + 1)
                graph.replay()
                seen.append(logits.clone())
            torch.cuda.synchronize()
        results.append((torch.stack(seen), cache))
    (serial, serial_cache), (overlapped, overlapped_cache) = results
    assert torch.equal(serial, overlapped)
    assert torch.equal(serial_cache, overlapped_cache)
    assert serial.std(dim=0).max() > 0  # the replays saw different inputs


def test_pdl_is_chosen_for_one_token_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the kernels launch with PDL in one-token steps (a chain of Triton kernels) on
    sm_90+ and not in bigger ones, where cuBLAS sits between them; NGRAMMAR_PDL=0 turns it off,
    and an explicit setting overrides the default."""
    from ngrammar.kernels import device_info

    dev = torch.device("cuda", 0)  # an explicit index: no CUDA query beyond the capability below
    monkeypatch.setattr(device_info, "_cuda_capability", lambda index: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for switch, expected in (("0", False), ("1", True)):
        monkeypatch.setenv("NGRAMMAR_PDL", switch)
        device_info._pdl_allowed.cache_clear()
        assert device_info.pdl_for_step(dev, 1) is expected and not device_info.pdl_for_step(dev, 2)
    monkeypatch.setattr(device_info, "_cuda_capability", lambda index: (8, 0))
    assert not device_info.pdl_supported(dev)  # Ampere: no griddepcontrol
    monkeypatch.setattr(device_info, "pdl_supported", lambda device: True)
    one, many = torch.empty(1, 8), torch.empty(8, 8)
    assert TritonOps()._pdl(one) and not TritonOps()._pdl(many)
    assert TritonOps(pdl=True)._pdl(many) and not TritonOps(pdl=False)._pdl(one)
    device_info._pdl_allowed.cache_clear()  # monkeypatch restores the variables after this test
