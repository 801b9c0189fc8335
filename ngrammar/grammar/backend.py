"""Grammar specs, compilation (cached, off the engine loop) and per-request matchers on xgrammar.

A request names at most one output grammar: a JSON schema, a regex, an EBNF grammar or "any JSON
object". ``grammar_spec_from_request`` turns the request fields into a hashable ``GrammarSpec``;
``GrammarBackend`` compiles specs against the model's vocabulary once each (an LRU bounded by count
and by the compiled grammars' bytes, shared by the blocking and the thread-pool entry points) and
hands out ``GrammarMatcher`` objects, which track one request's position in its grammar as tokens
are committed.

JSON schemas are bounded before any recursive work (``MAX_SCHEMA_DEPTH`` levels of JSON nesting) and
may only reference their own definitions (``$ref`` to ``#...``): xgrammar drops a remote or file
reference silently, which would turn a constrained request into an unconstrained one.

Every user-caused failure surfaces as ``GrammarError`` (a ``ValueError``) whose message names the
kind of grammar that is wrong, so the server can answer 400 with it verbatim.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from ngrammar.grammar.forced_bound import JUMP_FORWARD_LIMIT, forced_text_bound
from ngrammar.model.tokenizer import Tokenizer

if TYPE_CHECKING:  # xgrammar takes seconds to import; the backend loads it on first use
    import xgrammar as xgr

GrammarKind = Literal["json_schema", "regex", "ebnf", "json_object"]

# xgrammar's C++ checks prefix messages with "[hh:mm:ss] /path/file.cc:123: Check failed: (...) is
# false: "; users need only the part after it.
_XGR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")

MAX_SCHEMA_DEPTH = 64  # JSON nesting levels of a schema; deeper ones are refused before any recursion
# Keywords whose values are data, not subschemas: a "$ref" key inside them is not a reference.
_SCHEMA_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
# Keywords whose values map names to subschemas: a key inside them is a name, not a keyword.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class GrammarError(ValueError):
    """A grammar that cannot be used: malformed, unsupported, or more than one per request."""


@dataclass(frozen=True)
class GrammarSpec:
    """One request's output grammar; hashable, so it keys the compile cache.

    ``source`` is the compact JSON text for ``json_schema``, the pattern for ``regex``, the
    grammar text for ``ebnf`` and the empty string for ``json_object``.
    """

    kind: GrammarKind
    source: str


def grammar_spec_from_request(
    json_schema: dict[str, Any] | bool | str | None = None,
    regex: str | None = None,
    ebnf: str | None = None,
    json_object: bool = False,
) -> GrammarSpec | None:
    """The request's grammar, or None when it has none; raises GrammarError if two are set."""
    given = [json_schema is not None, regex is not None, ebnf is not None, bool(json_object)]
    if sum(given) > 1:
        raise GrammarError("only one of json_schema, regex, ebnf, json_object may be set")
    if json_schema is not None:
        return GrammarSpec("json_schema", _canonical_schema(json_schema))
    if regex is not None:
        return GrammarSpec("regex", regex)
    if ebnf is not None:
        return GrammarSpec("ebnf", ebnf)
    if json_object:
        return GrammarSpec("json_object", "")
    return None


def _canonical_schema(schema: dict[str, Any] | bool | str) -> str:
    """Compact JSON text, so equal schemas spelled with different whitespace share a cache entry.

    Keys are deliberately not sorted: xgrammar emits object properties in the order the schema
    lists them, so sorting ``properties`` would change the output the grammar produces.
    """
    parsed = _parse_schema(schema) if isinstance(schema, str) else _require_schema_type(schema)
    return json.dumps(parsed, separators=(",", ":"), ensure_ascii=False)


def _parse_schema(text: str) -> dict[str, Any] | bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid JSON schema: not valid JSON ({e})") from None
    except RecursionError:
        raise GrammarError(f"invalid JSON schema: nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    return _require_schema_type(value)


def _require_schema_type(value: Any) -> dict[str, Any] | bool:
    """A schema is a JSON object (or, per JSON Schema, true/false), bounded in depth, whose ``$ref``s
    are local."""
    if not isinstance(value, (dict, bool)):
        raise GrammarError(f"invalid JSON schema: must be a JSON object, got {type(value).__name__}")
    check_schema_shape(value)
    return value


def check_schema_shape(schema: Any, max_depth: int = MAX_SCHEMA_DEPTH) -> None:
    """Refuse a schema nested deeper than ``max_depth`` JSON levels or holding a non-local ``$ref``.

    Iterative, so it is safe on any input (the recursive checks after it are then bounded too).
    """
    # (value, depth, path, role): role "schema" (keywords), "map" (names -> schemas) or "data".
    stack: list[tuple[Any, int, str, str]] = [(schema, 1, "", "schema")]
    while stack:
        value, depth, where, role = stack.pop()
        if depth > max_depth:
            raise GrammarError(
                f"invalid JSON schema: nested deeper than {max_depth} levels (at {where or '/'})"
            )
        if isinstance(value, dict):
            ref = value.get("$ref")
            if role == "schema" and isinstance(ref, str) and not ref.startswith("#"):
                raise GrammarError(
                    f"invalid JSON schema: $ref {ref[:200]!r} (at {where or '/'}) is not a local reference; "
                    "remote and file references are not fetched: inline the schema under $defs and "
                    "refer to it as #/$defs/NAME"
                )
            for key, item in value.items():
                if isinstance(item, (dict, list)):
                    stack.append((item, depth + 1, f"{where}/{key}", _child_role(role, key)))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (dict, list)):
                    stack.append((item, depth + 1, f"{where}/{i}", role))


def _child_role(role: str, key: str) -> str:
    if role != "schema":
        return "data" if role == "data" else "schema"  # a map's values are schemas
    if key in _SCHEMA_DATA_KEYWORDS:
        return "data"
    return "map" if key in _SCHEMA_MAPS else "schema"


def check_json_schema(schema: dict[str, Any] | bool) -> None:
    """Validate against the schema's meta-schema (its ``$schema`` draft, else the newest).

    xgrammar itself rejects only what it cannot convert; the meta-schema also catches wrongly typed
    keywords that it would silently ignore.
    """
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(schema).check_schema(schema)
    except RecursionError:
        raise GrammarError("invalid JSON schema: nested too deeply to check") from None
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise GrammarError(
            f"invalid JSON schema: {e.message}" + (f" (at {where})" if where else "")
        ) from None


def _xgrammar_message(error: Exception) -> str:
    text = str(error).strip()
    return _XGR_LOCATION.sub("", text).strip() or type(error).__name__


class GrammarRejectedError(RuntimeError):
    """A token taken with ``accept_masked`` was not allowed after all: an engine bug, not bad input."""


class GrammarMatcher:
    """One request's parser state in its grammar; a thin wrapper over ``xgrammar.GrammarMatcher``.

    Invariant kept by the engine: the matcher has accepted exactly the request's committed output
    tokens (through ``accept_masked`` and ``settle``); draft exploration
    (``tree_mask``) always rolls back what it accepts.

    Deferred tokens: a token sampled under this matcher's own bitmask is allowed by construction,
    so the engine hands it over with ``accept_masked`` after the device->host read, and xgrammar
    accepts it at the next ``settle`` (or any call that reads the state), which the engine makes
    right after the next forward is launched: on a GPU the work runs while the device computes
    instead of between steps. ``is_terminated`` answers without settling: xgrammar terminates
    exactly when it accepts a stop token.
    """

    def __init__(
        self,
        inner: xgr.GrammarMatcher,
        vocab_size: int,
        stop_token_ids: frozenset[int],
        jump_forward: bool = True,
        start: np.ndarray | None = None,
    ) -> None:
        self._m = inner
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids  # the stop tokens the grammar was compiled with
        self._jumps = jump_forward  # False: the grammar may force more text than JUMP_FORWARD_LIMIT
        self._pending: list[int] = []  # accept_masked tokens not yet given to xgrammar, in order
        self._start = start  # int32 [W]: the grammar's start-state row, shared by its matchers (read only)
        self._depth = 0  # tokens xgrammar holds: 0 means the matcher is at the grammar's start

    def accept_token(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        self._settled()
        return self._take(int(token))

    def _take(self, token: int) -> bool:
        if 0 <= token < self.vocab_size and self._m.accept_token(token):
            self._depth += 1
            return True
        return False

    def accept_masked(self, token: int) -> None:
        """Commit a token drawn under this matcher's own bitmask; xgrammar takes it at ``settle``."""
        self._pending.append(int(token))

    def settle(self) -> int | None:
        """Give the deferred tokens to xgrammar; returns the first one it rejects (the rest are
        dropped with it), None when all were accepted."""
        pending, self._pending = self._pending, []
        for token in pending:
            if not self._take(token):
                return token
        return None

    def _settled(self) -> None:
        if self._pending and (rejected := self.settle()) is not None:
            raise GrammarRejectedError(f"grammar rejected committed token {rejected}")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bits into ``bitmask[row]`` (CPU int32 [R, ceil(V/32)]).

        Must not be called once terminated: nothing may follow the stop token.
        """
        start = self.start_row()
        if start is not None:
            bitmask.numpy()[row] = start
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    def start_row(self) -> np.ndarray | None:
        """The grammar's start-state row (int32 [W], read only) while the matcher is at the start
        with nothing deferred, else None (its row must be filled). Settles first."""
        self._settled()
        return self._start if self._depth == 0 else None

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (history is unlimited; n must not exceed it)."""
        self._settled()
        if n > 0:
            self._m.rollback(n)
            self._depth -= n

    def is_terminated(self) -> bool:
        """True once a stop token ended the grammar; no further token is accepted."""
        if self._pending:  # nothing is accepted after a stop token, so only the last can be one
            return self._pending[-1] in self.stop_token_ids
        return bool(self._m.is_terminated())

    def allows_any_token(self) -> bool:
        """Whether some token may follow: False once terminated, or at a dead end of the grammar
        (a state no token continues, where no text completes it)."""
        if self.is_terminated():
            return False
        self._settled()
        bitmask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        self._m.fill_next_token_bitmask(bitmask, 0)  # (not fill_bitmask: the step profilers count those)
        return bool(bitmask.any())

    def jump_forward(self) -> str:
        """The text every continuation of the current state starts with (xgrammar's jump-forward
        string): empty where the next character is not forced, or once completed or terminated, and
        always for a grammar that may force more than ``JUMP_FORWARD_LIMIT`` characters (xgrammar
        would build all of them)."""
        self._settled()
        if not self._jumps or self._m.is_terminated():
            return ""
        return str(self._m.find_jump_forward_string())

    @property
    def xgrammar_matcher(self) -> xgr.GrammarMatcher:
        """The wrapped ``xgrammar.GrammarMatcher`` (settled), for calls this wrapper does not cover."""
        self._settled()
        return self._m


class GrammarBackend:
    """Compiles grammar specs for one model's vocabulary and creates matchers.

    ``vocab_size`` is the model's logits width (the config's vocab), which may exceed the
    tokenizer's length; xgrammar then treats the extra ids as never allowed.

    The cache holds at most ``cache_size`` grammars and ``cache_max_bytes`` of compiled memory
    (xgrammar's ``memory_size_bytes``; one wide JSON schema can take 100+ MB), least recently used
    out first. A pinned entry (``pin``: a grammar between its compilation and its request's
    admission) is never evicted, so the engine finds it without compiling again.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        cache_size: int = 256,
        compile_threads: int = 2,
        cache_max_bytes: int = 2 << 30,
    ) -> None:
        import xgrammar as xgr

        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if cache_max_bytes < 1:
            raise ValueError(f"cache_max_bytes must be >= 1, got {cache_max_bytes}")
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.cache_max_bytes = cache_max_bytes
        stop = sorted(int(t) for t in tokenizer.eos_token_ids)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf, vocab_size=vocab_size, stop_token_ids=stop or None
        )
        self.stop_token_ids = frozenset(int(t) for t in self.tokenizer_info.stop_token_ids)
        # Our LRU is the only cache: xgrammar's own one is unbounded by count and would duplicate it.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=compile_threads, cache_enabled=False
        )
        # Compilations run here and nowhere else in the server: a slow one holds a worker of this
        # pool, never the threads that tokenize other requests or the event loop.
        self._pool = ThreadPoolExecutor(max_workers=compile_threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()  # newest last
        self._bytes: dict[GrammarSpec, int] = {}  # memory of each cached grammar
        self._pins: dict[GrammarSpec, int] = {}  # pin counts; pinned entries are not evicted
        self._in_flight: dict[GrammarSpec, Future[xgr.CompiledGrammar]] = {}  # one compile per spec
        # id(compiled grammar) -> whether it forces at most JUMP_FORWARD_LIMIT characters (set at
        # compile, dropped with the grammar: CompiledGrammar is not hashable)
        self._jumps: dict[int, bool] = {}
        self.compile_count = 0  # compilations that actually ran (cache misses), for tests and stats
        self._start_rows: dict[int, np.ndarray] = {}  # id(compiled grammar) -> ``start_row``

    @property
    def cache_bytes(self) -> int:
        """Compiled memory the cache holds now."""
        with self._lock:
            return sum(self._bytes.values())

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The ``xgrammar.CompiledGrammar`` for ``spec``; compiles on a cache miss (blocking).

        Concurrent calls for the same spec wait for one compilation. Failures raise GrammarError
        and leave nothing cached, so a later call tries again.
        """
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            pending = self._in_flight.get(spec)
            if pending is None:
                pending = Future()
                self._in_flight[spec] = pending
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()
        try:
            compiled = self._compile_uncached(spec)
        except BaseException as e:
            with self._lock:
                del self._in_flight[spec]
            pending.set_exception(e)
            raise
        with self._lock:
            del self._in_flight[spec]
            self._insert(spec, compiled)
        pending.set_result(compiled)
        return compiled

    def _insert(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar) -> None:
        """Cache ``compiled`` as the newest entry, then evict the oldest unpinned ones past the
        bounds (the new one last: alone over the byte budget, it is not kept unless pinned)."""
        self._cache[spec] = compiled
        self._cache.move_to_end(spec)
        self._bytes[spec] = int(compiled.memory_size_bytes)
        total = sum(self._bytes.values())
        for old in list(self._cache):
            if len(self._cache) <= self.cache_size and total <= self.cache_max_bytes:
                break
            if self._pins.get(old, 0) == 0:
                total -= self._bytes.pop(old)
                del self._cache[old]

    def pin(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar, count: int = 1) -> None:
        """Keep ``spec`` cached (as ``compiled``, re-inserted if it was evicted meanwhile) until
        ``unpin`` was called ``count`` times."""
        with self._lock:
            self._pins[spec] = self._pins.get(spec, 0) + count
            if spec not in self._cache:
                self._insert(spec, compiled)
            else:
                self._cache.move_to_end(spec)

    def unpin(self, spec: GrammarSpec) -> None:
        with self._lock:
            left = self._pins.get(spec, 0) - 1
            if left > 0:
                self._pins[spec] = left
                return
            self._pins.pop(spec, None)
            if spec in self._cache:  # settle the bounds it may have held open
                self._insert(spec, self._cache[spec])

    def compile_async(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """``compile`` on the backend's thread pool; a cache hit returns an already-done future.

        xgrammar releases the GIL while compiling, so the engine loop keeps running meanwhile. A
        queued (not yet running) compilation can be cancelled with ``Future.cancel``; a running one
        finishes (xgrammar cannot be interrupted) and is cached for a retry.
        """
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        if hit is not None:
            done: Future[xgr.CompiledGrammar] = Future()
            done.set_result(hit)
            return done
        return self._pool.submit(self.compile, spec)

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; the stop tokens are the tokenizer's EOS ids. Its
        first row is the grammar's start row, filled once per compiled grammar (``start_row``)."""
        jumps = self._jumps.get(id(compiled), False)  # compiled elsewhere: no bound known, no jumps
        inner = self._xgr.GrammarMatcher(compiled)
        return GrammarMatcher(inner, self.vocab_size, self.stop_token_ids, jumps, self.start_row(compiled))

    def start_row(self, compiled: xgr.CompiledGrammar) -> np.ndarray:
        """The next-token row of ``compiled`` at its start (int32 [W], read only), filled on first
        use and kept while the compiled grammar lives (keyed by its id, dropped when it is freed)."""
        key = id(compiled)
        with self._lock:
            row = self._start_rows.get(key)
        if row is not None:
            return row
        bitmask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        row = bitmask.numpy()[0]
        row.flags.writeable = False
        with self._lock:
            if key not in self._start_rows:
                self._start_rows[key] = row
                weakref.finalize(compiled, self._start_rows.pop, key, None)
            return self._start_rows[key]

    def close(self) -> None:
        """Stop the compile threads (pending compilations finish first)."""
        self._pool.shutdown(wait=True)

    def _compile_uncached(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compile_fn, what = self._compiler_for(spec)
        with self._lock:
            self.compile_count += 1
        try:
            compiled = compile_fn()
        except RecursionError:
            raise GrammarError(f"invalid {what}: nested too deeply") from None
        except (GrammarError, ImportError):
            # A missing module is the deployment's fault, not the request's: it must not read as
            # "invalid JSON schema" (it did on a GPU box staged without jsonschema).
            raise
        except Exception as e:  # xgrammar raises RuntimeError (and a few others) for bad input
            raise GrammarError(f"invalid {what}: {_xgrammar_message(e)}") from None
        self._check_satisfiable(compiled, what)
        self._jumps[id(compiled)] = self._forces_little(spec)
        weakref.finalize(compiled, self._jumps.pop, id(compiled), None)
        return compiled

    def _check_satisfiable(self, compiled: xgr.CompiledGrammar, what: str) -> None:
        """A grammar must allow some first token (EOS, for one that matches only the empty string):
        otherwise every step would mask the whole vocabulary and the request could only fail inside
        the engine (it did, as a server error, for the regex ``[^\\s\\S]``)."""
        if not self.start_row(compiled).any():
            raise GrammarError(f"invalid {what}: it matches no text this tokenizer can produce")

    def _forces_little(self, spec: GrammarSpec) -> bool:
        """Whether ``spec`` forces at most ``JUMP_FORWARD_LIMIT`` characters anywhere. The bound reads
        the grammar before compilation: forced text depends on the language only, and a compiled
        grammar serializes its per-rule automata too (57 MB for 1,000 chained rules)."""
        if spec.kind == "ebnf" and "(=" in spec.source:
            return False  # a hand-written lookahead may narrow what follows a rule past what the bound sees
        xgr = self._xgr
        if spec.kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(spec.source)
        elif spec.kind == "regex":
            grammar = xgr.Grammar.from_regex(spec.source)
        elif spec.kind == "ebnf":
            grammar = xgr.Grammar.from_ebnf(spec.source)
        else:
            grammar = xgr.Grammar.builtin_json_grammar()
        return forced_text_bound(grammar.serialize_json()) <= JUMP_FORWARD_LIMIT

    def _compiler_for(self, spec: GrammarSpec) -> tuple[Callable[[], xgr.CompiledGrammar], str]:
        c = self._compiler
        if spec.kind == "json_schema":
            return (lambda: self._compile_schema(spec.source)), "JSON schema"
        if spec.kind == "regex":
            return (lambda: c.compile_regex(spec.source)), "regex"
        if spec.kind == "ebnf":
            return (lambda: c.compile_grammar(spec.source)), "EBNF grammar"
        if spec.kind == "json_object":
            return c.compile_builtin_json_grammar, "JSON grammar"
        raise GrammarError(f"unknown grammar kind: {spec.kind!r}")

    def _compile_schema(self, source: str) -> xgr.CompiledGrammar:
        check_json_schema(_parse_schema(source))
        return self._compiler.compile_json_schema(source)
