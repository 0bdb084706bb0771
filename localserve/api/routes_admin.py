"""Monitoring endpoints. They read the snapshot the engine published after its last step,
so they answer at once even while a long prefill is running."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from localserve import __version__

open_router = APIRouter()  # no key needed: load balancers and `localserve top` probe it
router = APIRouter()  # needs a key when keys are set


@open_router.get("/health")
async def health(request: Request):
    state, problem = request.app.state.service.status()
    if state == "ok":
        return {"status": "ok"}
    body = {"status": state} if problem is None else {"status": state, "error": problem}
    return JSONResponse(body, status_code=503)


@router.get("/slots")
async def slots(request: Request):
    service = request.app.state.service
    if service.engine is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    pool = service.loop.scheduler.pool
    snap = service.engine.snapshot
    return {
        "model": service.model_id,
        "ctx_size": pool.ctx_size,
        "n_slots": len(pool.slots),
        "n_ctx_per_slot": pool.n_ctx_per_slot,
        "split": pool.describe(),
        **snap.to_json(),
    }


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request):
    """The API's OpenAPI document (behind the key when keys are set)."""
    return request.app.openapi()


@router.get("/metrics")
async def metrics(request: Request):
    """Prometheus exposition: from the last published snapshot, never waiting for a step."""
    registry = request.app.state.service.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/props")
async def props(request: Request):
    """Model, backend, the -c split and scheduler settings: what a dashboard's header shows."""
    service = request.app.state.service
    if service.engine is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    s = service.settings
    pool = service.loop.scheduler.pool
    return {
        **service.facts,
        "ctx_size": pool.ctx_size, "n_slots": len(pool.slots), "n_ctx_per_slot": pool.n_ctx_per_slot,
        "kv_unified": pool.unified, "split": pool.describe(),
        "total_slots": len(pool.slots),  # llama-server's name for n_slots
        "cache": {"type_k": s.cache_type_k, "type_v": s.cache_type_v, "flash_attn": s.flash_attn},
        "chat_template": service.template.source if service.template else None,
        "scheduler": {"policy": s.scheduler, "max_num_batched_tokens": service.loop.scheduler.budget,
                      "max_num_seqs": service.loop.scheduler.max_num_seqs, "max_queue": s.max_queue,
                      "queue_timeout_s": s.queue_timeout},
        "version": __version__,
    }
