"""A sequence: one completion of a request, from prompt to finish, and its stop conditions."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from ngrammar.model.tokenizer import IncrementalDetokenizer, Tokenizer
from ngrammar.outputs import TokenLogprob
from ngrammar.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ngrammar.grammar import GrammarMatcher


GRAMMAR_DEAD_END = "the grammar allows no token after the output so far: no text can complete it"


class SequenceStatus(Enum):
    WAITING = auto()  # queued, or preempted and waiting to recompute its KV
    RUNNING = auto()  # holds KV pages; prefilling while num_cached < len(token_ids)
    FINISHED = auto()


class Sequence:
    """Token history, KV bookkeeping and stop state of one completion.

    Invariants: ``token_ids`` = prompt + output; ``num_cached`` tokens have KV in ``pages``; in
    decode, exactly the last token (the root of the next step) has no KV yet.
    """

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        seed: int,
        max_len: int,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.seq_id = f"{request_id}#{index}"
        self.prompt_token_ids = prompt_token_ids
        self._num_prompt = len(prompt_token_ids)  # (the properties below run per sequence per step)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.grammar = grammar
        # The context end: prompt + output never grow past it (plain decoding's RoPE table and KV
        # bound end there); reaching it finishes the sequence with "length", like max_tokens.
        self.max_len = max_len
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.request_error = (
            False  # the error is the request's own (its grammar's dead end), not the engine's
        )
        self.num_cached = 0
        self.pages: list[int] = []
        # Key ids of the leading pages that are full and registered in the prefix cache (shared
        # ones included), one per page, in order: the chain the next full page's key hangs off.
        self.page_key_ids: list[int] = []
        # Prompt tokens found in the prefix cache at first admission (None until admitted).
        self.cached_tokens: int | None = None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self._detok = IncrementalDetokenizer.after_prompt(tokenizer, len(prompt_token_ids))
        self._eos = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        self._stop_ids = frozenset(params.stop_token_ids)
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._cut_text: str | None = None  # the text up to a matched stop string, once one matched
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.spec_verify_steps = 0
        self.spec_accepted_tokens = 0  # tokens emitted by verify steps, bonus included
        self.spec_draft_tokens = 0  # draft nodes offered (D - 1 per verify step)

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self._num_prompt :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self._num_prompt

    @property
    def remaining_tokens(self) -> int:
        """Tokens the sequence may still emit before max_tokens or the context end stops it."""
        n = len(self.token_ids)
        return min(self.params.max_tokens - (n - self._num_prompt), self.max_len - n)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prefill_target(self) -> int:
        """Tokens whose KV prefill must compute: the whole prompt for a new sequence (its last
        logits give the first token); all but the last token for a preempted one being recomputed."""
        n = len(self.token_ids)
        return n if n == self._num_prompt else n - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.prefill_target

    @property
    def text(self) -> str:
        """The output text so far. Detokenized on demand: only stop strings need it every step, so
        requests without them (and every non-streaming request) pay the decode once per read."""
        if self._cut_text is not None:
            return self._cut_text
        if self._detok.read_offset < len(self.token_ids):
            self._detok.step(self.token_ids)
        return self._detok.text

    def visible_text(self) -> str:
        """Text safe to show now: while running, a possible stop-string prefix is held back."""
        if self.is_finished or not self._holdback:
            return self.text
        return self.text[: max(len(self.text) - self._holdback, 0)]

    def append_tokens(
        self, tokens: Seq[int], logprobs: Seq[TokenLogprob] | None = None, masked: bool = False
    ) -> int:
        """Append a run of sampled tokens, stopping exactly where plain decoding would.

        Returns how many were kept. Tokens after a stop condition (EOS, stop id, stop string,
        max_tokens, the context end, grammar termination) are dropped, as if they had never been sampled.
        ``masked``: each token was drawn under the grammar's bitmask for its own position (plain
        decoding), so the grammar takes it later (``GrammarMatcher.accept_masked``, see
        ``settle_grammar``); a verify step's run is checked token by token instead.
        """
        kept = 0
        for i, token in enumerate(tokens):
            if self.grammar is not None:
                if masked:
                    self.grammar.accept_masked(token)
                elif not self._grammar_accepts(token):
                    break
            self.token_ids.append(int(token))
            kept += 1
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(logprobs[i])
            if self._check_stop(int(token)):
                break
        return kept

    def settle_grammar(self) -> bool:
        """Let the grammar accept the tokens committed with ``masked``; False (and the sequence
        finished with an error) if it rejects one, which would be an engine bug: a grammar's dead end
        finishes the sequence before its token is drawn (``finish_at_dead_end``)."""
        if self.grammar is None:
            return True
        rejected = self.grammar.settle()
        if rejected is None:
            return True
        self.grammar_rejected(rejected)
        return False

    def grammar_rejected(self, token: int) -> None:
        """Settling found a committed ``token`` the grammar refuses: finish with an error."""
        self.finish("error", self._rejection(token))

    def _grammar_accepts(self, token: int) -> bool:
        assert self.grammar is not None
        if self.grammar.accept_token(token):
            return True
        self.finish("error", self._rejection(token))
        return False

    def _rejection(self, token: int) -> str:
        """Why the grammar refused ``token`` (its state is just before it): a grammar can reach a
        state no token continues (the regex ``a[^\\s\\S]`` after "a"), where every logit was masked."""
        assert self.grammar is not None
        if not self.grammar.is_terminated() and not self.grammar.allows_any_token():
            self.request_error = True
            return GRAMMAR_DEAD_END
        return f"grammar rejected sampled token {token}"

    def finish_at_dead_end(self) -> None:
        """The grammar allows no next token (its bitmask row is empty): finish before a token is
        drawn from an all-masked row (the request's error, not the engine's)."""
        self.request_error = True
        self.finish("error", GRAMMAR_DEAD_END)

    def _check_stop(self, token: int) -> bool:
        if token in self._eos or token in self._stop_ids:
            if token in self._stop_ids:  # its text is not part of the output (as in vLLM); its id is
                self._detok.step(self.token_ids[:-1])
                self._cut_text = self._detok.text
            return self.finish("stop")
        if self.params.stop:
            delta = self._detok.step(self.token_ids)
            if delta and self._check_stop_strings(len(delta)):
                return True
        if self.grammar is not None and self.grammar.is_terminated():
            return self.finish("stop")
        if self.remaining_tokens <= 0:
            return self.finish("length")
        return False

    def _check_stop_strings(self, delta_len: int) -> bool:
        text = self._detok.text
        window_start = max(len(text) - delta_len - self._holdback, 0)
        hits = [(i, s) for s in self.params.stop if (i := text.find(s, window_start)) >= 0]
        if not hits:
            return False
        self._cut_text = text[: min(i for i, _ in hits)]
        return self.finish("stop")

    def finish(self, reason: str, error: str | None = None) -> bool:
        if not self.is_finished:
            if self.grammar is not None and reason not in ("error", "abort"):
                # A final output must satisfy its grammar: tokens still deferred are checked now.
                rejected = self.grammar.settle()
                if rejected is not None:
                    reason, error = "error", self._rejection(rejected)
            self.status = SequenceStatus.FINISHED
            self.finish_reason = reason
            self.error = error
            self.finish_time = time.perf_counter()
        return True

    def metrics(self) -> dict[str, Any]:
        end = self.finish_time or time.perf_counter()
        m: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "e2e_latency_s": end - self.arrival_time,
            "cached_tokens": self.cached_tokens or 0,  # prompt tokens whose KV the prefix cache held
        }
        if self.first_token_time is not None:
            m["ttft_s"] = self.first_token_time - self.arrival_time
            # Absolute time.perf_counter() stamps, comparable across the requests of one process:
            # a batch's decode phase runs from its last first token to its last finish.
            m["first_token_time"] = self.first_token_time
            if self.finish_time is not None:
                m["finish_time"] = self.finish_time
            if self.num_output_tokens > 1:
                m["tpot_s"] = (end - self.first_token_time) / (self.num_output_tokens - 1)
        if self.spec_verify_steps:
            m["spec_verify_steps"] = self.spec_verify_steps
            m["spec_accept_length"] = self.spec_accepted_tokens / self.spec_verify_steps
            m["spec_accept_rate"] = (self.spec_accepted_tokens - self.spec_verify_steps) / max(
                self.spec_draft_tokens, 1
            )
        return m
