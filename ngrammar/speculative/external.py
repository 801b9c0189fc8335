"""External draft corpora: named document sets a request may draft from, besides the shared corpus.

Each corpus is its own ``NgramCorpus`` trie, tokenized and indexed once when it is added (from
``SpeculativeConfig.draft_corpus`` files at start-up, or at run time through the server), and
bounded: at most ``draft_corpus_max_tokens`` tokens (a bigger one is refused, nothing indexed) and
``capacity`` trie nodes (LRU-evicted past it, like the shared corpus). Files are plain text (one
document) or JSONL (``.jsonl``: one document per line, a JSON string or an object with a
``"text"`` field).

Threads: ``add`` / ``remove`` may run on a server thread while the engine thread drafts. A corpus is
indexed before it is published, and the name -> corpus table is replaced, never mutated, so a
draft reads one consistent table; removing a corpus a running request drafts from is safe (that
request stops drafting from it; a step already holding it finishes with it).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ngrammar.speculative.corpus import NgramCorpus

if TYPE_CHECKING:
    from ngrammar.config import SpeculativeConfig
    from ngrammar.model.tokenizer import Tokenizer

MAX_BYTES_PER_TOKEN = 32  # a file this many bytes per allowed token is refused without tokenizing it
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class DraftCorpusError(ValueError):
    """A corpus that cannot be added or used: bad file or name, unknown name, too big."""


@dataclass(frozen=True)
class CorpusInfo:
    name: str
    documents: int
    tokens: int
    nodes: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "documents": self.documents, "tokens": self.tokens, "nodes": self.nodes}


@dataclass(frozen=True)
class _Entry:
    corpus: NgramCorpus
    info: CorpusInfo


class DraftCorpora:
    """The named external corpora of one engine."""

    def __init__(self, config: SpeculativeConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_tokens = config.draft_corpus_max_tokens
        self._table: dict[str, _Entry] = {}  # replaced on every change (readers hold a snapshot)
        self._lock = threading.Lock()  # serializes writers
        for path in config.draft_corpus:
            self.add(_name_of(path), path=path)

    # ------------------------------------------------------------------ management
    def names(self) -> list[str]:
        return sorted(self._table)

    def info(self) -> list[dict[str, Any]]:
        return [self._table[n].info.as_dict() for n in self.names()]

    def add(
        self,
        name: str,
        path: str | None = None,
        documents: Sequence[str] | None = None,
        replace: bool = False,
    ) -> CorpusInfo:
        """Tokenize and index a corpus from a file or from documents (exactly one); raises
        DraftCorpusError for a bad name, a missing or malformed file, no text, or too many tokens."""
        _check_name(name)
        if (path is None) == (documents is None):
            raise DraftCorpusError("give exactly one of a file path and documents")
        if not replace and name in self._table:
            raise DraftCorpusError(f"draft corpus {name!r} exists; remove it first")
        self._check_room(name)
        docs = _read(path, self.max_tokens) if path is not None else _documents(documents)
        token_docs = []
        total = 0
        for doc in docs:
            ids = self.tokenizer.encode(doc)
            total += len(ids)
            if total > self.max_tokens:
                raise DraftCorpusError(
                    f"draft corpus {name!r} is over {self.max_tokens} tokens (draft_corpus_max_tokens)"
                )
            if len(ids) >= 2:
                token_docs.append(ids)
        if not token_docs:
            raise DraftCorpusError(f"draft corpus {name!r} has no document of two tokens or more")
        corpus = NgramCorpus.from_config(self.config)
        for i, ids in enumerate(token_docs):
            key = ("__document__", i)
            corpus.index_prompt(key, ids)
            corpus.erase_match_state([key])
        info = CorpusInfo(name, len(token_docs), total, corpus.num_nodes)
        with self._lock:
            if not replace and name in self._table:
                raise DraftCorpusError(f"draft corpus {name!r} exists; remove it first")
            self._check_room(name)
            self._table = {**self._table, name: _Entry(corpus, info)}
        return info

    def _check_room(self, name: str) -> None:
        """Each corpus costs memory and a lookup per decode step: at most ``draft_corpus_max_count``."""
        if name not in self._table and len(self._table) >= self.config.draft_corpus_max_count:
            raise DraftCorpusError(
                f"{len(self._table)} draft corpora exist, the most allowed (draft_corpus_max_count); remove one first"
            )

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self._table:
                raise DraftCorpusError(f"unknown draft corpus {name!r}")
            self._table = {k: v for k, v in self._table.items() if k != name}

    def check(self, names: Sequence[str] | None) -> None:
        """Raise DraftCorpusError unless every named corpus exists."""
        if names is None:
            return
        unknown = [n for n in names if n not in self._table]
        if unknown:
            known = ", ".join(self.names()) or "none"
            raise DraftCorpusError(f"unknown draft corpus {', '.join(map(repr, unknown))} (known: {known})")

    # ------------------------------------------------------------------ drafting (engine thread)
    def _selected(self, names: Sequence[str] | None) -> list[NgramCorpus]:
        table = self._table  # one snapshot
        if names is None:
            return [e.corpus for e in table.values()]
        return [table[n].corpus for n in names if n in table]  # a removed one is skipped

    def selects(self, names: Sequence[str] | None) -> bool:
        """Whether a request naming ``names`` (None: every one) drafts from any corpus now."""
        return bool(self._selected(names))

    def match_length(self, names: Sequence[str] | None, context: Sequence[int], max_len: int) -> int:
        return max((c.match_length(context, max_len) for c in self._selected(names)), default=0)

    def drafts(
        self, req_id: Hashable, names: Sequence[str] | None, context: Sequence[int], width: int
    ) -> list[tuple[list[int], list[int]]]:
        """One drafted tree (tokens, parents) per selected corpus that matched the context."""
        out = []
        for corpus in self._selected(names):
            ((tokens, parents),), matched = corpus.drafts(req_id, context, (width,))
            if matched:
                out.append((tokens, parents))
        return out

    def forget(self, req_ids: Sequence[Hashable]) -> None:
        for entry in self._table.values():
            entry.corpus.erase_match_state(req_ids)


def _name_of(path: str) -> str:
    stem = Path(path).stem
    name = "".join(ch if ch in NAME_CHARS else "_" for ch in stem)
    return name if name.strip(".") else "corpus"


def _check_name(name: Any) -> None:
    """A name is a URL path segment (``DELETE /v1/draft_corpora/{name}``): one made only of dots
    would be rewritten by clients (``..`` climbs a level), so it is refused. The error quotes at
    most 80 characters of what was given."""
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 64
        or not set(name) <= NAME_CHARS
        or not name.strip(".")
    ):
        shown = repr(name)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise DraftCorpusError(
            f"a draft corpus name is 1-64 letters, digits, '_', '-' or '.', not only dots; got {shown}"
        )


def _documents(documents: Any) -> list[str]:
    if isinstance(documents, str) or not all(isinstance(d, str) for d in documents):
        raise DraftCorpusError("documents must be a list of strings")
    return list(documents)


def _read(path: str, max_tokens: int) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise DraftCorpusError(f"draft corpus file {path!r} does not exist or is not a file")
    limit = MAX_BYTES_PER_TOKEN * max_tokens
    too_big = DraftCorpusError(
        f"draft corpus file {path!r} is over {max_tokens} tokens (draft_corpus_max_tokens)"
    )
    if p.stat().st_size > limit:  # refused before reading it all
        raise too_big
    try:
        with p.open("rb") as f:  # the read is bounded too: a file's size can lie (procfs, a growing file)
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise too_big
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DraftCorpusError(f"cannot read draft corpus file {path!r}: {e}") from None
    if p.suffix.lower() != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DraftCorpusError(f"{path}:{n}: not JSON ({e})") from None
        if isinstance(value, dict):
            value = value.get("text")
        if not isinstance(value, str):
            raise DraftCorpusError(
                f'{path}:{n}: a line must be a JSON string or an object with a "text" string'
            )
        docs.append(value)
    return docs
