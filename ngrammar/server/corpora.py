"""The draft-corpus routes (/v1/draft_corpora): list, add (documents, or a file inside --draft-corpus-dir), remove."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from ngrammar.engine.engine import LLMEngine
from ngrammar.server.core_client import CoreClient
from ngrammar.server.errors import APIError
from ngrammar.server.protocol import DraftCorpusRequest

if TYPE_CHECKING:
    from ngrammar.server.app import _Server
    from ngrammar.speculative.external import DraftCorpora


def install_corpus_routes(app: FastAPI, s: _Server) -> None:
    """/v1/draft_corpora: external corpora an NGRAM engine drafts from, added and removed at run
    time: in this process's engine, or by a call to every engine core."""

    @app.get("/v1/draft_corpora")
    async def list_draft_corpora() -> Response:
        if isinstance(s.engine, LLMEngine):
            return JSONResponse({"data": _draft_corpora(s.engine).info()})
        return JSONResponse({"data": await _cores(s).corpus_call("list")})

    @app.post("/v1/draft_corpora")
    async def add_draft_corpus(body: DraftCorpusRequest) -> Response:
        path = None if body.path is None else _corpus_path(s.config.draft_corpus_dir, body.path)
        if not isinstance(s.engine, LLMEngine):
            info = await _cores(s).corpus_call(
                "add", name=body.name, path=path, documents=body.documents, replace=body.replace
            )
            return JSONResponse(info)
        from starlette.concurrency import run_in_threadpool

        corpora = _draft_corpora(s.engine)
        # Tokenizing and indexing run on a worker thread; the engine keeps stepping meanwhile.
        added = await run_in_threadpool(corpora.add, body.name, path, body.documents, body.replace)
        return JSONResponse(added.as_dict())

    @app.delete("/v1/draft_corpora/{name}")
    async def remove_draft_corpus(name: str) -> Response:
        from ngrammar.speculative.external import DraftCorpusError

        try:  # one call: a corpus removed meanwhile is a 404 too
            if isinstance(s.engine, LLMEngine):
                _draft_corpora(s.engine).remove(name)
            else:
                await _cores(s).corpus_call("remove", name=name)
        except DraftCorpusError:
            raise APIError(404, f"unknown draft corpus {name!r}", "not_found_error") from None
        return JSONResponse({"name": name, "removed": True})


def _cores(s: _Server) -> CoreClient:
    assert isinstance(s.loop, CoreClient)
    return s.loop


def _corpus_path(root: str | None, path: str) -> str:
    """A file an HTTP client may have indexed: only inside ``--draft-corpus-dir`` (a client must
    not read the server's other files into a corpus whose n-grams speculation statistics reveal)."""
    from pathlib import Path

    if root is None:
        raise APIError(
            403,
            "indexing server files is off: send the documents, or start the server with --draft-corpus-dir",
            "permission_error",
        )
    base = Path(root).resolve()
    full = (base / path).resolve()
    if not full.is_relative_to(base) or not full.is_file():
        raise APIError(400, "path must name a file inside --draft-corpus-dir", param="path")
    return str(full)


def _draft_corpora(engine: LLMEngine) -> DraftCorpora:
    """The engine's external draft corpora."""
    spec = engine.ngram
    if spec is None or spec.proposer.corpora is None:
        raise APIError(400, "draft corpora need a server started with --speculative ngram")
    return spec.proposer.corpora
