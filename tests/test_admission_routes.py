"""Every route a client can reach that may lease a model (generate, tokenize, render, load)
passes the key check and the rate limit: the app's routes are enumerated, so a new route
added without them fails here. Only the monitoring routes (dashboards poll them), the page's
static files and /health stand outside the rate limit."""

from localserve.api.admission import limit_rate
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
    unguarded = {path for _, path, guards in seen if limit_rate not in guards}
    assert unguarded <= OUTSIDE_THE_RATE, unguarded - OUTSIDE_THE_RATE
    keyless = {path for _, path, guards in seen if require_key not in guards}
    assert keyless <= {"/health", "/", "/chat", "/web/{name}", "/favicon.ico"}, keyless
