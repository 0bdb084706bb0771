"""OpenAI-compatible endpoints: where a request enters, is checked, and where its text leaves.

Path: validate body (schemas) -> the key's rate (429) -> grammar from response_format or
tools (structured.py) -> render chat template and tokenize on a worker thread (prompt.py)
-> refuse what cannot fit its slot (400) -> engine.submit() -> replies.py shapes the events
into SSE chunks or one response.
"""

from __future__ import annotations

import math
from dataclasses import replace

from fastapi import APIRouter, Request

from localserve.api import prompt, structured
from localserve.api.replies import Reply, fingerprint
from localserve.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIError, _Sampling
from localserve.engine.loop import EngineUnavailable, QueueFull, UserQueueFull
from localserve.engine.streams import ChoiceStreams
from localserve.engine.request import Request as EngineRequest
from localserve.engine.request import SamplingParams
from localserve.quotas import QuotaError
from localserve.service import Service

router = APIRouter(prefix="/v1")
# llama-server and many snippets call the OpenAI paths without /v1: the same routes there.
bare_router = APIRouter()


def lease(request: Request, model: str | None = None, kind: str = "chat"):
    """The requested model's Service, loaded and ready, for an `async with` block (see
    registry.py); 404 for an unknown name when several models are served, 503 while loading."""
    return request.app.state.models.lease(model, kind)


def sampling_params(body: _Sampling, n_prompt: int, n_ctx: int,
                    grammar: str | None = None) -> SamplingParams:
    room = n_ctx - n_prompt
    return SamplingParams(grammar=grammar, logprobs=body.logprob_n,
        max_tokens=min(body.token_limit or room, room), temperature=body.temperature,
        top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, seed=body.seed,
        repeat_penalty=body.repeat_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, stop=tuple(body.stop or ()),
        ignore_eos=body.ignore_eos)


def check_rate(request: Request) -> None:
    """A key over its quota ([quotas]) or request rate (--rate-limit) gets 429 before any work
    is done for it."""
    user = getattr(request.state, "user", None)
    if user is None:
        return
    check_quota(request, user)
    limiter = request.app.state.rate_limiter
    if limiter is None:
        return
    wait = limiter.try_acquire(user)
    if wait > 0:
        raise OpenAIError(429, f"Too many requests from key '{user}': the limit is "
                          f"{limiter.rate:g} per second (burst {limiter.burst}). Retry in "
                          f"{wait:.1f} s.", code="rate_limit_exceeded",
                          headers={"Retry-After": str(max(1, math.ceil(wait)))})


def check_quota(request: Request, user: str) -> None:
    """[quotas] from the TOML: over one -> 429 saying which limit and when it resets."""
    keeper, service = request.app.state.quotas, request.app.state.service
    if keeper is None:
        return
    today, month = service.ledger.tokens_used(user) if service.ledger else (0, 0)
    in_flight = request.app.state.models.in_flight_of(user)
    try:
        keeper.check(user, today, month, in_flight)
    except QuotaError as exc:
        if service.ledger is not None:
            service.ledger.audit("quota", user, exc.limit)
        raise OpenAIError(429, str(exc), code="quota_exceeded", param=exc.limit,
                          headers={"Retry-After": str(math.ceil(exc.retry_after_s))}) from None


def submit(service: Service, tokens: list[int], body: _Sampling, user: str | None,
           grammar: str | None = None, endpoint: str = "") -> ChoiceStreams:
    """Queue the request's `n` choices: the first computes the prompt, the others copy it from
    its slot and sample with their own seeds (seed + i when a seed is given)."""
    n_ctx = service.n_ctx_per_slot
    if not tokens:
        raise OpenAIError(400, "The prompt is empty: there is nothing to continue.", param="prompt")
    if len(tokens) >= n_ctx:
        s = service.settings
        raise OpenAIError(400, f"This request's prompt is {len(tokens)} tokens, but each slot holds "
                          f"{n_ctx} tokens (-c {s.ctx_size} split over --parallel {s.parallel} slots)"
                          f", and the answer needs room too. Shorten the prompt, or raise -c or "
                          f"lower --parallel.", code="context_length_exceeded", param="messages")
    n_slots = service.settings.parallel
    if body.n > n_slots:
        raise OpenAIError(400, f"n={body.n} choices need {body.n} slots at once; this server has "
                          f"{n_slots} (--parallel)", param="n")
    params = sampling_params(body, len(tokens), n_ctx, grammar)
    choices: list[EngineRequest] = []
    for i in range(body.n):
        seeded = params if params.seed is None else replace(params, seed=params.seed + i)
        choices.append(EngineRequest(tokens, seeded, user=user, endpoint=endpoint,
                                     cache_scope=service.cache_scope(user),
                                     prefix_of=choices[0] if choices else None))
    try:
        return service.engine.submit_choices(choices)
    except UserQueueFull as exc:
        raise OpenAIError(429, f"{exc}; wait for some to finish.", code="queue_share_exceeded",
                          headers={"Retry-After": "2"})
    except QueueFull as exc:
        raise OpenAIError(503, f"The server is busy: {exc}. Retry in a few seconds.",
                          "server_error", code="queue_full", headers={"Retry-After": "2"})
    except EngineUnavailable as exc:
        raise OpenAIError(503, f"the server cannot take requests now: {exc}", "server_error")


def identity(request: Request, body: _Sampling) -> str | None:
    """Who is asking: the API key's name when keys are set, else the body's `user` field."""
    return getattr(request.state, "user", None) or body.user


@router.get("/models")
@bare_router.get("/models")
async def list_models(request: Request):
    """Every model offered, with its state (loaded, loading, unloaded, error)."""
    return {"object": "list", "data": request.app.state.models.cards()}


@router.get("/models/{model:path}")
@bare_router.get("/models/{model:path}")
async def get_model(model: str, request: Request):
    cards = {card["id"]: card for card in request.app.state.models.cards()}
    service = request.app.state.service
    if len(cards) == 1 and service.model_path and model == service.model_path.name:
        return next(iter(cards.values()))  # the file name, as llama-server accepts
    if model not in cards:
        raise OpenAIError(404, f"The model '{model}' does not exist; this server serves "
                          f"{', '.join(cards)}", code="model_not_found", param="model")
    return cards[model]


@router.post("/chat/completions")
@bare_router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    # With one model, every `model` name is answered by it (many tools hard-code
    # gpt-3.5-turbo, and llama-server does the same); responses report the served model's id.
    check_rate(request)
    async with lease(request, body.model) as service:
        tools = structured.tool_setup(service, body)
        if tools is not None:
            messages, grammar, plan = tools
        else:
            messages, plan = [m.as_template_dict() for m in body.messages], None
            grammar = structured.request_grammar(service, body)
        tokens = await prompt.chat_prompt(service, messages)
        stream = submit(service, tokens, body, identity(request, body), grammar,
                        "/v1/chat/completions")
    reply = Reply("chat.completion", service.model_id, body, fingerprint(service), plan,
                  piece=service.runner.piece)
    return await reply.respond(stream, request)


@router.post("/completions")
@bare_router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    check_rate(request)
    async with lease(request, body.model) as service:  # `model`: see chat_completions
        grammar = structured.request_grammar(service, body)
        if isinstance(body.prompt, str):
            tokens = await prompt.text_prompt(service, body.prompt)
        else:
            tokens = prompt.check_token_ids(service, body.prompt, "prompt")
        stream = submit(service, tokens, body, identity(request, body), grammar, "/v1/completions")
    reply = Reply("text_completion", service.model_id, body, fingerprint(service),
                  piece=service.runner.piece)
    if body.echo:
        reply.prefix = body.prompt if isinstance(body.prompt, str) else service.detokenize(tokens)
    return await reply.respond(stream, request)
