"""The H200 benchmark: one run, a table printed last, a JSON log under --out.

Part 1, SmolLM2-135M (the embedded GGUF, bf16): ngrammar plain, NGRAM, NGRAM + JSON grammar, NGRAM +
grammar with the readback switch, transformers ``generate`` plain and with prompt lookup, on
grounded and open-ended prompts at several batch sizes; the spec+grammar step runs with
``torch.cuda.set_sync_debug_mode("error")`` armed from drafting to the verify launch.
Part 2, a random-weight Llama-3-8B-shaped model: plain decode and tree-verify step times (CUDA
graphs) against the bandwidth floor measured in the same run.
Part ``kernels`` (not run by default): ``benchmarks.bench_kernels``, the fused small-step linear
kernel against the unfused ops, and whole steps per kernel set, the invariant numerics' included (``kernel_steps``: the steps only; ``kernel_splits``: batch-1 decode by split cap and context; ``verify_splits``: the same for a 16-token tree verify).
Part ``links``: host-derived tree links against the readback switch on equal work (NGRAM + grammar,
the policy off so that both variants verify at every step and emit the same tokens).
Part ``acceptor`` (not run by default): the greedy acceptor graph, torch ops against the one-launch
kernel (``ngrammar.kernels.tree_accept``).
Part ``serve_schema`` (not run by default): through the server, ``--serve-concurrency`` (256)
clients whose requests all carry a JSON schema against none, plain and NGRAM (``bench_serve_schema``).
Part ``identity`` (not run by default): ``benchmarks.bench_identity``, token identity (batch == alone,
NGRAM == plain and its variants) and tok/s under ``--numerics invariant`` and ``fast``; with
``--load-format dummy`` a config folder is enough.
Part ``overhead`` (not run by default; runs on a CPU too): plain against NGRAM with one draft width
(corpus upkeep only, never a verify step) and NGRAM with D = 16 (``bench_spec_overhead``).

    python -m benchmarks.gpu_bench --model /tmp/ngm/model.gguf --out $OUT/gpu_bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_arrivals import bench_arrivals, summarize_arrivals
from benchmarks.bench_grammar import (
    RECORD_SCHEMA,
    extraction_prompts,
)
from benchmarks.common import (
    accept_length,
    chat,
    copy_tokenizer,
    load_workload,
    machine,
    print_table,
    run_chat,
    switch_pairs,
)
from ngrammar import LLM, SamplingParams
from ngrammar.attention.metadata import AttentionMetadata
from ngrammar.config import EngineConfig
from ngrammar.engine.engine import StepRecord
from ngrammar.model.config import ModelConfig


# ---------------------------------------------------------------- part 1: SmolLM2
def _categories() -> dict[str, list[Any]]:
    work = load_workload()
    cats: dict[str, list[Any]] = {"code_edit": [], "extraction": [], "summarization": [], "open": []}
    for w in work:
        key = w.category if w.kind == "grounded" else "open"
        if key in cats:
            cats[key].append(chat(w.prompt))
    return cats


def _batch(prompts: list[Any], bs: int) -> list[Any]:
    """bs prompts, cycling through the category's."""
    return [prompts[i % len(prompts)] for i in range(bs)]


# --numerics: every engine of the run (None: the config's default).
_NUMERICS: str | None = None


def _engine_kwargs(model: str | None, graphs: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": model,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "kv_cache_tokens": 262144 if torch.cuda.is_available() else 16384,
    }
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    if "cuda_graph" in fields:
        kw["cuda_graph"] = graphs
    if _NUMERICS is not None and "numerics" in fields:
        kw["numerics"] = _NUMERICS
    return kw


def _arrivals_part(
    model: str | None, load_format: str, dtype: str, sizes: list[int], max_tokens: int
) -> dict[str, Any]:
    """``bench_arrivals`` on one engine (CUDA graphs and mixed-step graphs captured where CUDA is)."""
    llm = LLM(**_engine_kwargs(model, True), load_format=load_format, dtype=dtype)
    try:
        return bench_arrivals(llm, [p for ps in _categories().values() for p in ps], sizes, max_tokens)
    finally:
        llm.close()


def bench_small_model(
    model: str | None,
    batch_sizes: list[int],
    max_tokens: int,
    repeats: int,
    graphs: bool = True,
    transformers: bool = True,
    width: int = 16,
) -> dict[str, Any]:
    """``width``: the NGRAM engine's num_draft_tokens (its policy picks widths up to it)."""
    res: dict[str, Any] = {"cuda_graphs": graphs, "num_draft_tokens": width}
    t = time.perf_counter()
    plain = LLM(**_engine_kwargs(model, graphs))
    spec = LLM(**_engine_kwargs(model, graphs), speculative="ngram", num_draft_tokens=width)
    # Plain decoding that commits every step before launching the next (what overlap scheduling hides).
    stepwise = LLM(**_engine_kwargs(model, graphs), overlap_schedule=False)
    res["engine_start_s"] = time.perf_counter() - t
    assert spec.engine.ngram is not None
    cats = _categories()
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    run_chat(plain, cats["open"][:2], greedy)
    run_chat(spec, cats["open"][:2], greedy)
    for bs in batch_sizes:
        for cat, prompts in cats.items():
            batch = _batch(prompts, bs)
            # A first run of the cell, not in its figures: the policy times its draft widths once
            # per batch-size bucket (a server pays that once), which would land in the first pair.
            first = run_chat(spec, batch, greedy)[0] / run_chat(plain, batch, greedy)[0]
            # Interleaved pairs: a slow spell of the host hits both sides of a pair.
            p, s, q = [], [], []
            stats = spec.engine.stats
            for _ in range(repeats):
                p.append(run_chat(plain, batch, greedy))
                steps, chained = stats.steps, stats.chained_steps
                s.append(run_chat(spec, batch, greedy))
                chained_share = (stats.chained_steps - chained) / max(stats.steps - steps, 1)
                q.append(run_chat(stepwise, batch, greedy))
            same = [a.token_ids == b.token_ids for a, b in zip(p[-1][1], s[-1][1])]
            res[f"b{bs}/{cat}"] = {
                "plain_tok_s": statistics.median(r[0] for r in p),
                "ngram_tok_s": statistics.median(r[0] for r in s),
                "ratio": statistics.median(b[0] / a[0] for a, b in zip(p, s)),
                "plain_stepwise_tok_s": statistics.median(r[0] for r in q),
                "overlap_gain": statistics.median(a[0] / c[0] for a, c in zip(p, q)),
                # Every member ends at max_tokens, on the same step, so both engines run the same
                # batches through the same kernels: overlap must not change a single token.
                "overlap_identical": all(a.token_ids == c.token_ids for a, c in zip(p[-1][1], q[-1][1])),
                "accept_len": accept_length(s[-1][1]),
                "ngram_chained_share": chained_share,  # of the last NGRAM run's engine steps
                "ngram_identical_to_plain": sum(same) / len(same),
                "first_run_ratio": first,  # NGRAM / plain in the cell's untimed first run
            }
        try:
            res[f"b{bs}/json"] = _grammar_variants(plain, spec, bs, max_tokens, repeats)
        except Exception as e:  # a broken grammar run must not take the batch's other figures with it
            res[f"b{bs}/json"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(traceback.format_exc(), file=sys.stderr)
    if transformers:
        res["transformers_b1"] = bench_transformers(plain, model, max_tokens)
    return res


def bench_spec_overhead(
    model: str | None, batch_sizes: list[int], max_tokens: int, repeats: int
) -> dict[str, Any]:
    """Where NGRAM loses against plain decoding when it should not: three engines on the same
    batches, interleaved run by run. "ngram D=1" indexes prompts and outputs into the corpus like
    the NGRAM engine but can never verify (its only width is 1; the policy answers at once, without
    probing match lengths), so plain -> D=1 is the corpus upkeep's cost, and D=1 -> D=16 what the
    policy (its probes included), its verify steps and the chain breaks they cause gain or lose.
    Per variant: tok/s (median), the share of steps that were chained (launched before the
    previous one was read back), verify steps per run, and chains the policy broke for a verify
    step that it then called off (``EngineStats.false_drains``) per run."""
    kw = _engine_kwargs(model, True)
    engines = {
        "plain": LLM(**kw),
        "ngram D=1": LLM(**kw, speculative="ngram", num_draft_tokens=1),
        "ngram D=16": LLM(**kw, speculative="ngram", num_draft_tokens=16),
    }
    cats = _categories()
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for llm in engines.values():
        run_chat(llm, cats["open"][:2], greedy)
    res: dict[str, Any] = {}
    rows = []
    for bs in batch_sizes:
        for cat in ("open", "code_edit"):
            batch = _batch(cats[cat], bs)
            runs: dict[str, list[tuple[float, float, int, int, int, int]]] = {name: [] for name in engines}
            # A first run of the cell, not in its figures (see bench_small_model); its ratios are kept.
            first = {name: run_chat(llm, batch, greedy)[0] for name, llm in engines.items()}
            traces: dict[str, list[StepRecord]] = {}  # the last run's steps, one by one
            verify_reasons: dict[str, Counter[str]] = {name: Counter() for name in engines}  # over all runs
            for _rep in range(repeats):
                for name, llm in engines.items():
                    st = llm.engine.stats
                    before = (
                        st.steps,
                        st.chained_steps,
                        st.spec_steps,
                        st.false_drains,
                        st.policy_drains,
                        getattr(st, "shadow_samples", 0),
                    )  # (an engine before shadow drafts has none)
                    llm.engine.step_trace = traces[name] = []
                    tok_s = run_chat(llm, batch, greedy)[0]
                    llm.engine.step_trace = None
                    verify_reasons[name].update(r.reason for r in traces[name] if r.kind == "verify")
                    runs[name].append(
                        (
                            tok_s,
                            (st.chained_steps - before[1]) / max(st.steps - before[0], 1),
                            st.spec_steps - before[2],
                            st.false_drains - before[3],
                            st.policy_drains - before[4],
                            getattr(st, "shadow_samples", 0) - before[5],
                        )
                    )
            cell: dict[str, dict[str, Any]] = {}
            for name, r in runs.items():
                c = cell[name] = {
                    "tok_s": statistics.median(x[0] for x in r),
                    "chained": statistics.median(x[1] for x in r),
                    "verify_steps": statistics.median(x[2] for x in r),
                    "false_drains": statistics.median(x[3] for x in r),
                    "policy_drains": statistics.median(x[4] for x in r),
                    "shadow_samples": statistics.median(x[5] for x in r),
                    "ratio_to_plain": statistics.median(x[0] / p[0] for x, p in zip(r, runs["plain"])),
                    "first_run_ratio": first[name] / first["plain"],
                    # per run: tok/s, chained, verify steps, false and policy drains, shadow samples
                    "runs": [list(x) for x in r],
                    "steps": _trace_summary(traces[name]),
                    "verify_reasons": dict(verify_reasons[name]),
                }
                rows.append(
                    [
                        f"b{bs}/{cat}",
                        name,
                        c["tok_s"],
                        c["ratio_to_plain"],
                        c["first_run_ratio"],
                        c["chained"],
                        c["verify_steps"],
                        c["false_drains"],
                    ]
                )
            res[f"b{bs}/{cat}"] = cell
            res[f"b{bs}/{cat}/trace"] = {
                name: [dataclasses.astuple(r) for r in t] for name, t in traces.items()
            }
            print(
                f"b{bs}/{cat} last run, ms per step kind; the policy's reasons for verify steps over all runs: "
                + json.dumps(
                    {
                        n: {
                            "ms": {k: v["total_ms"] for k, v in c["steps"].items()},
                            "verify": c["verify_reasons"],
                        }
                        for n, c in cell.items()
                    }
                ),
                flush=True,
            )
    print_table(
        f"NGRAM overhead vs plain ({max_tokens} tokens per request, {repeats} interleaved runs, medians)",
        [
            "batch/workload",
            "engine",
            "tok/s",
            "x plain (paired)",
            "x plain (first run)",
            "chained share",
            "verify steps/run",
            "false drains/run",
        ],
        rows,
    )
    return res


def _trace_summary(trace: list[StepRecord]) -> dict[str, dict[str, Any]]:
    """Per step kind (a verify step's kind names its width): count, total and median ms, host ms,
    and how many steps each policy decision made (``StepRecord.reason``)."""
    kinds: dict[str, list[StepRecord]] = {}
    for r in trace:
        kinds.setdefault(r.kind if r.kind != "verify" else f"verify{r.width}", []).append(r)
    return {
        k: {
            "n": len(rs),
            "total_ms": round(1e3 * sum(r.seconds for r in rs), 3),
            "median_ms": round(1e3 * statistics.median(r.seconds for r in rs), 3),
            "host_ms": round(1e3 * sum(r.host_seconds for r in rs), 3),
            "shadow_ms": round(1e3 * sum(getattr(r, "shadow_seconds", 0.0) for r in rs), 3),
            "reasons": dict(Counter(r.reason for r in rs if r.reason)),
        }
        for k, rs in kinds.items()
    }


def _grammar_variants(plain: LLM, spec: LLM, bs: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    assert spec.engine.ngram is not None
    prompts = extraction_prompts(bs)
    base = SamplingParams(max_tokens=max_tokens, temperature=0)
    gram = SamplingParams(max_tokens=max_tokens, temperature=0, json_schema=RECORD_SCHEMA)
    out: dict[str, Any] = {}
    worker = spec.engine.ngram
    worker.sync_debug = True  # raises if anything syncs between drafting and the verify launch
    try:
        run_chat(spec, prompts, gram)
        out["sync_debug_region_clean"] = True
        for label, llm, params, readback in [
            ("plain+grammar", plain, gram, False),
            ("ngram", spec, base, False),
            ("ngram+grammar", spec, gram, False),
            ("ngram+grammar readback", spec, gram, True),
        ]:
            worker.readback_links = readback
            runs = [run_chat(llm, prompts, params) for _ in range(repeats)]
            out[label] = {
                "tok_s": statistics.median(r[0] for r in runs),
                "accept_len": accept_length(runs[-1][1]),
            }
    finally:
        worker.sync_debug = False
        worker.readback_links = False
    out["equal_work"] = grammar_equal_work(spec, prompts, max_tokens, repeats)
    out["equal_work_plain"] = grammar_equal_work(plain, prompts, max_tokens, repeats)
    return out


def grammar_equal_work(llm: LLM, prompts: list[Any], max_tokens: int, repeats: int) -> dict[str, Any]:
    """One engine (plain or NGRAM) with and without a grammar on the same work: the grammar is
    "any JSON object", which the model's own greedy output for these prompts satisfies, so both
    sides emit the same tokens (checked: ``identical``) and differ only by the grammar's cost. The
    unconstrained side stops where the grammar ended each request. (The schema variants above
    compare runs that emit different text: a schema reshapes the output and ends it where the JSON
    ends.)"""
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0, json_object=True)
    _, first = run_chat(llm, prompts, constrained)  # fixes each request's length (greedy: every run)
    eos = llm.engine.grammar_backend.stop_token_ids  # the tokens the grammar ends on

    def text_tokens(ids: list[int]) -> list[int]:  # where the JSON ended, the grammar's run ends with EOS
        return ids[:-1] if ids and ids[-1] in eos else ids

    free = [
        SamplingParams(max_tokens=max(len(text_tokens(o.token_ids)), 1), temperature=0, ignore_eos=True)
        for o in first
    ]
    pairs = []
    llm.engine.step_trace = trace = []  # both sides' steps: what a low ratio was made of
    for i in range(repeats):  # interleaved, alternating which side goes first
        order = [("grammar", constrained), ("free", free)]
        runs = dict(
            (label, run_chat(llm, prompts, params)) for label, params in (order if i % 2 else order[::-1])
        )
        pairs.append((runs["grammar"], runs["free"]))
    llm.engine.step_trace = None
    same = [text_tokens(a.token_ids) == b.token_ids for a, b in zip(pairs[-1][0][1], pairs[-1][1][1])]
    return {
        "json_object_tok_s": statistics.median(g[0] for g, _ in pairs),
        "free_tok_s": statistics.median(f[0] for _, f in pairs),
        "ratio": statistics.median(g[0] / f[0] for g, f in pairs),
        "accept_len": {"grammar": accept_length(pairs[-1][0][1]), "free": accept_length(pairs[-1][1][1])},
        "identical": sum(same) / len(same),
        "tokens": sum(len(o.token_ids) for o in first),
        "steps": _trace_summary(trace),
    }


def bench_serve_schema(model: str | None, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Through the server: ``concurrency`` clients, twice as many requests, every one JSON-schema
    constrained (plain and NGRAM) against none constrained (plain). The schema's output differs
    from the free text, so the figure to compare is the rate (tok/s), not the time."""
    from benchmarks.bench_serve import run_serve_benchmark

    server_args = ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    if model is not None:
        server_args = ["--model", model, *server_args]
    out = run_serve_benchmark(
        concurrency=(concurrency,),
        num_requests=2 * concurrency,
        max_tokens=max_tokens,
        server_args=server_args,
        modes=["free", "off+grammar", "ngram+grammar"],
    )
    rates = {level["mode"]: level["throughput_tok_s"] for level in out["levels"]}
    out["schema_vs_free"] = rates["off+grammar"] / rates["free"] if rates.get("free") else None
    out["ngram_schema_vs_free"] = rates["ngram+grammar"] / rates["free"] if rates.get("free") else None
    return out


def bench_links_equal_work(
    model: str | None, batch_sizes: list[int], max_tokens: int, repeats: int
) -> dict[str, Any]:
    """Host-derived tree links against the readback switch on the same work (``links_equal_work``)
    with the policy off: every decode step verifies at D = 16."""
    spec = LLM(**_engine_kwargs(model, True), speculative="ngram", num_draft_tokens=16, spec_policy="fixed")
    return {
        f"b{bs}": links_equal_work(spec, extraction_prompts(bs), max_tokens, repeats) for bs in batch_sizes
    }


def links_equal_work(spec: LLM, prompts: list[Any], max_tokens: int, repeats: int) -> dict[str, Any]:
    """NGRAM + the record schema with host-derived links and with the readback switch, in
    interleaved pairs (after one dropped warm-up pair). ``spec`` must not adapt its width: then
    both variants run the same verify steps and emit the same tokens (checked: ``identical``).
    With the policy on, the variants' different step times change which steps verify, and bf16
    verify and plain steps round differently, so the two ``_grammar_variants`` rows emit
    different text."""
    worker = spec.engine.ngram
    assert worker is not None and spec.engine.config.speculative.policy == "fixed"
    params = SamplingParams(max_tokens=max_tokens, temperature=0, json_schema=RECORD_SCHEMA)
    # Both sides draft and trim the same trees: the same verify steps, the same tokens.
    return switch_pairs(
        spec, prompts, params, "readback_links", ("host_links", False), ("readback", True), repeats
    )


def bench_acceptor(batch_sizes: list[int], width: int = 16, vocab: int = 49152) -> dict[str, Any]:
    """The greedy acceptor graph of a verify step: the torch ops (``verify_tree_greedy_from_logits``,
    ``compact_path_kv``, ``packed``) against the one-launch kernel (the argmax, ``greedy_tree_accept``,
    ``move_kv_slots``), on random chain-shaped trees, fp32 logits and a SmolLM2-shaped bf16 KV pool;
    µs per replay and whether results and the moved KV agree."""
    from ngrammar.kernels.tree_accept import greedy_tree_accept
    from ngrammar.runner.acceptance import TreeAcceptResult, verify_tree_greedy_from_logits
    from ngrammar.runner.model_runner import compact_path_kv, move_kv_slots

    def ops(
        pool: torch.Tensor, cands: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor, slots: torch.Tensor
    ) -> tuple[Any, torch.Tensor]:
        result = verify_tree_greedy_from_logits(cands, mask, logits)
        compact_path_kv(pool, slots, result.accept_nodes, result.accept_len)
        return result, result.packed()

    def fused(
        pool: torch.Tensor, cands: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor, slots: torch.Tensor
    ) -> tuple[Any, torch.Tensor]:
        out = greedy_tree_accept(cands, mask, logits.argmax(-1).view(cands.shape), slots)
        assert out.kv_src is not None
        move_kv_slots(pool, slots, out.kv_src)
        return TreeAcceptResult.of(out), out.packed

    res: dict[str, Any] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for bs in batch_sizes:
        logits = torch.randn(bs * width, vocab, device="cuda", generator=gen)
        predict = logits.argmax(-1).view(bs, width)
        mask = (
            torch.tril(torch.ones(width, width, dtype=torch.bool, device="cuda"))
            .expand(bs, width, width)
            .contiguous()
        )
        cands = torch.cat([predict[:, :1], predict[:, :-1]], dim=1)  # a chain that follows the argmax ...
        cands[:, width // 2] += 1  # ... up to its middle
        pages = bs * width // 16 + 8
        pool = torch.randn(30, 2, pages, 16, 3, 64, device="cuda", generator=gen).to(torch.bfloat16)
        slots = torch.randperm(pages * 16, device="cuda", generator=gen)[: bs * width].view(bs, width)
        outs, pools, row = {}, {}, {}
        for name, fn in {"torch": ops, "kernel": fused}.items():
            pools[name] = pool.clone()
            fn(pools[name], cands, mask, logits, slots)  # warm-up (compiles); moves are idempotent here
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs[name] = fn(pools[name], cands, mask, logits, slots)
            graph.replay()
            row[f"{name}_us"] = cuda_seconds(graph.replay, 50) * 1e6
        (a, pa), (b, pb) = outs["torch"], outs["kernel"]
        row["agree"] = bool(
            torch.equal(pa, pb)
            and torch.equal(pools["torch"], pools["kernel"])
            and all(
                torch.equal(getattr(a, f), getattr(b, f))
                for f in ("accept_index", "accept_len", "accept_tokens", "accept_nodes", "bonus")
            )
        )
        res[f"b{bs}"] = row
    print_table(
        f"greedy acceptor graph, D = {width} (µs per replay)",
        ["batch", "torch ops", "kernel", "agree"],
        [[k, v["torch_us"], v["kernel_us"], v["agree"]] for k, v in res.items()],
    )
    return res


def bench_transformers(
    plain: LLM, llm_model: str | None, max_tokens: int, repeats: int = 3
) -> dict[str, Any]:
    """transformers ``generate`` at batch 1 (plain and prompt lookup) on the first prompt per category,
    warm (a full-length run first), in the engine's dtype, against ngrammar plain on the same prompt:
    decode window ((n - 1) tokens over the time past the first token) and end to end (n tokens over
    the whole call, prefill included); medians of ``repeats``. Both run to ``max_tokens``
    (``ignore_eos`` / ``min_new_tokens``: tokens past EOS counted on both sides)."""
    from transformers import LlamaForCausalLM

    from ngrammar.model.loader import resolve_checkpoint

    ckpt = resolve_checkpoint(llm_model)  # the converted cache folder holds HF config + safetensors
    device, dtype = plain.engine.device, plain.engine.dtype
    hf = LlamaForCausalLM.from_pretrained(str(ckpt.tokenizer_dir), dtype=dtype).to(device).eval()
    res: dict[str, Any] = {"dtype": str(dtype)}
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def seconds(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    for cat, prompts in _categories().items():
        ids = torch.tensor([plain.engine.tokenize(prompts[0])], device=device)
        ours = plain.chat(prompts[0], greedy, use_tqdm=False)[0].token_ids
        one = SamplingParams(max_tokens=1, temperature=0)
        whole = seconds(lambda p=prompts[0]: plain.chat(p, greedy, use_tqdm=False))
        to_first = seconds(lambda p=prompts[0]: plain.chat(p, one, use_tqdm=False))
        row: dict[str, Any] = {
            "ngrammar_plain": (max_tokens - 1) / (whole - to_first),
            "ngrammar_plain_e2e": max_tokens / whole,
        }
        for label, extra in [("hf_plain", {}), ("hf_prompt_lookup10", {"prompt_lookup_num_tokens": 10})]:

            def gen(n: int, extra: dict[str, Any] = extra) -> Any:
                with torch.no_grad():
                    return hf.generate(
                        ids,
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        attention_mask=torch.ones_like(ids),
                        **extra,
                    )

            out = gen(max_tokens)  # warm: every shape of the timed calls seen once
            total, first = seconds(lambda: gen(max_tokens)), seconds(lambda: gen(1))
            row[label] = (max_tokens - 1) / max(total - first, 1e-9)
            row[f"{label}_e2e"] = max_tokens / total
            row[f"{label}_identical_to_ngrammar"] = out[0, ids.shape[1] :].tolist() == ours
        res[cat] = row
    return res


# ---------------------------------------------------------------- part 2: 8B shape
LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position=8192,
    tie_word_embeddings=False,
)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return 2 * nbytes / cuda_seconds(lambda: dst.copy_(src), 10)  # read + write bytes per second


def cuda_seconds(fn: Callable[[], Any], n: int) -> float:
    """Median seconds of ``fn`` over n calls, each timed between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def random_model(config: ModelConfig, ops: Any = None, backend: Any = None) -> Any:
    """(bf16 model with random weights on CUDA, its attention backend); TritonOps and
    TritonAttentionBackend by default."""
    from ngrammar.attention.triton import TritonAttentionBackend
    from ngrammar.kernels.fused_ops import TritonOps
    from ngrammar.model.llama import LlamaForCausalLM
    from ngrammar.model.loader import fill_dummy_weights

    backend = backend or TritonAttentionBackend()
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, ops or TritonOps())
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    model.rotary.__init__(config)
    model.rotary.to("cuda")
    fill_dummy_weights(model)
    return model.eval(), backend


def step_time(
    model: Any,
    backend: Any,
    config: ModelConfig,
    bs: int,
    q: int,
    ctx: int = 1024,
    kv_len_bound: int | None = None,
) -> float:
    """Median seconds of one captured step (bs requests of q new tokens after ctx cached ones); the
    plan is built for kv_len_bound (default ctx + q), as the engine builds it for its longest context."""
    ps = 16
    pages_per = -(-(ctx + q) // ps)
    kv = torch.zeros(
        (config.num_layers, 2, bs * pages_per + 1, ps, config.num_kv_heads, config.head_dim),
        dtype=torch.bfloat16,
        device="cuda",
    )
    table = torch.arange(bs * pages_per, device="cuda").view(bs, pages_per)
    kv_idx = torch.arange(ctx, ctx + q, device="cuda")
    slots = (table[:, kv_idx // ps] * ps + kv_idx % ps).reshape(-1)
    meta = AttentionMetadata(
        slot_mapping=slots,
        page_table=table,
        kv_lens=torch.full((bs,), ctx + q, device="cuda"),
        q_lens=torch.full((bs,), q, device="cuda"),
        q_start=torch.arange(bs + 1, device="cuda") * q,
        max_q_len=q,
        max_kv_len=ctx + q,
        page_size=ps,
        tree_mask=None
        if q == 1
        else torch.tril(torch.ones(q, q, dtype=torch.bool, device="cuda")).expand(bs, q, q),
    )
    plan = backend.plan(meta, kv_len_bound=kv_len_bound or ctx + q)
    ids = torch.randint(0, config.vocab_size, (bs * q,), device="cuda")
    pos = (ctx + torch.arange(q, device="cuda")).repeat(bs)
    with torch.inference_mode():
        for _ in range(2):
            model.compute_logits(model(ids, pos, kv, plan))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.compute_logits(model(ids, pos, kv, plan))
        for _ in range(3):
            graph.replay()
        return cuda_seconds(graph.replay, 20)


def bench_8b() -> dict[str, Any]:
    model, backend = random_model(LLAMA3_8B)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth()
    floor = wbytes / bw  # weight bytes / measured copy bandwidth (read + write bytes per second)
    res: dict[str, Any] = {"weight_gb": wbytes / 1e9, "copy_bw_tb_s": bw / 1e12, "floor_ms": floor * 1e3}
    for bs in (1, 8):
        for q in (1, 4, 8, 16, 32):
            res[f"b{bs}/q{q}_ms"] = step_time(model, backend, LLAMA3_8B, bs, q) * 1e3
    del model
    torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------- part 3: 8B replay
def shape_folder(folder: Path, config: ModelConfig, eos: tuple[int, ...], model: str | None = None) -> Path:
    """A Hugging Face folder with ``config``'s shape, the embedded model's tokenizer and chat
    template and no weights (``load_format="dummy"``); ``eos``: its end tokens (the recorded ones)."""
    from ngrammar.model.loader import resolve_checkpoint

    base = resolve_checkpoint(model)  # its tokenizer (``model``: a GGUF or folder of the same tokenizer)
    c = config
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position,
        "tie_word_embeddings": c.tie_word_embeddings,
        "eos_token_id": list(eos),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    copy_tokenizer(base.tokenizer_dir, folder)
    return folder


def timed_chat(llm: LLM, prompts: list[Any], params: Any) -> tuple[float, float, list[Any]]:
    """(decode-window tok/s, end-to-end tok/s with prefill and queueing, outputs) of one batch from an
    empty corpus; outputs stop at EOS unless ``params`` say otherwise."""
    t = time.perf_counter()
    tok_s, outs = run_chat(llm, prompts, params)
    wall = time.perf_counter() - t
    return tok_s, sum(len(o.token_ids) for o in outs) / wall, outs


def _pairs(
    a: LLM, b: LLM, batch: list[Any], params: Any, repeats: int
) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """``a`` (plain) against ``b`` (NGRAM) on one batch: one dropped first pair (the policy times its
    widths once per bucket), then interleaved pairs; medians and the paired ratio b / a, and each
    side's last outputs."""
    timed_chat(a, batch, params), timed_chat(b, batch, params)
    pa, pb = [], []
    for _ in range(repeats):
        pa.append(timed_chat(a, batch, params))
        pb.append(timed_chat(b, batch, params))
    outs_a, outs_b = pa[-1][2], pb[-1][2]
    same = [x.token_ids == y.token_ids for x, y in zip(outs_a, outs_b)]
    return (
        {
            "plain_tok_s": statistics.median(r[0] for r in pa),
            "ngram_tok_s": statistics.median(r[0] for r in pb),
            "ratio": statistics.median(y[0] / x[0] for x, y in zip(pa, pb)),
            "plain_e2e_tok_s": statistics.median(r[1] for r in pa),
            "ngram_e2e_tok_s": statistics.median(r[1] for r in pb),
            "e2e_ratio": statistics.median(y[1] / x[1] for x, y in zip(pa, pb)),
            "accept_len": accept_length(outs_b),
            "identical": sum(same) / len(same),
            "tokens": statistics.mean(len(o.token_ids) for o in outs_a),
        },
        outs_a,
        outs_b,
    )


def bench_replay(
    model: str | None,
    batch_sizes: list[int],
    max_tokens: int,
    repeats: int,
    shape: ModelConfig = LLAMA3_8B,
    categories: tuple[str, ...] = ("code_edit", "extraction", "summarization", "open"),
) -> dict[str, Any]:
    """NGRAM on an 8B-shaped engine: Llama-3-8B-shaped bf16 random weights (``load_format="dummy"``),
    every token decided by SmolLM2's greedy outputs recorded in this run (``ReplayTarget``), every
    piece of host work real: 8B step costs x SmolLM2 acceptance. Outputs stop at EOS.

    Controls in the same run: the NGRAM / plain ratios of SmolLM2 replaying its own recording against
    its live ratios (replay must reproduce them within 3%), and the 8B plain speed with and without
    replay on the same token counts (replay must cost < 1%)."""
    from ngrammar.speculative.replay import ReplayTarget

    cats = {k: v[:4] for k, v in _categories().items() if k in categories}
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    small = _engine_kwargs(model, True)
    plain = LLM(**small)
    spec = LLM(**small, speculative="ngram", num_draft_tokens=16)
    # The same NGRAM engine chaining a plain step out of a verify step (``chain_verify``, off by
    # default): what chaining out gains, in the same run.
    chained = LLM(**small, speculative="ngram", num_draft_tokens=16, chain_verify=True)
    # ... and one chaining a verify step out of a plain step in flight too (``chain_into_verify``,
    # off by default): what launching without a drain either way gains.
    both = LLM(**small, speculative="ngram", num_draft_tokens=16, chain_verify=True, chain_into_verify=True)
    eos = plain.engine.model_config.eos_token_ids
    res: dict[str, Any] = {
        "max_tokens": max_tokens,
        "prompts_per_category": {k: len(v) for k, v in cats.items()},
    }
    cells = [(bs, cat, _batch(prompts, bs)) for bs in batch_sizes for cat, prompts in cats.items()]
    records: dict[tuple[int, ...], list[int]] = {}
    for bs, cat, batch in cells:
        res[f"smollm2_live/b{bs}/{cat}"], recorded, _ = _pairs(plain, spec, batch, params, repeats)
        stats = chained.engine.stats
        steps, out_of_verify = stats.spec_steps, stats.chained_out_of_verify
        res[f"smollm2_chain_verify/b{bs}/{cat}"] = ab = _pairs(plain, chained, batch, params, repeats)[0]
        ab["chained_out_share"] = (stats.chained_out_of_verify - out_of_verify) / max(
            stats.spec_steps - steps, 1
        )
        stats = both.engine.stats
        steps, into_verify = stats.spec_steps, stats.chained_into_verify
        res[f"smollm2_chain_both/b{bs}/{cat}"] = ab = _pairs(plain, both, batch, params, repeats)[0]
        ab["chained_into_share"] = (stats.chained_into_verify - into_verify) / max(
            stats.spec_steps - steps, 1
        )
        for out in recorded:  # plain's greedy outputs: what the replay runs reproduce
            records[tuple(out.prompt_token_ids)] = list(out.prompt_token_ids) + out.token_ids
    target = ReplayTarget(records, eos[0])
    for llm in (plain, spec):
        llm.engine.set_replay(target)
    for bs, cat, batch in cells:
        rep = _pairs(plain, spec, batch, params, repeats)[0]
        rep["live_ratio_error"] = rep["ratio"] / res[f"smollm2_live/b{bs}/{cat}"]["ratio"] - 1
        res[f"smollm2_replay/b{bs}/{cat}"] = rep
    plain.close()
    spec.close()
    chained.close()
    both.close()
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        folder = shape_folder(Path(tmp) / "shape", shape, eos, model)
        longest = max(len(r) for r in records.values())
        big: dict[str, Any] = dict(
            model=str(folder),
            load_format="dummy",
            device=small["device"],
            kv_cache_tokens=max(batch_sizes) * (longest + 64),
            cuda_graph_max_bs=max(batch_sizes),
            max_running_requests=max(batch_sizes),
        )
        t = time.perf_counter()
        plain8 = LLM(**big)
        spec8 = LLM(**big, speculative="ngram", num_draft_tokens=16)
        res["8b_engine_start_s"] = time.perf_counter() - t
        # Control: plain 8B with and without replay, the same token counts (each request's recorded length).
        first = cells[0][2]
        lengths = [len(records[tuple(ids)]) - len(ids) for ids in map(plain8.engine.tokenize, first)]
        exact = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
        free = [timed_chat(plain8, first, exact)[0] for _ in range(repeats + 1)][1:]
        plain8.engine.set_replay(target)
        replayed = [timed_chat(plain8, first, exact)[0] for _ in range(repeats + 1)][1:]
        res["8b_replay_cost"] = {
            "free_tok_s": statistics.median(free),
            "replay_tok_s": statistics.median(replayed),
            "change": statistics.median(replayed) / statistics.median(free) - 1,
        }
        spec8.engine.set_replay(target)
        for bs, cat, batch in cells:
            r, _, got = _pairs(plain8, spec8, batch, params, repeats)
            r["replay_exact"] = all(
                records[tuple(o.prompt_token_ids)] == o.prompt_token_ids + o.token_ids for o in got
            )
            res[f"8b_replay/b{bs}/{cat}"] = r
        plain8.close()
        spec8.close()
    torch.cuda.empty_cache()
    return res


def summarize_replay(res: dict[str, Any]) -> None:
    rows = []
    for key, v in res.items():
        if not (isinstance(v, dict) and "ratio" in v):
            continue
        extra = f"live x{v['live_ratio_error']:+.1%}" if "live_ratio_error" in v else ""
        if "chained_out_share" in v:
            extra = f"{v['chained_out_share']:.0%} of verify steps chained out"
        if "chained_into_share" in v:
            extra = f"{v['chained_into_share']:.0%} of verify steps chained into (both chains on)"
        if "replay_exact" in v:
            extra = f"replay exact {v['replay_exact']}"
        rows.append(
            [
                key,
                f"{v['plain_tok_s']:.0f}",
                f"{v['ngram_tok_s']:.0f}",
                f"{v['ratio']:.2f}",
                f"{v['e2e_ratio']:.2f}",
                f"{v['accept_len']:.2f}",
                f"{v['identical']:.0%}",
                f"{v['tokens']:.0f}",
                extra,
            ]
        )
    cost = res.get("8b_replay_cost", {})
    print_table(
        f"NGRAM / plain, bf16, outputs stop at EOS (<= {res.get('max_tokens')} tokens); 8b_replay = "
        "Llama-3-8B-shaped random weights x SmolLM2's recorded acceptance; plain 8B speed with replay "
        f"{cost.get('change', float('nan')):+.2%} against without",
        [
            "engine/batch/workload",
            "plain tok/s",
            "NGRAM tok/s",
            "x decode",
            "x end-to-end",
            "accept",
            "same",
            "tokens",
            "control",
        ],
        rows,
    )


# ---------------------------------------------------------------- main
def _safe(name: str, fn: Callable[[], Any], log: dict[str, Any]) -> None:
    t = time.perf_counter()
    try:
        log[name] = fn()
    except Exception as e:  # a broken part must not hide the other parts' figures
        log[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(traceback.format_exc(), file=sys.stderr)
    print(f"[{name}] {time.perf_counter() - t:.1f}s", flush=True)


def summarize(log: dict[str, Any]) -> None:
    small = log.get("smollm2", {})
    if "error" in small:
        small = log.get("smollm2_eager", {})
    rows = []
    for key, v in small.items():
        if key.endswith("/json") and "error" not in v:
            for label, fig in v.items():
                if isinstance(fig, dict) and "tok_s" in fig:
                    rows.append([key, label, fig["tok_s"], fig["accept_len"]])
            for side, engine in (("equal_work", "ngram"), ("equal_work_plain", "plain")):
                eq = v.get(side)
                if eq:
                    acc = eq["accept_len"]
                    rows.append(
                        [
                            key,
                            f"equal work: {engine} (same tokens {eq['identical']:.0%})",
                            eq["free_tok_s"],
                            acc["free"],
                        ]
                    )
                    rows.append(
                        [
                            key,
                            f"equal work: {engine}+json_object (x{eq['ratio']:.2f})",
                            eq["json_object_tok_s"],
                            acc["grammar"],
                        ]
                    )
        elif isinstance(v, dict) and "plain_tok_s" in v:
            rows.append([key, "plain", v["plain_tok_s"], 1.0])
            if "plain_stepwise_tok_s" in v:
                rows.append(
                    [
                        key,
                        f"plain, no overlap (overlap x{v['overlap_gain']:.2f}, same "
                        f"{v.get('overlap_identical')})",
                        v["plain_stepwise_tok_s"],
                        1.0,
                    ]
                )
            ratio = v.get("ratio", v["ngram_tok_s"] / v["plain_tok_s"])  # median of paired runs when logged
            chained = v.get("ngram_chained_share")
            rows.append(
                [
                    key,
                    f"ngram (x{ratio:.2f}, same {v['ngram_identical_to_plain']:.0%}"
                    + ("" if chained is None else f", chained {chained:.0%}")
                    + ("" if "first_run_ratio" not in v else f", first run x{v['first_run_ratio']:.2f}")
                    + ")",
                    v["ngram_tok_s"],
                    v["accept_len"],
                ]
            )
    for cat, v in small.get("transformers_b1", {}).items():
        if isinstance(v, dict):
            for label in ("ngrammar_plain", "hf_plain", "hf_prompt_lookup10"):
                if label in v:
                    same = v.get(label + "_identical_to_ngrammar", "-")
                    rows.append(
                        [
                            f"b1/{cat} (warm, {small['transformers_b1']['dtype']})",
                            f"{label} (end to end {v[label + '_e2e']:.0f} tok/s; same {same})",
                            v[label],
                            "",
                        ]
                    )
    for key, v in log.get("links_equal_work", {}).items():
        if isinstance(v, dict) and "ratio" in v:
            rows.append(
                [
                    f"{key}/json D=16",
                    f"readback links ({v['readback_verify_ms']:.2f} ms/verify)",
                    v["readback_tok_s"],
                    v["accept_len"],
                ]
            )
            rows.append(
                [
                    f"{key}/json D=16",
                    f"host links (x{v['ratio']:.3f}, {v['host_links_verify_ms']:.2f} "
                    f"ms/verify, same {v['identical']:.0%})",
                    v["host_links_tok_s"],
                    v["accept_len"],
                ]
            )
    print_table(
        "SmolLM2-135M bf16, every request runs to max_tokens (ignore_eos: tokens past EOS counted)",
        ["batch/workload", "variant", "tok/s (decode window)", "accept len"],
        rows,
    )
    big = log.get("llama3_8b_shape", {})
    if "floor_ms" in big:
        rows = [[k, v, v / big["floor_ms"]] for k, v in big.items() if k.endswith("_ms") and k != "floor_ms"]
        print_table(
            f"8B-shaped random model (floor {big['floor_ms']:.2f} ms, copy {big['copy_bw_tb_s']:.2f} TB/s)",
            ["step", "ms", "x floor"],
            rows,
        )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="gpu_bench.json")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-transformers", action="store_true", help="skip transformers generate (A/B runs)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--parts", default="smollm2,links,8b")
    p.add_argument("--num-draft-tokens", type=int, default=16, help="D of the smollm2 part's NGRAM engine")
    p.add_argument("--replay-tokens", type=int, default=256, help="max tokens of the replay part")
    p.add_argument("--serve-concurrency", type=int, default=256, help="clients of the serve_schema part")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="arrivals and identity parts: dummy = random weights of --model's architecture (a config folder will do)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="arrivals part: float32 to check tokens under --numerics fast (its bf16 GEMMs vary with row count)",
    )
    p.add_argument(
        "--numerics",
        default=None,
        choices=["auto", "invariant", "fast"],
        help="every engine's numerics (default: the engine's default)",
    )
    args = p.parse_args()
    global _NUMERICS
    _NUMERICS = args.numerics
    log: dict[str, Any] = {
        "numerics": args.numerics or "default",
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    parts = args.parts.split(",")
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    if "smollm2" in parts:
        _safe(
            "smollm2",
            lambda: bench_small_model(
                args.model,
                sizes,
                args.max_tokens,
                args.repeats,
                transformers=not args.no_transformers,
                width=args.num_draft_tokens,
            ),
            log,
        )
        if "error" in log["smollm2"]:  # recorded above; measure the eager path too rather than nothing
            _safe(
                "smollm2_eager",
                lambda: bench_small_model(
                    args.model,
                    sizes,
                    args.max_tokens,
                    args.repeats,
                    graphs=False,
                    transformers=not args.no_transformers,
                    width=args.num_draft_tokens,
                ),
                log,
            )
    if "links" in parts:
        _safe(
            "links_equal_work",
            lambda: bench_links_equal_work(args.model, sizes, args.max_tokens, args.repeats),
            log,
        )
    if "serve_schema" in parts:
        _safe(
            "serve_schema",
            lambda: bench_serve_schema(args.model, args.serve_concurrency, args.max_tokens),
            log,
        )
    if "acceptor" in parts and torch.cuda.is_available():
        _safe("acceptor", lambda: bench_acceptor(sizes), log)
    if "overhead" in parts:
        _safe(
            "spec_overhead",
            lambda: bench_spec_overhead(args.model, sizes, args.max_tokens, args.repeats),
            log,
        )
    if "arrivals" in parts:
        _safe(
            "arrivals",
            lambda: _arrivals_part(args.model, args.load_format, args.dtype, sizes, args.max_tokens),
            log,
        )
    if "identity" in parts:
        from benchmarks.bench_identity import bench_identity

        kw = _engine_kwargs(args.model, True) | {"load_format": args.load_format}
        kw.pop("numerics", None)
        prompts = [p for ps in _categories().values() for p in ps[:2]]
        _safe(
            "identity",
            lambda: bench_identity(kw, ["invariant", "fast"], prompts, sizes, args.max_tokens),
            log,
        )
    if "8b" in parts and torch.cuda.is_available():
        _safe("llama3_8b_shape", bench_8b, log)
    if "replay" in parts and torch.cuda.is_available():
        _safe("replay", lambda: bench_replay(args.model, sizes, args.replay_tokens, args.repeats), log)
    kernel_parts = tuple(
        p
        for p, name in (
            ("linear", "kernels"),
            ("steps", "kernels"),
            ("steps", "kernel_steps"),
            ("splits", "kernel_splits"),
            ("verify_splits", "verify_splits"),
            ("invariant", "invariant_linear"),
        )
        if name in parts
    )
    if kernel_parts and torch.cuda.is_available():
        from benchmarks.bench_kernels import run as run_kernels

        _safe("kernels", lambda: run_kernels(kernel_parts), log)
    with open(args.out, "w") as f:
        json.dump(log, f, indent=1, default=str)
    summarize(log)
    if isinstance(log.get("replay"), dict) and "error" not in log["replay"]:
        summarize_replay(log["replay"])
    if isinstance(log.get("arrivals"), dict) and "error" not in log["arrivals"]:
        summarize_arrivals(log["arrivals"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
