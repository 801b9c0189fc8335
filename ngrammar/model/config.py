"""Model hyper-parameters, read once from a GGUF header or a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; absent for SmolLM/Qwen. ``rope_type`` "linear" divides every
    frequency by ``factor`` (position interpolation); "llama3" scales the low frequencies by it and
    blends the band between (the other fields are used by "llama3" only)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position: int = 0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_scaling: RopeScaling | None = None
    # Attention limited to the last ``sliding_window`` tokens (Mistral; Qwen with
    # use_sliding_window). Not implemented: within that many tokens it equals full attention, so the
    # engine's context is capped there (``max_context``).
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def max_context(self) -> int:
        """The longest context this engine computes exactly for the model."""
        return min(self.max_position, self.sliding_window or self.max_position)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
        if act not in ("silu", "swish"):  # the MLP computes SiLU(gate) * up
            raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")
        # A null in config.json means "the default", as transformers reads it.
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            max_position=int(cfg.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=_rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
            sliding_window=_sliding_window(cfg, arch),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=token_ids(cfg.get("eos_token_id")),
        )


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def token_ids(value: Any) -> tuple[int, ...]:
    """An ``eos_token_id`` field: one id, a list of them, or null."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    """The config's RoPE scaling; one this engine does not compute is refused, never ignored
    (yarn or longrope would otherwise give silently wrong logits)."""
    kind = (raw or {}).get("rope_type", (raw or {}).get("type", "default"))
    if kind in ("default", "dynamic"):
        return None  # dynamic NTK changes nothing within max_position_embeddings, the engine's bound
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))  # type: ignore[index]
    if kind == "llama3":
        assert raw is not None
        return RopeScaling(
            "llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw["low_freq_factor"]),
            high_freq_factor=float(raw["high_freq_factor"]),
            original_max_position=int(raw["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"unsupported rope scaling {kind!r}; supported: linear, llama3 (and dynamic, exact here)"
    )


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    """The window if some layer slides, else None. transformers 5 lists each layer's kind in
    ``layer_types``; before that Qwen slid only with ``use_sliding_window``, from layer
    ``max_window_layers`` on (its configs carry a window they do not use), and Mistral always."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if "layer_types" in cfg and cfg["layer_types"] is not None:
        slides = "sliding_attention" in cfg["layer_types"]
    elif arch.startswith("Qwen"):
        layers = int(cfg["num_hidden_layers"])
        slides = (
            bool(cfg.get("use_sliding_window", False)) and int(cfg.get("max_window_layers") or 0) < layers
        )
    else:
        slides = True
    return int(window) if slides else None
