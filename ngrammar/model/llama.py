"""Llama-family decoder (Llama / SmolLM / Mistral, Qwen2 attention bias, Qwen3 q/k-norm).

A pure ``nn.Module``: ``forward`` takes packed token ids, their positions, the KV pool and the
attention plan as arguments and returns hidden states; ``compute_logits`` maps selected rows to the
vocabulary. Weights use Hugging Face names; q/k/v and gate/up are fused at load time so each layer
runs two GEMMs fewer (the CPU decode step is bound by those weight reads). Norms, SiLU·mul and the
projections go through ``ops`` (``ngrammar.model.ops``): torch on the CPU, fused Triton kernels on
CUDA, where the residual add rides along with the next norm and, in one-token steps, the norm and
SiLU·mul ride inside the projection that consumes them. RoPE is applied by the attention
backend, which can fuse it into its K/V write. With tensor parallelism (``tp``) the module is built
from the rank's share of the config (``model.parallel.local_model_config``): o and down end
in one all-reduce each, the embedding and the logits are vocab-parallel.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ngrammar.attention.metadata import AttentionBackend
from ngrammar.model.config import ModelConfig
from ngrammar.model.ops import LayerOps, TorchOps
from ngrammar.model.quant import PackedWeight, Q4Weight

if TYPE_CHECKING:
    from ngrammar.model.parallel import TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: LayerOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., n]
        shape = x.shape
        return self.ops.rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps)[0].view(shape)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) for x, residual [T, n]."""
        normed, summed = self.ops.rms_norm(x, self.weight, self.eps, residual)
        assert summed is not None
        return normed, summed


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, scaled (linear or Llama-3) when the config asks."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = config.rope_scaling
    if rs is None:
        return inv.float()
    if rs.rope_type == "linear":
        return (inv / rs.factor).float()
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled).float()


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE with a cos/sin table indexed by absolute position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        t = torch.arange(config.max_position, dtype=torch.float32)
        freqs = torch.outer(t, rope_inverse_frequencies(config))  # [max_pos, d/2]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, d/2] for the step's positions, gathered once and shared by all layers."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.ops = ops
        self.tp = tp
        self.qkv_proj = nn.Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size]: qkv_proj of the normed input (the layer fuses the two)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, d/2]
        layer_cache: torch.Tensor,  # [2, pages, page_size, Hkv, d]
        plan: Any,
    ) -> torch.Tensor:  # [T, hidden]
        c = self.config
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.backend.forward(q, k, v, layer_cache, plan, self.scale, rope)
        h = self.ops.linear(out.reshape(-1, c.q_size), self.o_proj.weight)
        return h if self.tp is None else self.tp.all_reduce(h)  # row-parallel: partial sums


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * intermediate] -> [T, hidden]
        """gate_up: gate_up_proj of the normed input (the layer fuses the two)."""
        h = self.ops.silu_mul_linear(gate_up, self.down_proj.weight)
        return h if self.tp is None else self.tp.all_reduce(h)  # row-parallel: partial sums


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, backend, ops, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops, tp)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden]: the previous layer's output (not yet added to the residual)
        residual: torch.Tensor | None,  # [T, hidden] running residual stream; None for layer 0
        rope: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        plan: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm, attn = self.input_layernorm, self.self_attn
        qkv, summed = self.ops.norm_linear(
            h, residual, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias
        )
        residual = h if summed is None else summed
        h = attn(qkv, rope, layer_cache, plan)
        norm, mlp = self.post_attention_layernorm, self.mlp
        gate_up, residual = self.ops.norm_linear(
            h, residual, norm.weight, norm.eps, mlp.gate_up_proj.weight, None
        )
        assert residual is not None
        return mlp(gate_up), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,  # with ``tp``: this rank's share (``local_model_config``)
        backend: AttentionBackend,
        ops: LayerOps | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        ops = ops or TorchOps()
        self.ops = ops
        self.config = config
        self.tp = tp
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, ops, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.packed_head: PackedWeight | None = (
            None  # the LM head's quantized forms (quant.apply_quantization)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] packed tokens of all requests in the step
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [layers, 2, pages, page_size, Hkv, d]
        plan: Any,  # the attention backend's plan for this step
    ) -> torch.Tensor:  # [T, hidden]
        if self.tp is None:
            h = self.embed_tokens(input_ids)
        else:
            h = self.tp.embed(input_ids, self.embed_tokens.weight)
        rope = self.rotary.table(positions)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, rope, kv_cache[i], plan)
        assert residual is not None
        return self.norm.add_forward(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.ops.linear(hidden, weight)  # the ops' own kernel: row-invariant ops stay so
        return (logits if self.tp is None else self.tp.gather_logits(logits)).float()

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up on the way."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            target, part = _fused_target(name)
            if target is None:
                if name not in params:
                    if name.startswith("rotary") or "rotary_emb" in name:
                        continue
                    if name == "lm_head.weight" and self.lm_head is None:
                        continue  # a tied checkpoint may store the head anyway (the embedding's copy)
                    raise ValueError(f"unexpected weight {name!r}")
                params[name].copy_(tensor)
                loaded.add(name)
                continue
            group = pending.setdefault(target, {})
            group[part] = tensor
            if len(group) == len(_FUSED_PARTS[target.rsplit(".", 2)[-2]]):
                order = _FUSED_PARTS[target.rsplit(".", 2)[-2]]
                params[target].copy_(torch.cat([group[p] for p in order], dim=0))
                loaded.add(target)
                del pending[target]
        missing = set(params) - loaded
        if pending or missing:
            raise ValueError(f"incomplete checkpoint: missing {sorted(missing | set(pending))[:5]}")

    def head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the LM head (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def projections(self) -> dict[str, nn.Linear]:
        """The decoder layers' projections (fused names, e.g. ``layers.0.self_attn.qkv_proj``)."""
        return {n: m for n, m in self.layers.named_modules(prefix="layers") if isinstance(m, nn.Linear)}

    @staticmethod
    def fuse_q4(weights: dict[str, Q4Weight]) -> dict[str, Q4Weight]:
        """Hugging Face-named 4-bit weights -> the projections' (fused) names; a fused projection is
        listed only when all its parts are (q/k/v, gate/up)."""
        out: dict[str, Q4Weight] = {}
        groups: dict[str, dict[str, Q4Weight]] = {}
        for name, w in weights.items():
            name = name.removeprefix("model.").removesuffix(".weight")
            target, part = _fused_target(name + ".weight")
            if target is None:
                out[name] = w
            else:
                groups.setdefault(target.removesuffix(".weight"), {})[part] = w
        for target, parts in groups.items():
            order = _FUSED_PARTS[target.rsplit(".", 1)[-1]]
            if all(p in parts for p in order):
                out[target] = Q4Weight.cat([parts[p] for p in order])
        return out


_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fused_target(name: str) -> tuple[str | None, str]:
    """Map e.g. ``layers.3.self_attn.k_proj.bias`` to (``layers.3.self_attn.qkv_proj.bias``, ``k_proj``)."""
    parts = name.split(".")
    if len(parts) < 2:
        return None, ""
    for fused, members in _FUSED_PARTS.items():
        if parts[-2] in members:
            return ".".join(parts[:-2] + [fused, parts[-1]]), parts[-2]
    return None, ""
