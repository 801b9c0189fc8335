"""The grammar fill pool: rows filled in chunks on threads equal rows filled one by one, bit for bit."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngrammar.grammar import GrammarBackend, GrammarMatcher, GrammarSpec, allocate_bitmask, build_tree_bitmask
from ngrammar.grammar.fill_pool import GrammarFillPool, fill_threads
from ngrammar.model.tokenizer import Tokenizer
from tests.tree_oracles import links_from_parents

VOCAB = 49152
EOS = 2

SPECS = [
    GrammarSpec(
        "json_schema",
        '{"type":"object","properties":{"name":{"type":"string","maxLength":6},"n":{"type":"integer"},'
        '"ok":{"type":"boolean"}},"required":["name","n","ok"],"additionalProperties":false}',
    ),
    GrammarSpec("json_schema", '{"type":"array","items":{"enum":["red","green","blue"]},"maxItems":3}'),
    GrammarSpec("regex", r"(INFO|WARN) [a-z]{1,5}\n"),
    GrammarSpec("regex", r"\d{1,4}(\.\d{1,2})?"),
    GrammarSpec("ebnf", 'root ::= "yes" | "no" | "maybe " [0-9]'),
    GrammarSpec("json_object", ""),
]


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> Iterator[GrammarBackend]:
    b = GrammarBackend(tokenizer, VOCAB)
    yield b
    b.close()


@pytest.fixture(scope="module")
def compiled(backend: GrammarBackend) -> list[xgr.CompiledGrammar]:
    return [backend.compile(spec) for spec in SPECS]


@pytest.fixture(scope="module", params=["threads", "one-call"])
def pool(request: pytest.FixtureRequest) -> Iterator[GrammarFillPool]:
    """Chunks on two threads plus the caller's even for one matcher, or always one batched call."""
    p = (
        GrammarFillPool(threads=2, serial_below=0)
        if request.param == "threads"
        else GrammarFillPool(threads=0)
    )
    yield p
    p.close()


class Request:
    """One request walked twice: ``pooled`` as the engine does (deferred tokens, pool fills) and
    ``serial``, a bare xgrammar matcher filled row by row (the reference)."""

    def __init__(self, backend: GrammarBackend, grammar: xgr.CompiledGrammar) -> None:
        self.pooled = backend.new_matcher(grammar)
        self.serial = xgr.GrammarMatcher(grammar)

    def reference_row(self) -> np.ndarray:
        row = allocate_bitmask(1, VOCAB)
        self.serial.fill_next_token_bitmask(row, 0)
        return row.numpy()[0]


def _allowed(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(st.tuples(st.integers(0, len(SPECS) - 1), st.integers(0, 6)), min_size=1, max_size=40),
    seed=st.integers(0, 2**16),
    spare=st.integers(0, 3),
)
def test_pool_rows_equal_serial_rows(
    backend: GrammarBackend,
    compiled: list[xgr.CompiledGrammar],
    pool: GrammarFillPool,
    arrivals: list[tuple[int, int]],
    seed: int,
    spare: int,
) -> None:
    """Requests arrive mid-flight (grammar, step), take random allowed tokens and leave when their
    grammar terminates; each step the batch's rows, at shuffled positions among rows without a
    grammar, equal the serial fills, and rows without a grammar are left alone."""
    rng = random.Random(seed)
    live: list[Request] = []
    pending = sorted(arrivals, key=lambda a: a[1])
    for step in range(12):
        while pending and pending[0][1] <= step:
            live.append(Request(backend, compiled[pending.pop(0)[0]]))
        if not live:
            continue
        rows = rng.sample(range(len(live) + spare), len(live))
        bitmask = allocate_bitmask(len(live) + spare, VOCAB)
        bitmask.fill_(7)
        outcome = pool.fill_rows([r.pooled for r in live], rows, bitmask)
        assert not outcome.rejected and not outcome.dead
        words = bitmask.numpy()
        for r, row in zip(live, rows):
            assert np.array_equal(words[row], r.reference_row())
        assert (np.delete(words, rows, axis=0) == 7).all()
        for r, row in zip(live, rows):  # a random allowed token; EOS (where allowed) ends the request
            token = int(rng.choice(_allowed(words[row])))
            r.pooled.accept_masked(token)
            assert r.serial.accept_token(token)
        live = [r for r in live if not r.pooled.is_terminated()]


def test_pool_reports_rejected_tokens_and_dead_ends(backend: GrammarBackend, pool: GrammarFillPool) -> None:
    """A refused deferred token and a dead end are reported for their own row only."""
    dead_end = backend.compile(GrammarSpec("regex", r"a[^\s\S]"))
    digits = backend.compile(GrammarSpec("regex", r"\d{3}"))
    matchers = [backend.new_matcher(g) for g in (digits, dead_end, digits, digits)]
    a_token = int(
        np.flatnonzero(np.unpackbits(backend.start_row(dead_end).view(np.uint8), bitorder="little"))[0]
    )
    matchers[1].accept_masked(a_token)  # "a": nothing may follow
    matchers[2].accept_masked(EOS)  # not allowed before three digits
    bitmask = allocate_bitmask(4, VOCAB)
    outcome = pool.fill_rows(matchers, [0, 1, 2, 3], bitmask)
    assert outcome.rejected == [(2, EOS)]
    assert outcome.dead == [1]
    assert (bitmask[2] == -1).all()  # the refused request's row allows everything
    assert torch.equal(bitmask[0], bitmask[3])


def test_pool_settles_every_kind_of_deferred_state(
    backend: GrammarBackend, compiled: list[xgr.CompiledGrammar], pool: GrammarFillPool, tokenizer: Tokenizer
) -> None:
    """Matchers at the start, with one deferred token, with nothing deferred past the start, with
    several deferred tokens or with a refused token (alone, among several, past the vocabulary),
    at rows in another order: each row equals a bare matcher's fill, a refused one allows
    everything, and each wrapper's own state (its depth: the start row or a fill) agrees."""
    schema = compiled[0]
    text = tokenizer.encode('{"name": "ab", "n": 12, "ok": true}')
    eos_first = [EOS, *text[1:]]
    walks = [  # (tokens accepted now, tokens deferred)
        ([], []),  # at the start
        ([], text[:1]),  # one deferred token
        (text[:3], []),  # nothing deferred, past the start
        ([], text[:4]),  # several deferred
        (text[:2], text[2:3]),  # one deferred after accepted ones
        ([], [EOS]),  # one refused token
        ([], eos_first[:3]),  # a refused token among several
        (text[:1], [VOCAB + 5]),  # a token past the vocabulary
    ]
    matchers, references = [], []
    for accepted, deferred in walks:
        m = backend.new_matcher(schema)
        reference = xgr.GrammarMatcher(schema)
        for t in accepted:
            assert m.accept_token(t) and reference.accept_token(t)
        for t in deferred:
            m.accept_masked(t)
        refused = next((t for t in deferred if not (0 <= t < VOCAB and reference.accept_token(t))), None)
        matchers.append(m)
        references.append((reference, refused))
    rows = list(range(len(walks)))[::-1]
    bitmask = allocate_bitmask(len(walks), VOCAB)
    bitmask.fill_(7)
    outcome = pool.fill_rows(matchers, rows, bitmask)
    assert outcome.rejected == [(i, r) for i, (_, r) in enumerate(references) if r is not None]
    assert outcome.dead == []
    for m, row, (reference, refused) in zip(matchers, rows, references):
        want = allocate_bitmask(1, VOCAB)
        if refused is None:
            reference.fill_next_token_bitmask(want, 0)
        assert torch.equal(bitmask[row], want[0])
        assert not m.is_terminated()
        m.fill_bitmask(want, 0)  # the wrapper's own state: its row, from its depth
        if refused is None:
            assert torch.equal(bitmask[row], want[0])


def test_start_row_is_filled_once_and_equals_a_fresh_fill(
    backend: GrammarBackend, compiled: list[xgr.CompiledGrammar], tokenizer: Tokenizer
) -> None:
    for grammar in compiled:
        reference = allocate_bitmask(1, VOCAB)
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(reference, 0)
        assert np.array_equal(backend.start_row(grammar), reference.numpy()[0])
        assert backend.start_row(grammar) is backend.start_row(grammar)
    matcher = backend.new_matcher(compiled[0])
    assert matcher.start_row() is not None
    assert matcher.accept_token(tokenizer.encode("{")[0])
    assert matcher.start_row() is None
    matcher.rollback(1)
    assert matcher.start_row() is not None  # back at the start: the cached row serves again


def _random_tree(matcher: GrammarMatcher, d: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Parents and tokens of a BFS-ordered D-node tree: mostly allowed tokens, some random."""
    parents, tokens = [-1], [0]
    for parent in sorted(rng.randrange(i) for i in range(1, d)):
        path, walk = [], parent
        while walk > 0:
            path.append(tokens[walk])
            walk = parents[walk]
        took = sum(matcher.accept_token(t) for t in reversed(path))
        row = allocate_bitmask(1, VOCAB)
        if took == len(path) and not matcher.is_terminated():
            matcher.fill_bitmask(row, 0)
        allowed = _allowed(row.numpy()[0])
        matcher.rollback(took)
        token = int(rng.choice(allowed)) if rng.random() < 0.8 else rng.randrange(VOCAB)
        parents.append(parent)
        tokens.append(token)
    return parents, tokens


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    grammars=st.lists(st.one_of(st.none(), st.integers(0, len(SPECS) - 1)), min_size=1, max_size=9),
    d=st.sampled_from([1, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_pool_tree_masks_equal_serial_tree_masks(
    backend: GrammarBackend,
    compiled: list[xgr.CompiledGrammar],
    pool: GrammarFillPool,
    grammars: list[int | None],
    d: int,
    seed: int,
) -> None:
    rng = random.Random(seed)
    matchers = [None if g is None else backend.new_matcher(compiled[g]) for g in grammars]
    trees = []
    for m in matchers:
        parents = [-1] + sorted(rng.randrange(i) for i in range(1, d))
        tokens = [0] + [rng.randrange(VOCAB) for _ in range(1, d)]
        trees.append((parents, tokens) if m is None else _random_tree(m, d, rng))
    links = [links_from_parents(p) for p, _ in trees]
    nxt = torch.tensor([n for n, _ in links])
    sib = torch.tensor([s for _, s in links])
    tokens = torch.tensor([t for _, t in trees])
    serial = allocate_bitmask(len(matchers) * d, VOCAB)
    build_tree_bitmask(matchers, nxt, sib, tokens, serial)
    pooled = allocate_bitmask(len(matchers) * d, VOCAB)
    pooled.fill_(7)
    pool.fill_trees(matchers, nxt, sib, tokens, pooled)
    assert torch.equal(pooled, serial)


def test_pool_threads_write_a_bitmask_made_in_inference_mode(
    backend: GrammarBackend, compiled: list[xgr.CompiledGrammar]
) -> None:
    """Regression: the engine makes its bitmasks inside its step (inference mode); the pool's threads
    wrote them outside it and failed at every constrained verify step of a batch past ``SERIAL_BELOW``."""
    pool = GrammarFillPool(threads=2, serial_below=0)
    try:
        matchers = [backend.new_matcher(compiled[i % len(compiled)]) for i in range(6)]
        d = 4
        links = [links_from_parents([-1, 0, 0, 1]) for _ in matchers]
        nxt = torch.tensor([n for n, _ in links])
        sib = torch.tensor([s for _, s in links])
        tokens = torch.zeros(len(matchers), d, dtype=torch.int64)
        with torch.inference_mode():
            bitmask = allocate_bitmask(len(matchers) * d, VOCAB)
            pool.fill_trees(matchers, nxt, sib, tokens, bitmask)
            rows = allocate_bitmask(len(matchers), VOCAB)
            pool.fill_rows(matchers, list(range(len(matchers))), rows)
        serial = allocate_bitmask(len(matchers) * d, VOCAB)
        build_tree_bitmask(matchers, nxt, sib, tokens, serial)
        assert torch.equal(bitmask, serial)
    finally:
        pool.close()


def test_fill_threads_leave_the_engine_loop_a_core() -> None:
    assert fill_threads(1) == 0
    assert fill_threads(2) == 1
    assert fill_threads(128) == 8


def test_plain_rows_stay_on_the_callers_thread_where_the_pool_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain rows go to the workers only past the batches where one batched call was measured
    faster (up to 256 members); tree masks keep their own threshold; the variable sets both."""
    from ngrammar.grammar.fill_pool import ROWS_SERIAL_BELOW, SERIAL_BELOW

    monkeypatch.delenv("NGRAMMAR_FILL_SERIAL_BELOW", raising=False)
    default = GrammarFillPool(threads=2)
    assert (default.rows_serial_below, default.serial_below) == (ROWS_SERIAL_BELOW, SERIAL_BELOW)
    assert default.rows_serial_below > 256
    default.close()
    monkeypatch.setenv("NGRAMMAR_FILL_SERIAL_BELOW", "7")
    forced = GrammarFillPool(threads=2)
    assert (forced.rows_serial_below, forced.serial_below) == (7, 7)
    forced.close()
