"""POST /v1/embeddings (and /embeddings): what RAG frontends call, in OpenAI's shape; the
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
@bare_router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request,
                     admitted: Admitted = Depends(admit)):
    async with admitted.lease(body.model, kind="embedding") as host:
        vectors, n_tokens = await embed(request, admitted, host, body, "/v1/embeddings")
    return {"object": "list", "model": host.model_id,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
