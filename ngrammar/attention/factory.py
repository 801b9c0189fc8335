"""The attention backend an ``EngineConfig.attention_backend`` name stands for."""

from __future__ import annotations

import torch

from ngrammar.attention.metadata import AttentionBackend
from ngrammar.attention.sdpa import TorchSDPABackend


def attention_backend(name: str, device: torch.device, invariant: bool = False) -> AttentionBackend:
    """The backend ``name`` names ("auto": Triton on CUDA, SDPA elsewhere); ``invariant``: Triton's
    row-invariant launches."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "sdpa"
    if name == "triton":
        # Imported on demand: a CPU engine never loads Triton.
        from ngrammar.attention.triton import TritonAttentionBackend

        return TritonAttentionBackend(invariant=invariant)
    return TorchSDPABackend()
