"""LLMEngine: the request lifecycle and the engine loop.

add_request -> validate, tokenize, compile grammar -> Scheduler.waiting
step        -> Scheduler.schedule -> prefill | decode | NGRAM verify -> commit -> outputs
finished    -> pages released, match state erased, RequestOutput(finished=True)

Overlap scheduling (on by default on CUDA): a plain decode step is sampled on the device and left
in flight; the next step launches the same batch's next forward from those device tokens first
and only then reads them back and commits them, so the host's commit, outputs, corpus and policy
work run while the device computes. With ``chain_verify`` a pipelined verify step is chained out of
the same way: the next plain step starts from its bonus tokens at the positions its accepted
lengths give, both still on the device. Any other step (prefill, a verify, a changed batch) first
drains the step in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ngrammar.config import EngineConfig
from ngrammar.engine.builder import (
    EngineParts,
    attach_graphs,
    build_parts,
    mixed_step_tokens,
    prefill_wait_steps,
)
from ngrammar.engine.grammar_rows import GrammarRows
from ngrammar.engine.logprobs import unpack_logprobs
from ngrammar.engine.plain_step import PendingDecode, commit_runs, decode_input, prefill_input, sample_plain
from ngrammar.engine.requests import (
    Request,
    collect_outputs,
    tokenize_prompt,
    validate_request,
)
from ngrammar.engine.scheduler import Scheduler
from ngrammar.engine.sequence import Sequence
from ngrammar.engine.speculator import NoSpeculation, Speculator
from ngrammar.engine.stats import EngineStats, StepKind, StepRecord, timed_forward
from ngrammar.engine.verify_step import NgramSpecWorker, PendingVerify, VerifyResult
from ngrammar.model.tokenizer import Message
from ngrammar.outputs import RequestOutput
from ngrammar.runner.cuda_graph import graph_capturable
from ngrammar.runner.transfer import to_device
from ngrammar.sampling_params import InvalidRequestError, SamplingParams
from ngrammar.speculative.forced import forced_text

if TYPE_CHECKING:
    from ngrammar.grammar import GrammarBackend, GrammarSpec
    from ngrammar.speculative.replay import ReplayTarget

__all__ = ["EngineStats", "LLMEngine", "Request", "StepKind", "StepRecord"]


class _Chain(NamedTuple):
    """A step the batch in flight can go on with (``LLMEngine._chainable``)."""

    keep: list[int]  # indices into the batch in flight of the members launched
    members: list[Sequence]
    leaving: int | None  # prompts ride along (members ending with the token in flight); None: none do
    width: int = 1  # > 1: a verify step of this width, drafted one token behind (``chain_into_verify``)


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        """``parts``: already built from ``config`` (``build_parts``), else built here."""
        self.config = config
        self.parts = parts = parts if parts is not None else build_parts(config)
        self.device, self.dtype = parts.device, parts.dtype
        self.model_config, self.model_name = parts.model_config, parts.model_name
        self.tokenizer, self.max_model_len = parts.tokenizer, parts.max_model_len
        self.runner, self.blocks = parts.runner, parts.blocks
        self.scheduler = Scheduler(
            self.blocks,
            config.max_running_requests,
            config.max_prefill_tokens,
            mixed_step_tokens(config, self.device),
            prefill_wait_steps(config, self.device),
        )
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.closed = False
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._grammar: GrammarBackend | None = None
        self.overlap = (
            config.overlap_schedule if config.overlap_schedule is not None else self.device.type == "cuda"
        )
        # Verify steps left in flight: the next engine step commits them (``PendingVerify``).
        self.pipeline = (
            config.pipeline_verify if config.pipeline_verify is not None else self.overlap
        ) and config.speculative is not None
        # A plain step chained out of a pipelined verify step (the ranks of tensor parallelism
        # receive host steps only, so they drain instead).
        self.chain_verify = (
            config.chain_verify and self.pipeline and self.overlap and config.tensor_parallel_size == 1
        )
        # A verify step chained out of a plain step in flight, where the policy wants one (the same
        # conditions; ``_chain_into_verify``).
        self.chain_into_verify = (
            config.chain_into_verify and self.pipeline and self.overlap and config.tensor_parallel_size == 1
        )
        self.grammar_rows = GrammarRows(self.model_config.vocab_size, self.device, self.stats)
        # The step not read back yet: a plain one (overlap scheduling) or a verify one (pipelined).
        self._in_flight: PendingDecode | PendingVerify | None = None
        self._step_start = 0.0  # perf_counter() at the start of the current engine step
        self._last_commit = 0.0  # perf_counter() when the last step's tokens were committed
        self._policy_drained = False  # the chain was just broken because the policy wanted a verify step
        # The last engine step was a verify step: seconds from its commit to the end of that engine
        # step (taken by the next schedule); None otherwise.
        self._verify_tail: float | None = None
        # Seconds the last commit waited for the device: host time that was free (with overlap,
        # the next step's forward was already running). ~0 on a CPU; after a prefill, its forward.
        self.read_wait = 0.0
        self.step_trace: list[StepRecord] | None = None  # a list: every step is recorded in it
        self.replay: ReplayTarget | None = None  # benchmarks: recorded outputs decide (``set_replay``)
        self.speculator: Speculator = NoSpeculation()
        if config.speculative is not None:
            self.speculator = NgramSpecWorker(
                config.speculative,
                self.runner,
                self.grammar_rows,
                self.stats,
                self.tokenizer,
                forced=lambda: forced_text(self.grammar_backend, self.tokenizer),
            )
        if config.cuda_graph and self.device.type == "cuda" and graph_capturable(self.runner.backend):
            self.enable_cuda_graphs(capture=True)

    # ----------------------------------------------------------------- set-up
    def set_replay(self, target: ReplayTarget | None) -> None:
        """Let recorded greedy outputs decide every token (``speculative/replay.py``), or stop."""
        self.replay = self.speculator.replay = target

    @property
    def ngram(self) -> NgramSpecWorker | None:
        """The NGRAM worker, where the config speculates."""
        spec = self.speculator
        return spec if isinstance(spec, NgramSpecWorker) else None

    def close(self) -> None:
        """Release what the engine holds now: its requests, the KV pool and graphs, the other
        tensor-parallel ranks and the process group, the grammar fill and compile threads (idempotent).
        Nothing can be added or stepped afterwards."""
        if self.closed:
            return
        self.abort_and_release(list(self.requests))
        self.closed = True
        self.runner.close()
        self.grammar_rows.close()
        if self._grammar is not None:
            self._grammar.close()

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed (LLM.close()): build a new one")

    def enable_cuda_graphs(self, capture: bool = True) -> None:
        """Serve uniform decode / verify steps from CUDA graphs, and (captured) prefill and mixed
        steps from mixed-step graphs (``builder.attach_graphs``)."""
        attach_graphs(self.parts, self.config, self.speculator, capture)

    @property
    def grammar_backend(self) -> GrammarBackend:
        if self._grammar is None:
            from ngrammar.grammar import GrammarBackend

            self._grammar = GrammarBackend(
                self.tokenizer,
                self.model_config.vocab_size,
                self.config.grammar_cache_size,
                cache_max_bytes=self.config.grammar_cache_mb << 20,
            )
        return self._grammar

    # ------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int] | Seq[Message]) -> list[int]:
        return tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.blocks.allocator.num_pages * self.blocks.page_size

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_request(
            prompt_ids, params, self.max_model_len, self.kv_capacity_tokens, self.model_config.vocab_size
        )
        if params.draft_corpora:
            self.speculator.check_corpora(params.draft_corpora)

    def add_request(
        self,
        prompt: str | list[int] | Seq[Message],
        params: SamplingParams,
        request_id: str | None = None,
        stream: bool = True,
    ) -> str:
        """Queue a request; raises InvalidRequestError / GrammarError for bad input (nothing queued)."""
        self.check_open()
        prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        compiled = self.compile_grammar(params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        backend = None if compiled is None else (self.grammar_backend, compiled)
        self.requests[request_id] = req = Request.create(
            request_id, prompt_ids, params, self.tokenizer, seed, self.max_model_len, backend, stream
        )
        seqs = req.seqs
        for seq in seqs:
            self.scheduler.add(seq)
            self.speculator.on_admit(seq)
        return request_id

    def grammar_spec(self, params: SamplingParams) -> GrammarSpec | None:
        """The request's ``GrammarSpec`` (the compile cache's key), None without a grammar."""
        if not params.has_grammar:
            return None
        from ngrammar.grammar import grammar_spec_from_request

        return grammar_spec_from_request(params.json_schema, params.regex, params.ebnf, params.json_object)

    def compile_grammar(self, params: SamplingParams) -> Any:
        spec = self.grammar_spec(params)
        return None if spec is None else self.grammar_backend.compile(spec)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            for seq in req.seqs:
                seq.finish("abort")

    def abort_and_release(self, request_ids: Seq[str]) -> None:
        """Abort these requests and release what they hold now (KV pages, corpus state, the step in
        flight, their entries), without running a step: for a caller whose step raised."""
        for request_id in request_ids:
            self.abort(request_id)
        self._drop_finished_flight()
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is not None and req.finished:
                del self.requests[request_id]
        self._retire()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; returns outputs of requests that progressed or finished."""
        self.check_open()
        start = self._step_start = time.perf_counter()
        self.scheduler.tick()
        host, shadow = self._host_seconds(), self.stats.shadow_seconds
        chained, width = 0, 1
        if isinstance(self._in_flight, PendingDecode):
            chained, width = self._chain_decode()
        elif isinstance(self._in_flight, PendingVerify):
            chained = self._chain_out_of_verify()
        if chained:
            kind: StepKind = "chain" if width == 1 else "verify"
            size = chained
        else:
            self._drain()
            kind, size, width = self._schedule_and_run()
        self.stats.steps += 1
        self.stats.last_step_seconds = time.perf_counter() - start
        self.stats.step_seconds += self.stats.last_step_seconds
        if self.step_trace is not None:
            host = self._host_seconds() - host
            # The policy's last decision is this step's: the schedule's, or the chain's decided ahead.
            reason = self.speculator.reason if kind in ("chain", "decode", "verify") else ""
            seconds, shadow = self.stats.last_step_seconds, self.stats.shadow_seconds - shadow
            self.step_trace.append(StepRecord(kind, size, width, start, seconds, host, reason, shadow))
        outputs = self._collect_outputs()
        if kind == "verify" and self._in_flight is None:
            # Committed in its own engine step: the device idled through the rest of it.
            self._verify_tail = time.perf_counter() - self._last_commit
        return outputs

    def _host_seconds(self) -> float:
        """Host time spent so far on NGRAM and grammar work (drafting, indexing, shadows, masks)."""
        st = self.stats
        return st.draft_seconds + st.grammar_seconds + st.shadow_seconds

    def _observe(
        self,
        batch_size: int,
        width: int,
        launched: float,
        restart: float | None = None,
        result: VerifyResult | None = None,
    ) -> None:
        """A decode step's tokens were just committed: time it for the draft policy.

        A step costs the time from the previous step's commit to its own (overlapped steps commit
        one device step apart), but never from before the engine step that launched it (idle time
        between engine steps is nobody's cost). ``restart``: see ``PendingDecode``."""
        now = time.perf_counter()
        seconds = now - max(self._last_commit, launched)
        self._last_commit = now
        self.speculator.observe_step(batch_size, width, seconds, restart, result)

    def _schedule_and_run(self) -> tuple[StepKind, int, int]:
        """Schedule and run one step from committed state; returns its kind, size and width
        (``StepRecord``)."""
        self._retire()  # aborted sequences must not be scheduled again
        batch = self.scheduler.schedule(self._decode_width)
        self.stats.prefix_cache_query_tokens = self.blocks.query_tokens
        self.stats.prefix_cache_hit_tokens = self.blocks.hit_tokens
        drained = self._policy_drained
        if drained and batch.decode and batch.width == 1:
            self.stats.false_drains += 1
        self._policy_drained = False
        tail, self._verify_tail = self._verify_tail, None
        for seq in batch.failed:
            seq.finish("error", "the KV cache is too small for this request")
        if batch.failed:
            self.speculator.on_finish(batch.failed)  # not in running any more: _retire will not see them
        if batch.prefill:
            self._run_prefill(batch.prefill, batch.decode)
            if batch.decode:
                return "mixed", len(batch.decode) + len(batch.prefill), 1
            return "prefill", len(batch.prefill), 1
        if not batch.decode:
            return "idle", 0, 1
        if batch.width > 1:
            pending = self.speculator.launch_verify(
                batch.decode, batch.width, self._step_start, self.pipeline, self.chain_verify, drained
            )
            if pending is not None:  # (narrower than batch.width where the trees were trimmed)
                if self.pipeline:
                    self._in_flight = pending  # committed by the next step, first thing
                    self.stats.pipelined_steps += 1
                else:
                    self._commit_verify(pending)
                return "verify", len(batch.decode), pending.width
        self._run_decode(batch.decode, tail if self.overlap else None)
        return "decode", len(batch.decode), 1

    def _decode_width(self, seqs: list[Sequence]) -> int:
        """The policy's width, or 1 where a member is too close to the end of the context for it:
        a verify step's deepest node sits at position len(tokens) + width - 2, which must stay
        inside ``max_model_len`` (the RoPE table and the KV bound end there)."""
        if not seqs:
            return 1
        width = self.speculator.choose_width(seqs, draining=not self.scheduler.waiting)
        if width > 1 and max(len(s.token_ids) for s in seqs) + width - 1 > self.max_model_len:
            return 1
        return width

    def _run_prefill(self, chunks: list[tuple[Sequence, int]], decode: Seq[Sequence] = ()) -> None:
        """A prefill step, or with ``decode`` a mixed step: one forward whose first rows are the
        decode sequences' plain step (one token each) and the rest the prefill chunks; a token is
        sampled for every decode sequence and every sequence whose prompt the step completes. Not
        timed for the draft policy: it is not a plain step. With overlap its tokens stay in flight
        (the next step may be launched from them: ``_chain_decode``)."""
        sampled, logits = self._launch_prefill(chunks, list(decode), None)
        if sampled:
            flight = self._sample_prefill(sampled, logits, list(decode))
            if self.overlap:
                self._in_flight = flight  # committed by the next step, after it launches
                return
            self._commit_decode(flight)
        self._last_commit = time.perf_counter()

    def _launch_prefill(
        self, chunks: list[tuple[Sequence, int]], decode: list[Sequence], decode_ids: torch.Tensor | None
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Launch a prefill or mixed step (``decode_ids``: its decode rows' tokens, still on the
        device); returns the sequences it samples for and their logits rows."""
        step, sampled = prefill_input(chunks, decode, decode_ids)
        logits = timed_forward(self.runner, step, self.stats)
        for seq in decode:
            seq.num_cached += 1
        for seq, n in chunks:
            seq.num_cached += n
        self.stats.prefill_tokens += sum(n for _, n in chunks)
        self.stats.mixed_steps += bool(decode)
        return sampled, logits[: len(sampled)]

    def _sample_prefill(
        self, sampled: list[Sequence], logits: torch.Tensor, decode: list[Sequence]
    ) -> PendingDecode:
        """Queue a prefill or mixed step's sampling (after the commit of the step before: grammar
        rows need its tokens), then index its decode rows' committed tokens."""
        flight = self._sample(sampled, logits)
        flight.decode_rows = len(decode)
        if decode:
            self.speculator.index_plain_step(decode, self.read_wait)
        return flight

    def _run_decode(self, seqs: list[Sequence], restart: float | None) -> None:
        """A plain step from committed state. ``restart`` (overlap): it is the first after a verify
        step, whose engine step spent that long on the host after its commit (outputs, retiring)
        while the device idled, where a chain would have overlapped it; the draft policy charges
        that, and what this step takes beyond a plain one, to the verify step
        (``AdaptiveDraftPolicy.observe``)."""
        flight = self._sample_and_index(seqs, self._launch_decode(seqs, None))
        flight.restart = restart
        if self.overlap:
            self._in_flight = flight  # committed by the next step, after it launches its forward
        else:
            self._commit_decode(flight)

    def _launch_decode(self, seqs: list[Sequence], input_ids: torch.Tensor | None) -> torch.Tensor:
        """Launch a plain decode forward; ``input_ids`` [B] (device): tokens not read back yet."""
        step = decode_input(seqs, input_ids)
        logits = timed_forward(self.runner, step, self.stats)
        for seq in seqs:
            seq.num_cached += 1
        return logits

    def _chain_decode(self) -> tuple[int, int]:
        """Overlap: launch the in-flight batch's next step from its device tokens, then commit
        those tokens while the forward runs. Members that finished, or finish with the token in
        flight, are left out of the launch (``_chainable``). With mixed steps, prompts waiting or
        part-prefilled ride along in it (a chained mixed step: a serving engine's usual step).
        With ``chain_into_verify`` the step may be a verify step (``_chain_into_verify``).
        Returns the rows launched and the step's width; 0 rows (nothing launched) when the batch
        cannot simply go on."""
        flight = self._in_flight
        assert isinstance(flight, PendingDecode)
        self._retire()  # requests aborted since the last step must not be admitted
        chain = self._chainable(flight.seqs)
        if chain is None:
            return 0, 1
        if chain.width > 1:
            return self._chain_into_verify(flight, chain)
        keep, seqs = chain.keep, chain.members
        tokens = flight.tokens
        if len(keep) < len(flight.seqs):
            tokens = tokens.index_select(0, to_device(keep, torch.int64, self.device))  # no host read
        chunks = [] if chain.leaving is None else self.scheduler.chain_prefill(chain.leaving)
        if chunks:
            sampled, logits = self._launch_prefill(chunks, seqs, tokens)
            # The read waits for the previous step only; not timed for the policy: the commit comes
            # after this step's eager launches, which a plain step's time must not include.
            self._commit_decode(flight, timed=False)
            self._in_flight = self._sample_prefill(sampled, logits, seqs)
            self.stats.chained_mixed += 1
        else:
            logits = self._launch_decode(seqs, tokens)
            self._commit_decode(flight)
            self._in_flight = self._sample_and_index(
                seqs, logits
            )  # after the commit: grammar rows need its tokens
        self.stats.chained_steps += 1
        return len(seqs) + len(chunks), 1

    def _chain_into_verify(self, flight: PendingDecode, chain: _Chain) -> tuple[int, int]:
        """Launch the verify step the policy wants from the plain step in flight, before its
        tokens are read back: drafted from the committed tokens one level deeper, each member's
        tree picked on the device by its token in flight (``NgramSpecWorker.launch_verify_ahead``);
        then commit that token and queue the acceptance (``finish_ahead``). The device goes from
        the plain step to the verify step without waiting for the host, where a drain would leave
        it idle through the commit, the drafting and the launch. Returns the rows launched and the
        width verified; 0 rows where no member had a draft under any outcome (the chain drains, as
        the policy asked)."""
        ngram = self.ngram
        assert ngram is not None
        seqs = chain.members
        assert len(seqs) == len(flight.seqs)  # every member goes on (``_verifies_ahead``): no row to drop
        ahead = ngram.launch_verify_ahead(seqs, chain.width, flight.tokens, self._step_start)
        if ahead is None:
            self.stats.policy_drains += 1
            self._policy_drained = True
            return 0, 1
        # Not timed for the policy: its time would hold this verify step's drafting and launch (a
        # plain step that restarted the chain after a verify step so leaves that break uncharged).
        self._commit_decode(flight, timed=False)
        self._in_flight = ngram.finish_ahead(ahead, chain=self.chain_verify)
        self.stats.pipelined_steps += 1
        return len(seqs), ahead.outcomes.trees.draft_token_num

    def _chain_out_of_verify(self) -> int:
        """Launch the in-flight verify step's batch's next plain step from its device result (each
        member's bonus token, at its root's position plus its accepted length), then commit the
        verify step while the forward runs and queue the sampling (after the commit: grammar rows
        need its tokens). Returns the rows launched; 0 (nothing launched) where the batch cannot
        simply go on (``_chainable``: members within a verify step of their end leave it) or the
        policy wants another verify step now."""
        flight = self._in_flight
        assert isinstance(flight, PendingVerify)
        if flight.next_tokens is None or flight.offsets is None:
            return 0  # (kept only where ``chain_verify`` is on)
        if not self.speculator.chain_after_verify(flight.seqs):
            return 0  # another verify step is likely worth it: decide on the committed result
        chain = self._chainable(
            flight.seqs, ahead=flight.width, reserve=flight.width + 1, plain=True, prefill=False
        )
        if chain is None:
            return 0
        keep, seqs = chain.keep, chain.members
        tokens, offsets = flight.next_tokens, flight.offsets
        if len(keep) < len(flight.seqs):
            index = to_device(keep, torch.int64, self.device)
            tokens, offsets = tokens.index_select(0, index), offsets.index_select(0, index)
        step = dataclasses.replace(decode_input(seqs, tokens), offsets=offsets, max_offset=flight.width)
        logits = timed_forward(self.runner, step, self.stats)
        self._in_flight = None
        self._commit_verify(flight, chained=True)
        for seq in seqs:
            if not seq.is_finished:  # (a finished member's token is dropped at its commit)
                seq.num_cached += 1
        self._in_flight = self._sample_and_index(seqs, logits)
        self.stats.chained_steps += 1
        self.stats.chained_out_of_verify += 1
        return len(seqs)

    def _sample_and_index(self, seqs: list[Sequence], logits: torch.Tensor) -> PendingDecode:
        """Queue a plain step's sampling, then index the batch's committed tokens into the corpus:
        on a GPU that host work runs while the device computes."""
        flight = self._sample(seqs, logits)
        self.speculator.index_plain_step(seqs, self.read_wait)
        return flight

    def _chainable(
        self,
        seqs: list[Sequence],
        ahead: int = 1,
        reserve: int = 1,
        plain: bool | None = None,
        prefill: bool = True,
    ) -> _Chain | None:
        """The members the next plain step can be launched for before the tokens in flight are
        read back, or None: drain and schedule afresh. ``ahead``: the most tokens per member the
        step in flight may commit (1 for a plain step, its width for a verify step); ``reserve``:
        KV slots past ``num_cached`` the next step may write up to (1 past a plain step, whose token
        is counted already; width + 1 past a verify step, counted from its root). ``plain``:
        decided already (else the policy is asked). ``prefill``: the chained step may carry prompt
        chunks (a mixed step; only where mixed steps are on).

        Members leave the chain without breaking it when they finished while their token was in
        flight (EOS, a stop string, an abort: that token is dropped at commit) or when the token in
        flight is their last (``max_tokens`` or the context end, ``Sequence.remaining_tokens``): the
        members of a speculating batch, or of any batch ending on EOS, finish at different steps,
        and each drain there costs about half a step. Without mixed steps the chain breaks for
        requests that wait while the batch and the KV pool have room for them
        (``Scheduler.can_admit``); with them, those prompts ride along in the chained step. It also
        breaks for a verify step the policy wants (unless it is chained into: ``_Chain.width``,
        ``_verifies_ahead``), or KV that cannot grow."""
        sched = self.scheduler
        mixed = prefill and sched.mixed_step_tokens is not None
        # Waiting requests stop an unmixed chain only while they could be admitted (and, with mixed
        # steps, are due): a full batch, or a full KV pool, must keep overlapping under load.
        if not mixed and (
            sched.admission_due() if sched.mixed_step_tokens is not None else sched.can_admit()
        ):
            return None
        live = [i for i, seq in enumerate(seqs) if not seq.is_finished]  # finished ones were retired
        # Every sequence decoding now is a member (part-prefilled ones go on with their chunks).
        decoding: set[int] = set()
        part_prefilled = False
        for s in sched.running:
            if mixed and s.is_prefilling:
                part_prefilled = True
            else:
                decoding.add(id(s))
        if len(decoding) != len(live) or decoding != {id(seqs[i]) for i in live}:
            return None  # requests joined (or left some other way): the scheduler decides
        keep = [i for i in live if seqs[i].remaining_tokens > ahead]  # the others may finish on commit
        if not keep or (not mixed and sched.waiting and len(keep) < len(seqs)):
            return None  # nothing left, or a member leaves and a waiting request can take its place
        members = seqs if len(keep) == len(seqs) else [seqs[i] for i in keep]
        leaving = len(live) - len(keep)
        prefill_now = mixed and (part_prefilled or sched.admission_due(leaving))
        # The policy sees the committed tokens, one behind the step it decides for, and prices the
        # token in flight: chain unless a verify step is expected to pay; otherwise drain and decide
        # afresh with that token. A step that prefills is plain (``Scheduler._schedule_mixed``).
        width = 1
        if plain is None:
            # With ``chain_into_verify`` the policy also says whether its width pays without a drain
            # deciding again with the token in flight (``final_ok``).
            if not prefill_now:
                final = self.chain_into_verify
                width = self.speculator.choose_width(members, not sched.waiting, ahead=True, final=final)
            plain = width == 1
        if not plain:
            if (
                self.speculator.final_ok
                and self._verifies_ahead(seqs, members, width)
                and sched.reserve_decode(members, width)
            ):
                return _Chain(keep, members, None, width)
            self.stats.policy_drains += 1
            self._policy_drained = True
        if plain and sched.reserve_decode(members, reserve):
            return _Chain(keep, members, leaving if prefill_now else None)
        return None

    def _verifies_ahead(self, seqs: list[Sequence], members: list[Sequence], width: int) -> bool:
        """Whether the verify step of ``width`` the policy wants for a batch in flight can be
        chained out of it (``_chain_into_verify``): on, every member goes on, the corpus is their
        only draft source (no grammar, external corpus or tree size of their own) and each tree
        stays inside the context (its root, the token in flight, sits at ``len(token_ids)``)."""
        ngram = self.ngram
        if not self.chain_into_verify or ngram is None or len(members) != len(seqs):
            return False
        return (
            all(s.grammar is None for s in members)  # (grammar drafts off: the corpus alone drafts)
            and ngram.proposer.corpus_only(members, width)
            and max(len(s.token_ids) for s in members) + width <= self.max_model_len
        )

    def _drain(self) -> None:
        """Commit the step in flight, if any (its forward and sampling are already queued)."""
        if self._in_flight is not None:
            flight, self._in_flight = self._in_flight, None
            if isinstance(flight, PendingDecode):
                self._commit_decode(flight)
            else:
                self._commit_verify(flight)

    def _commit_verify(self, pending: PendingVerify, chained: bool = False) -> None:
        """Wait for a verify step's result and commit each member's accepted run; the policy is
        taught the width it chose, at the cost of the trimmed trees it led to. ``chained``: a plain
        step launched after it writes its next root's KV, whose page stays."""
        t = time.perf_counter()
        result = pending.wait()
        self.stats.gap_start = now = time.perf_counter()
        self.read_wait = now - t
        emitted = commit_runs(
            result.seqs, result.runs, result.logprobs, self.blocks, result.width, keep_next=chained
        )
        self.stats.verify_steps += len(result.seqs)
        self.stats.verify_emitted += emitted
        self.stats.decode_tokens += emitted
        self._observe(len(result.seqs), result.chosen, result.launched, result=result)

    def _commit_decode(self, flight: PendingDecode, timed: bool = True) -> None:
        """Commit a plain, prefill or mixed step's tokens; a plain one is timed for the draft policy
        unless ``timed`` is off."""
        rows = flight.decode_rows
        if rows is not None:  # decode tokens only, not prompts' first ones (a member gone keeps none)
            self.stats.decode_tokens += sum(not s.is_finished for s in flight.seqs[:rows])
        appended = self._commit(flight)
        if rows is None:
            self.stats.decode_tokens += appended
        if rows is None and timed:
            self._observe(len(flight.seqs), 1, flight.launched, flight.restart)
        else:
            self._last_commit = time.perf_counter()

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> PendingDecode:
        """Grammar-mask and sample one token per sequence on the device; start reading them back."""
        return sample_plain(seqs, logits, self.grammar_rows, self.runner, self.replay, self._step_start)

    def _commit(self, flight: PendingDecode) -> int:
        """Wait for the sampled tokens and append one per sequence that is still running; returns
        how many were appended."""
        seqs = flight.seqs
        t = time.perf_counter()
        host = flight.read.wait()
        self.read_wait = time.perf_counter() - t
        logprobs = unpack_logprobs(seqs, host[1:], [1] * len(seqs))
        return commit_runs(seqs, [[token] for token in host[0].tolist()], logprobs, self.blocks)

    # --------------------------------------------------------------- outputs
    def _retire(self) -> None:
        """Release the KV pages and corpus match state of finished sequences."""
        done = self.scheduler.remove_finished()
        if done:
            self.speculator.on_finish(done)

    def _drop_finished_flight(self) -> None:
        """Forget the step in flight if every member finished while it ran (EOS, a stop, an abort):
        nothing of it is committed, and it must not wait for the next request to be drained, which
        would time the idle gap as its step. One with a live member stays (its commit skips the
        finished ones)."""
        if self._in_flight is not None and all(s.is_finished for s in self._in_flight.seqs):
            self._in_flight = None

    def _collect_outputs(self) -> list[RequestOutput]:
        self._retire()
        self._drop_finished_flight()
        outputs = collect_outputs(self.requests, self.stats)
        if not self.requests:
            self.stats.gap_start = None  # nothing left to launch: the device is done, not waiting
        return outputs

    def kv_usage(self) -> float:
        a = self.blocks.allocator
        return 1.0 - a.num_free / a.num_pages
