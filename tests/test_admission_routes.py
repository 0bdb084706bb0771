"""Every route a client can reach that may lease a model (generate, tokenize, render, load)
passes the key check and the rate limit: the app's routes are enumerated, so a new route
added without them fails here. Only the monitoring routes (dashboards poll them), the page's
static files and /health stand outside the rate limit."""

import ast
import inspect
from pathlib import Path

from localserve.api.admission import admit, limit_rate
from localserve.api.app import create_app
from localserve.api.auth import require_key
from localserve.common.config import Settings

OUTSIDE_THE_RATE = {"/health", "/slots", "/openapi.json", "/metrics", "/v1/usage", "/props",
                    "/", "/chat", "/web/{name}", "/web/sign-in", "/favicon.ico"}


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
    assert keyless <= {"/health", "/", "/chat", "/web/{name}", "/web/sign-in", "/favicon.ico"}, keyless


# Routes that run no model: the catalog, stored answers, the page's conversations, monitoring.
NO_MODEL = {"/v1/models", "/models", "/v1/models/{model:path}", "/models/{model:path}", "/web/api/whoami",
            "/v1/responses/{response_id}", "/responses/{response_id}", "/web/api/conversations", "/web/api/conversations/export",
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


API = Path(__file__).resolve().parent.parent / "localserve" / "api"
# A model leased (loaded) or a request handed to its engine: what every route that runs a
# model does somewhere below its handler.
RUNS_A_MODEL = {"lease", "submit"}


def calls_by_function(sources: list[str]) -> dict[str, set[str]]:
    """For each function defined in `sources`, by name: the names it calls (plain or as an
    attribute, `x.name(...)`). Functions of one name in several modules are taken together."""
    calls: dict[str, set[str]] = {}
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found = calls.setdefault(node.name, set())
                for call in ast.walk(node):
                    if isinstance(call, ast.Call):
                        func = call.func
                        found.add(func.attr if isinstance(func, ast.Attribute)
                                  else func.id if isinstance(func, ast.Name) else "")
    return calls


def model_calls_of(calls: dict[str, set[str]]) -> set[str]:
    """RUNS_A_MODEL and every function that reaches one of them, however deep: derived from
    the HTTP layer's code, so a new helper (queue_chat, embed, ...) is counted without a list."""
    found, grown = set(RUNS_A_MODEL), True
    while grown:
        more = {name for name, called in calls.items() if name not in found and called & found}
        found |= more
        grown = bool(more)
    return found


def model_calls(handler_source: str, function: str) -> set[str]:
    """The model-running calls (model_calls_of, over every module of localserve/api and the
    handler's own source) that `function` makes, itself or through any function it calls."""
    calls = calls_by_function([path.read_text() for path in API.glob("*.py")] + [handler_source])
    running = model_calls_of(calls)
    found, seen, todo = set(), set(), [function]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for called in calls.get(name, ()):
            if called in running:
                found.add(called)
            else:
                todo.append(called)
    return found


def test_what_runs_a_model_is_derived_from_the_code():
    running = model_calls_of(calls_by_function([p.read_text() for p in API.glob("*.py")]))
    assert {"lease", "submit", "start_chat", "queue_chat", "embed"} <= running
    assert not running & {"require_key", "caller", "visible", "cards"}


def test_the_routes_that_run_no_model_never_lease_one():
    """Read from what each handler calls, not from its router: /api/show starting to lease
    a model (the deliberate break below) fails here."""
    app = create_app(Settings(api_keys=("route-test-key",)))
    handlers = {}
    for route in app.router.routes:
        inner = getattr(route, "original_router", None)
        for r in (inner.routes if inner is not None else [route]):
            if r.path in NO_MODEL and getattr(r, "endpoint", None) is not None:
                handlers[r.path] = r.endpoint
    assert {"/api/show", "/v1/models", "/api/tags"} <= set(handlers)
    for path, endpoint in handlers.items():
        source = inspect.getsource(inspect.getmodule(endpoint))
        assert model_calls(source, endpoint.__name__) == set(), path
    show = handlers["/api/show"]
    source = inspect.getsource(inspect.getmodule(show))
    leasing = f"\n\nasync def {show.__name__}(admitted):\n    return _load(admitted)\n\n" \
              "def _load(admitted):\n    return admitted.lease(None)\n"  # the handler, broken
    assert model_calls(source + leasing, show.__name__) == {"_load"}  # it leases
    # ... or through another module's helper that queues a chat
    helper = f"\n\nasync def {show.__name__}(admitted, host, body):\n" \
             "    return await serving.queue_chat(admitted, host, body, '/api/show')\n"
    assert model_calls(source + helper, show.__name__) == {"queue_chat"}
