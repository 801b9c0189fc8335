"""Tokenizations of grammar-forced text, for draft branches.

A grammar forces a *string* (``GrammarMatcher.jump_forward``: the text every continuation starts
with), not its tokens. The model may spell it differently from the tokenizer's canonical encoding
(``"name"`` as one token, or ``"`` + ``name`` + ``"``), and may merge its last characters with
what follows (a forced ``name"`` written as ``name`` + ``":``). ``ForcedText`` gives:

* ``canonical(text)``: the tokenizer's encoding (cached);
* ``alternatives(text)``: distinct token sequences decoding to exactly ``text``, canonical first
  (then the greedy longest-token spelling, then the first character split off), so a tree can
  hedge between spellings with sibling branches;
* ``overhang_candidates(text)``: single tokens that start with ``text`` and go past it (the merge
  with what follows), in vocabulary order (BPE merges are ranked: a lower id was a more frequent
  merge).

Nothing here checks a grammar: the proposer walks the matcher over every branch it keeps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ngrammar.grammar import GrammarBackend
    from ngrammar.model.tokenizer import Tokenizer

MAX_TOKEN_BYTES = 48  # the longest vocabulary token a greedy spelling tries (SmolLM2's longest: ~32)
CACHE_SIZE = 4096  # forced strings repeat (keys, punctuation): their tokenizations are cached


class ForcedText:
    """Canonical and hedged tokenizations over one vocabulary.

    ``decoded_vocab[i]``: the bytes token i decodes to (xgrammar's ``TokenizerInfo.decoded_vocab``);
    ``special``: ids never used to spell text; ``encode``: the tokenizer's canonical encoding of a
    string, without special tokens."""

    def __init__(
        self, encode: Callable[[str], list[int]], decoded_vocab: Sequence[bytes], special: Sequence[int]
    ) -> None:
        self._encode = encode
        self.vocab = [bytes(v) for v in decoded_vocab]  # token id -> its bytes
        skip = set(int(t) for t in special)
        self._by_bytes: dict[bytes, int] = {}  # bytes -> the lowest id spelling them
        self._by_first: dict[int, list[int]] = {}  # first byte -> ids starting with it, ascending
        for token, text in enumerate(self.vocab):
            if token in skip or not text:
                continue
            self._by_bytes.setdefault(text, token)
            self._by_first.setdefault(text[0], []).append(token)
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._overhangs: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # ``overhang_candidates``

    def decode(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.vocab[t] for t in tokens)

    def tokenize(self, text: str) -> tuple[int, ...]:
        """The tokenizer's encoding of ``text``, uncached (text that rarely repeats: the cache of
        ``canonical`` keeps the forced strings that do)."""
        return tuple(int(t) for t in self._encode(text)) if text else ()

    def canonical(self, text: str) -> tuple[int, ...]:
        """The tokenizer's encoding of ``text`` (empty for empty text)."""
        if not text:
            return ()
        hit = self._cache.get(text)
        if hit is not None:
            self._cache.move_to_end(text)
            return hit
        tokens = tuple(int(t) for t in self._encode(text))
        self._cache[text] = tokens
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return tokens

    def greedy(self, text: str) -> tuple[int, ...] | None:
        """The longest-token-first spelling of ``text``; None where some byte has no token."""
        data = text.encode()
        out: list[int] = []
        i = 0
        while i < len(data):
            for n in range(min(MAX_TOKEN_BYTES, len(data) - i), 0, -1):
                token = self._by_bytes.get(data[i : i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                return None
        return tuple(out)

    def alternatives(self, text: str, limit: int = 3) -> list[tuple[int, ...]]:
        """Up to ``limit`` distinct token sequences that decode to exactly ``text``, canonical first."""
        if not text:
            return []
        data = text.encode()
        out: list[tuple[int, ...]] = []
        candidates: list[tuple[int, ...] | None] = [self.canonical(text), self.greedy(text)]
        if len(text) > 1:
            head, tail = self.canonical(text[:1]), self.canonical(text[1:])
            candidates.append(head + tail)
        for tokens in candidates:
            if tokens and tokens not in out and self.decode(tokens) == data:
                out.append(tokens)
                if len(out) == limit:
                    break
        return out

    def overhang_candidates(self, text: bytes) -> tuple[int, ...]:
        """Every token whose bytes start with ``text`` and are longer, lowest id first (cached: the
        scan reads every token with ``text``'s first byte, thousands for a quote or a space)."""
        if not text:
            return ()
        hit = self._overhangs.get(text)
        if hit is not None:
            self._overhangs.move_to_end(text)
            return hit
        found = tuple(
            t
            for t in self._by_first.get(text[0], ())
            if len(self.vocab[t]) > len(text) and self.vocab[t].startswith(text)
        )
        self._overhangs[text] = found
        if len(self._overhangs) > CACHE_SIZE:
            self._overhangs.popitem(last=False)
        return found


def clip(text: str, tokens: int) -> tuple[str, bool]:
    """The part of forced ``text`` that a chain of ``tokens`` draft tokens can spell (a token spells at
    most ``MAX_TOKEN_BYTES`` bytes, so at most that many characters), and whether that is all of it:
    only that part is tokenized."""
    keep = max(tokens, 0) * MAX_TOKEN_BYTES
    return (text, True) if len(text) <= keep else (text[:keep], False)


def forced_text(backend: GrammarBackend, tokenizer: Tokenizer) -> ForcedText:
    """The ``ForcedText`` of a grammar backend's vocabulary (the model's logits width)."""
    info = backend.tokenizer_info
    special = [*info.special_token_ids, *info.stop_token_ids]
    return ForcedText(tokenizer.encode, info.decoded_vocab, special)
