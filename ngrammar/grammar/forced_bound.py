"""An upper bound on the text a grammar can force, computed once per compiled grammar.

xgrammar's ``find_jump_forward_string`` has no length limit: on ``a{99999999}`` it builds the whole
100-million-character string (about 110 bytes and 0.45 µs per character in its parser history).
``forced_text_bound`` bounds, from the grammar's rules alone, the longest text any reachable state
can force; the backend turns jump-forward off for a grammar whose bound exceeds what drafting can
use, so the call is never made where it could be long. The bound is linear in the grammar's size.

Why it is an upper bound: the forced text of a state is the longest common prefix (LCP) of every
completion, so it is at most the LCP of any non-empty subset of them. For an expression ``e``
followed by text ``X``: ``LCP(L(e)·X) <= minlen(e) + LCP(X)`` (take e's shortest string), and
``LCP(L(e)·X) <= brk(e)`` where ``brk`` is 0 at a character class of two or more characters (both
continue alike), the minimum over the live alternatives of a choice, and through a sequence the
least ``minlen(prefix) + brk(element)``. A state is a stack of rule positions; ``into[rule]`` is the
largest bound of the text after the rule over every place it is entered from, a fixpoint that must
settle (a recursion that adds text at each level never does: no bound). A lookahead assertion only
narrows what follows a rule; xgrammar's own lookaheads repeat what does follow, so the bound ignores
them, and the backend gives no bound to a hand-written EBNF lookahead.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass

# xgrammar's GrammarExprType values (serialized grammar format v18): [type, length, payload...]
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _REF, _SEQ, _CHOICES, _TAG, _REPEAT = range(9)
_REGEX = 12  # [in_json_string, pattern bytes...]: a schema's "pattern", kept as a regex
_ESCAPE = 6  # inside a JSON string a character takes at most 6 ("\uXXXX")
_UPDATES = 64  # times a rule's values may change; a continuation bound still growing counts as unbounded
INF = math.inf
# Characters of forced text a grammar may have for jump-forward to be asked for: more than a draft
# tree can use (D <= 64 tokens; the drafting code keeps at most MAX_TOKEN_BYTES per token).
JUMP_FORWARD_LIMIT = 4096


@dataclass(frozen=True)
class _Grammar:
    exprs: list[tuple[int, list[int]]]  # expr id -> (type, payload)
    bodies: list[int]  # rule id -> body expr id
    root: int


def _parse(serialized: str) -> _Grammar:
    data = json.loads(serialized)
    flat, ptr = data["grammar_expr_data"], data["grammar_expr_indptr"]
    exprs = [(flat[a], flat[a + 2 : b]) for a, b in zip(ptr, [*ptr[1:], len(flat)])]
    return _Grammar(exprs, [int(rule[1]) for rule in data["rules"]], int(data["root_rule_id"]))


def _class_size(payload: list[int]) -> float:
    """Characters a class matches (payload: negated, then inclusive code point ranges)."""
    if payload[0]:
        return INF
    return sum(hi - lo + 1 for lo, hi in zip(payload[1::2], payload[2::2]))


class _Analysis:
    def __init__(self, g: _Grammar) -> None:
        self.g = g
        n = len(g.bodies)
        self.minlen: list[float] = [INF] * n  # per rule: its shortest string (INF: none known)
        self.brk: list[float] = [INF] * n  # per rule: LCP(L(rule)·X) <= brk for every X
        self.into: list[float] = [-INF] * n  # per rule: largest LCP bound of the text after it
        self.top = 0.0  # the largest state bound seen
        self._raised: set[int] = set()  # rules whose ``into`` the last ``visit`` raised
        self._regexes: dict[int, tuple[float, float, float]] = {}  # expr -> (minlen, brk, top)

    # ----------------------------------------------- minlen and brk (any round's values are sound)
    def summary(self, expr: int) -> tuple[float, float]:
        """(minlen, brk) of an expression from the rules' current values."""
        kind, p = self.g.exprs[expr]
        if kind == _BYTES:
            return float(len(p)), INF
        if kind in (_CLASS, _CLASS_STAR):
            many = _class_size(p) > 1
            return (0.0 if kind == _CLASS_STAR else 1.0), (0.0 if many else INF)
        if kind == _EMPTY:
            return 0.0, INF
        if kind == _REF:
            return self.minlen[p[0]], self.brk[p[0]]
        if kind == _SEQ:
            total, brk = 0.0, INF
            for e in p:
                m, b = self.summary(e)
                brk = min(brk, total + b)
                total += m
            return total, brk
        if kind == _CHOICES:
            live = [s for s in map(self.summary, p) if s[0] < INF]  # a dead alternative adds no text
            return (min(s[0] for s in live), min(s[1] for s in live)) if live else (INF, INF)
        if kind == _REPEAT:
            rule, low, high = p
            if high == 0:
                return 0.0, INF
            return (low * self.minlen[rule] if low else 0.0), self.brk[rule]
        if kind == _REGEX:
            return self.regex(expr)[:2]
        return INF, INF  # tag dispatch, token-level expressions: nothing known

    def settle_summaries(self) -> None:
        """A worklist over the rules, callers again after a callee changed (intermediate values are
        sound, so a rule that keeps changing just keeps its last values)."""
        callers: list[set[int]] = [set() for _ in self.g.bodies]
        for rule, body in enumerate(self.g.bodies):
            for callee in self.callees(body):
                callers[callee].add(rule)
        work, queued = deque(reversed(range(len(self.g.bodies)))), set(range(len(self.g.bodies)))
        updates = [0] * len(self.g.bodies)
        while work:
            rule = work.popleft()
            queued.discard(rule)
            s = self.summary(self.g.bodies[rule])
            if s == (self.minlen[rule], self.brk[rule]) or updates[rule] > _UPDATES:
                continue
            self.minlen[rule], self.brk[rule] = s
            updates[rule] += 1
            for caller in callers[rule] - queued:
                work.append(caller)
                queued.add(caller)

    def callees(self, expr: int) -> set[int]:
        out: set[int] = set()
        stack = [expr]
        while stack:
            kind, p = self.g.exprs[stack.pop()]
            if kind in (_REF, _REPEAT):
                out.add(p[0])
            elif kind in (_SEQ, _CHOICES):
                stack.extend(p)
        return out

    # ----------------------------------------------- continuations (must settle)
    def visit(self, expr: int, after: float) -> None:
        """Raise the bounds of the states inside ``expr``, followed by text of LCP bound ``after``."""
        kind, p = self.g.exprs[expr]
        if kind == _BYTES:
            self.top = max(self.top, len(p) + after)
        elif kind in (_CLASS, _CLASS_STAR, _EMPTY):
            many = kind != _EMPTY and _class_size(p) > 1
            self.top = max(self.top, 0.0 if many else (1.0 if kind == _CLASS else 0.0) + after)
        elif kind == _REF:
            self.raise_into(p[0], after)
        elif kind == _SEQ:
            for e in reversed(p):
                self.visit(e, after)
                m, b = self.summary(e)
                after = min(b, m + after)
        elif kind == _CHOICES:
            for e in p:
                self.visit(e, after)
        elif kind == _REPEAT:
            rule, low, high = p
            if high != 0:  # inside the first copy: the other mandatory copies, then what follows
                rest = min(self.brk[rule], (low - 1) * self.minlen[rule] + after) if low > 1 else after
                self.raise_into(rule, rest)
        elif kind == _REGEX:  # top(after) <= top(0) + after: each state's bound grows by at most that
            self.top = max(self.top, self.regex(expr)[2] + after)
        else:
            self.top = INF

    def regex(self, expr: int) -> tuple[float, float, float]:
        """(minlen, brk, largest state bound with nothing after) of a regex expression."""
        hit = self._regexes.get(expr)
        if hit is None:
            hit = self._regexes[expr] = _regex_summary(self.g.exprs[expr][1])
        return hit

    def raise_into(self, rule: int, after: float) -> None:
        if after > self.into[rule]:
            self.into[rule] = after
            self._raised.add(rule)

    def settle_continuations(self) -> float:
        """A worklist from the root: a rule is visited again after its ``into`` rose; one that rose
        more than ``_UPDATES`` times (a recursion adding text at each level) counts as unbounded."""
        root = self.g.root
        self.into[root] = 0.0  # after the root: the stop token, no text
        work, queued, updates = deque([root]), {root}, [0] * len(self.g.bodies)
        while work:
            rule = work.popleft()
            queued.discard(rule)
            self.top = max(self.top, self.into[rule])
            self._raised.clear()
            self.visit(self.g.bodies[rule], self.into[rule])
            for callee in self._raised:
                updates[callee] += 1
                if updates[callee] > _UPDATES:
                    if self.into[callee] == INF:
                        continue
                    self.into[callee] = INF
                if callee not in queued:
                    work.append(callee)
                    queued.add(callee)
        return self.top


def _regex_summary(payload: list[int]) -> tuple[float, float, float]:
    import xgrammar as xgr

    try:
        sub = _Analysis(_parse(xgr.Grammar.from_regex(bytes(payload[1:]).decode()).serialize_json()))
    except (RuntimeError, ValueError):
        return INF, INF, INF
    sub.settle_summaries()
    top = sub.settle_continuations()
    grow = _ESCAPE if payload[0] else 1
    root = sub.g.root
    return grow * sub.minlen[root], grow * sub.brk[root], grow * top


def forced_text_bound(serialized_grammar: str) -> float:
    """An upper bound on the characters any state of the grammar forces (``math.inf``: none found).

    ``serialized_grammar``: ``xgrammar.Grammar.serialize_json()`` (of ``CompiledGrammar.grammar``)."""
    analysis = _Analysis(_parse(serialized_grammar))
    analysis.settle_summaries()
    return analysis.settle_continuations()
