"""Continuous batching: admission by free KV pages and a running cap, chunked prefill, preemption,
prefix sharing and mixed steps.

Without mixed steps a step is either a prefill step (new or preempted sequences, chunked to a
token budget) or a decode step over every running sequence; prefill goes first so new requests
join quickly. With mixed steps (``mixed_step_tokens``) a step that has running sequences to decode
carries their decode tokens and, up to that many prompt tokens, prefill chunks of waiting or
partially prefilled ones, so streams keep their pace while long prompts prefill. Such a step is
plain (width 1): a tree verify step waits until no prefill is pending. Only when nothing is
decoding does a prefill step take the whole ``max_prefill_tokens``. Arriving prompts may wait up to
``prefill_wait_steps`` decode steps to share one mixed step (``admission_due``): on a GPU a mixed
step's eager attention launches cost the same for one prompt as for several.

Admission looks the prompt up in the prefix cache (``BlockManager.match``) and starts the sequence
on the shared pages; a sequence whose next page another running sequence is prefilling right now
(the ``n`` samples of a request, clients sending one system prompt at once) waits for it and then
shares it instead of computing it twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ngrammar.engine.block_manager import BlockManager
from ngrammar.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)
    decode: list[Sequence] = field(default_factory=list)
    width: int = 1  # tokens per decode sequence: 1 plain, D for a tree verify
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # could not fit even alone

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


def _plain(seqs: list[Sequence]) -> int:
    return 1


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_running: int,
        max_prefill_tokens: int,
        mixed_step_tokens: int | None = None,
        prefill_wait_steps: int = 0,
    ) -> None:
        self.blocks = blocks
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        # Token budget of a step that decodes running sequences and prefills others (None: no
        # mixed steps; a step either prefills or decodes).
        self.mixed_step_tokens = mixed_step_tokens
        self.prefill_wait_steps = prefill_wait_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._steps = 0  # engine steps so far (``tick``)
        self._wait_from: int | None = None  # the step since which an admissible prompt waits

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def tick(self) -> None:
        """An engine step begins (the clock of ``prefill_wait_steps``)."""
        self._steps += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.is_finished] + [s for s in self.waiting if s.is_finished]
        if not done:
            return done  # (called every step, twice when chained: no rebuild of the queues)
        for seq in done:
            if seq.pages:
                self.blocks.release(seq)
        self.running = [s for s in self.running if not s.is_finished]
        self.waiting = deque(s for s in self.waiting if not s.is_finished)
        return done

    def schedule(self, decode_width: Callable[[list[Sequence]], int]) -> ScheduledBatch:
        if self.blocks.prefix_cache:  # what the last step computed is findable before anyone looks
            for seq in self.running:
                self.blocks.register_full_pages(seq)
        if self.mixed_step_tokens is not None and any(not s.is_prefilling for s in self.running):
            return self._schedule_mixed(decode_width)
        batch = self._schedule_prefill(self.max_prefill_tokens)
        if batch.prefill or batch.failed:
            return batch
        batch = self._schedule_decode(decode_width)
        self._unblock(batch)
        return batch

    def _schedule_mixed(self, decode_width: Callable[[list[Sequence]], int]) -> ScheduledBatch:
        """Decode every running sequence (plainly while prefill is pending), then prefill chunks
        of up to ``mixed_step_tokens`` prompt tokens. Decoding reserves first: running sequences
        never give way to a prefill."""
        assert self.mixed_step_tokens is not None
        pending = any(s.is_prefilling for s in self.running) or self.admission_due()
        batch = self._schedule_decode(_plain if pending else decode_width)
        if pending and not batch.preempted:  # (the pool is short: no admissions this step)
            prefill = self._schedule_prefill(self.mixed_step_tokens)
            batch.prefill = prefill.prefill
            batch.failed += prefill.failed
        self._unblock(batch)
        return batch

    def chain_prefill(self, leaving: int) -> list[tuple[Sequence, int]]:
        """Prompt chunks for a mixed step chained behind the step in flight (overlap scheduling),
        whose decode rows' KV is reserved already: part-prefilled prompts first, then admissions,
        up to ``mixed_step_tokens`` tokens. ``leaving`` running sequences end with the token in
        flight: their places in the batch are taken now. Never preempts: where the pool is short
        it prefills less."""
        assert self.mixed_step_tokens is not None
        if self.blocks.prefix_cache:
            for seq in self.running:
                self.blocks.register_full_pages(seq)
        batch = self._schedule_prefill(self.mixed_step_tokens, leaving)
        assert not batch.failed  # (only a step with nothing running fails a prompt)
        return batch.prefill

    def _unblock(self, batch: ScheduledBatch) -> None:
        if batch.empty and len(self.running) > 1:
            # Partial prefills filled the pool and none can grow: requeue one so the rest can.
            batch.preempted.append(self._preempt(self.running.pop()))

    def _schedule_prefill(self, budget: int, leaving: int = 0) -> ScheduledBatch:
        """Prefill chunks within ``budget`` tokens (``leaving``: see ``chain_prefill``)."""
        batch = ScheduledBatch()
        cap = self.max_running + leaving
        for seq in self.running:  # continue chunked prefills first
            if seq.is_prefilling and budget > 0:
                chunk = self._fit_chunk(seq, budget)
                if chunk:
                    batch.prefill.append((seq, chunk))
                    budget -= chunk
        # Sequences prefilling now: few, so a waiting sequence is checked against them alone.
        prefilling = [s for s in self.running if s.is_prefilling] if self.blocks.prefix_cache else []
        i = 0
        deferred = False
        while i < len(self.waiting) and budget > 0 and len(self.running) < cap:
            seq = self.waiting[i]
            hit = self.blocks.match(seq)
            if self._deferred(seq, len(hit), prefilling):
                i += 1  # it shares that page once computed; later requests may go first
                deferred = True
                continue
            first = self._admit(seq, hit, budget)
            if first is None:
                if not self.running and not batch.prefill:
                    del self.waiting[i]
                    batch.failed.append(seq)  # an empty pool cannot hold it: it never will
                    continue
                break
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if first:  # 0: a preempted sequence whose whole context was still cached decodes next
                batch.prefill.append((seq, first))
                budget -= first
                if seq.is_prefilling and self.blocks.prefix_cache:
                    prefilling.append(seq)
        if not self.waiting:
            self._wait_from = None
        elif budget <= 0 or deferred:
            # A full step's leftovers, or a prompt waiting for a page another computes now (the
            # n samples of a request): due at once, not after another wait.
            self._wait_from = self._steps - self.prefill_wait_steps
        return batch

    def _admit(self, seq: Sequence, hit: list[int], budget: int) -> int | None:
        """Give ``seq`` its cached prefix ``hit`` and pages for its first chunk; the chunk length,
        or None (holding nothing) if it cannot start now."""
        if not self._resumable(seq, hit):
            return None
        self.blocks.acquire(seq, hit)
        chunk = self._fit_chunk(seq, budget)
        if not chunk and seq.is_prefilling:
            self.blocks.release(seq)
            return None
        self.blocks.count_hit(seq, len(hit))
        return chunk

    def _deferred(self, seq: Sequence, hit_pages: int, prefilling: list[Sequence]) -> bool:
        """Whether a running sequence of ``prefilling`` has yet to compute the page ``seq`` would
        compute next (the same tokens from the first on): ``seq`` waits and shares it rather than
        compute it too."""
        if not prefilling:
            return False
        end = (hit_pages + 1) * self.blocks.page_size
        if end > len(seq.token_ids) - 1:  # no further full page it could share (``match``'s limit)
            return False
        head = seq.token_ids[:end]
        return any(
            other.num_cached < end <= len(other.token_ids) and other.token_ids[:end] == head
            for other in prefilling
        )

    def admission_due(self, leaving: int = 0) -> bool:
        """Whether a mixed step should admit waiting prompts now: one is admissible
        (``can_admit``) and has waited ``prefill_wait_steps`` steps, or the waiting prompts fill a
        mixed step's budget. Admissions left over by a full step are due at once."""
        if not self.can_admit(leaving):
            self._wait_from = None
            return False
        if self._wait_from is None:
            self._wait_from = self._steps
        if self._steps - self._wait_from >= self.prefill_wait_steps:
            return True
        budget = self.mixed_step_tokens or self.max_prefill_tokens
        waiting = 0
        for seq in self.waiting:
            waiting += len(seq.token_ids)
            if waiting >= budget:
                return True
        return False

    def can_admit(self, leaving: int = 0) -> bool:
        """Whether scheduling now would admit the first waiting sequence (and so run a prefill);
        ``leaving``: see ``chain_prefill``."""
        if not self.waiting or len(self.running) >= self.max_running + leaving:
            return False
        seq = self.waiting[0]
        hit = self.blocks.match(seq) if seq.num_output_tokens else []
        return self._resumable(seq, hit) and self.blocks.allocator.num_free > 0

    def _resumable(self, seq: Sequence, hit: list[int]) -> bool:
        """A preempted sequence comes back only when its whole context and its next token fit
        (``hit``: its pages still in the prefix cache): re-admitted into just the pages it gave up,
        it would be recomputed and preempted again at every step until an older sequence freed a
        page."""
        if not seq.num_output_tokens:
            return True
        need = -(-len(seq.token_ids) // self.blocks.page_size) - len(hit)
        return need <= self.blocks.allocator.num_free - self.blocks.evictable_pages(hit)

    def _fit_chunk(self, seq: Sequence, budget: int) -> int:
        """Largest chunk (<= budget) of seq's remaining prefill whose pages can be reserved now."""
        free_tokens = (
            len(seq.pages) + self.blocks.allocator.num_free
        ) * self.blocks.page_size - seq.num_cached
        chunk = min(seq.prefill_target - seq.num_cached, budget, free_tokens)
        if chunk <= 0:
            return 0
        self.blocks.reserve(seq, seq.num_cached + chunk)
        return chunk

    def _schedule_decode(self, decode_width: Callable[[list[Sequence]], int]) -> ScheduledBatch:
        batch = ScheduledBatch()
        decoding = [s for s in self.running if not s.is_prefilling]
        width = decode_width(decoding)
        if width > 1 and not self._fits(decoding, width):
            # A verify step's extra KV must not cost a preemption, or fail a request that a plain
            # step has room for: decode plainly (which preempts only what plain decoding would).
            width = 1
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.is_prefilling:
                i += 1
                continue
            need = seq.num_cached + width
            while not self.blocks.can_hold(seq, need) and self.running[-1] is not seq:
                batch.preempted.append(self._preempt(self.running.pop()))
            if not self.blocks.can_hold(seq, need):
                self.running.pop()  # seq, the newest now: older sequences hold the pages it needs
                if self.running:
                    batch.preempted.append(self._preempt(seq))  # it recomputes once they are freed
                else:
                    self.blocks.release(seq)  # it leaves running here, so remove_finished never sees it
                    batch.failed.append(seq)  # alone, the whole pool cannot hold it
                continue
            self.blocks.reserve(seq, need)
            i += 1
        batch.decode = [s for s in self.running if not s.is_prefilling]
        batch.width = width
        return batch

    def reserve_decode(self, seqs: list[Sequence], width: int) -> bool:
        """Reserve KV for one more decode step of ``seqs`` without preempting anyone (overlap
        scheduling chains a step this way); False, reserving nothing, if some cannot grow."""
        if not self._fits(seqs, width):
            return False
        for seq in seqs:
            self.blocks.reserve(seq, seq.num_cached + width)
        return True

    def _fits(self, seqs: list[Sequence], width: int) -> bool:
        """Whether the free pages can hold ``width`` more tokens for every one of ``seqs``."""
        blocks = self.blocks
        return sum(blocks.pages_needed(s, s.num_cached + width) for s in seqs) <= blocks.allocator.num_free

    def _preempt(self, seq: Sequence) -> Sequence:
        """Free a sequence's KV and requeue it first; it recomputes its prefix later."""
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        return seq
