"""Every route a client can reach that may lease a model (generate, tokenize, render, load)
passes the key check and the rate limit: the app's routes are enumerated, so a new route
added without them fails here. Only the monitoring routes (dashboards poll them), the page's
static files and /health stand outside the rate limit."""

from localserve.api.admission import admit, limit_rate
from localserve.api.app import create_app
from localserve.api.auth import require_key
from localserve.config import Settings

OUTSIDE_THE_RATE = {"/health", "/slots", "/openapi.json", "/metrics", "/v1/usage", "/props",
                    "/", "/chat", "/web/{name}", "/favicon.ico"}


def routes_and_guards(app):
    """(method, path, dependency callables) of every route, through included routers (newer
    FastAPI keeps them as included routers) or flat (older FastAPI)."""
    for route in app.router.routes:
        context = getattr(route, "include_context", None)
        if context is not None:
            guards = {d.dependency for d in context.dependencies}
            inner = route.original_router.routes
        else:
            guards, inner = set(), [route]
        for r in inner:
            own = {d.call for d in getattr(getattr(r, "dependant", None), "dependencies", [])}
            for method in getattr(r, "methods", None) or ():
                yield method, r.path, guards | own


def test_every_model_route_checks_the_key_and_the_rate():
    app = create_app(Settings(api_keys=("route-test-key",)))
    seen = list(routes_and_guards(app))
    assert len(seen) > 30 and ("POST", "/v1/responses", ) in {(m, p) for m, p, _ in seen}
    unguarded = {path for _, path, guards in seen if not guards & {limit_rate, admit}}
    assert unguarded <= OUTSIDE_THE_RATE, unguarded - OUTSIDE_THE_RATE
    keyless = {path for _, path, guards in seen if not guards & {require_key, admit}}
    assert keyless <= {"/health", "/", "/chat", "/web/{name}", "/favicon.ico"}, keyless


# Routes that run no model: the catalog, stored answers, the page's conversations, monitoring.
NO_MODEL = {"/v1/models", "/models", "/v1/models/{model:path}", "/models/{model:path}", "/web/api/whoami",
            "/v1/responses/{response_id}", "/web/api/conversations", "/web/api/conversations/export",
            "/web/api/conversations/{conversation_id}", "/api/version", "/api/tags", "/api/ps",
            "/api/show", "/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete",
            "/api/blobs/{digest}"} | OUTSIDE_THE_RATE


def test_every_route_that_runs_a_model_is_admitted_by_the_one_dependency():
    """Key, rate and quota hold come from `admit` (no route takes the hold by hand): a new
    model route on a router without it fails here, and so does one of the vocabulary routes
    (/tokenize, count_tokens, ...) left without."""
    app = create_app(Settings(api_keys=("route-test-key",)))
    seen = list(routes_and_guards(app))
    held = {path for _, path, guards in seen if admit in guards}
    unheld = {path for _, path, guards in seen if admit not in guards}
    assert unheld <= NO_MODEL, unheld - NO_MODEL
    assert {"/tokenize", "/detokenize", "/apply-template", "/v1/messages/count_tokens",
            "/v1/responses/input_tokens", "/v1/chat/completions", "/infill",
            "/v1/embeddings", "/api/chat", "/api/generate", "/api/embed"} <= held
    assert not held & {"/v1/models", "/v1/responses/{response_id}"}
