"""The prefix cache's page accounting under every way a sequence comes and goes (no model).

A hypothesis state machine drives the real ``Scheduler`` / ``BlockManager`` / ``PageAllocator``
through add / step (prefill, plain or tree-verify decode, mixed) / finish / abort / preempt /
evict, and simulates the KV a forward writes: every slot holds the token whose KV it is. After
every rule: reference counts equal readers, ``check_integrity`` holds, no forward wrote a page
another sequence reads, and every running sequence's cached KV is its own tokens'.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ngrammar.engine.block_manager import BlockManager, PageAllocator
from ngrammar.engine.scheduler import Scheduler
from ngrammar.engine.sequence import Sequence, SequenceStatus
from ngrammar.model.tokenizer import Tokenizer
from ngrammar.sampling_params import SamplingParams

PAGE = 4
PAGES = 24
# Prompts drawn from a few shared stems, so prefixes collide page-aligned and not.
STEMS = [[7] * 9, list(range(10, 23)), [5, 6] * 5]


class PrefixCacheMachine(RuleBasedStateMachine):
    tokenizer: Tokenizer

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(PAGES, PAGE)
        self.seqs: list[Sequence] = []
        self.kv: dict[int, int] = {}  # slot -> token whose KV it holds
        self.rng = random.Random(0)

    @initialize(mixed=st.booleans(), cache=st.booleans())
    def setup(self, mixed: bool, cache: bool) -> None:
        self.blocks = BlockManager(self.alloc, prefix_cache=cache)
        self.sched = Scheduler(
            self.blocks, max_running=5, max_prefill_tokens=12, mixed_step_tokens=8 if mixed else None
        )

    # ---------------------------------------------------------------- rules
    @rule(
        stem=st.integers(0, len(STEMS) - 1),
        tail=st.lists(st.integers(30, 33), max_size=6),
        n=st.integers(1, 2),
    )
    def add(self, stem: int, tail: list[int], n: int) -> None:
        prompt = STEMS[stem] + tail
        params = SamplingParams(max_tokens=40, ignore_eos=True, n=n)
        for i in range(n):
            seq = Sequence(f"r{len(self.seqs)}", i, prompt, params, self.tokenizer, seed=i, max_len=64)
            self.seqs.append(seq)
            self.sched.add(seq)

    @rule(width=st.sampled_from([1, 1, 3]), accept=st.integers(0, 2))
    def step(self, width: int, accept: int) -> None:
        batch = self.sched.schedule(lambda seqs: width)
        for seq in batch.failed:
            seq.finish("error")
        for seq, n in batch.prefill:
            self._write(seq, range(seq.num_cached, seq.num_cached + n), seq.token_ids)
            seq.num_cached += n
            if seq.num_cached == len(seq.token_ids):
                seq.append_tokens([40 + self.rng.randrange(3)])
        w = batch.width
        for seq in batch.decode:
            start = seq.num_cached
            if w == 1:
                self._write(seq, [start], seq.token_ids)
                seq.num_cached += 1
                seq.append_tokens([40 + self.rng.randrange(3)])
                continue
            # Tree verify: w nodes at kv start..start+w-1 (drafts: junk tokens), then the accepted
            # path's KV compacted next to the prefix, the rest of the tail trimmed.
            run = [40 + self.rng.randrange(3) for _ in range(min(accept, w - 1) + 1)]
            drafts = [seq.token_ids[-1]] + [99] * (w - 1)
            self._write(seq, range(start, start + w), [0] * start + drafts)
            kept = seq.append_tokens(run)
            self._write(seq, range(start + 1, start + kept), seq.token_ids)  # compaction
            seq.num_cached = start + max(kept, 1)
            self.blocks.trim(seq, seq.num_cached)
        self.sched.remove_finished()

    @precondition(lambda self: self.sched.mixed_step_tokens is not None)
    @rule(leaving=st.integers(0, 2))
    def chained_mixed_step(self, leaving: int) -> None:
        """A mixed step chained behind a plain step in flight (overlap scheduling), in the engine's
        order: the step in flight has written its KV and holds its tokens; the members that do not
        end with that token reserve KV without preempting, ``chain_prefill`` admits behind them (the
        ``leaving`` ones' places taken at once), the tokens in flight are committed (the leaving
        members finish), then the chained step writes its rows."""
        decoding = [s for s in self.sched.running if not s.is_prefilling]
        if not decoding or not self.sched.reserve_decode(decoding, 1):
            return
        for seq in decoding:  # the step in flight
            self._write(seq, [seq.num_cached], seq.token_ids)
            seq.num_cached += 1
        leaving = min(leaving, len(decoding))
        members = decoding[leaving:]
        chunks = self.sched.chain_prefill(leaving) if self.sched.reserve_decode(members, 1) else []
        for seq in decoding:  # its commit
            seq.append_tokens([40 + self.rng.randrange(3)])
        for seq in decoding[:leaving]:
            seq.finish("length")
        for seq in members if chunks else []:  # the chained step (a plain one is the next rule's)
            self._write(seq, [seq.num_cached], seq.token_ids)
            seq.num_cached += 1
            seq.append_tokens([40 + self.rng.randrange(3)])
        for seq, n in chunks:
            self._write(seq, range(seq.num_cached, seq.num_cached + n), seq.token_ids)
            seq.num_cached += n
            if seq.num_cached == len(seq.token_ids):
                seq.append_tokens([40 + self.rng.randrange(3)])
        self.sched.remove_finished()

    @precondition(lambda self: self.sched.running)
    @rule(i=st.integers(0, 10))
    def finish(self, i: int) -> None:
        self.sched.running[i % len(self.sched.running)].finish("stop")
        self.sched.remove_finished()

    @precondition(lambda self: any(not s.is_finished for s in self.seqs))
    @rule(i=st.integers(0, 100))
    def abort(self, i: int) -> None:
        live = [s for s in self.seqs if not s.is_finished]
        live[i % len(live)].finish("abort")
        self.sched.remove_finished()

    @precondition(lambda self: self.sched.running)
    @rule()
    def preempt(self) -> None:
        self.sched._preempt(self.sched.running.pop())

    @rule()
    def evict(self) -> None:
        self.alloc.evict_all()
        assert self.alloc.num_cached == 0

    # ----------------------------------------------------------- invariants
    @invariant()
    def refcounts_are_readers(self) -> None:
        readers = [0] * PAGES
        for seq in self.seqs:
            assert not (seq.is_finished and seq.pages), "a finished sequence kept pages"
            for p in seq.pages:
                readers[p] += 1
        assert readers == self.alloc.refcount
        self.alloc.check_integrity()
        assert len(self.sched.running) <= self.sched.max_running

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        for seq in self.sched.running:
            assert seq.status is SequenceStatus.RUNNING
            for i in range(min(seq.num_cached, len(seq.token_ids))):
                assert self.kv[self._slot(seq, i)] == seq.token_ids[i], (seq.seq_id, i)

    def teardown(self) -> None:
        for seq in self.seqs:
            seq.finish("abort")
        self.sched.remove_finished()
        assert self.alloc.num_used == 0  # every page free or cached
        self.alloc.check_integrity()
        self.alloc.evict_all()
        assert self.alloc.num_free == PAGES and not self.alloc._page_of

    # -------------------------------------------------------------- helpers
    def _slot(self, seq: Sequence, i: int) -> int:
        return seq.pages[i // PAGE] * PAGE + i % PAGE

    def _write(self, seq: Sequence, positions: range | list[int], tokens: list[int]) -> None:
        for i in positions:
            page = seq.pages[i // PAGE]
            assert self.alloc.refcount[page] == 1, f"{seq.seq_id} writes page {page}, which others read"
            self.kv[self._slot(seq, i)] = tokens[i]


def test_prefix_cache_state_machine(tokenizer: Tokenizer) -> None:
    PrefixCacheMachine.tokenizer = tokenizer
    run_state_machine_as_test(
        PrefixCacheMachine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None)
    )


def test_pages_are_shared_by_content_and_evicted_lru(tokenizer: Tokenizer) -> None:
    alloc = PageAllocator(8, PAGE)
    blocks = BlockManager(alloc, prefix_cache=True)
    params = SamplingParams(max_tokens=4)
    a = Sequence("a", 0, list(range(11)), params, tokenizer, seed=0, max_len=64)
    blocks.reserve(a, 11)
    a.num_cached = 11
    blocks.register_full_pages(a)  # 2 full pages (8 tokens); the third, partial, is never shared
    assert len(a.page_key_ids) == 2
    b = Sequence("b", 0, list(range(9)) + [50, 51], params, tokenizer, seed=0, max_len=64)
    hit = blocks.match(b)
    assert hit == a.pages[:2]
    blocks.acquire(b, hit)
    assert b.num_cached == 8 and [alloc.refcount[p] for p in hit] == [2, 2]
    c = Sequence("c", 0, list(range(8)), params, tokenizer, seed=0, max_len=64)
    assert blocks.match(c) == a.pages[:1]  # a page-aligned prompt recomputes its last page
    blocks.release(a)
    blocks.release(b)
    assert alloc.num_cached == 2 and alloc.num_used == 0
    d = Sequence("d", 0, [9] * 30, params, tokenizer, seed=0, max_len=64)
    blocks.reserve(d, 30)  # 8 pages: both cached ones are evicted for it
    assert alloc.evictions == 2 and blocks.match(b) == []
    with pytest.raises(ValueError, match="double free"):
        alloc.free([hit[0]] * 2)


def test_a_full_batch_leaves_a_mixed_step_its_prompt_budget(tokenizer: Tokenizer) -> None:
    """A mixed step prefills up to ``mixed_step_tokens`` prompt tokens beside its decode rows
    (a budget shared with them left a batch as large as the budget one page per step, so
    admissions fell behind arrivals and the batch shrank); a chained one alike."""
    blocks = BlockManager(PageAllocator(64, PAGE), prefix_cache=False)
    sched = Scheduler(blocks, max_running=16, max_prefill_tokens=16, mixed_step_tokens=8)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(8):
        sched.add(Sequence(f"d{i}", 0, [7, 8], params, tokenizer, seed=0, max_len=64))
    sched.schedule(lambda seqs: 1)  # prefill: all eight prompts
    for seq in sched.running:
        seq.num_cached = 2
        seq.append_tokens([40])
    for i in range(3):
        sched.add(Sequence(f"p{i}", 0, list(range(10, 16)), params, tokenizer, seed=0, max_len=64))
    batch = sched.schedule(lambda seqs: 1)
    assert len(batch.decode) == 8 and [n for _, n in batch.prefill] == [6, 2]
    for seq, n in batch.prefill:
        seq.num_cached += n
    assert [n for _, n in sched.chain_prefill(leaving=0)] == [4, 4]  # p1's rest, then p2 in part


def test_arriving_prompts_wait_to_share_a_mixed_step(tokenizer: Tokenizer) -> None:
    """With ``prefill_wait_steps`` an admissible prompt waits up to that many steps for others to
    share its mixed step; prompts that fill the step's budget, and what a full step left over, go at
    once; with 0 (a CPU's default) every admissible prompt goes at once."""
    blocks = BlockManager(PageAllocator(64, PAGE), prefix_cache=False)
    sched = Scheduler(
        blocks, max_running=16, max_prefill_tokens=16, mixed_step_tokens=8, prefill_wait_steps=2
    )
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    sched.add(Sequence("d", 0, [7, 8], params, tokenizer, seed=0, max_len=64))
    sched.tick()
    sched.schedule(lambda seqs: 1)  # nothing decodes: a prefill step takes it at once
    decoding = sched.running[0]
    decoding.num_cached = 2
    decoding.append_tokens([40])

    def step() -> list[int]:
        sched.tick()
        batch = sched.schedule(lambda seqs: 1)
        for seq, n in batch.prefill:
            seq.num_cached += n
        return [n for _, n in batch.prefill]

    sched.add(Sequence("a", 0, [1, 2, 3], params, tokenizer, seed=0, max_len=64))
    assert [step(), step(), step()] == [[], [], [3]]  # waited two steps, then shared nothing
    sched.add(Sequence("b", 0, [1, 2, 3, 4, 5], params, tokenizer, seed=0, max_len=64))
    sched.add(Sequence("c", 0, [1, 2, 3, 4, 5, 6, 7], params, tokenizer, seed=0, max_len=64))
    assert step() == [5, 3]  # together they fill the budget (8): due at once
    sched.add(Sequence("e", 0, [9, 9, 9], params, tokenizer, seed=0, max_len=64))
    assert step() == [4, 3]  # c's rest, and e rides along the step that is mixed anyway
    sched.add(Sequence("g", 0, list(range(20, 31)), params, tokenizer, seed=0, max_len=64))
    sched.add(Sequence("h", 0, [6, 6], params, tokenizer, seed=0, max_len=64))
    assert step() == [8]  # g's first chunk fills the step ...
    assert step() == [3, 2]  # ... and its leftovers go at once: g's rest, then h, not after a wait
    sched.prefill_wait_steps = 0
    sched.add(Sequence("f", 0, [5, 5], params, tokenizer, seed=0, max_len=64))
    assert step() == [2]
