"""The draft proposer (speculative/proposer.py): grammar-forced branches, hedged tokenizations,
refill, field memory, external corpora and per-request control."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngrammar import LLM, SamplingParams
from ngrammar.grammar import GrammarBackend, GrammarMatcher, grammar_spec_from_request
from ngrammar.model.tokenizer import Tokenizer
from ngrammar.sampling_params import InvalidRequestError
from ngrammar.speculative.corpus import NgramCorpus
from ngrammar.speculative.external import DraftCorpusError
from ngrammar.speculative.field_memory import FieldMemory, JsonPath
from ngrammar.speculative.forced import ForcedText, forced_text
from ngrammar.speculative.policy import AdaptiveDraftPolicy, FixedWidthPolicy, ThresholdDraftPolicy
from ngrammar.speculative.proposer import TEXT_MATCH, DraftProposer
from ngrammar.speculative.text_lookup import (
    CONTINUATION_BYTES,
    LONG_BYTES,
    MAX_BYTES,
    MIN_BYTES,
    TAIL_TOKENS,
    TextLookup,
)
from tests.grammar_oracles import fork

# ----------------------------------------------------------------------------- random schemas
_NAMES = st.sampled_from(["name", "unit", "qty", "id", "city", "tags", "kind", "note"])


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.just({"type": "string"}),
        st.just({"type": "integer"}),
        st.just({"type": "boolean"}),
        st.lists(st.sampled_from(["kg", "pcs", "box", "litre"]), min_size=1, max_size=3, unique=True).map(
            lambda e: {"enum": e}
        ),
        st.sampled_from(["v1", "fixed value"]).map(lambda c: {"const": c}),
        st.just({"type": "array", "items": {"type": "string"}, "maxItems": 2}),
    )


def _object(values: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(_NAMES, values, min_size=1, max_size=4).map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": list(props),
            "additionalProperties": False,
        }
    )


SCHEMAS = _object(st.one_of(_leaf(), _object(_leaf())))


def _instance(schema: dict[str, Any]) -> Any:
    """One valid instance of a ``SCHEMAS`` schema."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][-1]
    kind = schema["type"]
    if kind == "object":
        return {k: _instance(v) for k, v in schema["properties"].items()}
    return {"string": "ab c", "integer": 42, "boolean": True, "array": ["x"]}[kind]


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer, checkpoint: Any) -> GrammarBackend:
    return GrammarBackend(tokenizer, checkpoint.config.vocab_size)


@pytest.fixture(scope="module")
def forced(backend: GrammarBackend, tokenizer: Tokenizer) -> ForcedText:
    return forced_text(backend, tokenizer)


@dataclass
class _Seq:
    """The fields of an engine ``Sequence`` the proposer reads."""

    token_ids: list[int]
    grammar: GrammarMatcher | None
    params: SamplingParams = field(default_factory=SamplingParams)
    seq_id: str = "s"
    is_finished: bool = False
    prompt_len: int = 1

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def settle_grammar(self) -> bool:
        return True


def _matcher(backend: GrammarBackend, schema: dict[str, Any]) -> GrammarMatcher:
    return backend.new_matcher(backend.compile(grammar_spec_from_request(json_schema=schema)))


def _states(
    backend: GrammarBackend, tokenizer: Tokenizer, schema: dict[str, Any]
) -> tuple[GrammarMatcher, list[int]]:
    """A matcher and the tokens of one instance it accepts (stopping at a token it refuses)."""
    m = _matcher(backend, schema)
    tokens = []
    for t in tokenizer.encode(json.dumps(_instance(schema))):
        if not m.accept_token(t):
            break
        tokens.append(t)
    m.rollback(len(tokens))
    return m, tokens


def _paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    out = []
    for i in range(1, len(tokens)):
        path, n = [], i
        while n > 0:
            path.append(tokens[n])
            n = parents[n]
        out.append(path[::-1])
    return out


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS)
def test_forced_branches_match_a_token_by_token_walk_of_the_matcher(
    schema: dict[str, Any], backend: GrammarBackend, tokenizer: Tokenizer, forced: ForcedText
) -> None:
    """At every state along an instance: the canonical forced tokens decode to the jump-forward
    string, and walking them one by one the matcher forces exactly the rest of it; every tree path
    the proposer drafts is accepted by a fresh matcher walked token by token; the alternatives are
    distinct spellings of the same text, each accepted; the matcher ends where it started."""
    m, tokens = _states(backend, tokenizer, schema)
    proposer = DraftProposer(NgramCorpus(), forced=lambda: forced)
    seen_forced = 0
    for i in range(len(tokens) + 1):
        text = m.jump_forward()
        if text:
            seen_forced += 1
            canonical = forced.canonical(text)
            assert forced.decode(canonical) == text.encode()
            walk = fork(m)
            done = b""
            for t in canonical:
                assert walk.accept_token(t)
                done += forced.vocab[t]
                assert walk.jump_forward().encode() == text.encode()[len(done) :]
            alternatives = forced.alternatives(text)
            assert alternatives[0] == canonical and len(set(alternatives)) == len(alternatives)
            for alt in alternatives:
                assert forced.decode(alt) == text.encode()
                walk = fork(m)
                assert all(walk.accept_token(t) for t in alt)
        seq = _Seq([1] + tokens[:i], m)
        proposal = proposer.propose([seq], 16, trim=False, widths=[1, 4, 8, 16])
        assert proposal is not None
        tree_tokens, parents = proposal.tree.tokens.tolist(), proposal.tree.parents()[0].tolist()
        real = [
            p for p, j in zip(_paths(tree_tokens, parents), range(1, 16)) if not proposal.tree.padding()[0, j]
        ]
        for path in real:
            walk = fork(m)
            assert all(walk.accept_token(t) for t in path), path
        if text and len(forced.canonical(text)) < 16:
            assert list(forced.canonical(text)) in real  # the canonical branch is in the tree
        assert m.jump_forward() == text  # the proposer left the matcher as it found it
        if i < len(tokens):
            assert m.accept_token(tokens[i])
    assert seen_forced > 0


def test_a_forced_key_is_drafted_with_the_merge_the_model_writes(
    backend: GrammarBackend, tokenizer: Tokenizer, forced: ForcedText
) -> None:
    """``"name"`` is forced after ``{"``; the model writes ``name`` + ``":``, not ``name`` + ``"``:
    both are in the tree (the overhang sibling), and the other spellings hedge the first token."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    m = _matcher(backend, schema)
    prefix = tokenizer.encode('{"')
    assert all(m.accept_token(t) for t in prefix)
    assert m.jump_forward() == 'name"'
    proposer = DraftProposer(NgramCorpus(), forced=lambda: forced)
    proposal = proposer.propose([_Seq([1] + prefix, m)], 8, trim=True, widths=[1, 4, 8])
    assert proposal is not None
    tree = proposal.tree
    paths = _paths(tree.tokens.tolist(), tree.parents()[0].tolist())
    name = tokenizer.encode("name")
    assert name + tokenizer.encode('"') in paths
    assert name + tokenizer.encode('":') in paths
    assert proposer.source_nodes["forced"] >= 3


def test_overhang_candidates_are_the_longer_tokens_and_cached() -> None:
    vocab = [b"a", b"ab", b'"', b'"x', b"abc", b"b", b"ab", b""]
    forced = ForcedText(lambda text: [], vocab, special=[4])
    assert forced.overhang_candidates(b"a") == (1, 6)  # not "a" itself, nor the special 4
    assert forced.overhang_candidates(b'"') == (3,)
    assert forced.overhang_candidates(b"abc") == ()
    assert forced.overhang_candidates(b"a") is forced.overhang_candidates(b"a")  # cached


def test_grammar_forbidden_corpus_drafts_are_refilled(
    backend: GrammarBackend, tokenizer: Tokenizer, forced: ForcedText
) -> None:
    """A corpus whose first continuations the grammar forbids: the freed nodes go to the next-best
    continuations the grammar allows (drafted wider than the budget), not to padding."""
    m = backend.new_matcher(backend.compile(grammar_spec_from_request(regex="(c[0-9])+")))
    (c,) = tokenizer.encode("c")
    corpus = NgramCorpus(max_bfs_breadth=16)
    root = 7
    # After the root token the corpus saw "c" first, then 5 continuations the grammar forbids.
    for t in [c, *range(200, 205)]:
        assert t == c or not fork(m).accept_token(t)
        corpus.index_prompt(("doc", t), [root, t, 5])
    seq = _Seq([1, root], m)
    off = DraftProposer(corpus, grammar_drafts=False).propose([seq], 4, trim=True, widths=[1, 4])
    on = DraftProposer(corpus, forced=lambda: forced).propose([seq], 4, trim=True, widths=[1, 4])
    assert off is None  # the corpus' first three continuations are all forbidden: nothing to verify
    assert on is not None and c in on.tree.tokens.tolist()


# ----------------------------------------------------------------------------- field memory
def test_json_path_scanner_follows_keys_and_arrays() -> None:
    scan = JsonPath()
    scan.feed(b'{"items": [{"unit": ')
    assert scan.expect_value and scan.path() == ("items", "[]", "unit")
    scan.feed(b'"kg"')
    assert scan.ended == 1 and not scan.expect_value
    scan.feed(b', "qty": 3')
    assert scan.path() == ("items", "[]", "qty") and scan.in_scalar
    scan.feed(b"}]}")
    assert scan.ended == 2 and scan.frames == []


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 9), st.lists(st.integers(1, 50), min_size=1, max_size=5).map(tuple)),
        max_size=120,
    ),
    capacity=st.integers(1, 12),
    per_field=st.integers(1, 4),
)
def test_field_memory_stays_within_its_bounds(
    ops: list[tuple[int, tuple[int, ...]]], capacity: int, per_field: int
) -> None:
    memory = FieldMemory(capacity, per_field)
    last: dict[int, tuple[int, ...]] = {}
    for field_id, value in ops:
        key = ("schema", (str(field_id),))
        memory.remember(key, value)
        last[field_id] = value
        assert len(memory) <= capacity
        assert all(len(memory.lookup(("schema", (str(f),)))) <= per_field for f in range(10))
        assert memory.lookup(key)[0] == value  # the newest value of a field is offered first
    # An evicted value is gone from its field too, and the most recent one survives.
    if ops:
        field_id, value = ops[-1]
        assert value in memory.lookup(("schema", (str(field_id),)))


def test_field_memory_offers_values_seen_at_the_same_path(tokenizer: Tokenizer, forced: ForcedText) -> None:
    schema = {"type": "object", "properties": {"unit": {"enum": ["kg", "pcs"]}}}
    params = SamplingParams(json_schema=schema)
    memory = FieldMemory()
    memory.vocab = forced.vocab
    first = _Seq([1, *tokenizer.encode('{"unit": "pcs"}')], None, params, seq_id="a")
    memory.forget(first)
    second = _Seq([1, *tokenizer.encode('{"unit":')], None, params, seq_id="b")
    values = memory.values(second)
    assert values and forced.decode(values[0]).decode().startswith(' "pcs"')
    other = _Seq(
        [1, *tokenizer.encode('{"unit":')], None, SamplingParams(json_schema={"type": "object"}), seq_id="c"
    )
    assert memory.values(other) == []  # another schema: nothing


# ----------------------------------------------------------------------------- prompt text
def _byte_text() -> ForcedText:
    """One token per byte value: a token's bytes are its id's byte."""
    return ForcedText(lambda text: list(text.encode()), [bytes([i]) for i in range(256)], special=[])


def _oracle(prompt: bytes, tail: bytes) -> tuple[int, int]:
    """Brute force: (suffix size, end of the occurrence its continuation follows), or (0, 0)."""
    starts = [i for i in range(len(prompt)) if i == 0 or not chr(prompt[i - 1]).isalnum()]
    for n in range(len(tail), MIN_BYTES - 1, -1):
        needle = tail[-n:]
        hits = [i for i in range(len(prompt) - n) if prompt[i : i + n] == needle]  # a byte after
        if not hits:
            continue
        if n >= LONG_BYTES:
            return n, hits[0] + n
        word = n == len(tail) or not chr(tail[-n - 1]).isalnum()
        aligned = [i for i in hits if i in starts]
        if word and aligned:
            return n, aligned[0] + n
    return 0, 0


@settings(max_examples=300, deadline=None, derandomize=True)
@given(prompt=st.binary(min_size=1, max_size=80), output=st.binary(min_size=0, max_size=40))
def test_text_lookup_finds_the_longest_suffix_with_text_after_it(prompt: bytes, output: bytes) -> None:
    """Against a brute-force scan: the longest suffix (MIN_BYTES..MAX_BYTES) of the last
    TAIL_TOKENS tokens' bytes found in the prompt with a byte after it (below LONG_BYTES: starting a
    word in both), and the prompt's bytes after that occurrence; small alphabets (a space among
    them) so that matches are common."""
    prompt, output = bytes(b" abcd"[b % 5] for b in prompt), bytes(b" abcd"[b % 5] for b in output)
    seq = _Seq(list(prompt + output), None, prompt_len=len(prompt))
    lookup = TextLookup(_byte_text())
    tail = (prompt + output)[-TAIL_TOKENS:][-MAX_BYTES:]
    size, end = _oracle(prompt, tail)
    assert lookup.match(seq) == size
    expected = b""
    if size:
        expected = prompt[end : end + CONTINUATION_BYTES]
    assert bytes(lookup.continuation(seq, 64)) == expected
    assert len(lookup.continuation(seq, 2)) == min(2, len(expected))
    lookup.forget([seq.seq_id])
    assert not lookup._prompts and not lookup._matches


_PEOPLE = "Alice is 34 years old. Bob Smith is 27 years old and lives in Berlin."
_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "city"],
    "additionalProperties": False,
}


def test_a_value_spelled_apart_from_the_prompt_is_drafted_from_its_text(
    backend: GrammarBackend, tokenizer: Tokenizer, forced: ForcedText
) -> None:
    """The prompt has `` Bob`` `` Smith``; the JSON value opens ``"`` + ``Bob``, after which no token
    window of the prompt matches. The prompt's text does: `` Smith`` is drafted (and the policy is
    told of a match), and only with the lookup on."""
    prompt = tokenizer.encode(_PEOPLE)
    output = tokenizer.encode('{"name": "Bob')
    assert tokenizer.encode(" Bob")[0] in prompt and tokenizer.encode("Bob")[0] == output[-1]
    m = _matcher(backend, _PERSON)
    assert all(m.accept_token(t) for t in output)
    corpus = NgramCorpus()
    corpus.index_prompt("s", prompt)
    seq = _Seq(prompt + output, m, SamplingParams(json_schema=_PERSON), prompt_len=len(prompt))
    assert corpus.match_length(seq.token_ids, 4) == 0
    on = DraftProposer(corpus, forced=lambda: forced)
    off = DraftProposer(corpus, forced=lambda: forced)
    off.text_lookup = False
    assert on.match_length(seq, 4) == TEXT_MATCH and off.match_length(seq, 4) < TEXT_MATCH
    smith = tokenizer.encode(" Smith")
    for proposer, drafted in ((on, True), (off, False)):
        proposal = proposer.propose([seq], 8, trim=False, widths=[1, 4, 8])
        assert proposal is not None
        paths = _paths(proposal.tree.tokens.tolist(), proposal.tree.parents()[0].tolist())
        assert (smith in paths) is drafted
        assert m.jump_forward() == ""  # the matcher is back where it was (inside the string)
    assert on.source_nodes["text"] >= 1
    on.on_finish([seq])
    assert on._text is not None and not on._text._prompts  # the prompt's bytes go with the sequence


# ----------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpora") / "units.jsonl"
    path.write_text(
        '{"text": "The unit of mass is the kilogram and the unit of length is the metre."}\n"second doc"\n'
    )
    return path


@pytest.fixture(scope="module")
def forced_llm(corpus_file: Path) -> LLM:
    """NGRAM with grammar drafts, non-adaptive (every decode step a verify step), an external corpus."""
    return LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=16384,
        speculative="ngram",
        num_draft_tokens=8,
        spec_policy="fixed",
        draft_corpus=[str(corpus_file)],
    )


@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(SCHEMAS, min_size=10, max_size=10))
def test_forced_drafts_keep_greedy_outputs_on_random_schemas(
    schemas: list[dict[str, Any]], llm: LLM, forced_llm: LLM
) -> None:
    prompts = [[{"role": "user", "content": f"Fill in this JSON schema: {json.dumps(s)}"}] for s in schemas]
    params = [SamplingParams(max_tokens=32, temperature=0, json_schema=s) for s in schemas]
    plain = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    proposer = forced_llm.engine.ngram.proposer  # type: ignore[union-attr]
    before = proposer.source_nodes.get("forced", 0)
    batched = [o.outputs[0].token_ids for o in forced_llm.chat(prompts, params)]
    alone = [forced_llm.chat(p, q)[0].outputs[0].token_ids for p, q in zip(prompts[:4], params[:4])]
    assert batched == plain
    assert alone == plain[:4]
    assert proposer.source_nodes["forced"] > before


def test_prompt_text_drafts_keep_greedy_extraction_outputs(llm: LLM, forced_llm: LLM) -> None:
    """Values copied from the prompt (names, cities) under a schema: NGRAM with the prompt-text
    drafts gives plain decoding's tokens, batched and alone, and the drafts were used."""
    from benchmarks.bench_grammar import RECORD_SCHEMA, extraction_prompts

    prompts = extraction_prompts(3)
    params = SamplingParams(max_tokens=48, temperature=0, json_schema=RECORD_SCHEMA)
    plain = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    proposer = forced_llm.engine.ngram.proposer  # type: ignore[union-attr]
    before = proposer.source_nodes.get("text", 0)
    batched = [o.outputs[0].token_ids for o in forced_llm.chat(prompts, params)]
    alone = forced_llm.chat(prompts[:1], params)[0].outputs[0].token_ids
    assert batched == plain and alone == plain[0]
    assert proposer.source_nodes["text"] > before


def test_forced_drafts_keep_greedy_outputs_on_the_sglang_regexes_alone(llm: LLM, forced_llm: LLM) -> None:
    from test_grammar_engine import REGEXES

    convs = [[{"role": "user", "content": q}] for _, q in REGEXES]
    params = [SamplingParams(max_tokens=40, temperature=0, regex=r) for r, _ in REGEXES]
    plain = [o.outputs[0].token_ids for o in llm.chat(convs, params)]
    alone = [forced_llm.chat(c, p)[0].outputs[0].token_ids for c, p in zip(convs, params)]
    assert alone == plain


def test_sampling_with_forced_drafts_follows_the_grammar(forced_llm: LLM) -> None:
    """Sampled outputs under a grammar with forced text stay grammatical, through verify steps
    that carried forced drafts."""
    regex = r'\{"answer": "(yes|no)", "sure": (true|false)\}'
    proposer = forced_llm.engine.ngram.proposer  # type: ignore[union-attr]
    before = proposer.source_nodes.get("forced", 0)
    out = forced_llm.generate(
        "Answer in JSON:", SamplingParams(max_tokens=24, temperature=0.8, n=4, seed=5, regex=regex)
    )[0]
    assert all(re.fullmatch(regex, c.text) for c in out.outputs)
    assert proposer.source_nodes["forced"] > before


# A grammar-shaped tree over V = 8: a forced chain 1 -> 2 -> 3 (node 1..3), an overhang sibling 4 of
# the chain's last token (node 4), a corpus draft 5 at the root (node 5) and one below it (node 6).
GRAMMAR_PARENTS = [-1, 0, 1, 2, 2, 0, 5]
GRAMMAR_TOKENS = [7, 1, 2, 3, 4, 5, 6]
# The tokens each node's grammar state allows (the bitmask): the forced positions allow one token.
GRAMMAR_ALLOWED = [{1, 5, 6}, {2}, {3, 4, 0}, {0, 1, 2}, {0, 3}, {6, 7}, {1, 2, 3}]


def test_tree_sampling_under_a_grammar_is_lossless_with_forced_drafts() -> None:
    """The distribution test of tests/test_verify.py under a grammar: the target rows masked to
    what each node's grammar state allows (as the engine's bitmask does) and a forced-draft tree;
    every emitted token, given the node it was drawn at, follows that node's masked row."""
    from test_verify import chi_square_p_value, child_by_token, mask_from_parents

    from ngrammar.runner.acceptance import tree_speculative_sampling_target_only

    d, v, n = len(GRAMMAR_PARENTS), 8, 20000
    gen = torch.Generator().manual_seed(11)
    rows = torch.rand(d, v, generator=gen) + 0.05
    for node, allowed in enumerate(GRAMMAR_ALLOWED):
        rows[node, [t for t in range(v) if t not in allowed]] = 0.0
    probs = rows / rows.sum(-1, keepdim=True)
    result = tree_speculative_sampling_target_only(
        torch.tensor(GRAMMAR_TOKENS).expand(n, d),
        mask_from_parents(GRAMMAR_PARENTS).expand(n, d, d),
        probs.expand(n, d, v),
        torch.rand(n, d, generator=gen),
        torch.rand(n, generator=gen),
        1.0,
        1.0,
    )
    counts: dict[int, Counter[int]] = {node: Counter() for node in range(d)}
    for tokens, length in zip(result.accept_tokens.tolist(), result.accept_len.tolist()):
        node = 0
        for k in range(length):
            assert tokens[k] in GRAMMAR_ALLOWED[node]  # never a token the grammar forbids
            counts[node][tokens[k]] += 1
            node = child_by_token(GRAMMAR_PARENTS, GRAMMAR_TOKENS, node, tokens[k])
            if node == -1:
                break
    tested = 0
    for node, counter in counts.items():
        if sum(counter.values()) < 1000:
            continue
        assert chi_square_p_value([counter[t] for t in range(v)], probs[node].tolist()) > 1e-3, (
            node,
            counter,
        )
        tested += 1
    assert tested >= 4


def test_an_opted_out_request_never_takes_a_verify_step(forced_llm: LLM, llm: LLM) -> None:
    eng = forced_llm.engine
    steps = eng.stats.verify_steps
    p = SamplingParams(max_tokens=12, temperature=0, speculative=False, regex=r"(ab)+")
    out = forced_llm.generate("Write ab ab ab:", p)[0]
    assert eng.stats.verify_steps == steps
    assert out.metrics.get("spec_verify_steps", 0) == 0
    assert out.outputs[0].token_ids == llm.generate("Write ab ab ab:", p)[0].outputs[0].token_ids
    # The same request speculating does verify.
    forced_llm.generate("Write ab ab ab:", SamplingParams(max_tokens=12, temperature=0, regex=r"(ab)+"))
    assert eng.stats.verify_steps > steps


def test_a_request_caps_its_own_draft_width(forced_llm: LLM) -> None:
    eng = forced_llm.engine
    trace: list[Any] = []
    eng.step_trace = trace
    try:
        forced_llm.generate(
            "Count: 1 2 3 4 5 6 7", SamplingParams(max_tokens=10, temperature=0, num_draft_tokens=4)
        )
    finally:
        eng.step_trace = None
    assert all(r.width <= 4 for r in trace if r.kind == "verify")
    with pytest.raises(InvalidRequestError, match="num_draft_tokens"):
        SamplingParams(num_draft_tokens=0)


def test_a_capped_batch_times_and_prices_only_the_widths_it_can_use() -> None:
    # Regression: with every member asking for 4-node trees, the policy kept asking to time widths
    # 8 and 16, which the cap lowered to 4, so they were never timed and every step said "time".
    for policy in (AdaptiveDraftPolicy(16), FixedWidthPolicy(16), ThresholdDraftPolicy(16)):
        reasons = []
        for _ in range(12):
            w = policy.choose(["a", "b"], lambda: [3, 3], cap=4)
            assert w in (1, 4)
            reasons.append(policy.reason)
            policy.observe(2, w, 0.010 if w == 1 else 0.011, None if w == 1 else {"a": 3, "b": 3})
        assert reasons[-1] != "time", (type(policy).__name__, reasons)
    assert AdaptiveDraftPolicy(16).choose(["a"], lambda: [3], cap=1) == 1


def test_external_corpora_errors_and_removal(forced_llm: LLM, tmp_path: Path) -> None:
    eng = forced_llm.engine
    corpora = eng.ngram.proposer.corpora  # type: ignore[union-attr]
    assert corpora is not None and corpora.names() == ["units"]
    with pytest.raises(DraftCorpusError, match="does not exist"):
        corpora.add("missing", path=str(tmp_path / "nope.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(DraftCorpusError, match="not JSON"):
        corpora.add("bad", path=str(bad))
    big = tmp_path / "big.txt"
    big.write_text("word " * 1000)
    old = corpora.max_tokens
    corpora.max_tokens = 100
    try:
        with pytest.raises(DraftCorpusError, match="over 100 tokens"):
            corpora.add("big", path=str(big))
    finally:
        corpora.max_tokens = old
    with pytest.raises(DraftCorpusError, match="name"):
        corpora.add("no spaces", documents=["a b c"])
    # Regression (bug hunt): names of dots only are path segments clients rewrite ("..": up a
    # level), and a long bad name is quoted cut short.
    for dots in (".", "..", "..."):
        with pytest.raises(DraftCorpusError, match="not only dots"):
            corpora.add(dots, documents=["a b c"])
    with pytest.raises(DraftCorpusError) as long_name:
        corpora.add("x y" * 1000, documents=["a b c"])
    assert len(str(long_name.value)) < 200
    with pytest.raises(InvalidRequestError, match="unknown draft corpus 'nope'"):
        forced_llm.generate("Hi", SamplingParams(max_tokens=2, draft_corpora=["nope"]))
    # Drafting from a named corpus, then removing it while its request runs.
    corpora.add("facts", documents=["The unit of mass is the kilogram and the unit of length is the metre."])
    params = SamplingParams(max_tokens=16, temperature=0, draft_corpora=["facts"])
    eng.add_request("Repeat: the unit of mass is the kilogram", params)
    eng.step()
    eng.step()
    corpora.remove("facts")
    while eng.has_unfinished():
        eng.step()
    assert not eng.requests  # it ran to its end after its corpus went
    with pytest.raises(DraftCorpusError, match="unknown"):
        corpora.remove("facts")
    assert forced_llm.generate("Hi", SamplingParams(max_tokens=2))[0].finished  # still serving


def test_draft_corpus_is_a_generated_flag() -> None:
    import argparse

    from ngrammar.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative", "ngram", "--draft-corpus", "a.txt", "b.jsonl"])
    assert engine_kwargs(args)["draft_corpus"] == ("a.txt", "b.jsonl")
