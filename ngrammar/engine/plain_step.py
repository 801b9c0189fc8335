"""A plain (one token per sequence) step's pieces: its inputs, its sampling, and the one commit
path that plain tokens and verified runs share."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from ngrammar.engine.block_manager import BlockManager
from ngrammar.engine.grammar_rows import GrammarRows
from ngrammar.engine.logprobs import logprob_tensors
from ngrammar.engine.sequence import Sequence
from ngrammar.outputs import TokenLogprob
from ngrammar.runner.model_runner import ModelRunner, PendingRead, StepInput
from ngrammar.runner.sampler import SamplingTensors, sample
from ngrammar.runner.transfer import to_device
from ngrammar.speculative.replay import ReplayTarget


@dataclass
class PendingDecode:
    """A plain decode step sampled on the device whose tokens are not committed yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [B] int64 on the device: each sequence's sampled token
    read: PendingRead  # the tokens (and logprob tensors) on their way to the host
    launched: float  # perf_counter() at the start of the engine step that launched it
    # The first plain step after a verify step (overlap): the verify engine step's host time after
    # its commit, which the device sat idle through (``LLMEngine._run_decode``); None otherwise.
    restart: float | None = None
    # Sampled by a prefill or mixed step: its first ``decode_rows`` rows decode (the rest are first
    # tokens of prompts); not a plain step's time for the draft policy. None: a plain step.
    decode_rows: int | None = None


def decode_input(seqs: list[Sequence], input_ids: torch.Tensor | None) -> StepInput:
    """A plain decode step's input; ``input_ids`` [B] (device): tokens not read back yet."""
    return StepInput(
        [[0] if input_ids is not None else [s.token_ids[-1]] for s in seqs],
        [[s.num_cached] for s in seqs],
        [s.num_cached for s in seqs],
        [s.pages for s in seqs],
        list(range(len(seqs))),
        input_ids=input_ids,
    )


def prefill_input(
    chunks: list[tuple[Sequence, int]],
    decode: Seq[Sequence],
    decode_ids: torch.Tensor | None = None,
) -> tuple[StepInput, list[Sequence]]:
    """A prefill (or mixed) step's input: the decode sequences' one token each first, then the
    prefill chunks; and the sequences a token is sampled for, in the order of their logits rows
    (every decode sequence, and every sequence whose prompt the step completes). ``decode_ids``
    ([len(decode)] int64, device): the decode rows' tokens, still in flight (a chained mixed
    step); the step's packed ids are then built on the device."""
    tokens = [[0] if decode_ids is not None else [s.token_ids[-1]] for s in decode]
    positions = [[s.num_cached] for s in decode]
    rows = list(range(len(decode)))
    sampled = list(decode)
    offset = len(decode)
    for seq, n in chunks:
        lo = seq.num_cached
        tokens.append(seq.token_ids[lo : lo + n])
        positions.append(list(range(lo, lo + n)))
        offset += n
        if lo + n == len(seq.token_ids):  # the final chunk of a new sequence: sample its first token
            rows.append(offset - 1)
            sampled.append(seq)
    members = [*decode, *(s for s, _ in chunks)]
    input_ids = None
    if decode_ids is not None:
        prompt_ids = to_device(
            [t for toks in tokens[len(decode) :] for t in toks], torch.int64, decode_ids.device
        )
        input_ids = torch.cat([decode_ids, prompt_ids])
    step = StepInput(
        tokens,
        positions,
        [s.num_cached for s in members],
        [s.pages for s in members],
        rows or [0],
        input_ids=input_ids,
    )
    return step, sampled


def sample_plain(
    seqs: list[Sequence],
    logits: torch.Tensor,
    grammar_rows: GrammarRows,
    runner: ModelRunner,
    replay: ReplayTarget | None,
    launched: float,
) -> PendingDecode:
    """Grammar-mask and sample one token per sequence on the device (logits [B, V]); start reading
    them back."""
    if replay is not None:  # row i is sequence i's last token, at position num_cached - 1
        replay.apply(logits, [replay.targets(s.prompt_token_ids, [s.num_cached - 1])[0] for s in seqs])
    grammar_rows.apply_plain(seqs, logits)
    if all(s.params.greedy for s in seqs):
        tokens = logits.argmax(dim=-1)  # no per-row parameters to copy in
    else:
        params = [s.params for s in seqs]
        st = SamplingTensors.build(
            params, [s.seed for s in seqs], [len(s.token_ids) for s in seqs], logits.device
        )
        tokens = sample(logits, st)
    lp: list[torch.Tensor] = []
    if any(s.params.logprobs is not None for s in seqs):
        rows = torch.arange(len(seqs), device=logits.device)[:, None]
        lp = logprob_tensors(seqs, logits, rows, tokens[:, None])
    return PendingDecode(seqs, tokens, runner.to_host_async(tokens, *lp), launched)


def commit_runs(
    seqs: list[Sequence],
    runs: list[list[int]],
    logprobs: list[list[TokenLogprob]] | None,
    blocks: BlockManager,
    verify_width: int | None = None,
    keep_next: bool = False,
) -> int:
    """Append each member's run (plain: its one sampled token; a verify step of ``verify_width``
    nodes: its accepted drafts and bonus), cut where a stop condition holds; returns the tokens
    appended.

    A member that finished while its step was in flight (EOS, a stop string, an abort, a grammar
    that failed to settle) keeps nothing. A plain token was drawn under its own grammar row, so the
    grammar takes it later (``masked``); a verified run is checked token by token. A verify step
    keeps the KV of the root and of all but the last kept token (the accepted paths' KV was moved
    in place on the device), the last kept token being the next root, and releases its pages past
    that (``keep_next``: past the next root's, which a step chained out of it is writing)."""
    appended = 0
    for b, seq in enumerate(seqs):
        if seq.is_finished:
            continue
        lp = None if logprobs is None else logprobs[b]
        start = seq.num_cached
        kept = seq.append_tokens(runs[b], lp, masked=verify_width is None)
        appended += kept
        if verify_width is not None:
            seq.num_cached = start + max(kept, 1)
            seq.spec_verify_steps += 1
            seq.spec_accepted_tokens += kept
            seq.spec_draft_tokens += verify_width - 1
            blocks.trim(seq, seq.num_cached + keep_next)  # the KV move is queued already
    return appended
