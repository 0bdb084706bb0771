"""Monitoring endpoints. They read the snapshot the engine published after its last step,
so they answer at once even while a long prefill is running."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from starlette.concurrency import run_in_threadpool

from localserve import __version__
from localserve.api.auth import caller, is_admin
from localserve.api.serving import server_defaults
from localserve.api.schemas import OpenAIError
from localserve.office.ledger import GROUPS
from localserve.office.ledger import usage as ledger_usage
from localserve.models.model_entry import Entry, ModelState

open_router = APIRouter()  # no key needed: load balancers and `localserve top` probe it
router = APIRouter()  # needs a key when keys are set


@open_router.get("/health")
async def health(request: Request):
    if request.app.state.office.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    default = next(iter(request.app.state.models.entries.values()))
    state = default.state  # model_entry.ModelState: the one vocabulary of a model's lifecycle
    if state.takes_requests:
        return {"status": "ok"}
    body = {"status": "loading"} if state is ModelState.LOADING else {
        "status": "error", "error": default.problem}
    return JSONResponse(body, status_code=503)


def shown_entry(request: Request, model: str | None) -> Entry:
    """The model a monitoring route describes: ?model=NAME, else the first loaded one (the
    default model first), else the default model; only those the caller's key may use."""
    models, allowed = request.app.state.models, caller(request).models
    shown = models.visible(allowed)
    if model is not None or not shown:
        return models.entry(model, allowed)
    loaded = [e for e in shown if e.loaded]
    return loaded[0] if loaded else shown[0]


def not_loaded(request: Request, entry: Entry) -> JSONResponse:
    """503 with the model's lifecycle state (model_entry.ModelState) and every model's card."""
    cards = request.app.state.models.cards(caller(request).models)
    return JSONResponse({"status": str(entry.state), "models": cards}, status_code=503)


@router.get("/slots")
async def slots(request: Request, model: str | None = None, view: str | None = None):
    """llama-server's shape (an array, one object per slot) by default; `?view=full` is
    localserve's whole picture (slots, queue, cache, engine counters, models) that the
    dashboard and the page read."""
    if view not in (None, "full"):
        raise OpenAIError(400, "view: 'full' or nothing", param="view")
    entry = shown_entry(request, model)
    host = entry.host
    if host.engine is None:
        return not_loaded(request, entry)
    pool = host.pool_view()
    snap = host.engine.snapshot.to_json()
    if not is_admin(request):
        hide_others(snap, caller(request).key)
        coarse_pool(snap, pool.ctx_size)
    if view is None:
        spec = pool.drafts
        return [{**row, "id_task": row["request_id"] or -1, "speculative": spec,
                 "next_token": {"has_next_token": row["is_processing"],
                                "n_decoded": row["n_decoded"]}} for row in snap["slots"]]
    return {"model": host.model_id, "ctx_size": pool.ctx_size, "n_slots": pool.n_slots,
            "n_ctx_per_slot": pool.n_ctx_per_slot, "n_ctx_guaranteed": pool.guarantee,
            "split": pool.split, "embeddings_running": host.embeddings.running, **snap,
            "models": request.app.state.models.cards(caller(request).models)}


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request):
    """The API's OpenAPI document (behind the key when keys are set)."""
    return request.app.openapi()


@router.get("/metrics")
async def metrics(request: Request):
    """Prometheus exposition: from the last published snapshot, never waiting for a step;
    per-key counters and the families that count tokens or cells for admin keys only
    (USER_HIDDEN)."""
    host, models = request.app.state.default_host, request.app.state.models
    text = generate_latest(models.metrics_registry if models.several else host.metrics_registry)
    if is_admin(request):
        text += generate_latest(request.app.state.office.key_registry)
    else:
        text = b"".join(line for line in text.splitlines(keepends=True)
                        if not any(family in line for family in USER_HIDDEN))
    return Response(text, media_type=CONTENT_TYPE_LATEST)


# What a user key's /metrics leaves out: the families that count prompt tokens or cells, where
# the difference of two scrapes beside one colleague is that colleague's document's size (a
# slot's cells, the pool's fill, prompt tokens, a step's tokens, prefix lookups, the prompt
# cache's bytes and restored tokens). /slots?view=full gives them the pool's fill, coarsely.
USER_HIDDEN = tuple(b"localserve:" + name for name in (
    b"slot_", b"kv_cache_usage_perc", b"prompt_tokens", b"iteration_tokens", b"prefix_cache_",
    b"prompt_cache_bytes", b"prompt_cache_disk_bytes", b"prompt_cache_tokens_restored"))


def _when(value: str | None, param: str) -> float | None:
    """A time bound: unix seconds, or an ISO date/time (local time)."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise OpenAIError(400, f"{param}={value!r}: use unix seconds or an ISO date such as "
                          f"2026-11-29", param=param) from None


@router.get("/v1/usage")
async def usage(request: Request, group_by: str = "key",
                since: str | None = Query(None, alias="from"),
                until: str | None = Query(None, alias="to"), model: str | None = None):
    """Token usage from the ledger, grouped by key, day or model; `model`: that model's rows
    only. A user key sees only its own."""
    ledger = request.app.state.office.ledger
    if ledger is None:
        raise OpenAIError(404, "the ledger is off (--no-ledger)", code="ledger_off")
    if group_by not in GROUPS:
        raise OpenAIError(400, f"group_by must be one of {', '.join(GROUPS)}", param="group_by")
    key = None if is_admin(request) else caller(request).key
    rows = await run_in_threadpool(ledger_usage, ledger.path, _when(since, "from"),
                                   _when(until, "to"), group_by, key, model)
    return {"object": "list", "group_by": group_by, "data": rows}


def hide_others(snap: dict, me: str | None) -> None:
    """A user sees their own rows whole; others' rows anonymously and without their token
    counts or where their prefix came from ("ram" tells that someone came back to an earlier
    conversation): the slots' states and the totals stay."""
    for row in (*snap["slots"], *snap["queue"]["requests"]):
        if row["user"] == me:
            continue
        row["user"] = row["request_id"] = None
        for field in ("n_cached", "n_borrowed", "n_prompt_tokens", "n_decoded", "cached_tokens"):
            if field in row:
                row[field] = 0
        for field in ("prefix_source", "age_s"):
            if field in row:
                row[field] = None


# Others' share of the pool as a user key sees it: whole steps of this many cells at least
POOL_STEP_MIN = 256


def coarse_pool(snap: dict, pool_tokens: int) -> None:
    """A user's view of the pool's fill: their own cells exactly, everyone else's rounded up
    to a sixteenth of the pool (256 cells at least), and the engine's and the prompt cache's
    token counts left out: what a lone colleague's document takes is not theirs to read."""
    step = max(POOL_STEP_MIN, pool_tokens // 16)
    mine = [row for row in snap["slots"] if row.get("n_cached")]  # others' are zeroed
    cache = snap["cache"]
    for total, own in (("used_tokens", "n_cached"), ("borrowed_tokens", "n_borrowed")):
        own_cells = sum(row.get(own, 0) for row in mine)
        others = max(cache[total] - own_cells, 0)
        cache[total] = min(own_cells + -(-others // step) * step, pool_tokens)
    for counter in ("tokens_batched", "last_step_tokens", "prompt_tokens_computed",
                    "prefix_cache_queries", "prefix_cache_hits"):
        snap["engine"].pop(counter, None)
    if cache.get("ram"):
        for counter in ("bytes", "disk_bytes", "tokens_restored"):
            cache["ram"].pop(counter, None)


@router.get("/props")
async def props(request: Request, model: str | None = None):
    """Model, backend, the -c split and scheduler settings: what a dashboard's header shows."""
    entry = shown_entry(request, model)
    host = entry.host
    if host.engine is None:
        return not_loaded(request, entry)
    s = host.settings
    pool = host.pool_view()
    model_path = str(host.model_path) if host.model_path else None  # users see its name only
    return {
        **host.facts,
        "ctx_size": pool.ctx_size, "n_slots": pool.n_slots, "n_ctx_per_slot": pool.n_ctx_per_slot,
        "kv_unified": s.kv_unified, "split": pool.split, "n_ctx_guaranteed": pool.guarantee,
        "context": host.context.as_json() if host.context else None,
        "total_slots": pool.n_slots,  # llama-server's name for n_slots
        "modalities": {"vision": host.reads_images, "audio": False},  # llama-server's
        "cache": {"type_k": s.cache_type_k, "type_v": s.cache_type_v, "flash_attn": s.flash_attn},
        "chat_template": host.template_source,
        "model_path": model_path if is_admin(request) else Path(model_path).name if model_path else None,
        "default_generation_settings": {"n_ctx": pool.n_ctx_per_slot, "params": {
            **server_defaults(s), "n_predict": -1 if s.n_predict is None else s.n_predict,
            "task_max_tokens": s.task_max_tokens,
            "speculative": pool.drafts}},
        "scheduler": {"policy": s.scheduler, "max_num_batched_tokens": pool.max_num_batched_tokens,
                      "max_num_seqs": pool.max_num_seqs, "max_queue": s.max_queue,
                      "queue_timeout_s": s.queue_timeout},
        "version": __version__,
    }
