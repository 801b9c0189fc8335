"""The engine-core protocol: what the API server and an engine core send each other (msgspec).

API server process(es) -> core: ``Add`` (a prepared request: token ids and validated params), ``Abort``,
``Stop``. Core -> each API server process: ``Ready`` (or ``StartFailed``) once its engine is built,
then one ``StepDelta`` per loop turn that changed something, holding that process's requests: the new token ids of every request that
progressed (never the whole output again, never one message per token), finish reasons, logprobs,
usage and the core's load.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ngrammar.engine.stats import EngineStats
from ngrammar.sampling_params import SamplingParams


class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    group: str  # the HTTP request it belongs to: cores hand requests over round-robin by group
    prompt_ids: list[int]
    params: SamplingParams
    client: int = 0  # the API server process (``--api-server-count``) its deltas go to


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


class CorpusCall(msgspec.Struct, tag=True, array_like=True):
    """An operation on the engine's external draft corpora (/v1/draft_corpora), run on a worker
    thread in the core while the engine keeps stepping; answered by a ``CorpusReply``."""

    call: int
    op: str  # "list", "add" or "remove"
    name: str | None = None
    path: str | None = None
    documents: list[str] | None = None
    replace: bool = False
    client: int = 0  # the API server process the reply goes to


Command = Add | Abort | CorpusCall | Stop


class SeqDelta(msgspec.Struct, array_like=True):
    """What one completion (of a request's n) gained in one step."""

    index: int
    token_ids: list[int]  # new tokens only
    finish_reason: str | None = None
    error: str | None = None
    request_error: bool = False  # the error is the request's fault (400), not the engine's
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None  # (id, logprob, top)


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    seqs: list[SeqDelta]
    finished: bool = False
    metrics: dict[str, float] | None = None  # the engine's request metrics, with the final delta


class RequestFailed(msgspec.Struct, array_like=True):
    """The engine refused a request the server's checks let through (bad input: 400) or failed
    while running it (500); the request is gone from the core."""

    request_id: str
    kind: str  # the exception's class name
    message: str


class Load(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int  # in the scheduler plus handed to the core and not yet to the engine
    kv_pages_free: int  # (cached prefix pages nobody reads count as free)
    kv_pages_total: int
    kv_pages_cached: int
    stats: EngineStats
    compiles: int  # kernel compilations since the core started, its warm-up's included


class StepDelta(msgspec.Struct, tag=True, array_like=True):
    core: int  # which core (``--dp`` replica) sent it
    requests: list[RequestDelta]
    failed: list[RequestFailed]
    load: Load
    # None: the turn ran no step (only admissions or aborts), or another API server process got it
    # (each step is timed once server-wide: only client 0's delta carries it)
    step_seconds: float | None


class CorpusReply(msgspec.Struct, tag=True, array_like=True):
    core: int
    call: int
    result: Any = None  # list: every corpus' info; add: the new corpus' info; remove: None
    error: str | None = None  # why the call was refused (the request's fault: a 400, or 404 for remove)


class Ready(msgspec.Struct, tag=True, array_like=True):
    core: int
    model_name: str
    max_model_len: int
    kv_capacity_tokens: int
    page_size: int
    compiles: int  # kernels and graphs compiled while warming up
    load: Load | None = None  # the idle core's load (its KV pool), for /server_info before any step


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    core: int
    message: str


Report = StepDelta | CorpusReply | Ready | StartFailed

encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
report_decoder = msgspec.msgpack.Decoder(Report)
