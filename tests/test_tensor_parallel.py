"""Tensor parallelism over gloo on the CPU: ranks are real processes and real collectives.

SmolLM2 (9 heads, 3 KV heads, vocab 49152) at TP=3 against the one-process engine, all on one
spawned group (the module's ``tp3``): logits within fp32 tolerance, greedy outputs identical, plain
(with overlap scheduling, so chained steps send device-sampled input ids, and a request admitted
mid-run in a mixed step), under pipelined NGRAM tree verify (KV compaction on every rank) over
prefix-cache pages shared between requests, and with grammars. Bad sizes, and 4-bit weights, are
refused before any process starts. (A tiny HF folder at TP=2: ``test_tensor_parallel_hf``.)
Outputs stay short: each step is ~60 collectives across processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ngrammar import LLM, SamplingParams
from ngrammar.engine.speculator import NoSpeculation
from ngrammar.model.parallel import ParallelConfigError, check_tensor_parallel
from ngrammar.model.sharding import split_dim
from ngrammar.runner.model_runner import StepInput

PROMPTS = ["The capital of France is", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tp3() -> Iterator[LLM]:
    llm = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=2048,
        tensor_parallel_size=3,
        speculative="ngram",
        num_draft_tokens=4,
        spec_policy="fixed",
        overlap_schedule=True,  # and so pipelined verify steps
        max_running_requests=2,  # a third request joins mid-run (a mixed step)
    )
    yield llm
    llm.engine.close()


def logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    runner, blocks = llm.engine.runner, llm.engine.blocks
    pages = blocks.allocator.allocate(-(-len(ids) // blocks.page_size))
    try:
        step = StepInput([ids], [list(range(len(ids)))], [0], [pages], list(range(len(ids))))
        return runner.forward(step).clone()
    finally:
        blocks.allocator.free(pages)


def test_logits_match_one_process_within_fp32_tolerance(tp3: LLM, llm: LLM) -> None:
    ids = llm.engine.tokenize(PROMPTS[1])
    ref, got = logits(llm, ids), logits(tp3, ids)
    assert got.shape == ref.shape == (len(ids), 49152)
    assert (got - ref).abs().max().item() < 2e-3 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def verify_then_decode_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Prefill ``ids``, verify a 4-node tree (root; nodes 1 and 2 its children; node 3 node 2's
    child), move the path root -> 2 -> 3 next to the prefix as an accepted path is moved, then
    decode one token after it: [1, V] logits that read the moved KV."""
    runner, blocks = llm.engine.runner, llm.engine.blocks
    n = len(ids)
    pages = blocks.allocator.allocate(-(-(n + 4) // blocks.page_size))
    try:
        runner.forward(StepInput([ids], [list(range(n))], [0], [pages], [n - 1]))
        mask = np.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], dtype=bool)
        tree = [ids[-1], 11, 22, 33]
        runner.forward(StepInput([tree], [[n, n + 1, n + 1, n + 2]], [n], [pages], [0, 1, 2, 3], mask))
        slots = runner.last_slots().view(1, 4)
        runner.compact_accepted_kv(slots, torch.tensor([[0, 2, 3]]), torch.tensor([3]))
        return runner.forward(StepInput([[44]], [[n + 3]], [n + 3], [pages], [0])).clone()
    finally:
        blocks.allocator.free(pages)


def test_accepted_path_kv_moves_on_every_rank(tp3: LLM, llm: LLM) -> None:
    """Each rank moves its own KV heads' share of an accepted path: the token after the path reads
    the moved KV of all heads (a rank that did not move its share would read node 1's)."""
    ids = llm.engine.tokenize(PROMPTS[0])
    ref, got = verify_then_decode_logits(llm, ids), verify_then_decode_logits(tp3, ids)
    assert (got - ref).abs().max().item() < 2e-3 * ref.abs().max().item()


def test_plain_greedy_outputs_are_identical(tp3: LLM, llm: LLM) -> None:
    prompts = [*PROMPTS, "1, 2, 3, 4,"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 8, 6)]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    eng = tp3.engine
    spec, eng.speculator = (
        eng.speculator,
        NoSpeculation(),
    )  # the same ranks, decoding plainly (chained steps: overlap on)
    try:
        chained, mixed = eng.stats.chained_steps, eng.stats.mixed_steps
        got = [o.outputs[0].token_ids for o in tp3.generate(prompts, params)]
        assert eng.stats.chained_steps > chained
        assert eng.stats.mixed_steps > mixed  # the third prefilled alongside the second's decode
    finally:
        eng.speculator = spec
    assert got == ref


def test_ngram_tree_verify_is_lossless(tp3: LLM, llm: LLM) -> None:
    # the second prompt extends the first: it starts on the first's cached page (shared, read-only)
    prompts = [PROMPTS[1], PROMPTS[1] + "def mul(a, b):\n"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = tp3.engine.stats
    steps, emitted = stats.verify_steps, stats.verify_emitted
    pipelined, hits = stats.pipelined_steps, stats.prefix_cache_hit_tokens
    got = [o.outputs[0].token_ids for o in tp3.generate(prompts, params)]
    assert got == ref
    assert stats.verify_emitted - emitted > stats.verify_steps - steps  # drafts were accepted (KV moved)
    assert stats.pipelined_steps > pipelined
    assert stats.prefix_cache_hit_tokens > hits


def test_grammar_outputs_are_identical(tp3: LLM, llm: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, json_schema=SCHEMA)
    prompt = [{"role": "user", "content": "Give a person as JSON."}]
    ref = llm.chat(prompt, params)[0].outputs[0]
    got = tp3.chat(prompt, params)[0].outputs[0]
    assert got.token_ids == ref.token_ids
    if got.finish_reason == "stop":
        json.loads(got.text)


def test_bad_tp_is_refused_before_any_process_starts() -> None:
    before = multiprocessing.active_children()
    with pytest.raises(ParallelConfigError, match="9 attention heads do not divide by 2"):
        LLM(device="cpu", dtype="float32", kv_cache_tokens=256, tensor_parallel_size=2)
    with pytest.raises(ParallelConfigError, match="3 KV heads do not divide by 9"):
        LLM(device="cpu", dtype="float32", kv_cache_tokens=256, tensor_parallel_size=9)
    with pytest.raises(ValueError, match="--tp must be a positive integer"):
        LLM(device="cpu", dtype="float32", tensor_parallel_size=0)
    with pytest.raises(ParallelConfigError, match="--quantization int4 does not run with --tp 3"):
        LLM(device="cpu", kv_cache_tokens=256, tensor_parallel_size=3, quantization="int4")
    with pytest.raises(ValueError, match="replicas run behind the server"):
        LLM(device="cpu", dtype="float32", kv_cache_tokens=256, data_parallel_size=2)
    assert multiprocessing.active_children() == before


def test_too_few_devices_is_refused(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ParallelConfigError, match="needs 3 CUDA devices on this node, but 2 are visible"):
        check_tensor_parallel(llm.engine.model_config, 3, torch.device("cuda"))


def test_cli_bad_tp_exits_with_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ngrammar.cli", "generate", "hi", "--device", "cpu", "--tp", "4"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        timeout=300,
    )
    assert out.returncode == 2
    assert "do not divide by 4" in out.stderr
    assert "Traceback" not in out.stderr


def test_weights_split_on_the_right_dimension() -> None:
    assert split_dim("model.layers.0.self_attn.k_proj.weight") == 0
    assert split_dim("model.layers.0.self_attn.q_proj.bias") == 0
    assert split_dim("model.layers.0.self_attn.o_proj.weight") == 1
    assert split_dim("model.layers.0.mlp.down_proj.weight") == 1
    assert split_dim("model.layers.0.mlp.gate_proj.weight") == 0
    assert split_dim("model.embed_tokens.weight") == 0
    assert split_dim("lm_head.weight") == 0
    assert split_dim("model.layers.0.self_attn.q_norm.weight") is None
    assert split_dim("model.norm.weight") is None


def test_a_second_tensor_parallel_engine_in_one_process_is_refused(tp3: LLM) -> None:
    with pytest.raises(ParallelConfigError, match="already runs a tensor-parallel engine"):
        LLM(device="cpu", dtype="float32", kv_cache_tokens=256, tensor_parallel_size=3)
