"""CLI: batch jobs through --input/--output, and bad input as one line with exit code 2."""

from __future__ import annotations

import json

import pytest

from ngrammar.cli import main


def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert main(["generate", "Hi", "--max-tokens", "-3"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "max_tokens" in err and "Traceback" not in err
    assert main(["generate", "Hi", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate"]) == 2


def test_jsonl_batch_job(tmp_path) -> None:  # type: ignore[no-untyped-def]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        json.dumps({"prompt": "The capital of France is", "max_tokens": 3})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Say hi."}]})
        + "\n"
    )
    assert (
        main(
            [
                "generate",
                "--input",
                str(src),
                "--output",
                str(dst),
                "--temperature",
                "0",
                "--max-tokens",
                "4",
                "--device",
                "cpu",
                "--kv-cache-tokens",
                "4096",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["metrics"]["completion_tokens"] == 3
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)


def test_speculative_flags_reach_the_engine_config() -> None:
    from ngrammar.args import engine_kwargs
    from ngrammar.cli import build_parser
    from ngrammar.llm import build_engine_config

    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--speculative",
            "ngram",
            "--num-draft-tokens",
            "16",
            "--spec-policy",
            "fixed",
            "--no-spec-grammar-drafts",
        ]
    )
    spec = build_engine_config(**engine_kwargs(args)).speculative
    assert spec is not None and spec.num_draft_tokens == 16 and spec.policy == "fixed"
    assert not spec.grammar_drafts
    args = build_parser().parse_args(["generate", "hi", "--speculative", "ngram"])
    spec = build_engine_config(**engine_kwargs(args)).speculative
    assert spec is not None and spec.policy == "adaptive" and spec.grammar_drafts


def test_jsonl_rows_are_checked_and_take_every_sampling_field(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Regressions: fields beyond eight were dropped silently (n, ignore_eos, json_object...), a
    typo passed, a row that was not an object failed with a Python error, --chat was ignored, a bad
    prompt or grammar did not name its line."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    flags = ["--output", str(dst), "--temperature", "0", "--device", "cpu", "--kv-cache-tokens", "4096"]
    for bad, message in [
        ({"prompt": "Hi", "max_new_tokens": 3}, "unknown field"),
        ("Hi", "JSON object"),
        ({"prompt": "Hi", "temperature": -1}, "temperature"),
        ({"messages": "Hi"}, "must be a list"),
        ({"prompt": "Hi", "regex": 5}, "strings"),
        ({"prompt": "Hi", "regex": "("}, "invalid regex"),
        ({"prompt": ""}, "prompt is empty"),
        ({"messages": [{"role": "user"}]}, "role and content"),
    ]:
        src.write_text("\n" + json.dumps(bad) + "\n")
        assert main(["generate", "--input", str(src), *flags]) == 2
        err = capsys.readouterr().err
        assert f"{src}:2:" in err and message in err, err
    src.write_text(
        json.dumps({"prompt": "Say hi.", "max_tokens": 3, "n": 2, "ignore_eos": True, "logprobs": 1}) + "\n"
    )
    assert main(["generate", "--input", str(src), "--chat", *flags]) == 0
    row = json.loads(dst.read_text())
    assert len(row["outputs"]) == 2 and row["metrics"]["completion_tokens"] == 2 * 3
    assert len(row["logprobs"]) == 3 and all(len(top) == 1 for _, _, top in row["logprobs"])
    assert row["prompt"] == "Say hi." and row["metrics"]["prompt_tokens"] > 5  # the chat template's


def test_a_failed_request_is_an_error_with_and_without_stream(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Regression: with --stream a request that ended with an error printed its partial text and
    exited 0; a batch wrote it with no message and exited 0."""
    prompt = "Count: one two three four five six seven eight nine ten eleven twelve"
    flags = [
        "--max-tokens",
        "40",
        "--kv-cache-tokens",
        "32",
        "--temperature",
        "0",
        "--device",
        "cpu",
        "--ignore-eos",
    ]
    for extra in ([], ["--stream"]):
        assert main(["generate", prompt, *flags, *extra]) == 2
        assert "KV cache is too small" in capsys.readouterr().err
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": prompt}) + "\n")
    assert main(["generate", "--input", str(src), *flags]) == 2
    captured = capsys.readouterr()
    assert "KV cache is too small" in json.loads(captured.out)["error"] and "1 of 1" in captured.err


def test_every_config_field_has_a_flag_and_unset_flags_keep_the_defaults() -> None:
    """One config path: the flags are generated from the config dataclasses, so none can drift."""
    import dataclasses

    from ngrammar.args import engine_kwargs
    from ngrammar.cli import build_parser
    from ngrammar.config import SPECULATIVE_ARGS, EngineConfig
    from ngrammar.llm import build_engine_config

    args = build_parser().parse_args(["generate", "hi"])
    assert engine_kwargs(args) == {"speculative": None}
    assert build_engine_config(**engine_kwargs(args)) == EngineConfig()
    dests = set(vars(args))
    for f in dataclasses.fields(EngineConfig):
        if f.name != "speculative":
            assert (f.metadata.get("flag") or f.name) in dests, f.name
    assert set(SPECULATIVE_ARGS) <= dests
    # The engine's seed and a request's --seed are different flags.
    args = build_parser().parse_args(["generate", "hi", "--seed", "5", "--engine-seed", "7"])
    assert args.seed == 5 and engine_kwargs(args)["seed"] == 7
    args = build_parser().parse_args(["serve", "--overlap-schedule", "off", "--page-size", "32"])
    assert build_engine_config(**engine_kwargs(args)).overlap_schedule is False
