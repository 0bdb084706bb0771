"""POST /v1/rerank (and /rerank, /v1/reranking, /reranking: llama-server's and Jina's shape):
`query`, `documents`, `top_n`, answered with `results` of `index` and `relevance_score`.

Ranking needs a reranker model (a GGUF whose pooling type is "rank", such as bge-reranker):
this server does not load one yet, so a well-formed request is refused with a 400 naming the
model and why, never a 404 and never a silent answer from a model that cannot rank. The body
is validated first, so a client learns about its own mistakes either way.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from localserve.api.auth import caller
from localserve.api.schemas import OpenAIError

router = APIRouter()
MAX_DOCUMENTS = 1000


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str = Field(..., min_length=1)
    documents: list[str | dict] = Field(..., min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v1/reranking")
@router.post("/reranking")
async def rerank(body: RerankRequest, request: Request):
    for i, document in enumerate(body.documents):
        if isinstance(document, dict) and not isinstance(document.get("text"), str):
            raise OpenAIError(400, f"documents[{i}]: a string or {{'text': ...}}",
                              param=f"documents[{i}]")
    entry = request.app.state.models.entry(body.model, caller(request).models)
    raise OpenAIError(400, f"'{entry.spec.name}' is a {entry.spec.kind} model and cannot rank "
                      f"documents: reranking needs a reranker GGUF (pooling type rank, e.g. "
                      f"bge-reranker), which this server does not load yet",
                      code="model_cannot_rank", param="model")
