"""Llama-family decoder (Llama / SmolLM / Mistral, Qwen2 attention bias, Qwen3 q/k-norm).

A pure ``nn.Module``: ``forward`` takes packed token ids, their positions, the KV pool and the
attention plan as arguments and returns hidden states; ``compute_logits`` maps selected rows to the
vocabulary. Weights use Hugging Face names; q/k/v and gate/up are fused at load time so each layer
runs two GEMMs fewer (the CPU decode step is bound by those weight reads).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ngrammar.model.config import ModelConfig
from ngrammar.runner.attention import AttentionBackend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, Llama-3 scaled when the config asks for it."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = config.rope_scaling
    if rs is None:
        return inv.float()
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled).float()


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE with a cos/sin table indexed by absolute position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        t = torch.arange(config.max_position, dtype=torch.float32)
        freqs = torch.outer(t, rope_inverse_frequencies(config))  # [max_pos, d/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, d/2] for the step's positions, gathered once and shared by all layers."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rope(
    rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, d/2]
        layer_cache: torch.Tensor,  # [2, pages, page_size, Hkv, d]
        plan: Any,
    ) -> torch.Tensor:
        c = self.config
        q, k, v = self.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(rope, q, k)
        out = self.backend.forward(q, k, v, layer_cache, plan, self.scale)
        return self.o_proj(out.reshape(-1, c.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] packed tokens of all requests in the step
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [layers, 2, pages, page_size, Hkv, d]
        plan: Any,  # the attention backend's plan for this step
    ) -> torch.Tensor:  # [T, hidden]
        h = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions)
        for i, layer in enumerate(self.layers):
            h = h + layer.self_attn(layer.input_layernorm(h), rope, kv_cache[i], plan)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

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
