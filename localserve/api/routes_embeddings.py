"""POST /v1/embeddings: what RAG frontends call, in OpenAI's shape; POST /embeddings in
llama-server's own (as it answers there, and for a `content` body anywhere). The
embedding itself is the model's service (models/embeddings.py), its inputs read by
api/embedding.py (shared with Ollama's /api/embed)."""

from __future__ import annotations

import base64
import struct

from fastapi import APIRouter, Depends, Request

from localserve.api.admission import Admitted, admit
from localserve.api.embedding import EmbeddingRequest, embed

router = APIRouter(prefix="/v1")
bare_router = APIRouter()


def _encode(vector: list[float], form: str):
    if form == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request,
                     admitted: Admitted = Depends(admit)):
    """OpenAI's shape; llama-server's own for a body that names its inputs `content` (as
    llama-server answers it: that key is not OpenAI's)."""
    if body.input is None:
        return await llama_server_embeddings(body, request, admitted)
    async with admitted.lease(body.model, kind="embedding") as host:
        vectors, n_tokens = await embed(request, admitted, host, body, "/v1/embeddings")
    return {"object": "list", "model": host.model_id,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


@bare_router.post("/embeddings")
async def llama_server_embeddings(body: EmbeddingRequest, request: Request,
                                  admitted: Admitted = Depends(admit)):
    """llama-server's /embeddings: its own shape, a list of `{index, embedding}` with each
    pooled vector in a list of one (what it answers without /v1, and for `content`)."""
    async with admitted.lease(body.model, kind="embedding") as host:
        vectors, _ = await embed(request, admitted, host, body, "/embeddings")
    return [{"index": i, "embedding": [v]} for i, v in enumerate(vectors)]
