"""Loading a local Hugging Face folder: what the config asks for is computed exactly or refused.

Tiny random-weight checkpoints (hidden 64, 2 layers) saved by transformers, with the embedded
model's tokenizer; ngrammar's logits are compared with transformers' on the same folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ngrammar import LLM
from ngrammar.model.loader import ModelLoadError, resolve_checkpoint
from ngrammar.runner.model_runner import StepInput

IDS = list(range(100, 148))


def build(folder: Path, arch: str = "LlamaForCausalLM", **overrides: Any) -> Path:
    import transformers

    cfg = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    getattr(transformers, arch)(config).eval().save_pretrained(folder, safe_serialization=True)
    tokenizer_dir = resolve_checkpoint(None).tokenizer_dir
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, folder)
    return folder


def logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    runner, blocks = llm.engine.runner, llm.engine.blocks
    pages = blocks.allocator.allocate(-(-len(ids) // blocks.page_size))
    try:
        return runner.forward(
            StepInput([ids], [list(range(len(ids)))], [0], [pages], list(range(len(ids))))
        ).float()
    finally:
        blocks.allocator.free(pages)


def relative_error(folder: Path) -> float:
    import transformers

    ours = logits(LLM(model=str(folder), device="cpu", dtype="float32", kv_cache_tokens=1024), IDS)
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(torch.tensor([IDS])).logits[0]
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("rope_type", ["linear", "dynamic"])
def test_rope_scaling_matches_transformers(tmp_path: Path, rope_type: str) -> None:
    """Regression: "linear" scaling was ignored (a 9e-3 logit error, no warning). Dynamic NTK
    changes nothing within max_position_embeddings, which bounds the engine's context."""
    folder = build(
        tmp_path / rope_type, rope_parameters=dict(rope_type=rope_type, rope_theta=10000.0, factor=4.0)
    )
    assert relative_error(folder) < 1e-4


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
        ("rope_scaling", {"type": "longrope", "factor": 2.0}),
        ("hidden_act", "gelu"),
    ],
)
def test_what_is_not_computed_is_refused(tmp_path: Path, key: str, value: Any) -> None:
    """Regression: yarn / dynamic RoPE and a non-SiLU MLP loaded and gave wrong logits."""
    folder = build(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported"):
        resolve_checkpoint(folder)


def test_a_sliding_window_caps_the_context(tmp_path: Path) -> None:
    """Regression: Mistral's window was ignored, so past it logits were wrong. It is not
    implemented; within the window attention is full, so the context stops there."""
    mistral = build(tmp_path / "mistral", "MistralForCausalLM", sliding_window=32)
    assert (
        LLM(model=str(mistral), device="cpu", dtype="float32", kv_cache_tokens=1024).engine.max_model_len
        == 32
    )
    with pytest.raises(ValueError, match="sliding window"):
        LLM(model=str(mistral), device="cpu", dtype="float32", kv_cache_tokens=1024, max_model_len=64)
    qwen = build(tmp_path / "qwen", "Qwen2ForCausalLM", sliding_window=32, use_sliding_window=False)
    assert resolve_checkpoint(qwen).config.max_context == 512  # a window Qwen does not use
    # (Review) nor one only layers past max_window_layers would use, with 2 layers.
    qwen = build(
        tmp_path / "qwen2",
        "Qwen2ForCausalLM",
        sliding_window=32,
        use_sliding_window=True,
        max_window_layers=2,
    )
    assert resolve_checkpoint(qwen).config.max_context == 512


def test_folder_quirks_load(tmp_path: Path) -> None:
    """Regressions: the end-of-turn ids in generation_config.json were ignored; every
    *.safetensors was loaded although an index names the shards (Mistral ships a
    consolidated.safetensors of its own format beside them); a tied model storing lm_head failed."""
    from safetensors.torch import load_file, save_file

    folder = build(tmp_path / "m", tie_word_embeddings=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 507]}))
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors" for name in weights}}
        )
    )
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, folder / "consolidated.safetensors")
    ckpt = resolve_checkpoint(folder)
    assert set(ckpt.config.eos_token_ids) == {2, 507} and [p.name for p in ckpt.weight_files] == [
        "model-00001-of-00001.safetensors"
    ]
    assert relative_error(folder) < 1e-4


def test_plain_prompts_get_the_tokenizer_special_tokens(tmp_path: Path) -> None:
    """Regression: plain prompts were encoded without the BOS a Llama-style tokenizer adds, unlike
    ``tokenizer(text)`` and vLLM; chat prompts (whose template writes it) stay as rendered."""
    import transformers

    folder = build(tmp_path / "bos")
    tj = json.loads((folder / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    engine = LLM(model=str(folder), device="cpu", dtype="float32", kv_cache_tokens=1024).engine
    text = "The capital of France is"
    assert engine.tokenize(text) == transformers.AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    assert engine.tokenize(text)[0] == 1


@pytest.mark.parametrize(
    "kwargs",
    [dict(kv_cache_tokens=0), dict(kv_cache_tokens=8), dict(max_model_len=0), dict(max_model_len=100_000)],
)
def test_engine_sizes_are_checked_not_replaced(kwargs: dict[str, int]) -> None:
    """Regression: kv_cache_tokens=0 meant the default pool, a pool under one page became two
    pages, max_model_len=0 meant the whole context and one past the model's was cut silently."""
    with pytest.raises(ValueError):
        LLM(device="cpu", dtype="float32", **kwargs)


def test_gguf_rope_frequencies_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review): a GGUF's Llama-3.1 RoPE factors (the rope_freqs tensor) and its
    rope.scaling keys were skipped, so such a model loaded with silently wrong logits."""
    import gguf
    import numpy as np

    monkeypatch.setenv("NGRAMMAR_CACHE_DIR", str(tmp_path / "cache"))
    for name, extra in (("freqs", "rope_freqs"), ("yarn", "yarn")):
        writer = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        writer.add_block_count(1)
        writer.add_embedding_length(8)
        writer.add_feed_forward_length(16)
        writer.add_head_count(2)
        writer.add_context_length(64)
        if extra == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(4.0)
        else:
            writer.add_tensor("rope_freqs.weight", np.ones(2, dtype=np.float32))
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(
            ModelLoadError, match="rope_freqs" if extra == "rope_freqs" else "unsupported rope"
        ):
            resolve_checkpoint(tmp_path / f"{name}.gguf")


def test_gguf_layer_tensors_of_other_models_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a Llama-architecture GGUF with MoE experts or a fused attn_qkv raised KeyError."""
    import gguf
    import numpy as np

    monkeypatch.setenv("NGRAMMAR_CACHE_DIR", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "llama")
    for add, value in (
        (writer.add_block_count, 1),
        (writer.add_embedding_length, 8),
        (writer.add_feed_forward_length, 16),
        (writer.add_head_count, 2),
        (writer.add_context_length, 64),
    ):
        add(value)
    writer.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="ffn_gate_inp"):
        resolve_checkpoint(tmp_path / "moe.gguf")


def test_an_interrupted_gguf_conversion_is_redone_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a tokenizer.json cut short by a killed conversion was kept as "pre-seeded" and
    the cache then failed on every load; conversions also shared one temp file name, so two
    processes converting at once could rename each other's file away."""
    from ngrammar.model.loader import embedded_model_path

    # The state a conversion killed while writing tokenizer.json leaves, made from the session
    # cache's conversion rather than by converting first: its files without the "complete" mark,
    # the tokenizer cut short. The weights are linked (the conversion replaces them by a rename).
    done = resolve_checkpoint(embedded_model_path()).tokenizer_dir
    folder = tmp_path / "cache" / done.name
    folder.mkdir(parents=True)
    for f in done.iterdir():
        if not f.is_file() or f.name in ("complete", "tokenizer.json"):
            continue
        if f.suffix == ".safetensors":
            (folder / f.name).symlink_to(f)
        else:
            shutil.copy(f, folder / f.name)
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_text((done / "tokenizer.json").read_text()[:1000])
    monkeypatch.setenv("NGRAMMAR_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = resolve_checkpoint(embedded_model_path())
    json.loads(tokenizer.read_text())
    assert ckpt.tokenizer_dir == folder and not [f.name for f in folder.iterdir() if ".tmp-" in f.name]
    assert not (folder / "model.safetensors").is_symlink()  # the weights were written again too
