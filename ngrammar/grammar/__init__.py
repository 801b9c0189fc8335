"""Grammar-constrained decoding on xgrammar: specs, cached compilation, matchers and token masks."""

from ngrammar.grammar.backend import (
    GrammarBackend,
    GrammarError,
    GrammarKind,
    GrammarMatcher,
    GrammarRejectedError,
    GrammarSpec,
    check_json_schema,
    grammar_spec_from_request,
)
from ngrammar.grammar.tree_mask import (
    allocate_bitmask,
    apply_bitmask,
    bitmask_width,
    build_tree_bitmask,
    fill_tree_bitmask,
    grammar_valid_nodes,
    unpack_bitmask,
)

__all__ = [
    "GrammarBackend",
    "GrammarError",
    "GrammarKind",
    "GrammarMatcher",
    "GrammarRejectedError",
    "GrammarSpec",
    "allocate_bitmask",
    "apply_bitmask",
    "bitmask_width",
    "build_tree_bitmask",
    "check_json_schema",
    "fill_tree_bitmask",
    "grammar_spec_from_request",
    "grammar_valid_nodes",
    "unpack_bitmask",
]
