"""Ollama's API (/api/*), for the frontends and editor plug-ins that speak only it (Open WebUI's
Ollama connection, Continue, the official `ollama` client): a thin adapter, like the Messages
one. Bodies become the same chat or completion requests and go through the same admission
(app.py's `admitted` dependencies: key, rate, quota hold), serving (serving.py) and answer
(answer.py) path; ollama_reply.py writes Ollama's NDJSON lines or one object.

    /api/chat       messages, tools, format, options, think, keep_alive  -> a chat request
    /api/generate   prompt (+ system) through the chat template; raw: as is; suffix: FIM
    /api/embed, /api/embeddings                                          -> embedding.py
    /api/tags, /api/ps, /api/show, /api/version                          -> the catalog
    /api/pull, push, create, copy, delete   -> 501, naming what localserve does instead

Every option either changes the answer as Ollama's does or is refused with a 400 naming it;
load-time options (num_gpu, num_thread, ...) are the server's to set and are listed back in
X-Ignored-Fields. Errors come in Ollama's shape, {"error": "..."} (app.py).
"""

from __future__ import annotations

import json
import re
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from localserve.api import prompt, structured
from localserve.api.admission import Admitted, admit
from localserve.api.auth import caller
from localserve.api.chat_message import base64_image_part
from localserve.api.embedding import EmbeddingRequest, embed
from localserve.api.ollama_model import show, tags_entry
from localserve.api.ollama_reply import OllamaReply, now_iso
from localserve.api.replies import ignored_header
from localserve.api.schemas import (ChatCompletionRequest, CompletionRequest, OpenAIError,
                                    translated_chat)
from localserve.api.serving import queue_chat, reasons, submit

router = APIRouter(prefix="/api")  # runs a model: admitted (app.py)
catalog_router = APIRouter(prefix="/api")  # what is served, and model management's 501s
OLLAMA_VERSION = "0.12.0"  # the Ollama API whose shapes this follows (localserve's own: /props)

SAMPLING = {"temperature", "top_k", "top_p", "min_p", "typical_p", "mirostat", "mirostat_tau",
            "mirostat_eta", "seed", "stop", "repeat_penalty", "repeat_last_n",
            "presence_penalty", "frequency_penalty"}
# Options that leave the answer as it is at these values (anything else is refused). The
# others (load-time ones: num_gpu, num_thread, use_mmap, ...) are the server's to set:
# listed back in X-Ignored-Fields.
HARMLESS = {"tfs_z": (1, 1.0)}


class OllamaBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    format: str | dict | None = None
    options: dict | None = None
    stream: bool = True
    keep_alive: float | int | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None


class ChatBody(OllamaBody):
    messages: list[dict] = []
    tools: list[dict] | None = None


class GenerateBody(OllamaBody):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list | None = None


# ---- translation ---------------------------------------------------------------------------

def sampling(body: OllamaBody) -> tuple[dict, list[str], int | None]:
    """(chat request fields, options ignored because the server sets them, num_ctx asked)."""
    fields, ignored, options = {}, [], dict(body.options or {})
    if body.logprobs:
        raise OpenAIError(400, "'logprobs' is not supported on Ollama's API here; use "
                          "/v1/chat/completions with logprobs", param="logprobs")
    predict = options.pop("num_predict", None)
    if predict is not None and predict not in (-1, -2):
        if not isinstance(predict, int) or predict < 1:
            raise OpenAIError(400, "options.num_predict: a positive count, or -1 (no limit)",
                              param="options.num_predict")
        fields["max_tokens"] = predict
    num_ctx = options.pop("num_ctx", None)
    if num_ctx is not None and (type(num_ctx) is not int or num_ctx < 1):
        raise OpenAIError(400, f"options.num_ctx: a positive count of tokens, not {num_ctx!r}",
                          param="options.num_ctx")
    for name, value in options.items():
        if name in SAMPLING:
            fields[name] = value
        elif name in HARMLESS:
            if value not in HARMLESS[name]:
                raise OpenAIError(400, f"options.{name} = {value!r} is not supported by this "
                                  f"server; leave it out (or at {HARMLESS[name][0]})",
                                  param=f"options.{name}")
        else:
            ignored.append(f"options.{name}")
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "format", "schema": body.format}}
    elif body.format not in (None, ""):
        raise OpenAIError(400, "format: \"json\" or a JSON schema", param="format")
    return fields, ignored + sorted(body.model_extra or {}), num_ctx


def with_images(text, images, where: str):
    """Ollama's `images` (base64, no media type) as OpenAI's image parts, before the text (as
    Ollama's own templates place them)."""
    if not images:
        return text
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise OpenAIError(400, f"{where} must be a list of base64 strings", param=where)
    parts = [base64_image_part("image/*", data) for data in images]
    return parts + ([{"type": "text", "text": text}] if text else [])


def chat_messages(messages: list[dict]) -> list[dict]:
    """Ollama's messages as OpenAI's: calls get ids (Ollama's have none), a tool's result
    answers the latest call of its tool_name."""
    out, ids = [], {}
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise OpenAIError(400, f"messages[{i}] must be an object", param="messages")
        turn = {"role": message.get("role"),
                "content": with_images(message.get("content") or "", message.get("images"),
                                       f"messages[{i}].images")}
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise OpenAIError(400, f"messages[{i}].tool_calls must be a list of objects",
                              param=f"messages[{i}].tool_calls")
        if calls:
            turn["tool_calls"] = []
            for j, call in enumerate(calls):
                function = call.get("function") or {}
                if not isinstance(function, dict):
                    raise OpenAIError(400, f"messages[{i}].tool_calls[{j}].function must be an "
                                      f"object", param=f"messages[{i}].tool_calls")
                if not isinstance(function.get("name"), (str, type(None))):
                    raise OpenAIError(400, f"messages[{i}].tool_calls[{j}].function.name must "
                                      f"be a string", param=f"messages[{i}].tool_calls")
                ids[function.get("name")] = call_id = f"call_{i}_{j}"
                args = function.get("arguments", {})
                turn["tool_calls"].append({"id": call_id, "type": "function", "function": {
                    "name": function.get("name"),
                    "arguments": args if isinstance(args, str) else json.dumps(args)}})
        if turn["role"] == "tool":
            turn["tool_call_id"] = ids.get(message.get("tool_name") or message.get("name"), "")
        out.append(turn)
    return out


def keep_alive_seconds(value) -> float | None:
    """Ollama's keep_alive ("5m", "1h30m", 300, -1, "0") in seconds; negative: forever."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return float(text)
    parts = re.fullmatch(r"(-)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    if not text or parts is None:
        raise OpenAIError(400, f"keep_alive: a duration like \"5m\" or seconds, not {value!r}",
                          param="keep_alive")
    sign, hours, minutes, seconds = parts.groups()
    total = int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(seconds or 0)
    return -total if sign else total


def thinking(body: OllamaBody, host) -> bool:
    """Whether thoughts are shown; think: true on a model that does not reason is refused."""
    if isinstance(body.think, str):
        raise OpenAIError(400, "think levels are not supported; send true or false", param="think")
    if body.think and not reasons(host):
        raise OpenAIError(400, f"'{host.model_id}' does not support thinking", param="think")
    return body.think is not False


def as_chat(body: OllamaBody, messages: list[dict], fields: dict) -> ChatCompletionRequest:
    return translated_chat({"model": body.model, "messages": messages, **fields,
                            "tools": getattr(body, "tools", None) or None, "stream": body.stream})


def loaded_or_unloaded(admitted: Admitted, body: OllamaBody, host, keep_alive: float | None,
                       shape: dict) -> JSONResponse:
    """Ollama's answer to a load call (no prompt): "unload" when keep_alive 0 was taken (the
    model goes once idle), else "load"; a keep_alive not taken is named in X-Ignored-Fields."""
    ignored = admitted.keep_alive(body.model, keep_alive)
    reason = "unload" if keep_alive == 0 and not ignored else "load"
    return JSONResponse({"model": host.model_id, "created_at": now_iso(), **shape, "done": True,
                         "done_reason": reason}, headers=ignored_header(ignored))


async def respond(reply: OllamaReply, stream, request: Request, streaming: bool, ignored):
    headers = ignored_header(ignored)
    if not streaming:
        return JSONResponse(await reply.collect(stream, request), headers=headers)
    return StreamingResponse(reply.lines(stream), media_type="application/x-ndjson",
                             headers=headers)


# ---- routes that run a model ----------------------------------------------------------------

@router.post("/chat")
async def chat(body: ChatBody, request: Request,
               admitted: Admitted = Depends(admit)):
    started = time.monotonic()
    fields, ignored, num_ctx = sampling(body)
    keep_alive = keep_alive_seconds(body.keep_alive)  # kept once the request is accepted
    async with admitted.lease(body.model, load_only=not body.messages) as host:
        loaded = time.monotonic()
        show_thinking = thinking(body, host)
        if not body.messages:  # Ollama's way to load a model: an empty chat
            return loaded_or_unloaded(admitted, body, host, keep_alive, {"message": {
                "role": "assistant", "content": ""}})
        # A num_ctx above what one request may use here is held to it, as Ollama does: a
        # prompt that does not fit is refused naming the real bound (serving.submit).
        stream, plan = await queue_chat(admitted, host, as_chat(
            body, chat_messages(body.messages), fields), "/api/chat", num_ctx)
    ignored += admitted.keep_alive(body.model, keep_alive)
    reply = OllamaReply(host.model_id, True, plan, reasons(host), show_thinking, started, loaded)
    return await respond(reply, stream, request, body.stream, ignored)


@router.post("/generate")
async def generate(body: GenerateBody, request: Request,
                   admitted: Admitted = Depends(admit)):
    started = time.monotonic()
    for name, why in (("template", "the model's own chat template is used; send raw: true "
                                   "with a prompt you formatted yourself"),
                      ("context", "send the conversation to /api/chat instead")):
        if getattr(body, name):
            raise OpenAIError(400, f"'{name}' is not supported: {why}", param=name)
    if body.images and (body.raw or body.suffix is not None):
        raise OpenAIError(400, "'images' go through the chat template, which raw: true and "
                          "suffix skip", param="images")
    if body.raw and body.system:
        raise OpenAIError(400, "'system' needs the chat template, which raw: true skips",
                          param="system")
    fields, ignored, num_ctx = sampling(body)
    keep_alive = keep_alive_seconds(body.keep_alive)  # kept once the request is accepted
    loading = not body.prompt and not body.suffix  # Ollama's way to load a model
    async with admitted.lease(body.model, load_only=loading) as host:
        loaded = time.monotonic()
        show_thinking = thinking(body, host)
        if loading:
            return loaded_or_unloaded(admitted, body, host, keep_alive, {"response": ""})
        if body.raw or body.suffix is not None:
            plan = None  # Ollama's default num_predict is no limit: max_tokens None, not 16
            completion = translated_chat({"prompt": body.prompt or " ", "max_tokens": None,
                                          **fields}, CompletionRequest)
            tokens, grammar = await raw_tokens(host, body), await grammar_of(host, completion)
            stream = submit(admitted, host, tokens, completion, grammar, "/api/generate", num_ctx)
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) \
                + [{"role": "user", "content": with_images(body.prompt, body.images, "images")}]
            stream, plan = await queue_chat(admitted, host, as_chat(body, messages, fields),
                                            "/api/generate", num_ctx)
    ignored += admitted.keep_alive(body.model, keep_alive)
    reply = OllamaReply(host.model_id, False, plan, reasons(host) and not body.raw,
                        show_thinking, started, loaded)
    return await respond(reply, stream, request, body.stream, ignored)


async def raw_tokens(host, body: GenerateBody) -> list[int]:
    """The prompt as is (raw), or wrapped in the model's fill-in-the-middle tokens (suffix)."""
    if body.suffix is None:
        return await prompt.text_prompt(host, body.prompt)
    return await prompt.fill_in_the_middle(host, body.prompt, body.suffix, "'suffix'", "suffix")


async def grammar_of(host, completion: CompletionRequest) -> str | None:
    return await run_in_threadpool(structured.request_grammar, host, completion)


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: float | int | str | None = None
    options: dict | None = None


@router.post("/embed")
async def embed_route(body: EmbedBody, request: Request,
                      admitted: Admitted = Depends(admit)):
    started = time.monotonic()
    keep_alive = keep_alive_seconds(body.keep_alive)
    async with admitted.lease(body.model, kind="embedding") as host:
        loaded = time.monotonic()
        asked = EmbeddingRequest(input=body.input, model=body.model, dimensions=body.dimensions)
        vectors, n_tokens = await embed(request, admitted, host, asked, "/api/embed", body.truncate)
    admitted.keep_alive(body.model, keep_alive)
    return {"model": host.model_id, "embeddings": vectors,
            "total_duration": int((time.monotonic() - started) * 1e9),
            "load_duration": int((loaded - started) * 1e9), "prompt_eval_count": n_tokens}


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str
    keep_alive: float | int | str | None = None
    options: dict | None = None


@router.post("/embeddings")
async def embeddings_route(body: EmbeddingsBody, request: Request,
                           admitted: Admitted = Depends(admit)):
    """Ollama's older embedding route: one prompt, one vector."""
    keep_alive = keep_alive_seconds(body.keep_alive)
    async with admitted.lease(body.model, kind="embedding") as host:
        vectors, _ = await embed(request, admitted, host, EmbeddingRequest(input=body.prompt,
                                                                 model=body.model), "/api/embeddings")
    admitted.keep_alive(body.model, keep_alive)
    return {"embedding": vectors[0]}


# ---- the catalog ----------------------------------------------------------------------------

@catalog_router.get("/version")
async def version():
    return {"version": OLLAMA_VERSION}


@catalog_router.get("/tags")
async def tags(request: Request):
    visible = request.app.state.models.visible(caller(request).models)
    return {"models": [tags_entry(entry) for entry in visible]}


@catalog_router.get("/ps")
async def ps(request: Request):
    """The loaded models, with when they will be unloaded if idle (pinned or never: Ollama's
    far future)."""
    registry = request.app.state.models
    return {"models": [{**tags_entry(entry), "expires_at": registry.expires_at(entry),
                        "size_vram": 0, "context_length": entry.host.n_ctx_per_slot}
                       for entry in registry.visible(caller(request).models) if entry.loaded]}


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    name: str | None = None  # older clients' spelling
    verbose: bool = False


@catalog_router.post("/show")
async def show_route(body: ShowBody, request: Request):
    entry = request.app.state.models.entry(body.model or body.name, caller(request).models)
    return show(entry, reasons(entry.host) if entry.loaded else False)


MANAGED_BY_ADMIN = ("localserve serves the GGUF files its admin configured (-m, or [models.*] "
                    "in --config); `localserve pull NAME` downloads one on the server machine. "
                    "This API cannot {what} models.")


@catalog_router.post("/pull", include_in_schema=False)  # 501s: not operations offered
@catalog_router.post("/push", include_in_schema=False)
@catalog_router.post("/create", include_in_schema=False)
@catalog_router.post("/copy", include_in_schema=False)
@catalog_router.delete("/delete", include_in_schema=False)
@catalog_router.post("/blobs/{digest}", include_in_schema=False)
async def managed_by_admin(request: Request):
    path = request.url.path
    what = "upload" if "/blobs/" in path else path.rsplit("/", 1)[-1]
    raise OpenAIError(501, MANAGED_BY_ADMIN.format(what=what), code="not_implemented")

