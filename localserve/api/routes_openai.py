"""OpenAI-compatible endpoints: where a request enters, is checked, and where its text leaves.

Path: validate body (schemas) -> the key's rate (429) -> render chat template and tokenize
on a worker thread (prompt.py) -> refuse what cannot fit its slot (400) -> engine.submit()
-> stream chunks (SSE) or collect one response.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

from fastapi import APIRouter, Request
from sse_starlette.sse import EventSourceResponse

from localserve.api import prompt
from localserve.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIError, _Sampling
from localserve.engine.loop import EngineUnavailable, QueueFull, RequestStream, UserQueueFull
from localserve.engine.request import Request as EngineRequest
from localserve.engine.request import SamplingParams, TokenEvent
from localserve.service import Service

router = APIRouter(prefix="/v1")


def ready_service(request: Request) -> Service:
    service: Service = request.app.state.service
    state, problem = service.status()
    if state == "ok":
        return service
    if state == "draining":
        raise OpenAIError(503, "the server is shutting down and takes no new requests",
                          "server_error", code="shutting_down", headers={"Retry-After": "10"})
    if state == "loading":
        raise OpenAIError(503, "the model is still loading; retry shortly", "server_error",
                          headers={"Retry-After": "2"})
    what = "the model failed to load" if service.load_error else "the engine is not running"
    raise OpenAIError(503, f"{what}: {problem}", "server_error")


def check_model_name(service: Service, name: str | None) -> None:
    if name and name not in (service.model_id, service.model_path.name, "default"):
        raise OpenAIError(404, f"The model '{name}' does not exist; this server serves "
                          f"'{service.model_id}' (see GET /v1/models)", code="model_not_found",
                          param="model")


def sampling_params(body: _Sampling, n_prompt: int, n_ctx: int) -> SamplingParams:
    room = n_ctx - n_prompt
    return SamplingParams(
        max_tokens=min(body.token_limit or room, room), temperature=body.temperature,
        top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, seed=body.seed,
        repeat_penalty=body.repeat_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, stop=tuple(body.stop or ()),
        ignore_eos=body.ignore_eos)


def check_rate(request: Request) -> None:
    """A key over its request rate (--rate-limit) gets 429 before any work is done for it."""
    user = getattr(request.state, "user", None)
    limiter = request.app.state.rate_limiter
    if user is None or limiter is None:
        return
    wait = limiter.try_acquire(user)
    if wait > 0:
        raise OpenAIError(429, f"Too many requests from key '{user}': the limit is "
                          f"{limiter.rate:g} per second (burst {limiter.burst}). Retry in "
                          f"{wait:.1f} s.", code="rate_limit_exceeded",
                          headers={"Retry-After": str(max(1, math.ceil(wait)))})


def submit(service: Service, tokens: list[int], body: _Sampling, user: str | None) -> RequestStream:
    n_ctx = service.n_ctx_per_slot
    if not tokens:
        raise OpenAIError(400, "The prompt is empty: there is nothing to continue.", param="prompt")
    if len(tokens) >= n_ctx:
        s = service.settings
        raise OpenAIError(400, f"This request's prompt is {len(tokens)} tokens, but each slot holds "
                          f"{n_ctx} tokens (-c {s.ctx_size} split over --parallel {s.parallel} slots)"
                          f", and the answer needs room too. Shorten the prompt, or raise -c or "
                          f"lower --parallel.", code="context_length_exceeded", param="messages")
    request = EngineRequest(tokens, sampling_params(body, len(tokens), n_ctx), user=user,
                            cache_scope=service.cache_scope(user))
    try:
        return service.engine.submit(request)
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


def usage(event: TokenEvent) -> dict:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}


def error_payload(event: TokenEvent) -> dict:
    return {"error": {"message": event.error or "generation failed", "type": "server_error",
                      "param": None, "code": event.finish_reason}}


@router.get("/models")
async def list_models(request: Request):
    service = request.app.state.service
    return {"object": "list", "data": [{"id": service.model_id, "object": "model",
                                        "created": 0, "owned_by": "localserve"}]}


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    service = ready_service(request)
    check_model_name(service, body.model)
    check_rate(request)
    tokens = await prompt.chat_prompt(service, body.messages)
    stream = submit(service, tokens, body, identity(request, body))
    reply = Reply("chat.completion", service.model_id, body)
    if body.stream:
        return EventSourceResponse(reply.sse(stream), ping=15)
    return await reply.collect(stream, request)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    service = ready_service(request)
    check_model_name(service, body.model)
    check_rate(request)
    if isinstance(body.prompt, str):
        tokens = await prompt.text_prompt(service, body.prompt)
    else:
        bad = [t for t in body.prompt if not 0 <= t < service.runner.n_vocab]
        if bad:
            raise OpenAIError(400, f"token ids out of range 0..{service.runner.n_vocab - 1}: {bad[:5]}",
                              param="prompt")
        tokens = list(body.prompt)
    stream = submit(service, tokens, body, identity(request, body))
    reply = Reply("text_completion", service.model_id, body)
    if body.echo:
        reply.prefix = body.prompt if isinstance(body.prompt, str) else service.detokenize(tokens)
    if body.stream:
        return EventSourceResponse(reply.sse(stream), ping=15)
    return await reply.collect(stream, request)


async def cancel_on_disconnect(request: Request, stream: RequestStream) -> None:
    """A non-streaming client that hangs up should free its slot too (streams notice by
    themselves: sse-starlette cancels their generator)."""
    while not stream.finished:
        await asyncio.sleep(0.25)
        if await request.is_disconnected():
            stream.cancel()
            return


class Reply:
    """Shapes engine events into OpenAI's chat or text completion objects (whole or chunked)."""

    def __init__(self, kind: str, model: str, body: _Sampling):
        self.kind, self.model, self.body = kind, model, body
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.prefix = ""

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _choice(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _chunk(self, choices: list, **extra) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"data": json.dumps({"id": self.id, "object": obj, "created": self.created,
                                    "model": self.model, "choices": choices, **extra})}

    async def sse(self, stream: RequestStream):
        try:
            if self.chat or self.prefix:
                yield self._chunk([self._choice(self.prefix, None, first=True)])
            async for event in stream:
                if event.finish_reason in ("error", "timeout"):
                    yield {"data": json.dumps(error_payload(event))}
                    break
                if event.text and not event.finished:
                    yield self._chunk([self._choice(event.text, None)])
                if event.finished:
                    yield self._chunk([self._choice(event.text, event.finish_reason)])
                    if self.body.include_usage:
                        yield self._chunk([], usage=usage(event))
            yield {"data": "[DONE]"}
        finally:
            stream.cancel()

    async def collect(self, stream: RequestStream, request: Request) -> dict:
        parts = [self.prefix]
        watcher = asyncio.create_task(cancel_on_disconnect(request, stream))
        try:
            async for event in stream:
                parts.append(event.text)
                if event.finish_reason == "timeout":
                    raise OpenAIError(503, event.error, "server_error", code="queue_timeout",
                                      headers={"Retry-After": "2"})
                if event.finish_reason == "error":
                    raise OpenAIError(500, event.error or "generation failed", "server_error")
                last = event
        finally:
            stream.cancel()
            watcher.cancel()
        if last.finish_reason == "abort":
            raise OpenAIError(499, "the client closed the request", code="client_closed")
        text = "".join(parts)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(last)}
