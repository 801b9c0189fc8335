"""Grammar cost, plain and under NGRAM speculation, incl. the readback switch (the pre-#32380 path)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import chat, decode_seconds, forget_outputs, print_table, timed
from ngrammar import LLM, SamplingParams

PEOPLE = [
    ("Alice Johnson", 34, "Paris"), ("Bob Smith", 27, "Berlin"), ("Carla Gomez", 45, "Madrid"),
    ("David Lee", 52, "Seoul"), ("Emma Brown", 19, "London"), ("Farid Khan", 38, "Lahore"),
]
RECORD_SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}
LOG_REGEX = r"(\[(INFO|WARN|ERROR)\] [a-z]+ [a-z ]+\n){3,6}"


def extraction_prompts(n: int) -> list[Any]:
    out = []
    for i in range(n):
        rot = PEOPLE[i % len(PEOPLE):] + PEOPLE[: i % len(PEOPLE)]
        text = " ".join(f"{name} is {age} years old and lives in {city}." for name, age, city in rot[:4])
        out.append(chat(f"{text}\n\nExtract every person with name, age and city as JSON."))
    return out


def regex_prompts(n: int) -> list[Any]:
    logs = "[INFO] server started on port eight\n[WARN] disk almost full\n[ERROR] database connection lost\n"
    return [chat(f"Here are log lines:\n{logs}\nRepeat the log lines exactly.") for _ in range(n)]


def _rate(llm: LLM, prompts: list[Any], params: SamplingParams) -> tuple[float, float, float, float]:
    forget_outputs(llm)
    eng = llm.engine
    g0, f0, s0 = eng.stats.grammar_seconds, eng.stats.forward_seconds, eng.stats.steps
    _, outs = timed(lambda: llm.chat(prompts, params, use_tqdm=False))
    decode = decode_seconds(outs)
    tokens = sum(len(o.token_ids) - 1 for o in outs)
    steps = max(eng.stats.steps - s0, 1)
    accept = [o.metrics.get("spec_accept_length", 1.0) for o in outs]
    return (tokens / decode, 1e3 * (eng.stats.grammar_seconds - g0) / steps,
            1e3 * (eng.stats.forward_seconds - f0) / steps, statistics.mean(accept))


def run_grammar_benchmark(plain: LLM, spec: LLM, batch_size: int = 1, max_tokens: int = 96,
                          repeats: int = 2, unpruned: LLM | None = None) -> dict[str, Any]:
    """Per workload: plain and NGRAM, without and with the grammar, and NGRAM + grammar with the
    readback switch; with ``unpruned`` (an NGRAM engine with ``spec_grammar_prune=False``) also
    NGRAM + grammar verifying the trees as drafted, the A/B side of grammar pruning."""
    assert spec.engine.spec is not None
    workloads = {
        "json-extraction": (extraction_prompts(batch_size), dict(json_schema=RECORD_SCHEMA)),
        "regex-logs": (regex_prompts(batch_size), dict(regex=LOG_REGEX)),
    }
    results: dict[str, Any] = {}
    rows = []
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
        if unpruned is not None:
            variants.append(("spec+grammar unpruned", unpruned, variants[3][2], False))
            _rate(unpruned, prompts, variants[3][2])
        for label, llm, params, readback in variants:
            spec.engine.spec.readback_links = readback
            figs = [_rate(llm, prompts, params) for _ in range(repeats)]
            spec.engine.spec.readback_links = False
            rate = statistics.median(f[0] for f in figs)
            gms = statistics.median(f[1] for f in figs)
            fms = statistics.median(f[2] for f in figs)
            acc = statistics.median(f[3] for f in figs)
            results[f"{name}/{label}"] = {"tok_s": rate, "grammar_ms_step": gms, "forward_ms_step": fms,
                                          "accept_len": acc}
            rows.append([name, label, rate, acc, gms, fms, gms / fms if fms else 0.0])
    for name in workloads:
        r = results
        r[f"{name}/spec+grammar_vs_plain+grammar"] = (
            r[f"{name}/spec+grammar"]["tok_s"] / r[f"{name}/plain+grammar"]["tok_s"])
        if unpruned is not None:
            r[f"{name}/spec+grammar_vs_unpruned"] = (
                r[f"{name}/spec+grammar"]["tok_s"] / r[f"{name}/spec+grammar unpruned"]["tok_s"])
    print_table(f"grammar (batch {batch_size}, greedy, {max_tokens} tokens)",
                ["workload", "variant", "tok/s", "accept len", "grammar ms/step", "forward ms/step",
                 "grammar/forward"], rows)
    return results
