"""OpenAI-compatible endpoints: where a request enters, is checked, and where its text leaves.

Path: validate body (schemas) -> the key's rate (429) -> grammar from response_format or
tools (structured.py) -> render chat template and tokenize on a worker thread (prompt.py)
-> refuse what cannot fit its slot (400) -> engine.submit() -> replies.py shapes the events
into SSE chunks or one response.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from localserve.api import prompt, structured
from localserve.api.admission import Admitted, admit
from localserve.api.auth import caller
from localserve.api.replies import Reply, fingerprint
from localserve.api.schemas import ChatCompletionRequest, CompletionRequest
from localserve.api.ollama_model import listed_with_capabilities
from localserve.api.serving import chat_tokens, reasons, start_chat, submit

router = APIRouter(prefix="/v1")
# llama-server and many snippets call the OpenAI paths without /v1: the same routes there
# (but /completions, which is llama-server's native completion: routes_native.py).
bare_router = APIRouter()
catalog_router = APIRouter()  # what is served: no model runs, so no quota hold


@catalog_router.get("/v1/models")
@catalog_router.get("/models", include_in_schema=False)
async def list_models(request: Request):
    """Every model offered (that the key may use), with its state (loaded, loading, unloaded,
    error); beside OpenAI's `data`, llama-server's `models` with each one's capabilities."""
    registry, allowed = request.app.state.models, caller(request).models
    return {"object": "list", "data": registry.cards(allowed),
            "models": [listed_with_capabilities(e) for e in registry.visible(allowed)]}


@catalog_router.get("/v1/models/{model:path}")
@catalog_router.get("/models/{model:path}", include_in_schema=False)
async def get_model(model: str, request: Request):
    allowed = caller(request).models
    cards = {name: card for card in request.app.state.models.cards(allowed)
             for name in (*card["aliases"], card["id"])}
    host = request.app.state.default_host
    if len({c["id"] for c in cards.values()}) == 1 and host.model_path \
            and model == host.model_path.name:
        return next(iter(cards.values()))  # the file name, as llama-server accepts
    if model not in cards:
        request.app.state.models.entry(model, allowed)  # a 403 for a model it may not use
        raise request.app.state.models.unknown(model, allowed)
    return cards[model]


@router.post("/chat/completions")
@bare_router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           admitted: Admitted = Depends(admit)):
    # With one model, every `model` name is answered by it (many tools hard-code
    # gpt-3.5-turbo, and llama-server does the same); responses report the served model's id.
    host, stream, plan = await start_chat(admitted, body, "/v1/chat/completions")
    reply = Reply("chat.completion", host.model_id, body, fingerprint(host), plan,
                  piece=host.piece, reasoning=reasons(host))
    return await reply.respond(stream, request)


@router.post("/chat/completions/input_tokens")
@bare_router.post("/chat/completions/input_tokens")
async def chat_input_tokens(body: ChatCompletionRequest, admitted: Admitted = Depends(admit)):
    """llama-server's count of a chat's prompt tokens (an image counts its positions), with
    nothing run."""
    async with admitted.lease(body.model) as host:
        tokens = (await chat_tokens(host, body, admitted.caller.key)).tokens
    return {"object": "response.input_tokens", "input_tokens": len(tokens)}


@router.post("/completions")  # without /v1 it is llama-server's native API (routes_native)
async def completions(body: CompletionRequest, request: Request,
                      admitted: Admitted = Depends(admit)):
    async with admitted.lease(body.model) as host:  # `model`: see chat_completions
        grammar = await run_in_threadpool(structured.request_grammar, host, body)
        tokens = await prompt.text_or_ids(host, body.prompt, "prompt")
        stream = submit(admitted, host, tokens, body, grammar, "/v1/completions")
    reply = Reply("text_completion", host.model_id, body, fingerprint(host),
                  piece=host.piece)
    if body.echo:
        reply.prefix = body.prompt if isinstance(body.prompt, str) else host.detokenize(tokens)
    return await reply.respond(stream, request)
