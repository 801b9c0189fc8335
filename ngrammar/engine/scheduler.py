"""Continuous batching: admission by free KV pages and a running cap, chunked prefill, preemption.

Each step is either a prefill step (new or preempted sequences, chunked to a token budget) or a
decode step over every running sequence; prefill goes first so new requests join quickly.
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


class Scheduler:
    def __init__(self, blocks: BlockManager, max_running: int, max_prefill_tokens: int) -> None:
        self.blocks = blocks
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.is_finished] + [s for s in self.waiting if s.is_finished]
        for seq in done:
            if seq.pages:
                self.blocks.release(seq)
        self.running = [s for s in self.running if not s.is_finished]
        self.waiting = deque(s for s in self.waiting if not s.is_finished)
        return done

    def schedule(self, decode_width: Callable[[list[Sequence]], int]) -> ScheduledBatch:
        batch = self._schedule_prefill()
        if batch.prefill or batch.failed:
            return batch
        batch = self._schedule_decode(decode_width)
        if batch.empty and len(self.running) > 1:
            # Partial prefills filled the pool and none can grow: requeue one so the rest can.
            batch.preempted.append(self._preempt(self.running.pop()))
        return batch

    def _schedule_prefill(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_prefill_tokens
        for seq in self.running:  # continue chunked prefills first
            if seq.is_prefilling and budget > 0:
                chunk = self._fit_chunk(seq, budget)
                if chunk:
                    batch.prefill.append((seq, chunk))
                    budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            chunk = self._fit_chunk(seq, budget) if self._resumable(seq) else 0
            if not chunk:
                if not self.running and not batch.prefill:
                    self.waiting.popleft()
                    batch.failed.append(seq)  # an empty pool cannot hold it: it never will
                    continue
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.prefill.append((seq, chunk))
            budget -= chunk
        return batch

    def can_admit(self) -> bool:
        """Whether scheduling now would admit the first waiting sequence (and so run a prefill)."""
        if not self.waiting or len(self.running) >= self.max_running:
            return False
        seq = self.waiting[0]
        return self._resumable(seq) and self.blocks.allocator.num_free > 0

    def _resumable(self, seq: Sequence) -> bool:
        """A preempted sequence comes back only when its whole context and its next token fit:
        re-admitted into just the pages it gave up, it would be recomputed and preempted again at
        every step until an older sequence freed a page."""
        return not seq.num_output_tokens or self.blocks.can_hold(seq, len(seq.token_ids))

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
