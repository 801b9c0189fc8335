"""Tensor parallelism over gloo on the CPU: ranks are real processes and real collectives.

SmolLM2 (9 heads, 3 KV heads, vocab 49152) at TP=3 against the one-process engine: logits within
fp32 tolerance, greedy outputs identical, plain (with overlap scheduling, so chained steps send
device-sampled input ids), under NGRAM tree verify (KV compaction on every rank) and with grammars.
A tiny random Llama-shaped HF folder at TP=2 runs the CUDA-graph static-buffer path (no capture on
a CPU) and loses a rank. Outputs stay short: each step is ~60 collectives across processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ngrammar import LLM, SamplingParams
from ngrammar.distributed.parallel import ParallelConfigError, check_tensor_parallel
from ngrammar.distributed.sharding import split_dim
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
        overlap_schedule=True,
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


def test_plain_greedy_outputs_are_identical(tp3: LLM, llm: LLM) -> None:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    eng = tp3.engine
    spec, eng.spec = eng.spec, None  # the same ranks, decoding plainly (chained steps: overlap on)
    try:
        chained = eng.stats.chained_steps
        got = [o.outputs[0].token_ids for o in tp3.generate(PROMPTS, params)]
        assert eng.stats.chained_steps > chained
    finally:
        eng.spec = spec
    assert got == ref


def test_ngram_tree_verify_is_lossless(tp3: LLM, llm: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    stats = tp3.engine.stats
    steps, emitted = stats.verify_steps, stats.verify_emitted
    got = [o.outputs[0].token_ids for o in tp3.generate(PROMPTS, params)]
    assert got == ref
    assert stats.verify_emitted - emitted > stats.verify_steps - steps  # drafts were accepted (KV moved)


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


# ----------------------------------------------------------- a tiny HF folder at TP=2


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_hf_folder import build

    return build(tmp_path_factory.mktemp("tiny") / "llama", num_attention_heads=4, num_key_value_heads=2)


def test_tiny_hf_folder_at_tp2_on_the_static_graph_path(tiny_folder: Path) -> None:
    kw = dict(model=str(tiny_folder), device="cpu", dtype="float32", kv_cache_tokens=1024)
    # every decode step verifies a tree as drafted (a random model rarely repeats what the corpus saw)
    spec = dict(speculative="ngram", num_draft_tokens=4, spec_policy="fixed", spec_trim_trees=False)
    one = LLM(**kw, **spec)  # type: ignore[arg-type]
    two = LLM(**kw, **spec, tensor_parallel_size=2)  # type: ignore[arg-type]
    try:
        ids = list(range(100, 140))
        ref, got = logits(one, ids), logits(two, ids)
        assert (got - ref).abs().max().item() < 1e-4
        # the CUDA-graph runner's static buffers and padding, eagerly (no capture on a CPU), on both ranks
        two.engine.enable_cuda_graphs(capture=False)
        one.engine.enable_cuda_graphs(capture=False)
        prompts = [ids, ids[:10] * 3]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == want
        assert two.engine.stats.verify_steps > 0
        print(
            "tiny TP=2 verify: emitted", two.engine.stats.verify_emitted, "in", two.engine.stats.verify_steps
        )
    finally:
        two.engine.close()


_KILLED_RANK = textwrap.dedent(
    """
    import sys
    from ngrammar import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", kv_cache_tokens=1024, tensor_parallel_size=2)
        print(llm.engine.runner.ranks.procs[1].pid, flush=True)
        while True:
            llm.generate([list(range(100, 120))], SamplingParams(max_tokens=8, temperature=0))
    """
)


def test_a_killed_rank_ends_the_engine_with_a_message(tiny_folder: Path, tmp_path: Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(_KILLED_RANK)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        os.kill(int(proc.stdout.readline()), signal.SIGKILL)  # rank 1, mid-run
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - t0 < 60
    assert proc.returncode != 0
    assert "tensor-parallel rank 1" in err, err[-2000:]


def test_two_nodes_rendezvous_at_dist_init_addr(tiny_folder: Path) -> None:
    """``--nnodes 2``: node 1 (here a second process on this machine) runs only its ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    common = [
        "--model",
        str(tiny_folder),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--tp",
        "2",
        "--nnodes",
        "2",
    ]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ngrammar.cli",
            "generate",
            *common,
            "--node-rank",
            "1",
            "--dist-init-addr",
            addr,
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        kw = dict(model=str(tiny_folder), device="cpu", dtype="float32", kv_cache_tokens=1024)
        two = LLM(**kw, tensor_parallel_size=2, nnodes=2, dist_init_addr=addr)  # type: ignore[arg-type]
        try:
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            got = two.generate([list(range(100, 120))], params)[0].outputs[0].token_ids
        finally:
            two.engine.close()
        assert node1.wait(timeout=60) == 0  # its rank stopped with rank 0
    finally:
        if node1.poll() is None:
            node1.kill()
    one = LLM(**kw)  # type: ignore[arg-type]
    assert got == one.generate([list(range(100, 120))], params)[0].outputs[0].token_ids
