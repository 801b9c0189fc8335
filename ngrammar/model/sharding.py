"""Each rank reads only its own shard of every weight (``safe_open(...).get_slice``).

GGUF checkpoints are converted once into a cached safetensors file (``model.loader``) before any
rank starts, so GGUF and Hugging Face folders are read the same way. Names are Hugging Face's; the
model's ``load_hf_weights`` fuses the shards (q_r | k_r | v_r, gate_r | up_r) as it does whole
tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ngrammar.model.loader import Checkpoint

# Which dimension of a weight is split: 0 = output rows (column-parallel, vocab-parallel),
# 1 = input columns (row-parallel). Anything else (norms, q/k norms) is replicated.
_ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_COLUMN_SPLIT = ("o_proj", "down_proj")


def split_dim(name: str) -> int | None:
    """The dimension ``name`` is split on across ranks, or None (replicated)."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in _ROW_SPLIT:
        return 0  # weights and the q/k/v biases alike
    if module in _COLUMN_SPLIT and parts[-1] == "weight":
        return 1
    return None


def iter_shard_weights(ckpt: Checkpoint, rank: int, size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's slice) for every tensor of the checkpoint, reading no other rank's bytes."""
    from safetensors import safe_open

    for file in ckpt.weight_files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                dim = split_dim(name)
                sliced = f.get_slice(name)
                if dim is None:
                    yield name, sliced[:]
                    continue
                full = sliced.get_shape()[dim]
                if full % size:
                    raise ValueError(f"{name}: {full} rows / columns do not divide by --tp {size}")
                lo, hi = rank * full // size, (rank + 1) * full // size
                yield name, sliced[lo:hi] if dim == 0 else sliced[:, lo:hi]
