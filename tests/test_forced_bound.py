"""``forced_text_bound``: an upper bound on xgrammar's jump-forward text in every state a walk reaches,
and no bound (or a large one) for the grammars that force long text."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import xgrammar as xgr

from ngrammar.grammar import GrammarSpec
from ngrammar.grammar.backend import GrammarBackend
from ngrammar.grammar.forced_bound import JUMP_FORWARD_LIMIT, forced_text_bound
from ngrammar.model.loader import Checkpoint
from ngrammar.model.tokenizer import Tokenizer

# One token per printable ASCII character: a walk can reach every state of these grammars.
CHARS = [chr(c) for c in range(32, 127)]


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(CHARS + ["<eos>"], stop_token_ids=[len(CHARS)]))


def _schema(schema: dict[str, Any]) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(json.dumps(schema))


SMALL: dict[str, xgr.Grammar] = {
    "regex": xgr.Grammar.from_regex("(ab|cd)e{5}(f|gh){2,3}x{0,4}"),
    "nested": xgr.Grammar.from_regex("((ab){3}c){2}[0-9]+z{7}"),
    "json": xgr.Grammar.builtin_json_grammar(),
    "schema": _schema(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 3},
                "kind": {"enum": ["alpha", "alphabet", "beta"]},
                "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
                "tags": {"type": "array", "items": {"const": "t"}, "minItems": 2},
            },
            "required": ["name", "kind", "code", "tags"],
        }
    ),
    "ebnf": xgr.Grammar.from_ebnf(
        'root ::= "let " name " = " value ";"\nname ::= [a-z]+\nvalue ::= "0" | "(" value [ \\t]* ")"'
    ),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_bound_holds_in_every_state_of_random_walks(compiler: xgr.GrammarCompiler, name: str) -> None:
    grammar = SMALL[name]
    bound = forced_text_bound(grammar.serialize_json())
    assert bound <= JUMP_FORWARD_LIMIT
    compiled = compiler.compile_grammar(grammar)
    rng = random.Random(0)
    bitmask = xgr.allocate_token_bitmask(1, len(CHARS) + 1)
    for _ in range(30):
        matcher = xgr.GrammarMatcher(compiled)
        for _ in range(60):
            forced = matcher.find_jump_forward_string()
            assert len(forced) <= bound, (name, forced)
            matcher.fill_next_token_bitmask(bitmask)
            allowed = [t for t in range(len(CHARS)) if bitmask[0, t // 32] >> (t % 32) & 1]
            if not allowed:
                break
            # follow the forced text part of the time, so its deepest states are reached too
            token = CHARS.index(forced[0]) if forced and rng.random() < 0.5 else rng.choice(allowed)
            assert matcher.accept_token(token)


BOMBS = {
    "counted repetition": xgr.Grammar.from_regex("a{99999999}"),
    "nested quantifiers": xgr.Grammar.from_regex("((ab{100}){100}){100}"),
    "after a choice": xgr.Grammar.from_regex("(x|ya{99999})b"),
    "schema pattern": _schema({"type": "string", "pattern": "^q{999999}$"}),
    "schema const": _schema({"const": "c" * 5000}),
    "doubling rules": xgr.Grammar.from_ebnf(
        "root ::= a0\n" + "".join(f"a{i} ::= a{i + 1} a{i + 1}\n" for i in range(40)) + 'a40 ::= "x"\n'
    ),
    "recursion adding text": xgr.Grammar.from_ebnf('root ::= "(" root "x"{100} | "y"'),
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_long_forced_text_is_over_the_limit(name: str) -> None:
    assert forced_text_bound(BOMBS[name].serialize_json()) > JUMP_FORWARD_LIMIT


def test_long_chains_of_rules_settle_with_a_small_bound() -> None:
    """The fixpoints follow the rules' dependencies: thousands of chained rules (each a property of a
    wide schema, or a hand-written chain) settle instead of counting as unbounded."""
    chain = (
        "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(3000)) + 'r3000 ::= "z"\n'
    )
    assert forced_text_bound(xgr.Grammar.from_ebnf(chain).serialize_json()) <= 2
    props = {f"p{i}": {"type": "string"} for i in range(2000)}
    wide = _schema({"type": "object", "properties": props, "required": list(props)})
    assert forced_text_bound(wide.serialize_json()) <= JUMP_FORWARD_LIMIT


def test_the_backend_asks_no_jump_forward_of_a_grammar_over_the_limit(
    checkpoint: Checkpoint, tokenizer: Tokenizer
) -> None:
    backend = GrammarBackend(tokenizer, checkpoint.config.vocab_size)
    bomb = backend.new_matcher(backend.compile(GrammarSpec("regex", "a{99999999}")))
    assert bomb.jump_forward() == ""
    small = backend.new_matcher(backend.compile(GrammarSpec("regex", "abc{3}d")))
    assert small.jump_forward() == "abcccd"
