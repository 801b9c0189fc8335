"""The engine's host cost per decode step, measured on a model whose forward costs next to nothing.

Why: on a fast GPU a batch-1 step of a small model can be bound by the host loop rather than the
device, and a profile cannot separate the two there. This benchmark isolates the engine loop on any machine: a one-layer, 16-wide random-weight Llama with the embedded model's tokenizer (so
prompts, chat template and detokenization are the real ones), plain greedy decoding, overlap
scheduling off and on. Host time per step = engine step time - forward time; the forward of this
model is a few hundred µs on the CPU (mostly the 49152-row head).

    python -m benchmarks host [--batch-sizes 1,8] [--max-tokens 128]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import chat, copy_tokenizer, load_workload, print_table
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


def shape_checkpoint(folder: Path, overrides: dict[str, Any] | None = None) -> Path:
    """A Hugging Face folder of the embedded model's architecture (its config with ``overrides``) and
    no weights: config, tokenizer and chat template, for ``load_format`` dummy (step costs at the real
    shape with nothing to carry to a GPU machine; the text means nothing)."""
    base = resolve_checkpoint(None)
    cfg = json.loads((base.weights_file.parent / "config.json").read_text()) | (overrides or {})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    copy_tokenizer(base.tokenizer_dir, folder)
    return folder


def tiny_checkpoint(folder: Path, layers: int = 1, weights: bool = True) -> Path:
    """A Hugging Face folder: the embedded model's config shrunk to ``layers`` 16-wide layers,
    random weights (seeded; ``weights=False``: none, for ``load_format`` dummy), the embedded
    tokenizer and chat template."""
    from safetensors.torch import save_file

    shape_checkpoint(folder, _TINY | {"num_hidden_layers": layers})
    cfg = json.loads((folder / "config.json").read_text())
    if not weights:
        return folder
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


def _verify_figures(
    llm: LLM, batches: list[list[Any]], params: SamplingParams
) -> tuple[dict[str, float], list[Any]]:
    """Run the batches one after another; per verify step: the host time from its result landing
    to the next forward's launch (the device idles through it on a GPU), and the step's wall time."""
    llm.chat(batches[0][:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    stats = llm.engine.stats
    keys = ("verify_gap_seconds", "verify_gaps", "spec_steps", "verify_steps", "verify_emitted")
    keys += ("prepared_trees", "prepared_hits", "steps", "step_seconds", "decode_tokens")
    before = {k: getattr(stats, k) for k in keys}
    outs = [o for batch in batches for o in llm.chat(batch, params, use_tqdm=False)]
    d = {k: getattr(stats, k) - before[k] for k in keys}
    return {
        "verify_steps": d["spec_steps"],
        "gap_us": 1e6 * d["verify_gap_seconds"] / max(d["verify_gaps"], 1),
        "accept_len": d["verify_emitted"] / max(d["verify_steps"], 1),
        "prepared_hit_rate": d["prepared_hits"] / max(d["prepared_trees"], 1),
        "step_us": 1e6 * d["step_seconds"] / max(d["steps"], 1),
        "tok_s": d["decode_tokens"] / max(d["step_seconds"], 1e-9),
    }, outs


def run_verify_host_benchmark(batch_sizes: tuple[int, ...] = (1, 4), max_tokens: int = 64) -> dict[str, Any]:
    """Host time between two forwards per NGRAM verify step, step by step against pipelined
    (``pipeline_verify``): the embedded model (fixed D = 8, every decode step a verify step), then
    the 1-layer random model replaying its recorded greedy outputs (``ReplayTarget``), where the
    forward costs next to nothing and the engine loop is what is timed."""
    from ngrammar.speculative.replay import ReplayTarget

    seen: set[str] = set()
    work = [
        w
        for w in load_workload()
        if w.kind == "grounded" and not (w.category in seen or seen.add(w.category))
    ]
    prompts = [chat(w.prompt) for w in work]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    spec: dict[str, Any] = dict(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=32768,
        speculative="ngram",
        num_draft_tokens=8,
        spec_policy="fixed",
    )
    res: dict[str, Any] = {}
    rows = []
    records: dict[tuple[int, ...], list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_checkpoint(Path(tmp) / "tiny")
        for model in ("embedded", "replay"):
            for pipeline in (False, True):
                if model == "embedded":
                    llm = LLM(pipeline_verify=pipeline, **spec)
                else:
                    llm = LLM(str(tiny), pipeline_verify=pipeline, **spec)
                    eos = llm.engine.model_config.eos_token_ids[0]
                    llm.engine.set_replay(ReplayTarget(records, eos))
                for bs in batch_sizes:
                    batches = [prompts[i : i + bs] for i in range(0, len(prompts), bs)]
                    r, outs = _verify_figures(llm, batches, params)
                    if model == "embedded":
                        for o in outs:
                            records[tuple(o.prompt_token_ids)] = (
                                list(o.prompt_token_ids) + o.outputs[0].token_ids
                            )
                    res[f"{model}/pipeline={pipeline}/b{bs}"] = r
                    rows.append([model, "on" if pipeline else "off", bs] + [r[k] for k in _COLUMNS])
                del llm
    print_table(
        f"host time between two forwards per verify step (D = 8, {len(prompts)} grounded prompts, {max_tokens} tokens)",
        [
            "model",
            "pipeline",
            "batch",
            "verify steps",
            "gap µs",
            "accept",
            "prepared hits",
            "step µs",
            "tok/s",
        ],
        rows,
    )
    return res


_COLUMNS = ("verify_steps", "gap_us", "accept_len", "prepared_hit_rate", "step_us", "tok_s")
