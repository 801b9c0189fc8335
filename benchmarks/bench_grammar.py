"""Grammar cost, plain and under NGRAM speculation, incl. the readback switch (the pre-#32380 path)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from benchmarks.common import chat, print_table, run_chat
from ngrammar import LLM, SamplingParams
from ngrammar.grammar import GrammarSpec

PEOPLE = [
    ("Alice Johnson", 34, "Paris"),
    ("Bob Smith", 27, "Berlin"),
    ("Carla Gomez", 45, "Madrid"),
    ("David Lee", 52, "Seoul"),
    ("Emma Brown", 19, "London"),
    ("Farid Khan", 38, "Lahore"),
]
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                    "city": {"type": "string"},
                },
                "required": ["name", "age", "city"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
LOG_REGEX = r"(\[(INFO|WARN|ERROR)\] [a-z]+ [a-z ]+\n){3,6}"


def extraction_prompts(n: int) -> list[Any]:
    out = []
    for i in range(n):
        rot = PEOPLE[i % len(PEOPLE) :] + PEOPLE[: i % len(PEOPLE)]
        text = " ".join(f"{name} is {age} years old and lives in {city}." for name, age, city in rot[:4])
        out.append(chat(f"{text}\n\nExtract every person with name, age and city as JSON."))
    return out


def regex_prompts(n: int) -> list[Any]:
    logs = "[INFO] server started on port eight\n[WARN] disk almost full\n[ERROR] database connection lost\n"
    return [chat(f"Here are log lines:\n{logs}\nRepeat the log lines exactly.") for _ in range(n)]


def _rate(llm: LLM, prompts: list[Any], params: SamplingParams) -> tuple[float, float, float, float]:
    """Decode tok/s, grammar and forward ms per engine step, and mean accept length of one run."""
    eng = llm.engine
    g0, f0, s0 = eng.stats.grammar_seconds, eng.stats.forward_seconds, eng.stats.steps
    tok_s, outs = run_chat(llm, prompts, params)
    steps = max(eng.stats.steps - s0, 1)
    accept = [o.metrics.get("spec_accept_length", 1.0) for o in outs]
    return (
        tok_s,
        1e3 * (eng.stats.grammar_seconds - g0) / steps,
        1e3 * (eng.stats.forward_seconds - f0) / steps,
        statistics.mean(accept),
    )


def run_grammar_benchmark(
    plain: LLM, spec: LLM, batch_size: int = 1, max_tokens: int = 96, repeats: int = 2
) -> dict[str, Any]:
    """Per workload: plain and NGRAM, without and with the grammar, and NGRAM + grammar with the
    readback switch, each run ``repeats`` times in a row."""
    assert spec.engine.ngram is not None
    workloads = {
        "json-extraction": (extraction_prompts(batch_size), dict(json_schema=RECORD_SCHEMA)),
        "regex-logs": (regex_prompts(batch_size), dict(regex=LOG_REGEX)),
    }
    results: dict[str, Any] = {}
    rows: list[list[Any]] = []
    for name, (prompts, grammar) in workloads.items():
        base = dict(max_tokens=max_tokens, temperature=0)
        variants = [
            ("plain", plain, SamplingParams(**base), False),
            ("plain+grammar", plain, SamplingParams(**base, **grammar), False),
            ("spec", spec, SamplingParams(**base), False),
            ("spec+grammar", spec, SamplingParams(**base, **grammar), False),
            ("spec+grammar readback", spec, SamplingParams(**base, **grammar), True),
        ]
        _rate(spec, prompts, variants[3][2])  # warm the corpus and grammar caches
        for label, llm, params, readback in variants:
            spec.engine.ngram.readback_links = readback
            figs = [_rate(llm, prompts, params) for _ in range(repeats)]
            spec.engine.ngram.readback_links = False
            rate = statistics.median(f[0] for f in figs)
            gms = statistics.median(f[1] for f in figs)
            fms = statistics.median(f[2] for f in figs)
            acc = statistics.median(f[3] for f in figs)
            results[f"{name}/{label}"] = {
                "tok_s": rate,
                "grammar_ms_step": gms,
                "forward_ms_step": fms,
                "accept_len": acc,
            }
            rows.append([name, label, rate, acc, gms, fms, gms / fms if fms else 0.0])
    for name in workloads:
        r = results
        r[f"{name}/spec+grammar_vs_plain+grammar"] = (
            r[f"{name}/spec+grammar"]["tok_s"] / r[f"{name}/plain+grammar"]["tok_s"]
        )
    print_table(
        f"grammar (batch {batch_size}, greedy, {max_tokens} tokens)",
        [
            "workload",
            "variant",
            "tok/s",
            "accept len",
            "grammar ms/step",
            "forward ms/step",
            "grammar/forward",
        ],
        rows,
    )
    return results


# ------------------------------------------------------------------ structured output (issue 29)
PRODUCT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "category": {"enum": ["kitchen", "garden", "office", "toys"]},
        "price": {"type": "number"},
        "unit": {"enum": ["kg", "pcs", "box"]},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "category", "price", "unit", "in_stock", "tags"],
    "additionalProperties": False,
}
PRODUCTS = [
    "a kettle",
    "a garden hose",
    "a stapler",
    "a wooden train",
    "flour",
    "a desk lamp",
    "seeds",
    "a kite",
]
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "item": {"type": "string"},
        "quantity": {"type": "integer"},
        "unit": {"enum": ["kg", "pcs", "box", "litre"]},
        "priority": {"enum": ["low", "normal", "high"]},
    },
    "required": ["item", "quantity", "unit", "priority"],
    "additionalProperties": False,
}
ORDERS = [
    ("apples", 3, "kg", "normal"),
    ("pens", 12, "pcs", "low"),
    ("milk", 2, "litre", "high"),
    ("nails", 1, "box", "normal"),
    ("rice", 5, "kg", "low"),
    ("chairs", 4, "pcs", "high"),
    ("juice", 6, "litre", "normal"),
    ("screws", 2, "box", "high"),
]
# (label, grammar_drafts, field memory on, prompt-text lookup on)
DRAFT_VARIANTS = [
    ("ngram+grammar", False, False, False),
    ("+forced", True, False, False),
    ("+forced+memory", True, True, False),
    ("+forced+memory+text", True, True, True),
]


def open_schema_prompts(n: int) -> list[Any]:
    return [
        chat(f"Describe {PRODUCTS[i % len(PRODUCTS)]} for sale as a JSON product record.") for i in range(n)
    ]


def order_prompts(n: int) -> list[Any]:
    out = []
    for i in range(n):
        item, qty, unit, prio = ORDERS[i % len(ORDERS)]
        out.append(chat(f"Order: {qty} {unit} of {item}, priority {prio}. Extract the order as JSON."))
    return out


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median tok/s (a batch-1 run is a fraction of a second on a CPU: one run's tok/s
    moves by several percent)."""
    return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]


def _structured_once(llm: LLM, prompts: list[Any], params: SamplingParams) -> dict[str, Any]:
    """One batch from an empty corpus (and field memory): tok/s, accept length, tokens per verify
    step and per decode step (plain steps included), and the outputs' tokens."""
    stats = llm.engine.stats
    v0, e0, d0, s0 = stats.verify_steps, stats.verify_emitted, stats.decode_tokens, stats.spec_steps
    trace: list[Any] = []
    llm.engine.step_trace = trace
    try:
        tok_s, outs = run_chat(llm, prompts, params)
    finally:
        llm.engine.step_trace = None
    decode_steps = sum(1 for r in trace if r.kind in ("decode", "chain", "verify"))
    verify = stats.verify_steps - v0
    return {
        "tok_s": tok_s,
        "accept_len": statistics.mean(o.metrics.get("spec_accept_length", 1.0) for o in outs),
        "tokens_per_verify": (stats.verify_emitted - e0) / verify if verify else 1.0,
        "tokens_per_decode_step": (stats.decode_tokens - d0) / max(decode_steps, 1),
        "verify_steps": stats.spec_steps - s0,
        "decode_steps": decode_steps,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def run_structured_benchmark(
    plain: LLM, spec: LLM, batch_size: int = 1, max_tokens: int = 64, batch_job: int = 0, repeats: int = 3
) -> dict[str, Any]:
    """Structured-output workloads: JSON extraction, open prompts with a schema and, with
    ``batch_job`` > 0, that many same-schema order extractions in one batch. Per workload: plain +
    grammar, NGRAM + grammar as before the draft proposer (n-gram drafts, pruned), with
    grammar-forced drafts, and with field memory too (``repeats`` rounds of every variant in turn,
    each variant's median run: greedy, so the tokens per step are deterministic given the policy's
    widths)."""
    worker = spec.engine.ngram
    assert worker is not None
    proposer = worker.proposer
    memory = proposer.memory
    workloads: dict[str, tuple[list[Any], dict[str, Any]]] = {}
    if batch_size:
        workloads["json-extraction"] = (extraction_prompts(batch_size), RECORD_SCHEMA)
        workloads["open+schema"] = (open_schema_prompts(batch_size), PRODUCT_SCHEMA)
    if batch_job:
        workloads[f"batch-job x{batch_job}"] = (order_prompts(batch_job), ORDER_SCHEMA)
    results: dict[str, Any] = {}
    rows: list[list[Any]] = []
    for name, (prompts, schema) in workloads.items():
        params = SamplingParams(max_tokens=max_tokens, temperature=0, json_schema=schema)
        for llm in (plain, spec):  # the schema's compile and the first shapes: paid here, not timed
            run_chat(llm, prompts, params)
        samples: dict[str, list[dict[str, Any]]] = {"plain+grammar": []}
        samples |= {label: [] for label, *_ in DRAFT_VARIANTS}
        for _ in range(repeats):  # the variants in turn, so a slower minute of the box hits them all
            samples["plain+grammar"].append(_structured_once(plain, prompts, params))
            for label, grammar_drafts, with_memory, text in DRAFT_VARIANTS:
                proposer.grammar_drafts, proposer.memory = grammar_drafts, memory if with_memory else None
                proposer.text_lookup = text
                samples[label].append(_structured_once(spec, prompts, params))
        proposer.grammar_drafts, proposer.memory, proposer.text_lookup = True, memory, True
        runs = {label: _median_run(r) for label, r in samples.items()}
        base, today = runs["plain+grammar"], runs["ngram+grammar"]
        for label, r in runs.items():
            rows.append(
                [
                    name,
                    label,
                    r["tok_s"],
                    r["tok_s"] / base["tok_s"],
                    r["accept_len"],
                    r["tokens_per_verify"],
                    r["tokens_per_verify"] / today["tokens_per_verify"],
                    r["tokens_per_decode_step"],
                    r["decode_steps"],
                    r["tokens"] == base["tokens"],
                ]
            )
            results[f"{name}/{label}"] = {k: v for k, v in r.items() if k != "tokens"}
    print_table(
        f"structured output (batch {batch_size or batch_job}, greedy, {max_tokens} tokens, median of {repeats})",
        [
            "workload",
            "variant",
            "tok/s",
            "vs plain",
            "accept len",
            "tok/verify",
            "vs today",
            "tok/decode step",
            "decode steps",
            "same tokens",
        ],
        rows,
    )
    return results


# ------------------------------------------------------------------ host fill (issue 41)
def _record_text(i: int) -> str:
    rot = PEOPLE[i % len(PEOPLE) :] + PEOPLE[: i % len(PEOPLE)]
    people = ", ".join(f'{{"name": "{n}", "age": {a}, "city": "{c}"}}' for n, a, c in rot[:3])
    return f'{{"people": [{people}]}}'


class _Member:
    """What ``GrammarRows.apply_plain`` reads of a sequence: its grammar and whether it finished."""

    def __init__(self, grammar: Any) -> None:
        self.grammar = grammar
        self.is_finished = False

    def grammar_rejected(self, token: int) -> None:
        raise AssertionError(f"the benchmark's walk took a token its grammar refused: {token}")

    def finish_at_dead_end(self) -> None:
        raise AssertionError("the benchmark's walk reached a dead end")


def run_host_fill_benchmark(
    model: str | None,
    batch_sizes: tuple[int, ...],
    steps: int = 200,
    repeats: int = 3,
    device: str = "cpu",
) -> dict[str, Any]:
    """Host time of a plain constrained step's grammar work at each batch size. Variants: settle the
    last token, fill the rows and find dead ends one by one (a Python loop over the matchers), in
    one batched xgrammar call on the engine thread, on the fill pool; and the engine's whole path
    (``GrammarRows.apply_plain``: settle, fill, dead-end check, the mask's upload and its application
    to the logits on ``device``: on a CPU the masking itself, on a GPU its launches, no sync). Every
    request writes a valid record under ``RECORD_SCHEMA`` (or any JSON object) from its own offset
    and starts over when done, so the batch mixes states, start states included. Median
    milliseconds per step, and the tokens per second a step of only that host work would give."""
    import torch

    from ngrammar.engine.grammar_rows import GrammarRows
    from ngrammar.engine.stats import EngineStats
    from ngrammar.grammar import GrammarBackend, GrammarMatcher, allocate_bitmask
    from ngrammar.grammar.fill_pool import GrammarFillPool
    from ngrammar.model.loader import resolve_checkpoint
    from ngrammar.model.tokenizer import Tokenizer
    from ngrammar.runner.model_runner import resolve_device

    dev = resolve_device(device)
    checkpoint = resolve_checkpoint(model)
    tokenizer = Tokenizer(checkpoint.tokenizer_dir, checkpoint.config.eos_token_ids)
    vocab = checkpoint.config.vocab_size
    backend = GrammarBackend(tokenizer, vocab)
    eos = min(backend.stop_token_ids)
    texts = [tokenizer.encode(_record_text(i)) + [eos] for i in range(len(PEOPLE))]
    grammars = {
        "schema": backend.compile(GrammarSpec("json_schema", json.dumps(RECORD_SCHEMA))),
        "json_object": backend.compile(GrammarSpec("json_object", "")),
    }

    def one_by_one(matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.settle()
            m.fill_bitmask(bitmask, i)
        torch.nonzero(~bitmask.any(dim=1))

    rows = GrammarRows(vocab, dev, EngineStats())
    logits: dict[int, torch.Tensor] = {}

    def engine_path(matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        bs = len(matchers)
        if bs not in logits:
            logits[bs] = torch.randn(bs, vocab, device=dev)
        rows.apply_plain([_Member(m) for m in matchers], logits[bs])  # type: ignore[misc]

    pools = {"one call": GrammarFillPool(threads=0), "pool": GrammarFillPool(serial_below=0)}
    variants: dict[str, Any] = {"one by one": one_by_one}
    for name, pool in pools.items():
        variants[name] = lambda ms, bm, p=pool: p.fill_rows(ms, range(len(ms)), bm)
    variants[f"engine path ({dev.type})"] = engine_path
    threads = pools["pool"].threads
    results: dict[str, Any] = {"fill_threads": threads, "device": str(dev)}
    table: list[list[Any]] = []
    with torch.inference_mode():
        for kind, compiled in grammars.items():
            for bs in batch_sizes:
                base = None
                for label, fill in variants.items():
                    per_step = []
                    for _ in range(repeats):
                        walks = [
                            (texts[b % len(texts)], (b * 7) % (len(texts[b % len(texts)]) - 1))
                            for b in range(bs)
                        ]
                        matchers = [backend.new_matcher(compiled) for _ in range(bs)]
                        for m, (ids, at) in zip(matchers, walks):
                            for t in ids[:at]:
                                m.accept_masked(t)
                        pos = [at for _, at in walks]
                        bitmask = allocate_bitmask(bs, vocab)
                        times = []
                        for _ in range(steps):
                            t = time.perf_counter()
                            fill(matchers, bitmask)
                            times.append(time.perf_counter() - t)
                            for b in range(bs):
                                ids = walks[b][0]
                                matchers[b].accept_masked(ids[pos[b]])
                                pos[b] += 1
                                if pos[b] == len(ids):  # EOS taken: a new request takes the row
                                    matchers[b], pos[b] = backend.new_matcher(compiled), 0
                        per_step.append(statistics.median(times))
                    ms = 1e3 * statistics.median(per_step)
                    base = base or ms
                    results[f"{kind}/b{bs}/{label}"] = ms
                    table.append([kind, bs, label, ms, base / ms, 1e3 * bs / ms])
    for pool in pools.values():
        pool.close()
    rows.close()
    backend.close()
    print_table(
        f"grammar host work per plain step (settle + fill + dead-end check; the engine path adds the "
        f"mask's upload and application), {threads} pool threads",
        ["grammar", "batch", "variant", "ms/step", "speedup", "tok/s equivalent"],
        table,
    )
    return results
