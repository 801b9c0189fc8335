"""Wire formats: OpenAI-compatible and native request/response bodies as pydantic models.

Request models validate shapes and simple ranges (FastAPI turns failures into 400s); the engine's
``SamplingParams`` re-validates everything, so these bounds are a first line, not the only one.
Each request model knows how to express itself as ``SamplingParams`` keyword arguments.

Types are strict, as OpenAI's are: ``"stream": "yes"`` or ``"max_tokens": "3"`` is a 400, not a
coercion (an int is still a valid float). Before any field is read, ``check_request_json`` walks the
raw body once: bounded nesting, and no lone UTF-16 surrogate (``"\ud800"``: valid JSON escape, but
not Unicode, so no tokenizer can take it) in any string or key.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from ngrammar.sampling_params import MAX_LOGPROBS, MAX_TOP_K, InvalidRequestError

# ------------------------------------------------------------------ errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ------------------------------------------------------------- raw checks

MAX_JSON_DEPTH = 100  # nesting of a request body; a JSON schema inside has its own, tighter bound
MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_TOKEN_IDS = 1024


def _surrogate_at(text: str) -> int | None:
    """Index of the first lone UTF-16 surrogate in ``text``, or None (the common case, in C speed)."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def check_request_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise ValueError if the raw JSON ``value`` nests deeper than ``max_depth`` or holds a lone
    surrogate; iterative, so any input is safe. The message names where, never echoes the text."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, str):
            at = _surrogate_at(item)
            if at is not None:
                raise ValueError(
                    f"{where.lstrip('.') or 'the body'}: the string holds a lone UTF-16 surrogate "
                    f"(U+{ord(item[at]):04X}) at character {at}, which is not valid Unicode"
                )
            continue
        if depth > max_depth:
            raise ValueError(f"{where.lstrip('.') or 'the body'}: nested deeper than {max_depth} levels")
        if isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str) and _surrogate_at(key) is not None:
                    raise ValueError(
                        f"{where.lstrip('.') or 'the body'}: a key holds a lone UTF-16 surrogate"
                    )
                if isinstance(sub, (dict, list, str)):
                    stack.append((sub, depth + 1, f"{where}.{key}"))
        elif isinstance(item, list):
            for i, sub in enumerate(item):
                if isinstance(sub, (dict, list, str)):
                    stack.append((sub, depth + 1, f"{where}.{i}"))


class _StrictModel(BaseModel):
    """Strict types (no "yes" -> True, "3" -> 3); unknown fields are ignored unless a model says."""

    model_config = ConfigDict(strict=True)


class _RequestModel(_StrictModel):
    """A whole request body: checked raw (depth, surrogates) before its fields are validated."""

    @model_validator(mode="before")
    @classmethod
    def _check_raw(cls, data: Any) -> Any:
        check_request_json(data)
        return data


# ----------------------------------------------------------- shared pieces


class JsonSchemaFormat(_StrictModel):
    name: str = "schema"
    description: str | None = None
    # "schema" would shadow a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True, strict=True)


class ResponseFormat(_StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class StreamOptions(_StrictModel):
    include_usage: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def sent_field(body: BaseModel, names: tuple[str, ...]) -> str | None:
    """The first of ``names`` the client actually sent (with a value), or None: an output limit
    the client sent is checked against the context, a default one is only capped to it."""
    return next((n for n in names if n in body.model_fields_set and getattr(body, n) is not None), None)


class _OpenAIRequest(_RequestModel):
    """Fields shared by chat and text completions; unknown fields are ignored, as OpenAI clients
    send many optional ones. Fields whose semantics we do not implement fail loudly instead."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=128)  # the server's --max-n is usually lower
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # SGLang-style structured-output extensions, given directly in the body.
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | bool | str | None = None
    # Speculation per request (``SamplingParams``): opt out, cap the draft tree, name external corpora.
    speculative: bool = True
    num_draft_tokens: int | None = Field(default=None, ge=1, le=64)
    draft_corpora: list[str] | None = None
    # Accepted only at their no-op values.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> _OpenAIRequest:
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams arguments except max_tokens (whose default depends on the prompt)."""
        kw: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "n": self.n,
            "stop": _stop_tuple(self.stop),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "regex": self.regex,
            "ebnf": self.ebnf,
            **_speculation_kwargs(self.speculative, self.num_draft_tokens, self.draft_corpora),
        }
        kw.update(self._grammar_kwargs())
        return kw

    def _grammar_kwargs(self) -> dict[str, Any]:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return {"json_schema": self.json_schema}
        if self.json_schema is not None:
            raise InvalidRequestError("give either response_format or json_schema, not both")
        if fmt.type == "json_object":
            return {"json_object": True}
        assert fmt.json_schema is not None  # checked by ResponseFormat
        return {"json_schema": fmt.json_schema.schema_}


def _speculation_kwargs(
    speculative: bool, num_draft_tokens: int | None, draft_corpora: list[str] | None
) -> dict[str, Any]:
    return {
        "speculative": speculative,
        "num_draft_tokens": num_draft_tokens,
        "draft_corpora": None if draft_corpora is None else tuple(draft_corpora),
    }


def _stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# ------------------------------------------------------------------- chat


class ContentPart(_StrictModel):
    type: str
    text: str | None = None


class ChatMessage(_StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_dict(self) -> dict[str, str]:
        """The {"role", "content"} dict chat templates expect; only text parts are understood."""
        if self.content is None or isinstance(self.content, str):
            return {"role": self.role, "content": self.content or ""}
        for p in self.content:
            if p.type != "text":
                raise InvalidRequestError(f"only text content parts are supported, got type {p.type[:40]!r}")
            if p.text is None:
                raise InvalidRequestError("a text content part needs its text")
        return {"role": self.role, "content": "".join(p.text for p in self.content if p.text is not None)}


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_dict() for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = super().sampling_kwargs()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true")
        kw["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return kw


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


# ------------------------------------------------------ text completions


class CompletionRequest(_OpenAIRequest):
    # One prompt (text or token ids) or a batch of them.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _reject_unsupported_completion_fields(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts; a flat list of ints is one tokenized prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p) if p else [[]]  # type: ignore[arg-type]

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = super().sampling_kwargs()
        kw["logprobs"] = self.logprobs
        return kw


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ------------------------------------------------------------------ models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ngrammar"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------- native /generate


class NativeSamplingParams(_StrictModel):
    """SGLang-style ``sampling_params``; unknown keys are errors so typos do not pass silently."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | bool | str | None = None
    json_object: bool = False
    speculative: bool = True
    num_draft_tokens: int | None = Field(default=None, ge=1, le=64)
    draft_corpora: list[str] | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        return {
            **_speculation_kwargs(self.speculative, self.num_draft_tokens, self.draft_corpora),
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": _stop_tuple(self.stop),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "regex": self.regex,
            "ebnf": self.ebnf,
            "json_schema": self.json_schema,
            "json_object": self.json_object,
        }


class GenerateRequest(_RequestModel):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if self.stream and self.is_batch:
            raise ValueError("streaming supports a single prompt")
        return self

    @property
    def is_batch(self) -> bool:
        if isinstance(self.text, list):
            return True
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts; an empty batch is one empty prompt (a 400, as ``prompt: []`` on
        /v1/completions), not an empty answer."""
        if self.text is not None:
            return (list(self.text) or [""]) if isinstance(self.text, list) else [self.text]
        ids = self.input_ids or []
        return list(ids) if self.is_batch else [ids]  # type: ignore[list-item, arg-type]


class GenerateMetaInfo(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None
    e2e_latency: float
    ttft: float | None = None
    spec_verify_steps: int = 0
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


# ------------------------------------------------------- external draft corpora


class DraftCorpusRequest(_RequestModel):
    """Add a named external draft corpus from documents, or from a file in the server's
    ``--draft-corpus-dir`` (``path`` relative to it)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: str
    path: str | None = None
    documents: list[str] | None = None
    replace: bool = False
