"""create_app(): the FastAPI application. Where a request enters: routes_openai.py."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from localserve.api import (routes_admin, routes_anthropic, routes_embeddings, routes_native,
                            routes_ollama, routes_openai, routes_rerank, routes_responses,
                            routes_web)
from localserve.api.admission import admit, limit_rate
from localserve.api.message_reply import anthropic_error
from localserve.api.auth import KeyChecker, require_key
from localserve.api.cors import LoggedCORS, cors_rules
from localserve.api.host_guard import LoopbackHostGuard
from localserve.office.ledger import refusal_row
from localserve.common.net import local_only
from localserve.api.limits import BodySizeLimit, JsonBodyByDefault, ReleaseReservations
from localserve.api.rate_limit import RateLimiter
from localserve.office.quotas import QuotaKeeper
from localserve.api.schemas import OpenAIError
from localserve.common.config import Settings
from localserve.api.connections import install_loop_error_throttle
from localserve.common.model_errors import (ModelError, ModelUnavailable, NotEnoughMemory,
                                            NotPermitted, UnknownModel, WrongKind)
from localserve.models.registry import ModelRegistry
from localserve.models.model_host import ModelHost

log = logging.getLogger("localserve.api")


def create_app(settings: Settings | None = None, model_host: ModelHost | None = None,
               models: ModelRegistry | None = None) -> FastAPI:
    """The app for `models`, else for one ready-made `model_host` (tests), else for the
    models `settings` name."""
    if models is None:
        models = (ModelRegistry.single(model_host) if model_host is not None
                  else ModelRegistry.from_settings(settings or Settings()))
    default_host = models.primary

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        install_loop_error_throttle(asyncio.get_running_loop())
        if default_host.engine is None and not default_host.loaded.is_set():
            default_host.start_loading()
        reaper = asyncio.create_task(models.unload_idle_forever())
        yield
        reaper.cancel()
        models.stop()

    settings = models.office.settings
    # No Swagger page (it loads its assets from a CDN: blank on an offline office network);
    # /openapi.json is served by routes_admin, behind the key like the other monitoring routes.
    app = FastAPI(title="localserve", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    office = models.office
    app.state.office = office  # keys, ledger, conversations, per-key counters, drain
    app.state.default_host = default_host  # the default model's
    app.state.models = models  # every model, loaded on demand: routes lease one per request
    app.state.keys = KeyChecker(office.keys)
    app.state.rate_limiter = (RateLimiter(settings.rate_limit, settings.rate_burst)
                              if office.keys_enabled and settings.rate_limit > 0 else None)
    app.state.quotas = (QuotaKeeper(settings.quotas)
                        if office.keys_enabled and settings.quotas else None)
    # Admission, one dependency for every route that runs a model (generates, embeds,
    # tokenizes, renders, or may load one): the key, its rate, its quota hold (admission.py).
    # No route takes the hold by hand; the catalog and stored answers need only the key and
    # the rate.
    guarded = [Depends(require_key), Depends(limit_rate)]
    admitted = [Depends(admit)]
    for router in (routes_openai.router, routes_native.router, routes_anthropic.router,
                   routes_responses.router, routes_rerank.router, routes_embeddings.router,
                   routes_ollama.router):
        app.include_router(router, dependencies=admitted)
    for router in (routes_openai.bare_router, routes_embeddings.bare_router,
                   routes_responses.bare_router):
        app.include_router(router, dependencies=admitted, include_in_schema=False)
    app.include_router(routes_openai.catalog_router, dependencies=guarded)
    app.include_router(routes_responses.stored_router, dependencies=guarded)
    app.include_router(routes_ollama.catalog_router, dependencies=guarded)
    if settings.web:
        app.include_router(routes_web.page_router)
        app.include_router(routes_web.api_router, dependencies=guarded, include_in_schema=False)
    app.include_router(routes_admin.open_router)
    app.include_router(routes_admin.router, dependencies=[Depends(require_key)])  # dashboards poll
    # Middleware order, innermost first: a body without a JSON content type read as JSON, quota holds released, the body limit, then CORS (so that its refusals,
    # e.g. a 413, carry CORS headers and a browser shows the error instead of "Failed to
    # fetch"), then the loopback Host guard, checked first.
    app.add_middleware(JsonBodyByDefault)
    app.add_middleware(ReleaseReservations)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(LoggedCORS, **cors_rules(settings.cors_origins),
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"])
    if local_only(settings.host) and not office.keys_enabled:  # outermost: checked first
        app.add_middleware(LoopbackHostGuard, allowed_hosts=settings.allowed_hosts,
                           cors_origins=settings.cors_origins)
    _install_error_handlers(app)
    return app


# Refusals the engine's own finish event already put in the ledger (ledger.LedgerObserver):
# those codes from answer.py, which name no param (the same code refused before the engine,
# as grammar_cost with param "grammar" in serving.submit, gets its row here).
BILLED_BY_THE_ENGINE = {"grammar_cost", "queue_timeout"}


def _error(exc: OpenAIError, request: Request | None = None) -> JSONResponse:
    """OpenAI's error shape, or Anthropic's on the Messages API's paths, or Ollama's
    ({"error": "..."}, what its client raises from) on /api/. A known key's refused request
    (a 4xx other than a bad key's 401) gets its ledger row."""
    path = request.url.path if request is not None else ""
    billed = exc.code in BILLED_BY_THE_ENGINE and exc.param is None
    if request is not None and 400 <= exc.status < 500 and not billed:
        _note_refusal(request, exc)
    body = (anthropic_error(exc) if path.startswith("/v1/messages") else
            {"error": exc.message} if path.startswith("/api/") else exc.body())
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _note_refusal(request: Request, exc: OpenAIError) -> None:
    who = getattr(request.state, "caller", None)
    ledger = request.app.state.office.ledger
    if who is None or who.key is None or ledger is None:
        return  # no key (a desktop without keys, or refused before the key check)
    why = exc.code or (f"param {exc.param}" if exc.param else exc.message.split(".")[0])
    ledger.record(refusal_row(who.key, request.url.path, exc.status, why))


# The model layer's refusals (model_errors.py) as HTTP answers: the one place they are mapped.
MODEL_ERROR_STATUS = {UnknownModel: 404, NotPermitted: 403, WrongKind: 400,
                      NotEnoughMemory: 507, ModelUnavailable: 503}


def model_refusal(exc: ModelError) -> OpenAIError:
    status = MODEL_ERROR_STATUS[type(exc)]
    return OpenAIError(status, exc.message, "server_error" if status >= 500 else
                       "invalid_request_error", code=exc.code, param=exc.param,
                       headers={"Retry-After": str(exc.retry_after)} if exc.retry_after else None)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        if exc.delay_s:
            await asyncio.sleep(exc.delay_s)
        return _error(exc, request)

    @app.exception_handler(ModelError)
    async def model_error(request: Request, exc: ModelError):
        return _error(model_refusal(exc), request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        problems, param = [], None
        for err in exc.errors():
            if err.get("type") == "json_invalid":  # loc holds a byte offset, not a field
                offset = err.get("loc", (None, "?"))[-1]
                problems.append(f"the body is not valid JSON (at byte {offset}: "
                                f"{err.get('ctx', {}).get('error', 'parse error')})")
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            param = param or where or None
            msg = str(err.get("msg")).removeprefix("Value error, ")
            problems.append(f"{where}: {msg}" if where else msg)
        return _error(OpenAIError(400, "Invalid request: " + "; ".join(problems), param=param),
                      request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{exc.detail}: {request.method} {request.url.path}"
        if exc.status_code == 400 and str(exc.detail).startswith("There was an error parsing"):
            message = ("The body could not be read as JSON: it is malformed, or nested more "
                       "deeply than a JSON parser allows.")
        if exc.status_code == 404 and not request.url.path.startswith("/v1/"):
            message += " (the OpenAI API lives under /v1, e.g. POST /v1/chat/completions)"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message += f" (this path accepts {allowed})"
        return _error(OpenAIError(exc.status_code, message, kind, headers=exc.headers), request)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return _error(OpenAIError(500, f"internal server error: {exc!r}", "server_error"), request)
