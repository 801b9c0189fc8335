"""Offline API: ``LLM(...).generate(prompts, params)`` and ``.chat(conversations, params)``."""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

from ngrammar.config import SPECULATIVE_ARGS, EngineConfig, SpeculativeConfig
from ngrammar.engine.engine import LLMEngine
from ngrammar.model.tokenizer import Message
from ngrammar.outputs import RequestOutput
from ngrammar.sampling_params import InvalidRequestError, SamplingParams

Prompt = str | list[int]


def build_engine_config(
    model: str | None = None, speculative: str | None = None, **kwargs: Any
) -> EngineConfig:
    """Split flat keyword arguments into the engine and speculative configs (unknown names fail)."""
    spec_kwargs = {SPECULATIVE_ARGS[k]: kwargs.pop(k) for k in list(kwargs) if k in SPECULATIVE_ARGS}
    engine_names = {f.name for f in fields(EngineConfig)}
    unknown = set(kwargs) - engine_names
    if unknown:
        raise TypeError(f"unknown LLM arguments: {', '.join(sorted(unknown))}")
    spec = None
    if speculative is not None:
        if speculative.lower() != "ngram":
            raise ValueError(f"speculative must be 'ngram' or None, got {speculative!r}")
        spec = SpeculativeConfig(**spec_kwargs)
    elif spec_kwargs:
        raise ValueError(f"{', '.join(spec_kwargs)} need speculative='ngram'")
    return EngineConfig(model=model, speculative=spec, **kwargs)


class LLM:
    """The offline engine. ``close()`` (or leaving ``with LLM(...) as llm:``, or dropping the last
    reference) releases its KV memory, threads, and with tensor parallelism its rank processes and
    process group, so another engine can start in the same process."""

    def __init__(
        self, model: str | None = None, device: str = "auto", dtype: str = "auto", **kwargs: Any
    ) -> None:
        self.engine = LLMEngine(build_engine_config(model, device=device, dtype=dtype, **kwargs))
        self.tokenizer = self.engine.tokenizer
        # Runs engine.close when this object is collected or at interpreter exit, whichever is first.
        self._finalizer = weakref.finalize(self, self.engine.close)

    def close(self) -> None:
        """Release the engine now (idempotent); generating afterwards raises."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple))
            and prompts
            and isinstance(prompts[0], numbers.Integral)
            and not isinstance(prompts[0], bool)
        ):
            prompts = [prompts]  # type: ignore[list-item, assignment]
        return self._run(_as_list(prompts, "prompts"), params, use_tqdm)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        if not isinstance(conversations, str) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item, assignment]
        convs = _as_list(conversations, "conversations")
        for i, conv in enumerate(convs):
            # A string (or token ids) is no conversation: it was generated as a plain prompt, one
            # character at a time for chat("hi"), without the chat template.
            if not isinstance(conv, (list, tuple)) or not all(isinstance(m, dict) for m in conv):
                raise InvalidRequestError(
                    f"conversation {i}: a conversation is a list of message dicts "
                    f"({{'role': ..., 'content': ...}}), got {conv!r:.80}; use generate() for plain prompts"
                )
        return self._run(convs, params, use_tqdm)

    def _run(
        self,
        prompts: list[Any],
        params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool | None,
        labels: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """``labels``: where each prompt came from (the CLI's ``file:line``), put before the message
        of the ValueError its checks raise."""
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            # (A dict or a generator was an AttributeError from deep inside the engine.)
            iterable = isinstance(params, Iterable) and not isinstance(params, (str, bytes, dict))
            plist = list(params) if iterable else [params]  # type: ignore[list-item]
            for p in plist:
                if not isinstance(p, SamplingParams):
                    raise TypeError(
                        f"params must be a SamplingParams or a list of them, got {type(p).__name__}"
                    )
        self.engine.check_open()
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids = self._add_all(prompts, plist, labels)
        results: dict[str, RequestOutput] = {}
        try:
            for out in self._progress(self._drain(set(ids)), len(ids), use_tqdm):
                results[out.request_id] = out
        except BaseException:
            # A step that raised (an engine bug, an interrupt) must not leave this call's requests
            # queued: every later call would step them again and fail the same way.
            self.engine.abort_and_release(ids)
            raise
        return [results[i] for i in ids]

    def _add_all(
        self, prompts: list[Any], plist: list[SamplingParams], labels: Sequence[str] | None = None
    ) -> list[str]:
        """Validate every request before queueing any, so one bad input runs nothing."""
        eng = self.engine
        prepared = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            with _labelled(labels, i):
                ids = eng.tokenize(prompt)
                eng.validate(ids, p)
            prepared.append((ids, p))
        for i, (_, p) in enumerate(prepared):
            with _labelled(labels, i):
                eng.compile_grammar(p)  # compile (cached) up front: a bad grammar fails before any work
        return [eng.add_request(ids, p, stream=False) for ids, p in prepared]

    def _drain(self, pending: set[str]) -> Iterator[RequestOutput]:
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    yield out

    @staticmethod
    def _progress(it: Iterator[RequestOutput], total: int, use_tqdm: bool | None) -> Iterator[RequestOutput]:
        if use_tqdm is False or (use_tqdm is None and total < 16):
            return it
        from tqdm import tqdm

        return iter(tqdm(it, total=total, desc="requests", unit="req"))


@contextmanager
def _labelled(labels: Sequence[str] | None, i: int) -> Iterator[None]:
    """A ValueError raised inside, prefixed with ``labels[i]`` (unchanged without labels)."""
    try:
        yield
    except ValueError as e:
        if labels is None:
            raise
        raise ValueError(f"{labels[i]}: {e}") from e


def _as_list(items: Any, what: str) -> list[Any]:
    """``items`` as a list, or a TypeError naming the argument (not "'int' object is not iterable")."""
    if isinstance(items, (str, bytes, dict)) or not isinstance(items, Iterable):
        raise TypeError(f"{what} must be a list, got {type(items).__name__}")
    return list(items)
