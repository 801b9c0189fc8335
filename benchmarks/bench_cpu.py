"""CPU side by side (``python -m benchmarks spec --device cpu``): batch 1, greedy, the same prompts
(one per workload category), in one run: ngrammar plain and NGRAM per precision (the default, the
GGUF's 4-bit weights, and float32), transformers plain and prompt
lookup, and llama.cpp plain and prompt lookup when ``llama_cpp`` is importable (optional, never a
CI dependency). tok/s = generated tokens / wall time of each request, prefill included, for all;
outputs stop at EOS.
Engines are built one at a time (a shared box's memory)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import chat, forget_outputs, load_workload, print_table
from ngrammar import LLM, SamplingParams

# The default (the GGUF's 4-bit weights) and float32.
PRECISIONS: dict[str, dict[str, str]] = {"4-bit": {}, "float32": {"dtype": "float32"}}


def prompts_per_category() -> list[tuple[str, list[dict[str, str]]]]:
    seen: dict[str, list[dict[str, str]]] = {}
    for w in load_workload():
        seen.setdefault(w.category if w.kind == "grounded" else f"open/{w.category}", chat(w.prompt))
    return list(seen.items())


def _rate(run: Callable[[list[dict[str, str]]], int], prompts: list[Any], repeats: int) -> dict[str, float]:
    """Per category: best of ``repeats`` tok/s (a shared box's slow spells are what best-of drops)."""
    out = {}
    run(prompts[0][1])  # warm-up
    for cat, msgs in prompts:
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            n = run(msgs)
            best = max(best, n / (time.perf_counter() - t))
        out[cat] = best
    return out


def chat_run(
    llm: LLM, params: SamplingParams, toks: list[list[int]]
) -> Callable[[list[dict[str, str]]], int]:
    """One chat per call from an empty n-gram corpus (a repeat must not draft from its own earlier
    answer); its tokens appended to ``toks``, their count returned."""

    def run(msgs: list[dict[str, str]]) -> int:
        forget_outputs(llm)
        out = llm.chat([msgs], params, use_tqdm=False)[0]
        toks.append(out.token_ids)
        return len(out.token_ids)

    return run


def ngrammar_runs(kw: dict[str, Any], prompts: list[Any], max_tokens: int, repeats: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)  # outputs stop at EOS
    results: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name, extra in PRECISIONS.items():
        for spec in (False, True):
            label = f"ngrammar {'NGRAM' if spec else 'plain'} {name}"
            spec_kw = {"speculative": "ngram", "num_draft_tokens": 8} if spec else {}
            llm = LLM(**{**kw, **extra, **spec_kw})
            toks: list[list[int]] = []
            results[label] = _rate(chat_run(llm, params, toks), prompts, repeats)
            outputs[label] = toks[1::repeats]  # the first repeat of each prompt (after the warm-up)
            del llm
            gc.collect()
        plain, ngram = outputs[f"ngrammar plain {name}"], outputs[f"ngrammar NGRAM {name}"]
        same = sum(a == b for a, b in zip(plain, ngram))
        results[f"identical {name}"] = f"{same}/{len(plain)}"
    return results


def transformers_runs(prompts: list[Any], max_tokens: int, repeats: int) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from ngrammar.model.loader import embedded_model_path

    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = LlamaForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    model.eval()
    results = {}
    for label, extra in (
        ("transformers plain float32", {}),
        ("transformers prompt lookup", {"prompt_lookup_num_tokens": 10}),
    ):

        def run(msgs: list[dict[str, str]], extra: dict[str, Any] = extra, model: Any = model) -> int:
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
            ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    **extra,
                )
            return out.shape[1] - ids.shape[1]

        results[label] = _rate(run, prompts, repeats)
    return results


def llama_cpp_runs(prompts: list[Any], max_tokens: int, repeats: int, threads: int) -> dict[str, Any]:
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return {}
    from ngrammar.model.loader import embedded_model_path

    results = {}
    for label, draft in (
        ("llama.cpp plain (Q4_1)", None),
        ("llama.cpp prompt lookup", LlamaPromptLookupDecoding(num_pred_tokens=10)),
    ):
        # With a draft model llama-cpp-python keeps every position's logits in a buffer of n_batch
        # rows: a prompt longer than n_batch overflows it, so lookup runs with n_batch = n_ctx.
        llm = llama_cpp.Llama(
            str(embedded_model_path()),
            n_ctx=4096,
            n_batch=512 if draft is None else 4096,
            n_threads=threads,
            verbose=False,
            draft_model=draft,
        )

        def run(msgs: list[dict[str, str]], llm: Any = llm) -> int:
            out = llm.create_chat_completion(msgs, max_tokens=max_tokens, temperature=0.0)
            return int(out["usage"]["completion_tokens"])

        try:  # a peer that fails is reported, and the run keeps every other figure
            results[label] = _rate(run, prompts, repeats)
        except Exception as e:
            print(f"{label} failed: {type(e).__name__}: {e}")
        del llm
        gc.collect()
    return results


def run_cpu_benchmark(
    kw: dict[str, Any], max_tokens: int, repeats: int, with_transformers: bool
) -> dict[str, Any]:
    import torch

    prompts = prompts_per_category()
    kw = {**kw, "device": "cpu", "kv_cache_tokens": kw.get("kv_cache_tokens") or 4096}
    kw = {k: v for k, v in kw.items() if k not in ("speculative", "dtype", "quantization")}
    results = ngrammar_runs(kw, prompts, max_tokens, repeats)
    if with_transformers:
        results.update(transformers_runs(prompts, max_tokens, repeats))
    results.update(llama_cpp_runs(prompts, max_tokens, repeats, torch.get_num_threads()))
    cats = [c for c, _ in prompts]
    grounded = [c for c in cats if not c.startswith("open/")]
    rows = []
    for label, fig in results.items():
        if not isinstance(fig, dict):
            continue
        rates = [fig[c] for c in cats]
        rows.append([label, statistics.mean(rates), statistics.mean(fig[c] for c in grounded)] + rates)
    print_table(
        f"CPU batch 1, greedy, {max_tokens} tokens, best of {repeats} (tok/s, prefill included)",
        ["system", "all", "grounded", *cats],
        rows,
    )
    for name in PRECISIONS:
        print(f"NGRAM identical to plain ({name}): {results[f'identical {name}']}")
    return results
