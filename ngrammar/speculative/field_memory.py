"""Per-field value memory: what earlier outputs with the same JSON schema wrote at the same JSON path.

A batch job sends many requests with one schema, and a field such as ``items[].unit`` takes a few
values (``"kg"``, ``"pcs"``) over and over. ``FieldMemory`` scans each constrained sequence's
committed output (``JsonPath``: a tolerant incremental scanner, the grammar guarantees the JSON),
records the tokens of every scalar value (from the token boundary where the value may start to
the token that ends it, punctuation after it included) under (schema, path), and offers them as
drafts when a sequence is at that path again: from the value's start, or, part-way through it,
the rest of every remembered value that starts with the tokens written so far.

Bounded: at most ``capacity`` values in all, ``per_field`` per field, least recently used evicted
first (a lookup counts as a use). Values longer than ``max_value_tokens`` are not remembered.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ngrammar.speculative.request import DraftRequest as Seq

Path = tuple[str, ...]  # object keys, "[]" for an array element
FieldKey = tuple[Hashable, Path]  # (schema, path)

_WS = frozenset(b" \t\r\n")
_SCALAR = frozenset(b"0123456789+-.eEtruefalsn")  # number and literal characters


@dataclass
class JsonPath:
    """Incremental JSON scan of one output: where the next value goes and when values end.

    ``frames``: open containers, outermost first, each [kind b"{" or b"[", current key or None];
    ``expect_value``: the next non-space byte starts a value; a string is a key when it starts
    inside an object where no value is expected."""

    frames: list[list[object]] = field(default_factory=list)
    expect_value: bool = True
    in_string: bool = False
    is_key: bool = False
    escape: bool = False
    in_scalar: bool = False
    key: bytearray = field(default_factory=bytearray)
    ended: int = 0  # scalar values ended so far (strings, numbers, literals)
    started: int = 0  # ... and started

    def path(self) -> Path:
        """The path of the value expected or being written."""
        out = []
        for kind, key in self.frames:
            out.append("[]" if kind == 0x5B else str(key))
        return tuple(out)

    def feed(self, data: bytes) -> None:
        for ch in data:
            self._byte(ch)

    def _byte(self, ch: int) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == 0x5C:  # backslash
                self.escape = True
            elif ch == 0x22:  # closing quote
                self.in_string = False
                if self.is_key:
                    self.frames[-1][1] = self.key.decode(errors="replace")
                else:
                    self.ended += 1
                return
            if self.is_key:
                self.key.append(ch)
            return
        if self.in_scalar:
            if ch in _SCALAR:
                return
            self.in_scalar = False
            self.ended += 1
        if ch in _WS:
            return
        if ch == 0x22:  # opening quote
            self.in_string = True
            self.is_key = bool(self.frames) and self.frames[-1][0] == 0x7B and not self.expect_value
            if self.is_key:
                self.key = bytearray()
            else:
                self.started += 1
            self.expect_value = False
        elif ch in (0x7B, 0x5B):  # { [
            self.frames.append([ch, None])
            self.expect_value = ch == 0x5B
        elif ch == 0x3A:  # :
            self.expect_value = True
        elif ch == 0x2C:  # ,
            self.expect_value = bool(self.frames) and self.frames[-1][0] == 0x5B
        elif ch in (0x7D, 0x5D):  # } ]
            if self.frames:
                self.frames.pop()
            self.expect_value = False
        elif self.expect_value:
            self.in_scalar = True
            self.started += 1
            self.expect_value = False


@dataclass
class _Track:
    """One sequence's scan: output tokens consumed, and the value being written."""

    schema: Hashable
    scan: JsonPath = field(default_factory=JsonPath)
    consumed: int = 0
    start: int | None = None  # output index of the token boundary where the current value may start
    path: Path = ()
    begun: bool = False  # the value at ``start`` has begun (its first byte was scanned)


class FieldMemory:
    def __init__(self, capacity: int = 4096, per_field: int = 4, max_value_tokens: int = 24) -> None:
        if capacity < 1 or per_field < 1 or max_value_tokens < 1:
            raise ValueError("capacity, per_field and max_value_tokens must be positive")
        self.capacity = capacity
        self.per_field = per_field
        self.max_value_tokens = max_value_tokens
        self._lru: OrderedDict[tuple[FieldKey, tuple[int, ...]], None] = OrderedDict()  # oldest first
        self._fields: dict[FieldKey, OrderedDict[tuple[int, ...], None]] = {}  # newest last
        self._tracks: dict[Hashable, _Track] = {}
        self.vocab: Sequence[bytes] | None = None  # token id -> bytes; set by the proposer

    def __len__(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        """Forget every value (sequences keep their scans)."""
        self._lru.clear()
        self._fields.clear()

    # ------------------------------------------------------------------ storage
    def remember(self, key: FieldKey, value: tuple[int, ...]) -> None:
        if not value or len(value) > self.max_value_tokens:
            return
        values = self._fields.setdefault(key, OrderedDict())
        values[value] = None
        values.move_to_end(value)
        self._lru[(key, value)] = None
        self._lru.move_to_end((key, value))
        while len(values) > self.per_field:
            self._drop(key, next(iter(values)))
        while len(self._lru) > self.capacity:
            old_key, old_value = next(iter(self._lru))
            self._drop(old_key, old_value)

    def lookup(self, key: FieldKey) -> list[tuple[int, ...]]:
        """The values remembered for a field, most recent first (each counts as used)."""
        values = self._fields.get(key)
        if not values:
            return []
        out = list(reversed(values))
        for value in out:
            self._lru.move_to_end((key, value))
        return out

    def _drop(self, key: FieldKey, value: tuple[int, ...]) -> None:
        del self._lru[(key, value)]
        values = self._fields[key]
        del values[value]
        if not values:
            del self._fields[key]

    # ------------------------------------------------------------------ sequences
    def observe(self, seq: Seq) -> _Track | None:
        """Scan the sequence's output committed since the last call, remembering finished values."""
        track = self._track(seq)
        if track is None or self.vocab is None:
            return track
        output = seq.output_token_ids
        scan = track.scan
        for i in range(track.consumed, len(output)):
            if track.start is None and scan.expect_value and not scan.in_string:
                track.start, track.path, track.begun = i, scan.path(), False
            ended, started, depth = scan.ended, scan.started, len(scan.frames)
            scan.feed(self.vocab[output[i]])
            if track.start is None:
                continue
            if scan.ended > ended:
                self.remember((track.schema, track.path), tuple(output[track.start : i + 1]))
                track.start = None
            elif scan.started > started:
                track.begun = True
            elif not track.begun and (len(scan.frames) != depth or not scan.expect_value):
                track.start = None  # no scalar value started here (a container opened or closed)
        track.consumed = len(output)
        if track.start is None and scan.expect_value and not scan.in_string:
            track.start, track.path, track.begun = len(output), scan.path(), False
        return track

    def values(self, seq: Seq) -> list[tuple[int, ...]]:
        """Drafts for the sequence's next tokens: the rest of each remembered value of the field it
        is writing that starts with what it wrote of the value so far."""
        track = self.observe(seq)
        if track is None or track.start is None:
            return []
        written = tuple(seq.output_token_ids[track.start :])
        n = len(written)
        return [v[n:] for v in self.lookup((track.schema, track.path)) if len(v) > n and v[:n] == written]

    def forget(self, seq: Seq) -> None:
        """A finished sequence: remember its last values, then drop its scan."""
        self.observe(seq)
        self._tracks.pop(seq.seq_id, None)

    def _track(self, seq: Seq) -> _Track | None:
        track = self._tracks.get(seq.seq_id)
        if track is None:
            schema = seq.params.json_schema
            if schema is None:
                return None
            from ngrammar.grammar import grammar_spec_from_request

            spec = grammar_spec_from_request(json_schema=schema)
            track = self._tracks[seq.seq_id] = _Track(spec)
        return track
