"""Replay target: recorded greedy outputs decide every token while a random-weight model of another
shape runs the forward (``ngrammar/speculative/replay.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_host import tiny_checkpoint
from ngrammar import LLM, SamplingParams
from ngrammar.speculative.replay import ReplayTarget

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = [
    f"Repeat this code exactly:\n{CODE}",
    "Tell me a short story about a cat.",
    f"Copy:\n{CODE}\nNow copy it again:\n",
]
SPEC: dict[str, Any] = dict(
    device="cpu", dtype="float32", kv_cache_tokens=8192, speculative="ngram", spec_policy="fixed"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("replay") / "tiny")


def _spec_figures(outs: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.metrics.get("spec_verify_steps"))
        + (o.metrics.get("spec_accept_length"),)
        for o in outs
    ]


_LONG = SamplingParams(max_tokens=40, temperature=0)
RECORD_PARAMS = [_LONG, SamplingParams(max_tokens=24, temperature=0), _LONG]


@pytest.fixture(scope="module")
def recording() -> tuple[list[Any], int]:
    """The embedded model's NGRAM outputs for PROMPTS from a fresh engine (what each case replays),
    and that model's hidden size."""
    real = LLM(**SPEC, num_draft_tokens=8)
    outs = real.generate(PROMPTS, RECORD_PARAMS)
    assert real.engine.stats.verify_emitted > real.engine.stats.verify_steps  # drafts were accepted
    return outs, real.engine.model_config.hidden_size


@pytest.mark.parametrize("pipeline", [False, True])
def test_replay_reproduces_the_recording_and_its_accept_lengths(
    tiny: Path, recording: tuple[list[Any], int], pipeline: bool
) -> None:
    params = RECORD_PARAMS
    recorded, real_hidden_size = recording
    replay = LLM(str(tiny), **SPEC, num_draft_tokens=8, pipeline_verify=pipeline)
    assert replay.engine.model_config.hidden_size != real_hidden_size
    replay.engine.set_replay(
        ReplayTarget.from_outputs(
            [(o.prompt_token_ids, o.outputs[0].token_ids) for o in recorded],
            replay.engine.model_config.eos_token_ids[0],
        )
    )
    got = replay.generate(PROMPTS, params)
    # The same tokens, finish reasons, verify steps and accept lengths, step for step the same drafts.
    assert _spec_figures(got) == _spec_figures(recorded)
    # Without the replay the random model emits something else entirely.
    replay.engine.set_replay(None)
    free = replay.generate(PROMPTS[0], params[0])[0]
    assert free.outputs[0].token_ids != recorded[0].outputs[0].token_ids


def test_replay_refuses_a_prompt_it_has_no_record_of(tiny: Path) -> None:
    replay = LLM(str(tiny), **SPEC)
    replay.engine.set_replay(ReplayTarget({(1, 2, 3): [1, 2, 3, 4]}, 0))
    with pytest.raises(KeyError, match="no recorded output"):
        replay.generate("Hello", SamplingParams(max_tokens=4, temperature=0))


def test_a_record_must_start_with_its_prompt() -> None:
    with pytest.raises(ValueError, match="start with its prompt"):
        ReplayTarget({(1, 2): [1, 3, 4]}, 0)


def test_dummy_weights_replay_a_recording_and_need_no_checkpoint(tmp_path: Path) -> None:
    """``load_format="dummy"``: a folder with only config.json and the tokenizer serves (seeded
    random weights, the same in every engine), and replay over it reproduces a recording exactly;
    without dummy the same folder is refused."""
    from ngrammar.model.loader import ModelLoadError

    folder = tiny_checkpoint(tmp_path / "shape", layers=2, weights=False)
    params = SamplingParams(max_tokens=32, temperature=0)
    real = LLM(**SPEC, num_draft_tokens=8)
    recorded = real.generate(PROMPTS[0], params)[0]
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(folder), **SPEC)
    dummy = LLM(str(folder), **SPEC, num_draft_tokens=8, load_format="dummy")
    again = LLM(str(folder), **SPEC, num_draft_tokens=8, load_format="dummy")
    free = dummy.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    assert again.generate(PROMPTS[0], params)[0].outputs[0].token_ids == free  # seeded weights
    assert free != recorded.outputs[0].token_ids
    eos = dummy.engine.model_config.eos_token_ids[0]
    dummy.engine.set_replay(
        ReplayTarget.from_outputs([(recorded.prompt_token_ids, recorded.outputs[0].token_ids)], eos)
    )
    got = dummy.generate(PROMPTS[0], params)[0]
    assert _spec_figures([got]) == _spec_figures([recorded])


def test_dummy_load_format_is_validated() -> None:
    from ngrammar.config import EngineConfig

    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="random")
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(load_format="dummy", tensor_parallel_size=2)


def test_a_server_starts_on_a_weightless_folder_with_dummy_weights(tmp_path: Path) -> None:
    """``ngrammar serve --load-format dummy`` on a folder of config.json and tokenizer only answers a
    completion (the server resolved the checkpoint with weights before the engine did, and refused it)."""
    import httpx

    from benchmarks.bench_serve import ServerProcess

    folder = tiny_checkpoint(tmp_path / "shape", layers=1, weights=False)
    flags = ["--model", str(folder), "--load-format", "dummy", "--device", "cpu", "--dtype", "float32"]
    with ServerProcess([*flags, "--kv-cache-tokens", "1024"], speculative=False) as server:
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
