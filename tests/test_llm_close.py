"""An ``LLM`` can be closed (``close()``, ``with``, or dropping it) and another built after it, also
with tensor-parallel rank processes started from a script that has no ``__main__`` guard."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest

from ngrammar import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
IDS = list(range(100, 120))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_hf_folder import build

    return build(tmp_path_factory.mktemp("tiny") / "llama")


def _kw(folder: Path) -> dict[str, object]:
    return dict(model=str(folder), device="cpu", dtype="float32", kv_cache_tokens=512)


def test_with_block_releases_the_engine_and_a_second_one_works(tiny_folder: Path) -> None:
    with LLM(**_kw(tiny_folder)) as llm:  # type: ignore[arg-type]
        first = llm.generate([IDS], PARAMS)[0].outputs[0].token_ids
        grammar = llm.engine.grammar_backend
    assert llm.engine.closed and llm.engine.runner.kv_cache.numel() == 0
    assert grammar._pool._shutdown  # the compile threads are stopped
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([IDS], PARAMS)
    llm.close()  # idempotent
    with LLM(**_kw(tiny_folder)) as again:  # type: ignore[arg-type]
        assert again.generate([IDS], PARAMS)[0].outputs[0].token_ids == first


def test_dropping_the_last_reference_releases_the_engine(tiny_folder: Path) -> None:
    llm = LLM(**_kw(tiny_folder))  # type: ignore[arg-type]
    llm.generate([IDS], PARAMS)
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None  # nothing (an exit hook, a thread) keeps the engine alive


_NO_MAIN_GUARD = textwrap.dedent(
    """
    import sys
    from ngrammar import LLM, SamplingParams

    kw = dict(model=sys.argv[1], device="cpu", dtype="float32", kv_cache_tokens=512, tensor_parallel_size=2)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = list(range(100, 120))
    with LLM(**kw) as llm:
        print("rank", llm.engine.runner.ranks.procs[1].pid, flush=True)
        first = llm.generate([ids], params)[0].outputs[0].token_ids
    second = LLM(**kw)  # a second tensor-parallel engine in the same process, after close()
    print("rank", second.engine.runner.ranks.procs[1].pid, flush=True)
    assert second.generate([ids], params)[0].outputs[0].token_ids == first
    del second
    print("done", flush=True)
    """
)


def test_tensor_parallel_from_a_script_without_a_main_guard(tiny_folder: Path, tmp_path: Path) -> None:
    """Rank processes do not re-import the user's script, and closing stops them."""
    script = tmp_path / "no_guard.py"
    script.write_text(_NO_MAIN_GUARD)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_folder)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split()
    assert lines[-1] == "done"
    ranks = [int(lines[i + 1]) for i, w in enumerate(lines) if w == "rank"]
    assert len(ranks) == 2 and ranks[0] != ranks[1]
    for pid in ranks:  # no orphan: each rank exited (and was reaped) before the script did
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
