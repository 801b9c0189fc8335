"""Plain engine speed: decode tok/s and ms/step at batch 1 and 8, prefill tok/s, weight bandwidth,
side by side with transformers ``generate`` on the same prompts in the same run."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.common import chat, decode_seconds, load_workload, print_table, timed
from ngrammar import LLM, SamplingParams


def weight_bytes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())


def decode_rate(llm: LLM, prompts: list[Any], max_tokens: int) -> tuple[float, float]:
    """(aggregate decode tok/s, ms per decode step); the prefill (time to first token) is excluded."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.chat(prompts, params)  # warm-up with the same shapes
    _, outs = timed(lambda: llm.chat(prompts, params))
    decode = decode_seconds(outs)
    steps = max(len(o.token_ids) for o in outs) - 1  # plain decoding: one token per request per step
    tokens = sum(len(o.token_ids) - 1 for o in outs)
    return tokens / decode, 1e3 * decode / steps


def prefill_rate(llm: LLM, prompt: str) -> float:
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompt, params)
    seconds, out = timed(lambda: llm.generate(prompt, params))
    return len(out[0].prompt_token_ids) / seconds


def transformers_rate(llm: LLM, prompt_ids: list[int], max_tokens: int) -> float | None:
    """transformers' greedy generate on the same GGUF, decode tok/s (generate(n) - generate(1))."""
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        return None
    from ngrammar.model.loader import embedded_model_path

    if llm.engine.config.model is not None:
        return None
    path = embedded_model_path()
    model = LlamaForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=llm.engine.dtype
    )
    model = model.to(llm.engine.device).eval()
    ids = torch.tensor([prompt_ids], device=llm.engine.device)

    def run(n: int) -> float:
        with torch.no_grad():
            s, _ = timed(
                lambda: model.generate(
                    ids,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    attention_mask=torch.ones_like(ids),
                )
            )
        return s

    run(4)
    total, first = run(max_tokens), run(1)
    return (max_tokens - 1) / (total - first)


def run_engine_benchmark(llm: LLM, max_tokens: int = 64, with_transformers: bool = True) -> dict[str, Any]:
    work = load_workload()
    prompts = [chat(w.prompt) for w in work if w.kind == "open"][:8]
    b1_rate, b1_ms = decode_rate(llm, prompts[:1], max_tokens)
    b8_rate, b8_ms = decode_rate(llm, prompts[:8], max_tokens)
    long_prompt = next(w.prompt for w in work if w.category == "summarization")
    pf = prefill_rate(llm, long_prompt)
    wb = weight_bytes(llm)
    hf = None
    if with_transformers:
        hf = transformers_rate(llm, llm.tokenizer.apply_chat_template(prompts[0]), max_tokens)
    result = {
        "decode_b1_tok_s": b1_rate,
        "decode_b1_ms_step": b1_ms,
        "decode_b8_tok_s": b8_rate,
        "decode_b8_ms_step": b8_ms,
        "prefill_tok_s": pf,
        "weight_bytes": wb,
        "bandwidth_b1_gb_s": wb / (b1_ms / 1e3) / 1e9,
        "transformers_b1_tok_s": hf,
    }
    rows = [
        ["ngrammar decode b=1", b1_rate, b1_ms, wb / (b1_ms / 1e3) / 1e9, "" if hf is None else b1_rate / hf],
        [
            "ngrammar decode b=8 (aggregate)",
            b8_rate,
            b8_ms,
            wb / (b8_ms / 1e3) / 1e9,
            "" if hf is None else b8_rate / hf,
        ],
        ["ngrammar prefill", pf, "", "", ""],
    ]
    if hf is not None:
        rows.append(["transformers generate b=1", hf, 1e3 / hf, wb / (1 / hf) / 1e9, 1.0])
    print_table("engine", ["variant", "tok/s", "ms/step", "weight GB/s", "x transformers b=1"], rows)
    return result
