"""Drafts copied from the prompt's text where its tokens cannot match.

The n-gram corpus matches tokens, so it copies from a prompt only where the output spells the text
with the prompt's tokens. Copying often changes the spelling at its start: a JSON value opens with
a quote, so ``"Bob`` is written with ``Bob`` (no leading space) where the prompt had `` Bob``, and
``"Berlin`` as ``Ber`` + ``lin`` where the prompt had `` Berlin``; the token after such a value's
first one then follows no indexed window, and the step is a plain one. ``TextLookup`` matches
bytes instead: the longest suffix of the output's last bytes that occurs in the prompt's bytes
(followed by more), and drafts the prompt's bytes after it, tokenized afresh (the output's last
token ends there, so a new token starts).

It only proposes: the proposer checks every node against the grammar, and the target model's
verification decides what is kept, so it changes speed, never the output.

A copy starts at a word: a suffix shorter than ``LONG_BYTES`` counts only where it starts one in the
output and the prompt (a non-alphanumeric byte before it, in both), so ``Bob`` after ``"`` matches
`` Bob``, while ``tle`` after ``Ket`` does not take the text after ``kettle``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ngrammar.speculative.forced import ForcedText
    from ngrammar.speculative.request import DraftRequest as Seq

MIN_BYTES = 3  # a shorter suffix occurs almost anywhere in a prompt
LONG_BYTES = 8  # from this long a suffix counts wherever it occurs; shorter ones at word starts only
MAX_BYTES = 32  # the longest suffix tried
TAIL_TOKENS = 16  # the last tokens decoded for the suffix
CONTINUATION_BYTES = 48  # prompt bytes after the match, tokenized for the draft


class _Match(NamedTuple):
    length: int  # len(token_ids) it was found for
    size: int  # bytes of the suffix found (0: none of at least MIN_BYTES)
    end: int  # where the first occurrence ends in the prompt's bytes


class TextLookup:
    """Byte-level prompt lookup per sequence (prompt bytes kept while it drafts; ``forget``)."""

    def __init__(self, forced: ForcedText) -> None:
        self.forced = forced
        self._prompts: dict[Hashable, bytes] = {}
        self._matches: dict[Hashable, _Match] = {}

    def match(self, seq: Seq) -> int:
        """Bytes of the longest suffix of the sequence's text found in its prompt with text after
        it; 0 below ``MIN_BYTES`` (computed once per length of ``token_ids``)."""
        return self._match(seq).size

    def continuation(self, seq: Seq, tokens: int) -> tuple[int, ...]:
        """The prompt's text after the match, tokenized: at most ``tokens`` tokens (none without a
        match)."""
        found = self._match(seq)
        if not found.size or tokens < 1:
            return ()
        prompt = self._prompts[seq.seq_id]
        text = prompt[found.end : found.end + CONTINUATION_BYTES].decode("utf-8", "ignore")
        return self.forced.tokenize(text)[:tokens] if text else ()

    def forget(self, seq_ids: Iterable[Hashable]) -> None:
        for seq_id in seq_ids:
            self._prompts.pop(seq_id, None)
            self._matches.pop(seq_id, None)

    def _match(self, seq: Seq) -> _Match:
        length = len(seq.token_ids)
        hit = self._matches.get(seq.seq_id)
        if hit is not None and hit.length == length:
            return hit
        prompt = self._prompts.get(seq.seq_id)
        if prompt is None:
            prompt = self._prompts[seq.seq_id] = self.forced.decode(seq.prompt_token_ids)
        tail = self.forced.decode(seq.token_ids[-TAIL_TOKENS:])[-MAX_BYTES:]
        size, end = _longest(prompt, tail)
        if 0 < size < LONG_BYTES:
            size, end = _at_word_start(prompt, tail, size)
        found = self._matches[seq.seq_id] = _Match(length, size, end)
        return found


def _longest(prompt: bytes, tail: bytes) -> tuple[int, int]:
    """The longest suffix of ``tail`` (at least ``MIN_BYTES``) found in ``prompt`` with a byte after
    it, and where its first occurrence ends; (0, 0) for none. A suffix found means each shorter one
    is found (ending at the same byte), so the longest is a binary search; ``find`` stops a byte
    early so that text follows the match."""
    size, end, lo, hi = 0, 0, MIN_BYTES, len(tail)
    while lo <= hi:
        mid = (lo + hi) // 2
        at = prompt.find(tail[-mid:], 0, len(prompt) - 1)
        if at >= 0:
            size, end, lo = mid, at + mid, mid + 1
        else:
            hi = mid - 1
    return size, end


def _at_word_start(prompt: bytes, tail: bytes, longest: int) -> tuple[int, int]:
    """The longest suffix of ``tail`` no longer than ``longest`` that starts a word in ``tail`` and,
    at its first such occurrence with a byte after it, in ``prompt``; (0, 0) for none."""
    for n in range(longest, MIN_BYTES - 1, -1):
        if n < len(tail) and not _boundary(tail[-n - 1]):
            continue
        needle = tail[-n:]
        at = prompt.find(needle, 0, len(prompt) - 1)
        while at >= 0:
            if at == 0 or _boundary(prompt[at - 1]):
                return n, at + n
            at = prompt.find(needle, at + 1, len(prompt) - 1)
    return 0, 0


def _boundary(byte: int) -> bool:
    """Whether a byte ends a word: ASCII other than letters and digits (UTF-8 multibyte parts are
    letters for this)."""
    return byte < 0x80 and not chr(byte).isalnum()
