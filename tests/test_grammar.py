"""Grammar package: specs and errors, compile cache, matcher commit, bitmask ops and tree masks."""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import xgrammar as xgr

from ngrammar.grammar import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarRejectedError,
    GrammarSpec,
    allocate_bitmask,
    apply_bitmask,
    build_tree_bitmask,
    fill_tree_bitmask,
    grammar_spec_from_request,
    grammar_valid_nodes,
    unpack_bitmask,
)
from ngrammar.model.tokenizer import Tokenizer
from tests.grammar_oracles import cached_specs, commit, dfs_tree_bitmask, fork, is_completed
from tests.tree_oracles import links_from_parents

VOCAB = 49152
EOS = 2

CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": r"^[\w]+$"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
    "additionalProperties": False,
}

# (pattern, a string it matches): the regex kit's eight patterns; the last two are written here.
REGEX_CASES = [
    (r"^user@example\.com$", "user@example.com"),
    (r"^(Hello|Hi|Hey)$", "Hey"),
    (r"^\d{3}$", "123"),
    (r"^\(\d{3}\) \d{3}-\d{4}$", "(555) 123-4567"),
    (r"^2024-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$", "2024-07-29"),
    (r"^#[0-9A-F]{6}$", "#1A2B3C"),
    (
        r'^\{"name": "[A-Za-z]+", "age": \d{1,3}, "city": "[A-Za-z ]+"\}$',
        '{"name": "Alice", "age": 30, "city": "New York"}',
    ),
    (
        r"^\[(INFO|WARN|ERROR)\] \d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} - [A-Za-z ]+$",
        "[ERROR] 2024-03-15 10:42:07 - Disk quota exceeded",
    ),
]


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> Iterator[GrammarBackend]:
    b = GrammarBackend(tokenizer, VOCAB)
    yield b
    b.close()


def regex(pattern: str) -> GrammarSpec:
    return GrammarSpec("regex", pattern)


def schema(value: dict[str, object] | str) -> GrammarSpec:
    spec = grammar_spec_from_request(json_schema=value)
    assert spec is not None
    return spec


def allowed(matcher: GrammarMatcher) -> list[int]:
    """Sorted allowed next tokens (numpy unpacking: these calls are the tree tests' hot loop)."""
    mask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(mask, 0)
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits).tolist()


# ---------------------------------------------------------------- specs, compilation, errors


@pytest.mark.parametrize("pattern,text", REGEX_CASES)
def test_regex_kit_compiles_and_walks(
    backend: GrammarBackend, tokenizer: Tokenizer, pattern: str, text: str
) -> None:
    assert re.fullmatch(pattern, text)
    matcher = backend.new_matcher(backend.compile(regex(pattern)))
    ids = tokenizer.encode(text)
    assert commit(matcher, ids) == (len(ids), False)
    assert is_completed(matcher) and not matcher.is_terminated()
    if pattern.endswith("+$"):
        assert EOS in allowed(matcher)  # complete, but the message may also go on
    else:
        assert allowed(matcher) == [EOS]  # a complete fixed-length match admits only the stop token
    assert commit(matcher, [EOS]) == (1, False)
    assert matcher.is_terminated()


def test_city_schema_walk(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    matcher = backend.new_matcher(backend.compile(schema(CITY_SCHEMA)))
    ids = tokenizer.encode('{"name": "Paris", "population": 2148000}') + [EOS]
    assert commit(matcher, ids) == (len(ids), False)
    assert matcher.is_terminated()


def test_schema_rejects_extra_and_missing_properties(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    compiled = backend.compile(schema(CITY_SCHEMA))
    for text in [
        '{"name": "Paris", "population": 1, "x": 2}',
        '{"name": "Paris"}',
        '{"name": "a b", "population": 1}',
    ]:
        retained, rejected = commit(backend.new_matcher(compiled), tokenizer.encode(text) + [EOS])
        assert rejected, text


def test_schema_keeps_property_order(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    # xgrammar emits properties in schema order, so the spec must not sort them.
    props = {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}}
    spec = schema({"type": "object", "properties": props, "required": ["zeta", "alpha"]})
    compiled = backend.compile(spec)
    ok = commit(backend.new_matcher(compiled), tokenizer.encode('{"zeta": 1, "alpha": 2}') + [EOS])
    bad = commit(backend.new_matcher(compiled), tokenizer.encode('{"alpha": 2, "zeta": 1}') + [EOS])
    assert ok[1] is False and bad[1] is True


def test_json_object_and_ebnf(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    spec = grammar_spec_from_request(json_object=True)
    assert spec == GrammarSpec("json_object", "")
    ids = tokenizer.encode('{"a": [1, 2.5, "x"], "b": null}') + [EOS]
    assert commit(backend.new_matcher(backend.compile(spec)), ids) == (len(ids), False)
    ebnf = grammar_spec_from_request(ebnf='root ::= "yes" | "no"')
    assert ebnf is not None
    matcher = backend.new_matcher(backend.compile(ebnf))
    assert commit(matcher, tokenizer.encode("no") + [EOS]) == (2, False)


def test_spec_from_request() -> None:
    assert grammar_spec_from_request() is None
    assert grammar_spec_from_request(regex="a+") == GrammarSpec("regex", "a+")
    as_dict = grammar_spec_from_request(json_schema={"type": "object", "required": ["a"]})
    as_text = grammar_spec_from_request(json_schema='{ "type" : "object",\n "required": ["a"] }')
    assert as_dict == as_text
    assert hash(as_dict) == hash(as_text)


@pytest.mark.parametrize(
    "fields",
    [
        {"json_schema": {"type": "object"}, "regex": "a"},
        {"regex": "a", "ebnf": 'root ::= "a"'},
        {"ebnf": 'root ::= "a"', "json_object": True},
        {"json_schema": "{}", "json_object": True},
    ],
)
def test_two_grammars_rejected(fields: dict[str, object]) -> None:
    with pytest.raises(GrammarError, match="only one of json_schema, regex, ebnf, json_object may be set"):
        grammar_spec_from_request(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["INVALID", "{not json", '"INVALID"', "[1, 2]", "42"])
def test_schema_text_must_be_a_json_object(text: str) -> None:
    with pytest.raises(GrammarError, match="invalid JSON schema"):
        grammar_spec_from_request(json_schema=text)


@pytest.mark.parametrize(
    "spec,message",
    [
        (GrammarSpec("json_schema", '{"type": "nonsense"}'), "invalid JSON schema"),
        (GrammarSpec("json_schema", '{"type": "object", "properties": 5}'), "invalid JSON schema"),
        (GrammarSpec("json_schema", '{"type": "string", "minLength": "x"}'), "invalid JSON schema"),
        (GrammarSpec("json_schema", "INVALID"), "invalid JSON schema: not valid JSON"),
        (GrammarSpec("regex", "(abc"), "invalid regex: .*parenthesis"),
        (GrammarSpec("regex", "[a-"), "invalid regex"),
        (GrammarSpec("ebnf", "root ::= ("), "invalid EBNF grammar"),
        (GrammarSpec("ebnf", 'rule ::= "a"'), "invalid EBNF grammar: .*root"),
    ],
)
def test_invalid_grammars_raise_grammar_error(
    backend: GrammarBackend, spec: GrammarSpec, message: str
) -> None:
    with pytest.raises(GrammarError, match=message) as info:
        backend.compile(spec)
    assert ".cc:" not in str(info.value)  # xgrammar's source locations are stripped
    with pytest.raises(GrammarError, match=message):
        backend.compile_async(spec).result(timeout=30)
    assert spec not in cached_specs(backend)


def test_a_missing_module_is_not_reported_as_bad_input(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: without jsonschema installed, every JSON schema was "invalid JSON schema: No module
    named 'jsonschema'" (a client error for a server fault)."""
    from ngrammar.grammar import backend as backend_module

    def missing(schema: object) -> None:
        raise ModuleNotFoundError("No module named 'jsonschema'")

    monkeypatch.setattr(backend_module, "check_json_schema", missing)
    b = GrammarBackend(tokenizer, VOCAB)
    try:
        with pytest.raises(ModuleNotFoundError, match="jsonschema"):
            b.compile(GrammarSpec("json_schema", json.dumps({"type": "object"})))
    finally:
        b.close()


def test_compile_cache_hits_and_counts(tokenizer: Tokenizer) -> None:
    small = GrammarBackend(tokenizer, VOCAB, cache_size=2)
    try:
        a, b, c = regex("a+"), regex("b+"), regex("c+")
        first = small.compile(a)
        assert small.compile(a) is first
        assert small.compile_async(a).result() is first
        assert small.compile_count == 1
        small.compile(b)
        small.compile(a)  # a becomes most recent, so c evicts b
        small.compile(c)
        assert cached_specs(small) == [a, c]
        assert small.compile_count == 3
        small.compile(b)
        assert small.compile_count == 4
        with pytest.raises(GrammarError):
            small.compile(regex("(x"))
        with pytest.raises(GrammarError):
            small.compile(regex("(x"))
        assert small.compile_count == 6  # failures are not cached as successes
    finally:
        small.close()


def test_concurrent_compiles_share_one_compilation(tokenizer: Tokenizer) -> None:
    b = GrammarBackend(tokenizer, VOCAB, compile_threads=4)
    try:
        spec = schema(CITY_SCHEMA)
        futures = [b.compile_async(spec) for _ in range(8)]
        results: list[object] = []
        threads = [threading.Thread(target=lambda: results.append(b.compile(spec))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        compiled = {id(f.result(timeout=30)) for f in futures} | {id(r) for r in results}
        assert len(compiled) == 1
        assert b.compile_count == 1
    finally:
        b.close()


def test_model_vocab_larger_than_tokenizer(tokenizer: Tokenizer) -> None:
    padded = tokenizer.vocab_size + 64
    b = GrammarBackend(tokenizer, padded)
    try:
        matcher = b.new_matcher(b.compile(GrammarSpec("json_object", "")))
        mask = allocate_bitmask(1, padded)
        assert mask.shape == (1, (padded + 31) // 32)
        matcher.fill_bitmask(mask, 0)
        bits = unpack_bitmask(mask, padded)[0]
        assert bits.any() and not bits[tokenizer.vocab_size :].any()
        assert not matcher.accept_token(padded - 1) and not matcher.accept_token(padded)
    finally:
        b.close()


# ---------------------------------------------------------------- commit


def test_commit_retains_through_terminating_token(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    compiled = backend.compile(regex(r"^\d{3}$"))
    digits = [tokenizer.encode(c)[0] for c in "1234"]
    matcher = backend.new_matcher(compiled)
    assert commit(matcher, digits[:3] + [EOS, digits[3], EOS]) == (4, False)
    assert matcher.is_terminated()
    assert commit(matcher, [EOS]) == (0, False)  # nothing follows the end

    matcher = backend.new_matcher(compiled)
    assert commit(matcher, digits[:2]) == (2, False)
    assert commit(matcher, [tokenizer.encode("a")[0], digits[2]]) == (0, True)
    assert commit(matcher, digits[2:]) == (1, True)  # third digit ok, a fourth is rejected
    assert not matcher.is_terminated() and is_completed(matcher)
    assert commit(matcher, []) == (0, False)


def test_commit_rejects_early_eos_and_out_of_range(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    matcher = backend.new_matcher(backend.compile(schema(CITY_SCHEMA)))
    ids = tokenizer.encode('{"name": "Rome"')
    assert commit(matcher, ids + [EOS]) == (len(ids), True)
    assert commit(matcher, [VOCAB, -1]) == (0, True)
    copy = fork(matcher)
    tail = tokenizer.encode(', "population": 2}') + [EOS]
    assert commit(copy, tail) == (len(tail), False) and copy.is_terminated()
    assert not matcher.is_terminated()  # the fork is independent


# ---------------------------------------------------------------- bitmask ops


def test_allocate_bitmask() -> None:
    mask = allocate_bitmask(3, 1000)
    assert mask.dtype == torch.int32 and mask.shape == (3, 32) and bool((mask == -1).all())
    assert unpack_bitmask(mask, 1000).all()


@pytest.mark.parametrize("rows,vocab", [(5, VOCAB), (4, 1000), (3, 64)])
def test_apply_bitmask_matches_xgrammar(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    width = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, width), dtype=torch.int32, generator=gen)
    bitmask[0] = -1
    bitmask[1] = 0
    bitmask[2, 0] = -(2**31)  # only the sign bit: token 31 allowed among the first 32
    logits = torch.randn(rows, vocab, generator=gen)
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours[1]).all() and torch.equal(ours[0], logits[0])
    assert not torch.isinf(ours[2, 31]) and torch.isinf(ours[2, :31]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [VOCAB, 1000, 64])
def test_apply_bitmask_on_the_cpu_equals_the_tensor_ops(vocab: int, dtype: torch.dtype) -> None:
    """The CPU unpacks the bits with numpy: the same -inf entries as the tensor ops (the CUDA path),
    on a row slice of a larger logits buffer, and through the tensor ops' fallback for a bitmask
    that is not contiguous."""
    from ngrammar.grammar.tree_mask import _forbidden

    rows, width = 6, (vocab + 31) // 32
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randint(-(2**31), 2**31 - 1, (rows, width + 5), dtype=torch.int32, generator=gen)
    wide[0] = 0
    wide[1] = -1
    logits = torch.randn(rows + 2, vocab, generator=gen).to(dtype)
    want = logits.clone()
    want[:rows].masked_fill_(_forbidden(wide[:, :width], vocab), float("-inf"))
    for bitmask in (wide[:, :width].contiguous(), wide[:, :width]):  # the second: not contiguous
        got = logits.clone()
        apply_bitmask(got[:rows], bitmask)
        assert torch.equal(got, want)
    assert torch.isinf(want[0]).all() and torch.equal(want[1], logits[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,vocab", [(1, VOCAB), (16, VOCAB), (48, 1000)])
def test_apply_bitmask_on_cuda_matches_the_tensor_ops(rows: int, vocab: int) -> None:
    """On CUDA the mask covers exactly what it covers on the CPU, on a row slice of a larger
    logits buffer as the CUDA-graph runner hands it out."""
    gen = torch.Generator().manual_seed(rows + vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    bitmask[0] = 0
    logits = torch.randn(rows + 3, vocab, generator=gen)
    want = logits[:rows].clone()
    apply_bitmask(want, bitmask)
    buffer = logits.cuda()
    apply_bitmask(buffer[:rows], bitmask.cuda())
    assert torch.equal(buffer[:rows].cpu(), want)
    assert torch.equal(buffer[rows:].cpu(), logits[rows:])  # rows past the slice untouched
    assert torch.isinf(want[0]).all()


def test_apply_bitmask_from_a_matcher(backend: GrammarBackend) -> None:
    matcher = backend.new_matcher(backend.compile(regex(r"^\d{3}$")))
    bitmask = allocate_bitmask(2, VOCAB)
    matcher.fill_bitmask(bitmask, 1)
    logits = torch.zeros(2, VOCAB)
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).all()
    finite = torch.nonzero(torch.isfinite(logits[1])).flatten().tolist()
    assert finite == allowed(matcher) and len(finite) == 10


def test_apply_bitmask_rejects_short_mask() -> None:
    with pytest.raises(ValueError):
        apply_bitmask(torch.zeros(2, 100), allocate_bitmask(2, 64))


# ---------------------------------------------------------------- tree masks


def random_tree(matcher: GrammarMatcher, d: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(parents, tokens) of a BFS tree with a mix of valid, invalid, stop and padding tokens."""
    parents, tokens = [-1], [rng.randrange(VOCAB)]
    states: list[GrammarMatcher | None] = [fork(matcher)]
    queue = [0]
    while queue and len(tokens) < d:
        node = queue.pop(0)
        state = states[node]
        live = state is not None and not state.is_terminated()
        options = allowed(state) if live else []  # type: ignore[arg-type]
        for _ in range(rng.choice([0, 1, 2, 2, 3])):
            if len(tokens) >= d:
                break
            roll = rng.random()
            if options and roll < 0.7:
                token = rng.choice(options)
            elif roll < 0.78:
                token = EOS
            elif roll < 0.82:
                token = rng.choice([-1, VOCAB, VOCAB + rng.randrange(100)])  # out of range: never allowed
            else:
                token = rng.randrange(VOCAB)
            child = None
            if live:
                child = fork(state)  # type: ignore[union-attr]
                if not child.accept_token(token):
                    child = None
            parents.append(node)
            tokens.append(token)
            states.append(child)
            queue.append(len(tokens) - 1)
    while len(tokens) < d:  # drafter padding: extra root children of token 0
        parents.append(0)
        tokens.append(0)
    return parents, tokens


def naive_tree_bitmask(
    backend: GrammarBackend, compiled: object, committed: list[int], parents: list[int], tokens: list[int]
) -> torch.Tensor:
    """Each node's row from a fresh matcher fed the committed tokens and the node's path."""
    d = len(tokens)
    out = allocate_bitmask(d, VOCAB)
    for node in range(d):
        path = []
        walk = node
        while walk != 0:
            path.append(tokens[walk])
            walk = parents[walk]
        path.reverse()
        fresh = backend.new_matcher(compiled)
        assert commit(fresh, committed) == (len(committed), False)
        if fresh.is_terminated():
            continue
        retained, rejected = commit(fresh, path)
        if retained == len(path) and not rejected and not fresh.is_terminated():
            fresh.fill_bitmask(out, node)
    return out


TREE_GRAMMARS = [
    (lambda: schema(CITY_SCHEMA), '{"name": "Paris", "population": 2148000}'),
    (lambda: regex(REGEX_CASES[3][0]), REGEX_CASES[3][1]),
    (lambda: regex(REGEX_CASES[6][0]), REGEX_CASES[6][1]),
    (lambda: regex(REGEX_CASES[1][0]), "Hello"),
    (lambda: GrammarSpec("json_object", ""), '{"k": [true, 1]}'),
]


@pytest.mark.parametrize("case", range(len(TREE_GRAMMARS)))
def test_tree_masks_equal_naive_recomputation(
    backend: GrammarBackend, tokenizer: Tokenizer, case: int
) -> None:
    make_spec, text = TREE_GRAMMARS[case]
    compiled = backend.compile(make_spec())
    ids = tokenizer.encode(text) + [EOS]
    rng = random.Random(case)
    checked_rows = 0
    for _ in range(45):  # 5 grammars x 45 = 225 trees
        cut = rng.randrange(0, len(ids) + 1)  # cut == len(ids): already terminated
        committed = ids[:cut]
        matcher = backend.new_matcher(compiled)
        commit(matcher, committed)
        d = rng.choice([1, 2, 4, 8, 16])
        parents, tokens = random_tree(matcher, d, rng)
        nxt, sib = links_from_parents(parents)
        expected = naive_tree_bitmask(backend, compiled, committed, parents, tokens)

        python_rows = allocate_bitmask(d + 2, VOCAB)
        python_rows.fill_(7)  # stale contents must not survive
        dfs_tree_bitmask(matcher, nxt, sib, tokens, python_rows, 1, VOCAB)
        assert torch.equal(python_rows[1 : d + 1], expected)
        assert bool((python_rows[0] == 7).all() and (python_rows[d + 1] == 7).all())

        native_rows = allocate_bitmask(d, VOCAB)
        native_rows.fill_(7)
        fill_tree_bitmask(matcher, torch.tensor(nxt), torch.tensor(sib), torch.tensor(tokens), native_rows, 0)
        assert torch.equal(native_rows, expected)

        reference = backend.new_matcher(compiled)
        commit(reference, committed)
        assert matcher.is_terminated() == reference.is_terminated()
        if not matcher.is_terminated():
            assert allowed(matcher) == allowed(reference)
        checked_rows += int((expected != -1).any(dim=1).sum())
    assert checked_rows >= 30  # the trees exercise real grammar rows, not just skipped ones


def naive_valid_nodes(
    backend: GrammarBackend, compiled: object, committed: list[int], parents: list[int], tokens: list[int]
) -> list[bool]:
    """Node i is valid iff a fresh matcher fed the committed tokens takes i's whole path, no token
    of it but the last terminating the grammar (the root: iff the grammar has not terminated)."""
    out = []
    for node in range(len(tokens)):
        path, walk = [], node
        while walk != 0:
            path.append(tokens[walk])
            walk = parents[walk]
        fresh = backend.new_matcher(compiled)
        commit(fresh, committed)
        if fresh.is_terminated():
            out.append(False)
            continue
        retained, rejected = commit(fresh, path[::-1])
        out.append(retained == len(path) and not rejected)
    return out


@pytest.mark.parametrize("case", range(len(TREE_GRAMMARS)))
def test_grammar_valid_nodes_equal_naive_recomputation(
    backend: GrammarBackend, tokenizer: Tokenizer, case: int
) -> None:
    make_spec, text = TREE_GRAMMARS[case]
    compiled = backend.compile(make_spec())
    ids = tokenizer.encode(text) + [EOS]
    rng = random.Random(100 + case)
    verdicts = set()
    for _ in range(45):
        committed = ids[: rng.randrange(0, len(ids) + 1)]
        matcher = backend.new_matcher(compiled)
        commit(matcher, committed)
        parents, tokens = random_tree(matcher, rng.choice([1, 2, 4, 8, 16]), rng)
        valid = grammar_valid_nodes(matcher, tokens, parents)
        assert valid == naive_valid_nodes(backend, compiled, committed, parents, tokens)
        verdicts.update(valid[1:])
        for limit in (1, 2):  # deeper nodes take the verdict of their ancestor at the limit
            expected, depth = list(valid), [0] * len(tokens)
            for i in range(1, len(tokens)):
                depth[i] = depth[parents[i]] + 1
                if depth[i] > limit:
                    expected[i] = expected[parents[i]]
            assert grammar_valid_nodes(matcher, tokens, parents, max_depth=limit) == expected
        reference = backend.new_matcher(compiled)  # the walk leaves the matcher as it found it
        commit(reference, committed)
        assert matcher.is_terminated() == reference.is_terminated()
        if not matcher.is_terminated():
            assert allowed(matcher) == allowed(reference)
    assert verdicts == {True, False}  # the trees hold both kinds of draft


def test_build_tree_bitmask_batch(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    compiled = backend.compile(schema(CITY_SCHEMA))
    committed = tokenizer.encode('{"name": "Par')
    matcher = backend.new_matcher(compiled)
    commit(matcher, committed)
    rng = random.Random(7)
    d = 8
    trees = [random_tree(matcher, d, rng) for _ in range(3)]
    links = [links_from_parents(p) for p, _ in trees]
    next_token = torch.tensor([n for n, _ in links])
    next_sibling = torch.tensor([s for _, s in links])
    draft = torch.tensor([t for _, t in trees])
    expected = [naive_tree_bitmask(backend, compiled, committed, p, t) for p, t in trees]

    bitmask = torch.zeros(3 * d, (VOCAB + 31) // 32, dtype=torch.int32)  # stale: all forbidden
    matchers = [matcher, None, matcher]
    assert build_tree_bitmask(matchers, next_token, next_sibling, draft, bitmask)
    for b in (0, 2):
        assert torch.equal(bitmask[b * d : (b + 1) * d], expected[b])
    assert bool((bitmask[d : 2 * d] == -1).all())

    bitmask.zero_()
    assert not build_tree_bitmask([None, None, None], next_token, next_sibling, draft, bitmask)
    assert bool((bitmask == -1).all())


def test_terminal_node_row_stays_unconstrained(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    # Root "12" committed; node 1 = "3", node 2 = EOS under it, node 3 = "4" under the EOS.
    matcher = backend.new_matcher(backend.compile(regex(r"^\d{3}$")))
    one, two, three, four = (tokenizer.encode(c)[0] for c in "1234")
    commit(matcher, [one, two])
    tokens = [two, three, EOS, four]
    nxt, sib = [1, 2, 3, -1], [-1, -1, -1, -1]
    for fill in ("python", "native"):
        rows = torch.zeros(4, (VOCAB + 31) // 32, dtype=torch.int32)
        if fill == "python":
            dfs_tree_bitmask(matcher, nxt, sib, tokens, rows, 0, VOCAB)
        else:
            fill_tree_bitmask(matcher, torch.tensor(nxt), torch.tensor(sib), torch.tensor(tokens), rows, 0)
        unpacked = unpack_bitmask(rows, VOCAB)
        assert unpacked[0].sum() == 10 and torch.nonzero(unpacked[1]).flatten().tolist() == [EOS]
        assert unpacked[2].all() and unpacked[3].all(), fill
    assert commit(matcher, [three, EOS]) == (2, False)


def test_spec_source_is_json_for_schema() -> None:
    spec = schema(CITY_SCHEMA)
    assert json.loads(spec.source) == CITY_SCHEMA
    assert list(json.loads(spec.source)["properties"]) == ["name", "population"]


# ------------------------------------------------------- deferred tokens


def test_deferred_tokens_give_the_same_state_as_accepted_ones(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    compiled = backend.compile(schema(CITY_SCHEMA))
    ids = tokenizer.encode('{"name": "Rome", "population": 2800000}')
    now, later = backend.new_matcher(compiled), backend.new_matcher(compiled)
    for i, token in enumerate(ids):
        assert now.accept_token(token)
        later.accept_masked(token)
        if i % 3 == 2:  # settle now and then, as the engine does once per step
            assert later.settle() is None
        a, b = allocate_bitmask(1, VOCAB), allocate_bitmask(1, VOCAB)
        now.fill_bitmask(a, 0)
        later.fill_bitmask(b, 0)  # reads the state: settles first
        assert torch.equal(a, b)
    later.accept_masked(EOS)
    assert later.is_terminated()  # told without settling: only a stop token terminates
    assert later.settle() is None and later.is_terminated()
    assert not now.is_terminated()


def test_settle_reports_the_first_rejected_token(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    digits = [tokenizer.encode(c)[0] for c in "123"]
    letter = tokenizer.encode("a")[0]
    matcher = backend.new_matcher(backend.compile(regex(r"^\d{3}$")))
    for token in (digits[0], letter, digits[1]):
        matcher.accept_masked(token)
    assert not matcher.is_terminated()
    assert matcher.settle() == letter  # the digit before it was accepted, the one after dropped
    assert commit(matcher, digits[1:] + [EOS]) == (3, False)

    matcher = backend.new_matcher(backend.compile(regex(r"^\d{3}$")))
    matcher.accept_masked(letter)
    with pytest.raises(GrammarRejectedError, match=f"rejected committed token {letter}"):
        matcher.fill_bitmask(allocate_bitmask(1, VOCAB), 0)
