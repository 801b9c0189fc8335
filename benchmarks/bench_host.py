"""The engine's host cost per decode step, measured on a model whose forward costs next to nothing.

Written when a batch-1 SmolLM2 step on the H200 looked host-bound (BENCHMARKS.md, session 7; session
8's ``profile_step --phases`` showed the device bound it then, and after PDL the host loop and the
device are close). This benchmark isolates the engine loop on any machine: a one-layer, 16-wide random-weight Llama with the embedded model's tokenizer (so
prompts, chat template and detokenization are the real ones), plain greedy decoding, overlap
scheduling off and on. Host time per step = engine step time - forward time; the forward of this
model is a few hundred µs on the CPU (mostly the 49152-row head).

    python -m benchmarks host [--batch-sizes 1,8] [--max-tokens 128]
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import chat, load_workload, print_table
from ngrammar import LLM, SamplingParams
from ngrammar.model.loader import resolve_checkpoint

_TINY = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
}


def tiny_checkpoint(folder: Path) -> Path:
    """A Hugging Face folder: the embedded model's config shrunk to one 16-wide layer, random
    weights (seeded), the embedded tokenizer and chat template."""
    from safetensors.torch import save_file

    base = resolve_checkpoint(None)
    cfg = json.loads((base.weights_file.parent / "config.json").read_text()) | _TINY
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in base.tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, folder / f.name)
    g = torch.Generator().manual_seed(0)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"embed_tokens.weight": (cfg["vocab_size"], h), "norm.weight": (h,)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    weights = {"model." + k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def _measure(llm: LLM, prompts: list[Any], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.chat(prompts, params, use_tqdm=False)  # warm-up
    stats = llm.engine.stats
    before = (stats.steps, stats.step_seconds, stats.forward_seconds, stats.decode_tokens)
    llm.chat(prompts, params, use_tqdm=False)
    steps = stats.steps - before[0]
    step_s, fwd_s = stats.step_seconds - before[1], stats.forward_seconds - before[2]
    return {
        "steps": steps,
        "step_us": 1e6 * step_s / steps,
        "forward_us": 1e6 * fwd_s / steps,
        "host_us": 1e6 * (step_s - fwd_s) / steps,
        "tok_s": (stats.decode_tokens - before[3]) / step_s,
    }


def run_host_benchmark(batch_sizes: tuple[int, ...] = (1, 8), max_tokens: int = 128) -> dict[str, Any]:
    prompts = [chat(w.prompt) for w in load_workload() if w.kind != "grounded"]
    res: dict[str, Any] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_checkpoint(Path(tmp) / "tiny")
        for overlap in (False, True):
            llm = LLM(
                model=str(folder),
                device="cpu",
                dtype="float32",
                # room for every sequence's prompt and output: host cost, not preemption, is measured
                kv_cache_tokens=max(16384, 1024 * max(batch_sizes)),
                max_running_requests=max(batch_sizes),
                overlap_schedule=overlap,
            )
            for bs in batch_sizes:
                r = _measure(llm, (prompts * bs)[:bs], max_tokens)
                res[f"overlap={overlap}/b{bs}"] = r
                rows.append(
                    [
                        "on" if overlap else "off",
                        bs,
                        r["steps"],
                        r["step_us"],
                        r["forward_us"],
                        r["host_us"],
                        r["tok_s"],
                    ]
                )
            del llm
    print_table(
        f"engine host cost per step (1-layer 16-wide model, {max_tokens} greedy tokens)",
        ["overlap", "batch", "steps", "step µs", "forward µs", "host µs", "tok/s"],
        rows,
    )
    return res
