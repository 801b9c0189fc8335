"""Host-side cost of n-gram drafting per decode step: corpus update, batch_get, derive_tree_links.

Simulates ``num_requests`` concurrent requests over a repetitive synthetic text (sentences drawn
from a small pool, as in templated or code-like output, optionally mixed with fresh random
sentences): each gets a prompt of ``prompt_len`` tokens, then every step appends 1-4 tokens of its
own stream. Per step it times the corpus update of all requests, one batch_get for the batch
(together: the worker's drafting cost per step, ``draft_us``), and derive_tree_links on the drafted
mask. It also reports how many draft tokens greedy verification would accept against the true
continuation, as a sanity check that the drafts are useful.

Scenarios, for each match type: "mixed" (half the sentences are fresh random text), "repetitive"
(every sentence from a pool of 200) and "very repetitive" (a pool of 10: nearly every suffix
matches and continues the same way, the costliest case for drafting).

Run from the repo root: ``.venv/bin/python -m benchmarks.bench_drafting`` (``--cpu-time`` on a
shared machine, ``--steps`` for a quicker run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ngrammar.speculative.corpus import NgramCorpus
from ngrammar.speculative.tree import derive_tree_links


def synthetic_stream(
    rng: np.random.Generator, sentences: list[list[int]], length: int, novelty: float, vocab_size: int
) -> list[int]:
    """A token stream of sentences drawn with a skewed (Zipf-like) popularity; with probability
    ``novelty`` a sentence is fresh random text instead, which no n-gram can predict."""
    weights = 1.0 / np.arange(1, len(sentences) + 1)
    weights /= weights.sum()
    stream: list[int] = []
    while len(stream) < length:
        if rng.random() < novelty:
            stream += rng.integers(1, vocab_size, size=int(rng.integers(5, 21))).tolist()
        else:
            stream += sentences[rng.choice(len(sentences), p=weights)]
    return stream[:length]


def sentence_pool(rng: np.random.Generator, num_sentences: int, vocab_size: int) -> list[list[int]]:
    return [rng.integers(1, vocab_size, size=int(rng.integers(5, 21))).tolist() for _ in range(num_sentences)]


def accepted_length(tokens: np.ndarray, parents: np.ndarray, future: list[int]) -> int:
    """Drafts greedy verification would accept from one tree (tokens, parents: [D]) when the target
    emits ``future`` (bonus token excluded)."""
    node, accepted = 0, 0
    for token in future:
        matches = [c for c in range(1, len(tokens)) if parents[c] == node and tokens[c] == token]
        if not matches:
            break
        node, accepted = matches[0], accepted + 1
    return accepted


def run_drafting_benchmark(
    num_requests: int = 32,
    draft_token_num: int = 16,
    steps: int = 200,
    prompt_len: int = 300,
    match_type: str = "BFS",
    max_trie_depth: int = 18,
    index_prompts: bool = True,
    novelty: float = 0.0,
    num_sentences: int = 200,
    seed: int = 0,
    cpu_time: bool = False,
) -> dict[str, float]:
    """Simulate ``steps`` decode steps and return median/p90 host costs in microseconds per step.

    ``novelty`` is the share of sentences that are fresh random text (0: every sentence comes from
    the shared pool, the costliest case for drafting since every suffix matches); a smaller
    ``num_sentences`` pool makes the text more repetitive. ``cpu_time`` times with this thread's CPU
    clock instead of the wall clock, for a machine shared with busy processes.
    """
    clock = time.thread_time if cpu_time else time.perf_counter
    rng = np.random.default_rng(seed)
    vocab_size = 32_000
    sentences = sentence_pool(rng, num_sentences=num_sentences, vocab_size=vocab_size)
    streams = [
        synthetic_stream(rng, sentences, prompt_len + 4 * steps + 32, novelty, vocab_size)
        for _ in range(num_requests)
    ]
    corpus = NgramCorpus(
        max_trie_depth=max_trie_depth,
        draft_token_num=draft_token_num,
        match_type=match_type,
        capacity=1_000_000,
    )
    req_ids = list(range(num_requests))
    lengths = [prompt_len] * num_requests

    start = clock()
    for req_id in req_ids:
        if index_prompts:
            corpus.index_prompt(req_id, streams[req_id][:prompt_len])
        else:
            corpus.update(req_id, streams[req_id][:prompt_len])
    prompt_us = (clock() - start) * 1e6 / num_requests

    update_us: list[float] = []
    draft_us: list[float] = []  # update + batch_get: the worker runs both before each verify step
    get_us: list[float] = []
    links_us: list[float] = []
    accepted: list[int] = []
    for _ in range(steps):
        histories = [streams[r][: lengths[r]] for r in req_ids]
        start = clock()
        tree = corpus.batch_get(req_ids, histories)
        get_us.append((clock() - start) * 1e6)

        start = clock()
        derive_tree_links(tree.mask.reshape(-1), tree.bs, draft_token_num)
        links_us.append((clock() - start) * 1e6)

        tokens, parents = tree.tokens_2d(), tree.parents()
        for r in req_ids:
            accepted.append(
                accepted_length(tokens[r], parents[r], streams[r][lengths[r] : lengths[r] + draft_token_num])
            )
            lengths[r] += int(rng.integers(1, 5))
        histories = [streams[r][: lengths[r]] for r in req_ids]
        start = clock()
        for r in req_ids:
            corpus.update(r, histories[r])
        update_us.append((clock() - start) * 1e6)
        draft_us.append(update_us[-1] + get_us[-1])

    def p90(samples: list[float]) -> float:
        return float(np.percentile(samples, 90))

    return {
        "update_us_median": statistics.median(update_us),
        "update_us_p90": p90(update_us),
        "batch_get_us_median": statistics.median(get_us),
        "batch_get_us_p90": p90(get_us),
        "draft_us_median": statistics.median(draft_us),
        "draft_us_p90": p90(draft_us),
        "derive_tree_links_us_median": statistics.median(links_us),
        "derive_tree_links_us_p90": p90(links_us),
        "index_prompt_us_per_request": prompt_us,
        "mean_accepted_drafts": float(np.mean(accepted)),
        "trie_nodes": float(corpus.num_nodes),
    }


SCENARIOS = {  # name -> (novelty, num_sentences)
    "mixed": (0.5, 200),
    "repetitive": (0.0, 200),
    "very repetitive": (0.0, 10),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-time", action="store_true", help="time with the thread CPU clock")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--match-type", choices=["BFS", "PROB"], action="append", help="default: both")
    parser.add_argument("--scenario", choices=list(SCENARIOS), action="append", help="default: all")
    args = parser.parse_args()
    clock = "thread CPU time" if args.cpu_time else "wall time"
    for match_type in args.match_type or ["BFS", "PROB"]:
        for scenario in args.scenario or list(SCENARIOS):
            novelty, num_sentences = SCENARIOS[scenario]
            result = run_drafting_benchmark(
                match_type=match_type,
                novelty=novelty,
                num_sentences=num_sentences,
                steps=args.steps,
                cpu_time=args.cpu_time,
            )
            print(f"match_type={match_type} {scenario} (novelty={novelty}, {num_sentences} sentences;")
            print(f"  32 requests, D=16, {args.steps} steps, {clock})")
            for key, value in result.items():
                print(f"  {key:32s} {value:12.1f}")


if __name__ == "__main__":
    main()
