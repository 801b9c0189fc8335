"""How many tokens a verify step could emit, by drafting configuration, on recorded greedy outputs.

Greedy NGRAM speculation is lossless, so a request's speculative run emits exactly its plain greedy
output; what a drafting configuration changes is only how many verify steps that takes. This suite
records each workload prompt's plain greedy output once (one model run), then replays the decode
offline for every configuration: draft a tree from the corpus, count the drafts greedy verification
would accept against the recorded continuation, emit them plus the bonus token, index, repeat. The
figure is the mean accept length (tokens per verify step, bonus included, as
``RequestOutput.metrics["spec_accept_length"]``), per prompt category, with no model in the loop.

It bounds what speculation can reach on a device: a verify step that costs c plain steps pays back
at most accept_length / c. Each prompt runs alone (batch 1) with a fresh corpus; the engine's corpus
is shared and keeps earlier requests, and its policy may shrink D, so engine figures differ.

    python -m benchmarks drafts --device cpu --max-tokens 128 --out drafts.json
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.bench_drafting import accepted_length
from benchmarks.common import chat, load_workload, print_table
from ngrammar.config import SpeculativeConfig
from ngrammar.speculative.corpus import NgramCorpus


@dataclass(frozen=True)
class Stream:
    category: str
    prompt: list[int]  # prompt token ids (chat template applied)
    output: list[int]  # plain greedy output token ids


def record_streams(llm: Any, max_tokens: int) -> list[Stream]:
    """Plain greedy output of every workload prompt, one request at a time."""
    from ngrammar import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    streams = []
    for w in load_workload():
        out = llm.chat([chat(w.prompt)], params, use_tqdm=False)[0]
        streams.append(
            Stream(w.category if w.kind == "grounded" else "open", out.prompt_token_ids, out.token_ids)
        )
    return streams


def _decode(
    stream: Stream, draft_token_num: int, accepted: Callable[[list[int], list[int]], int]
) -> list[int]:
    """Tokens each verify step emits when ``stream`` is decoded speculatively: ``accepted(history,
    future)`` says how many drafts of the step's D - 1 would be accepted given the true next tokens.
    The first output token comes from the prefill, so the steps emit ``len(output) - 1`` tokens."""
    history = list(stream.prompt) + stream.output[:1]
    pos, emitted = 1, []
    while pos < len(stream.output):
        future = stream.output[pos : pos + draft_token_num - 1]
        n = min(accepted(history, future) + 1, len(stream.output) - pos)
        history += stream.output[pos : pos + n]
        pos += n
        emitted.append(n)
    return emitted


def replay_steps(stream: Stream, draft_token_num: int, **overrides: Any) -> list[int]:
    """``_decode`` with a fresh corpus built as the engine builds it from
    ``SpeculativeConfig(num_draft_tokens=draft_token_num, **overrides)`` (its prompt indexed at
    admission, its output as it grows)."""
    c = SpeculativeConfig(num_draft_tokens=draft_token_num, **overrides)
    corpus = NgramCorpus(
        max_trie_depth=c.max_trie_depth,
        min_bfs_breadth=c.min_bfs_breadth,
        max_bfs_breadth=c.max_bfs_breadth,
        draft_token_num=draft_token_num,
        match_type=c.match_type,
        capacity=c.capacity,
    )
    corpus.index_prompt(0, stream.prompt)

    def accepted(history: list[int], future: list[int]) -> int:
        corpus.update(0, history)
        tree = corpus.batch_get([0], [history], draft_token_num)
        return accepted_length(tree.tokens_2d()[0], tree.parents()[0], future)

    return _decode(stream, draft_token_num, accepted)


def _as_text(tokens: Sequence[int]) -> str:
    """Token ids as one character each (code points from U+10000: valid for ids below 2^20, never
    surrogates), so that ``in`` is a substring search over token sequences."""
    return "".join(chr(0x10000 + t) for t in tokens)


def oracle_steps(stream: Stream, draft_token_num: int) -> list[int]:
    """``_decode`` where every step drafts one chain that continues the output as far as any
    earlier occurrence in the prompt or the output so far does: the accepted drafts are the longest
    prefix (at most D - 1 tokens) of the true continuation that appears anywhere in the context.
    An upper bound for copy-based drafting of a chain with D nodes, whatever the matching and
    ranking."""

    def accepted(history: list[int], future: list[int]) -> int:
        context, ahead = _as_text(history), _as_text(future)
        n = 0
        while n < len(ahead) and ahead[: n + 1] in context:
            n += 1
        return n

    return _decode(stream, draft_token_num, accepted)


def accept_lengths(
    streams: Sequence[Stream], draft_token_num: int, oracle: bool = False, **overrides: Any
) -> dict[str, float]:
    """Mean tokens per verify step per category (pooled over its prompts' steps); ``oracle``: of
    ``oracle_steps`` instead of the corpus's drafts."""
    tokens: dict[str, int] = {}
    steps: dict[str, int] = {}
    for s in streams:
        emitted = (
            oracle_steps(s, draft_token_num) if oracle else replay_steps(s, draft_token_num, **overrides)
        )
        tokens[s.category] = tokens.get(s.category, 0) + sum(emitted)
        steps[s.category] = steps.get(s.category, 0) + len(emitted)
    return {c: tokens[c] / steps[c] for c in tokens if steps[c]}


# (label, D, SpeculativeConfig overrides): D and the match type, then one knob at a time.
CONFIGS: list[tuple[str, int, dict[str, Any]]] = [
    *[(f"D={d} {mt}", d, {"match_type": mt}) for d in (8, 16, 32, 64) for mt in ("BFS", "PROB")],
    *[(f"D=16 max_bfs_breadth={b}", 16, {"max_bfs_breadth": b}) for b in (2, 4, 20)],
    *[(f"D=16 min_bfs_breadth={b}", 16, {"min_bfs_breadth": b}) for b in (2, 4)],
    *[(f"D=16 max_trie_depth={t}", 16, {"max_trie_depth": t}) for t in (4, 8, 32)],
    *[(f"D={d} oracle chain (any earlier copy)", d, {"oracle": True}) for d in (16, 64)],
]


def run_draft_quality(llm: Any, max_tokens: int) -> dict[str, Any]:
    streams = record_streams(llm, max_tokens)
    result = {label: accept_lengths(streams, d, **kw) for label, d, kw in CONFIGS}
    cats = sorted(result[CONFIGS[0][0]])
    print_table(
        f"accept length (tokens per verify step) on recorded greedy outputs, {max_tokens} tokens",
        ["config", *cats],
        [[label, *(r[c] for c in cats)] for label, r in result.items()],
    )
    return {"streams": {c: sum(s.category == c for s in streams) for c in cats}, "accept_length": result}
