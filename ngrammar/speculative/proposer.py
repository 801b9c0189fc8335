"""The draft proposer: one draft tree per sequence from every draft source, before a verify launch.

Sources, in the order they get the budget of D - 1 nodes (a node some source already drafted is
shared, never duplicated):

1. **grammar-forced text** at the root (``GrammarMatcher.jump_forward``): its canonical
   tokenization, the tokens that merge its last characters with what follows (``ForcedText``
   overhangs, as siblings of its last token);
2. **field memory** (``FieldMemory``): values earlier requests with the same grammar wrote at the
   same JSON path;
2b. **the prompt's text** (``TextLookup``) where the corpus matches fewer than ``TEXT_MATCH``
   tokens: the bytes after the output's last bytes in the prompt, tokenized afresh (a value copied
   from the prompt spelled with other tokens than the prompt's: ``"Ber`` + ``lin``);
3. **the n-gram corpus** (``NgramCorpus.drafts``), drafted wider than the budget under a grammar
   so the drafts the grammar forbids leave room for the next-best ones (refill);
4. **external corpora** the request drafts from (``DraftCorpora``);
5. **extensions**: at the forced branches' leaves and the deepest node, the text the grammar
   forces there and the corpus' continuation of the context extended by the branch;
6. the other spellings of the root's forced text (``ForcedText.alternatives``), as siblings.

Under a grammar every node is checked as it is added (the matcher walks the tree: accept /
roll back), so a tree holds only drafts the grammar allows; the matcher ends as it started.
Nothing reaches the output without the target model's verification, so the drafts change speed,
never the output. A proposer proposes: it never touches the KV cache or the scheduler.

A batch with nothing but the shared corpus to draft from (no grammar, or ``grammar_drafts`` off; no
external corpus; no narrower per-request width) takes the corpus' trees as one batched draft (``NgramCorpus.batch_get``, or the caller's trees drafted ahead) less their
padding and the drafts a grammar forbids (``trim_drafted``): what building them node by node would
give, without the per-node host work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ngrammar.speculative.corpus import NgramCorpus
from ngrammar.speculative.forced import clip
from ngrammar.speculative.text_lookup import TextLookup
from ngrammar.speculative.tree import PAD_TOKEN, DraftTree, carry_to_kept

if TYPE_CHECKING:
    from ngrammar.grammar import GrammarMatcher
    from ngrammar.speculative.external import DraftCorpora
    from ngrammar.speculative.field_memory import FieldMemory
    from ngrammar.speculative.forced import ForcedText
    from ngrammar.speculative.request import DraftRequest as Seq

# Under a grammar the corpus drafts this many times the budget, so forbidden drafts are replaced.
REFILL_FACTOR = 2
MAX_CORPUS_WIDTH = 64
OVERHANG_TRIES = 24  # overhang candidates checked against the grammar per forced branch (cost bound)
OVERHANGS = 1  # overhang siblings kept per forced branch
ALTERNATIVES = 2  # other spellings of the root's forced text, as sibling branches
EXTENSION_ROUNDS = 2  # leaves extended per tree (forced text, then the corpus from there)
# The match length a sequence whose grammar forces text at its root reports to the draft policy
# (at least): forced drafts are accepted about as often as drafts from a 3-token corpus match.
FORCED_MATCH = 3
# Below this corpus match a constrained sequence drafts from its prompt's text too, first, and
# reports this match length where that text matches (``TextLookup.match``).
TEXT_MATCH = 2
_EXTENSION_KEY = ("__proposer_extension__",)  # the corpus match cursor the extensions share


@dataclass(frozen=True)
class Proposal:
    """The trees to verify and what the draft policy learns from them."""

    tree: DraftTree  # [B, D'] D' <= the width asked for
    has_child: np.ndarray  # [B, D'] bool: a node had children as drafted (a run ending there is not censored)
    levels: list[int]  # [B] levels below each root as drafted
    pruned: int  # corpus drafts a grammar forbade
    batched: bool = False  # the corpus' trees in one call (``corpus_only``): trees drafted ahead apply


class _Builder:
    """One draft tree grown node by node; under a grammar each node is checked when added.

    Invariants: parent < child; a (parent, token) pair appears once; ``matcher`` (if any) has
    accepted the committed tokens plus the tokens on the root path of the nodes in ``path``."""

    def __init__(self, root: int, budget: int, matcher: GrammarMatcher | None) -> None:
        self.tokens = [root]
        self.parents = [-1]
        self.depth = [0]
        self.dead = [matcher is not None and matcher.is_terminated()]  # no child may follow
        self.had_child = [False]
        self.budget = budget  # non-root nodes
        self.matcher = matcher
        self.path: list[int] = []  # nodes whose tokens the matcher holds beyond the committed state
        self._kids: dict[tuple[int, int], int] = {}
        self._refused: set[tuple[int, int]] = set()
        self.pruned = 0

    @property
    def full(self) -> bool:
        return len(self.tokens) > self.budget

    @property
    def room(self) -> int:
        """Nodes that may still be added."""
        return self.budget + 1 - len(self.tokens)

    def chain(self, node: int) -> list[int]:
        """The nodes from the root's first child down to ``node`` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def goto(self, node: int) -> None:
        """Move the matcher to the state after ``node``'s root path."""
        if self.matcher is None:
            return
        chain = self.chain(node)
        k = 0
        while k < len(chain) and k < len(self.path) and chain[k] == self.path[k]:
            k += 1
        self.matcher.rollback(len(self.path) - k)
        self.path = chain[:k]  # what the matcher holds at every point, so ``finish`` rolls back exactly
        for n in chain[k:]:
            if not self.matcher.accept_token(self.tokens[n]):  # accepted when the node was added
                raise RuntimeError("a draft node's token no longer fits its grammar state")
            self.path.append(n)

    def add(self, parent: int, token: int, counted: bool = False) -> int | None:
        """The node for ``token`` under ``parent``: an existing one, a new one the grammar allows,
        or None (forbidden, no room, or nothing may follow the parent). ``counted``: a forbidden
        token counts in ``pruned`` and marks the parent as having had a child."""
        key = (parent, token)
        node = self._kids.get(key)
        if node is not None:
            return node
        if self.full or self.dead[parent] or key in self._refused:
            return None
        dead = False
        if self.matcher is not None:
            self.goto(parent)
            if not self.matcher.accept_token(token):
                self._refused.add(key)
                if counted:
                    self.pruned += 1
                    self.had_child[parent] = True
                return None
            dead = self.matcher.is_terminated()
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.dead.append(dead)
        self.had_child.append(False)
        self.had_child[parent] = True
        self._kids[key] = node
        if self.matcher is not None:
            self.path = self.path + [node]
        return node

    def add_path(self, parent: int, tokens: Sequence[int], counted: bool = False) -> list[int]:
        """Add ``tokens`` as a chain below ``parent``; the nodes added or reused, up to the first
        refusal (``counted``: as in ``add``)."""
        out = []
        for token in tokens:
            node = self.add(parent, int(token), counted)
            if node is None:
                break
            out.append(node)
            parent = node
        return out

    def add_tree(self, tokens: Sequence[int], parents: Sequence[int], at: int = 0) -> int:
        """Graft a drafted tree (node 0 = ``at``, parent < child, padding skipped) in its node order;
        returns the nodes it could not place for lack of room."""
        has_child = [False] * len(tokens)
        for i in range(1, len(tokens)):
            has_child[parents[i]] = True
        placed: list[int | None] = [at] + [None] * (len(tokens) - 1)
        for i in range(1, len(tokens)):
            parent = placed[parents[i]]
            if parent is None or (tokens[i] == PAD_TOKEN and parents[i] == 0 and not has_child[i]):
                continue
            if self.full and (parent, int(tokens[i])) not in self._kids:
                return len(tokens) - i
            placed[i] = self.add(parent, int(tokens[i]), counted=True)
        return 0

    def finish(self) -> tuple[list[int], list[int], list[bool]]:
        """(tokens, parents, had_child) renumbered in BFS order; the matcher back at the root."""
        self.goto(0)
        children: list[list[int]] = [[] for _ in self.tokens]
        for node in range(1, len(self.tokens)):
            children[self.parents[node]].append(node)
        order, queue = [], deque([0])
        while queue:
            node = queue.popleft()
            order.append(node)
            queue.extend(children[node])
        new = {old: i for i, old in enumerate(order)}
        tokens = [self.tokens[n] for n in order]
        parents = [-1] + [new[self.parents[n]] for n in order[1:]]
        return tokens, parents, [self.had_child[n] for n in order]


class DraftProposer:
    """Drafts the trees of a verify step from the corpus, the grammar, field memory and external corpora."""

    def __init__(
        self,
        corpus: NgramCorpus,
        grammar_drafts: bool = True,
        forced: Callable[[], ForcedText] | None = None,
        memory: FieldMemory | None = None,
        corpora: DraftCorpora | None = None,
    ) -> None:
        self.corpus = corpus
        self.grammar_drafts = grammar_drafts
        self._forced_factory = forced  # built on first use: only constrained requests need it
        self._forced: ForcedText | None = None
        self.memory = memory
        self.corpora = corpora
        self.text_lookup = True  # (under ``grammar_drafts``; benchmarks switch it to show its share)
        self._text: TextLookup | None = None
        # Nodes each source put in the trees verified so far (a source's node shared with an earlier
        # source counts for the earlier one): what the sources contribute, for stats and benchmarks.
        self.source_nodes: dict[str, int] = {}

    @property
    def forced(self) -> ForcedText | None:
        if self._forced is None and self._forced_factory is not None:
            self._forced = self._forced_factory()
            if self.memory is not None:
                self.memory.vocab = self._forced.vocab
        return self._forced

    def _text_lookup(self, seq: Seq) -> TextLookup | None:
        """The prompt-text source for a constrained sequence whose grammar drafts are on."""
        if not (self.text_lookup and self.grammar_drafts and seq.grammar is not None):
            return None
        if self._text is None and self.forced is not None:
            self._text = TextLookup(self.forced)
        return self._text

    # ------------------------------------------------------------------ the policy's signal
    def match_length(self, seq: Seq, max_len: int) -> int:
        """The sequence's match length for the draft policy: the corpus' (``NgramCorpus.match_length``),
        an external corpus' if longer, and at least ``FORCED_MATCH`` where its grammar forces text."""
        n = self.corpus.match_length(seq.token_ids, max_len)
        if n < max_len and self.corpora is not None:
            n = max(n, self.corpora.match_length(_corpus_names(seq), seq.token_ids, max_len))
        if (
            n < min(FORCED_MATCH, max_len)
            and self.grammar_drafts
            and self.forced is not None
            and seq.grammar is not None
            and not seq.is_finished
            and seq.settle_grammar()
            and seq.grammar.jump_forward()
        ):
            n = min(FORCED_MATCH, max_len)
        if n < min(TEXT_MATCH, max_len) and not seq.is_finished:
            lookup = self._text_lookup(seq)
            if lookup is not None and lookup.match(seq):
                n = min(TEXT_MATCH, max_len)
        return n

    # ------------------------------------------------------------------ drafting
    def propose(
        self,
        seqs: Sequence[Seq],
        width: int,
        trim: bool,
        widths: Sequence[int],
        check_depth: int | None = None,
        drafted: Callable[[], DraftTree] | None = None,
    ) -> Proposal | None:
        """One tree of ``width`` nodes per sequence (a request's ``num_draft_tokens`` caps its own).

        ``trim``: drop the nodes no verify can accept (padding, forbidden drafts) and verify at the
        narrowest of ``widths`` that holds every member's nodes; None when no member kept a draft
        (the caller runs a plain step). Without it the trees keep ``width`` nodes. Grammars must be
        settled. ``check_depth``: under ``grammar_drafts`` off, how deep the grammar check goes.
        ``drafted``: the corpus' trees of the batch at ``width`` (default ``NgramCorpus.batch_get``),
        used where the corpus is the only source (``corpus_only``)."""
        if self.corpus_only(seqs, width):
            tree = drafted() if drafted is not None else self._batch_get(seqs, width)
            return self._propose_corpus(seqs, tree, trim, widths, check_depth)
        rows = [self._build(seq, _cap(seq, width)) for seq in seqs]
        pruned = sum(r[3] for r in rows)
        most = max(len(r[0]) for r in rows)
        if trim:
            if most == 1:
                return None
            width = _narrowest(widths, most, width)
        tokens = np.full((len(seqs), width), PAD_TOKEN, dtype=np.int64)
        parents = np.zeros((len(seqs), width), dtype=np.int64)
        has_child = np.zeros((len(seqs), width), dtype=np.bool_)
        for b, (row_tokens, row_parents, row_had, _) in enumerate(rows):
            n = len(row_tokens)
            tokens[b, :n], parents[b, :n], has_child[b, :n] = row_tokens, row_parents, row_had
        tree = DraftTree.from_parents(tokens.reshape(-1), parents)
        levels = tree.depths().max(axis=1).tolist()
        return Proposal(tree, has_child, levels, pruned)

    def corpus_only(self, seqs: Sequence[Seq], width: int) -> bool:
        """Whether the shared corpus is the batch's only draft source at ``width`` (a grammar
        only checks its drafts where ``grammar_drafts`` is off)."""
        corpora = self.corpora
        return all(
            (s.grammar is None or not self.grammar_drafts)
            and _cap(s, width) == width
            and (corpora is None or not corpora.selects(_corpus_names(s)))
            for s in seqs
        )

    def _batch_get(self, seqs: Sequence[Seq], width: int) -> DraftTree:
        return self.corpus.batch_get([s.seq_id for s in seqs], [s.token_ids for s in seqs], width)

    def _build(self, seq: Seq, cap: int) -> tuple[list[int], list[int], list[bool], int]:
        """One sequence's tree: (tokens, parents, had_child, forbidden corpus drafts)."""
        root = seq.token_ids[-1]
        matcher = None if seq.grammar is None or seq.is_finished else seq.grammar
        builder = _Builder(root, cap - 1, matcher)
        if seq.is_finished or builder.dead[0] or cap == 1:
            return [root], [-1], [False], 0
        try:  # with grammar_drafts off a grammar only checks the drafts (no forced text, memory, refill)
            self._fill(seq, builder, matcher is not None and self.grammar_drafts)
        finally:
            tokens, parents, had = builder.finish()
        self.source_nodes["total"] = self.source_nodes.get("total", 0) + len(tokens) - 1
        return tokens, parents, had, builder.pruned

    def _count(self, source: str, builder: _Builder, before: int) -> None:
        self.source_nodes[source] = self.source_nodes.get(source, 0) + len(builder.tokens) - before

    def _fill(self, seq: Seq, builder: _Builder, constrained: bool) -> None:
        n = len(builder.tokens)
        leaves = self._forced_branch(builder, 0) if constrained else []
        self._count("forced", builder, n)
        if self.memory is not None and constrained and not builder.full:
            n = len(builder.tokens)
            for value in self.memory.values(seq):
                builder.add_path(0, value, counted=True)
            self._count("memory", builder, n)
        lookup = self._text_lookup(seq) if constrained else None
        if (
            lookup is not None
            and not builder.full
            and self.corpus.match_length(seq.token_ids, TEXT_MATCH) < TEXT_MATCH
        ):
            n = len(builder.tokens)
            builder.add_path(0, lookup.continuation(seq, builder.room // 2 + 1))
            self._count("text", builder, n)
        n = len(builder.tokens)
        wide = builder.budget + 1
        if constrained:
            wide = min(MAX_CORPUS_WIDTH, REFILL_FACTOR * wide)
        if not builder.full:
            ((tokens, parents),), _ = self.corpus.drafts(seq.seq_id, seq.token_ids, (wide,))
            builder.add_tree(tokens, parents)
        self._count("corpus", builder, n)
        n = len(builder.tokens)
        if self.corpora is not None and not builder.full:
            for tokens, parents in self.corpora.drafts(seq.seq_id, _corpus_names(seq), seq.token_ids, wide):
                builder.add_tree(tokens, parents)
        self._count("external", builder, n)
        if not constrained:
            return
        n = len(builder.tokens)
        self._extend(seq, builder, leaves)
        self._count("extension", builder, n)
        n = len(builder.tokens)
        if self.forced is not None and not builder.full and leaves:
            builder.goto(0)
            assert builder.matcher is not None
            text, _ = clip(builder.matcher.jump_forward(), builder.room)
            for alt in self.forced.alternatives(text, 1 + ALTERNATIVES)[1:]:
                builder.add_path(0, alt)
        self._count("alternative", builder, n)

    def _forced_branch(self, builder: _Builder, at: int) -> list[int]:
        """Add the text the grammar forces after node ``at``: its canonical tokens, and overhang
        siblings of the last one; returns the branch leaves (canonical leaf first)."""
        if self.forced is None or builder.full or builder.dead[at]:
            return []
        builder.goto(at)
        assert builder.matcher is not None
        text, whole = clip(builder.matcher.jump_forward(), builder.room)
        if not text:
            return []
        canonical = self.forced.canonical(text)
        nodes = builder.add_path(at, canonical)
        if not nodes:
            return []
        leaves = [nodes[-1]]
        if whole and len(nodes) == len(canonical):  # the whole text is drafted: hedge its last token's merge
            parent = builder.parents[nodes[-1]]
            kept = 0
            for token in self.forced.overhang_candidates(self.forced.vocab[canonical[-1]])[:OVERHANG_TRIES]:
                node = builder.add(parent, token)
                if node is not None:
                    leaves.append(node)
                    kept += 1
                    if kept == OVERHANGS:
                        break
                if builder.full:
                    break
        return leaves

    def _extend(self, seq: Seq, builder: _Builder, leaves: list[int]) -> None:
        """Grow the tree at the forced leaves and the deepest node: forced text there, then the
        corpus' continuation of the context extended by the branch."""
        done: set[int] = set()
        for _ in range(EXTENSION_ROUNDS):
            if builder.full:
                return
            candidates = [n for n in leaves if n not in done]
            if not candidates:
                deepest = max(range(len(builder.tokens)), key=lambda n: (builder.depth[n], -n))
                if deepest in done or deepest == 0:
                    return
                candidates = [deepest]
            at = candidates[0]
            done.add(at)
            if builder.dead[at]:
                continue
            branch = self._forced_branch(builder, at)
            end = branch[0] if branch else at
            context = list(seq.token_ids) + [builder.tokens[n] for n in builder.chain(end)]
            if not builder.full:
                ((tokens, parents),), _ = self.corpus.drafts(
                    _EXTENSION_KEY, context, (min(MAX_CORPUS_WIDTH, REFILL_FACTOR * (builder.budget + 1)),)
                )
                builder.add_tree(tokens, parents, at=end)
            leaves = leaves + branch[1:]

    # ------------------------------------------------------------------ the corpus alone
    def _propose_corpus(
        self,
        seqs: Sequence[Seq],
        drafted: DraftTree,
        trim: bool,
        widths: Sequence[int],
        check_depth: int | None,
    ) -> Proposal | None:
        width = drafted.draft_token_num
        levels = drafted.depths().max(axis=1).tolist()  # of the trees as drafted
        if not trim:
            return Proposal(drafted, drafted.has_child(), levels, 0, batched=True)
        keep, pruned = trim_drafted(seqs, drafted, check_depth)
        if not keep[:, 1:].any():
            return None
        narrow = _narrowest(widths, int(keep.sum(axis=1).max()), width)
        if narrow >= width:  # the dropped nodes stay: they cost nothing extra at this width
            return Proposal(drafted, drafted.has_child(), levels, pruned, batched=True)
        has_child = carry_to_kept(drafted.has_child(), keep, narrow, False)
        return Proposal(drafted.keep_nodes(keep, narrow), has_child, levels, pruned, batched=True)

    def on_finish(self, seqs: Sequence[Seq]) -> None:
        """Departed sequences: field memory takes their last values; their match state goes."""
        ids: list[Hashable] = [s.seq_id for s in seqs]
        self.corpus.erase_match_state(ids)
        if self.corpora is not None:
            self.corpora.forget(ids)
        if self.memory is not None:
            for seq in seqs:
                self.memory.forget(seq)
        if self._text is not None:
            self._text.forget(ids)


def trim_drafted(seqs: Sequence[Seq], tree: DraftTree, check_depth: int | None) -> tuple[np.ndarray, int]:
    """The nodes of drafted trees worth verifying [B, D] bool (each tree less its padding and the
    drafts its grammar forbids, ``grammar_valid_nodes``), and how many drafts the grammars forbade.
    A finished sequence (a grammar that failed to settle) keeps its root only."""
    from ngrammar.grammar import grammar_valid_nodes

    keep = ~tree.padding()
    keep[:, 0] = True
    pruned = 0
    if not any(s.grammar is not None for s in seqs):
        return keep, 0
    tokens, parents = tree.tokens_2d().tolist(), tree.parents().tolist()
    for b, seq in enumerate(seqs):
        if seq.is_finished:
            keep[b, 1:] = False
        elif seq.grammar is not None:
            drafted = int(keep[b].sum())
            keep[b] &= grammar_valid_nodes(seq.grammar, tokens[b], parents[b], check_depth)
            pruned += drafted - int(keep[b].sum())
    return keep, pruned


def _narrowest(widths: Sequence[int], most: int, width: int) -> int:
    """The narrowest of ``widths`` that holds ``most`` nodes, at most ``width`` (else ``width``)."""
    return min((w for w in widths if most <= w <= width), default=width)


def _cap(seq: Seq, width: int) -> int:
    """The tree size for this sequence: the step's width, or less where the request asked for less."""
    asked = seq.params.num_draft_tokens
    return width if asked is None else max(1, min(width, asked))


def _corpus_names(seq: Seq) -> tuple[str, ...] | None:
    """The external corpora a request drafts from (None: every one)."""
    return seq.params.draft_corpora
