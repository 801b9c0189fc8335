"""Tensor parallelism on a tiny random Llama-shaped Hugging Face folder (written by the test), TP=2
over gloo: logits and greedy NGRAM outputs equal one process's on the CUDA-graph static-buffer path
(no capture on a CPU); marked slow (each spawns an engine of its own): a killed rank ends its engine
with a message, and two "nodes" (processes on this machine) rendezvous at ``--dist-init-addr``.
Apart from ``test_tensor_parallel``: one tensor-parallel engine per process at a time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_tensor_parallel import logits, verify_then_decode_logits

from ngrammar import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_hf_folder import build

    return build(tmp_path_factory.mktemp("tiny") / "llama", num_attention_heads=4, num_key_value_heads=2)


def test_tiny_hf_folder_at_tp2_on_the_static_graph_path(tiny_folder: Path) -> None:
    kw = dict(model=str(tiny_folder), device="cpu", dtype="float32", kv_cache_tokens=1024)
    # every decode step with a draft verifies a tree (fixed policy)
    spec = dict(speculative="ngram", num_draft_tokens=4, spec_policy="fixed")
    one = LLM(**kw, **spec)  # type: ignore[arg-type]
    two = LLM(**kw, **spec, tensor_parallel_size=2)  # type: ignore[arg-type]
    try:
        ids = list(range(100, 140))
        ref, got = logits(one, ids), logits(two, ids)
        assert (got - ref).abs().max().item() < 1e-4
        # the CUDA-graph runner's static buffers and padding, eagerly (no capture on a CPU), on both ranks
        two.engine.enable_cuda_graphs(capture=False)
        one.engine.enable_cuda_graphs(capture=False)
        # an accepted path moved from the graph runner's static slots, on every rank
        ref, got = verify_then_decode_logits(one, ids), verify_then_decode_logits(two, ids)
        assert (got - ref).abs().max().item() < 1e-4
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        cont = list(one.generate([ids], params)[0].outputs[0].token_ids)
        # A random model never repeats itself: the second prompt holds the first's greedy
        # continuation (after the first's last tokens), so the corpus drafts it for the first.
        prompts = [ids, [5, 6, 7, *ids[-8:], *cont]]
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        stats = two.engine.stats
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == want
        assert stats.verify_emitted > stats.verify_steps > 0  # drafts were accepted
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


@pytest.mark.slow  # a spawned engine of its own (``pytest -m slow``)
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


@pytest.mark.slow  # a spawned engine of its own (``pytest -m slow``)
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
