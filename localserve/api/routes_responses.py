"""OpenAI's Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id},
POST /v1/responses/input_tokens) for the agent SDKs that speak it: a thin adapter. The body is
translated into a chat completion request and goes through the same admission, template,
grammar and engine path (serving.start_chat); only the shapes differ:

    instructions + input items (messages, function_call,   ->  chat messages (system, tool
    function_call_output)                                      calls, tool role)
    tools (function), tool_choice, text.format             ->  tools, tool_choice, response_format
    max_output_tokens, previous_response_id                ->  max_tokens, the earlier turns
    the answer                                             ->  message and function_call items,
                                                               status completed / incomplete
Stored responses (`store`, the default) live per key in <state-dir>/responses.db, kept like the
page's conversations (conversations.py: bounded per key); another key's id is a 404.
Streaming sends the typed events (response.created ... response.completed) in order.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from localserve.api.admission import Admitted, admit
from localserve.api.chat_message import image_part, joined_parts
from localserve.api.images import from_url
from localserve.api.replies import ignored_header, respond_with
from localserve.api.response_reply import ResponseReply
from localserve.api.serving import chat_tokens, reasons, start_chat
from localserve.api.store_threads import in_store_thread
from localserve.api.auth import caller
from localserve.api.schemas import (EXTENSIONS, ChatCompletionRequest, OpenAIError, extensions,
                                    translated_chat)
from localserve.office.conversations import MAX_CONVERSATION_BYTES, TooLarge

router = APIRouter(prefix="/v1")
bare_router = APIRouter()  # without /v1, as OpenAI-style clients given a bare base URL send it
stored_router = APIRouter()  # stored answers: read and deleted, no model runs
# Fields that would change the answer and this server cannot honour: refused by name.
# llama-server's Responses stream also takes return_progress (its in_progress events).
STREAMED_EXTENSIONS = (*EXTENSIONS, "return_progress", "timings_per_token")
REFUSED = ("background", "conversation", "prompt", "max_tool_calls", "top_logprobs")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict] = Field(..., min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    reasoning: dict | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict | None = None
    user: str | None = None
    # Accepted, they do not change the answer: which extra fields to include, the tier...
    include: list[str] | None = None
    truncation: str | None = None


def _owner(request: Request) -> str:
    return caller(request).owner


def _text(content, where: str):
    """A string, or text parts joined; with input_image parts, OpenAI's chat parts (images
    as image_url parts); files are refused by name."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else [content]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and isinstance(part.get("image_url"), str):
            from_url(part["image_url"], where, fetch=True)  # a bad one refused by its own name
            parts.append(image_part(part["image_url"]))
            continue
        if kind not in TEXT_PARTS and kind != "refusal":
            raise OpenAIError(400, f"{where}: parts of type {kind!r} are not supported: this "
                              f"server reads text, and images sent as image_url data URIs",
                              param=where)
        parts.append({"type": "text", "text": str(part.get("text", part.get("refusal", "")))})
    return joined_parts(parts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """Input items as chat messages: function_call items join the assistant turn before them
    as its tool_calls; function_call_output items become 'tool' messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(400, f"{where}.role must be user, system, developer or "
                                  f"assistant", param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content", ""), where)})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function", "function": {
                "name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _text(item.get("output", ""), where)})
        elif kind != "reasoning":  # earlier reasoning is not sent back to the model
            raise OpenAIError(400, f"{where}: items of type {kind!r} are not supported",
                              param=where)
    return out


def _tools(body: ResponsesRequest) -> dict:
    if not body.tools:
        return {}
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise OpenAIError(400, f"tools[{i}]: tools of type {tool.get('type')!r} are not "
                              f"supported; only function tools", param=f"tools[{i}]")
        tools.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise OpenAIError(400, f"tool_choice type {choice.get('type')!r}: use auto, none, "
                              f"required or a function", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat = {"tools": tools, "tool_choice": choice}
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    return chat


def _format(text: dict | None) -> dict:
    """text.format: text, json_object or json_schema (the grammar path)."""
    text = text or {}
    if text.get("verbosity") not in (None, "medium"):
        raise OpenAIError(400, "text.verbosity is not supported by this server",
                          param="text.verbosity")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "output", "schema": fmt.get("schema") or {}}}}
    raise OpenAIError(400, f"text.format type {kind!r}: use text, json_object or json_schema",
                      param="text.format")


def as_chat(body: ResponsesRequest, earlier: list[dict]) -> ChatCompletionRequest:
    """The chat completion request this Responses request means (validated as one)."""
    for name in REFUSED:
        if (body.model_extra or {}).get(name) not in (None, False, 0):
            raise OpenAIError(400, f"'{name}' is not supported by this server", param=name)
    if (body.reasoning or {}).get("effort") not in (None, "none", "minimal"):
        raise OpenAIError(400, "'reasoning' is not supported by this server's model; send the "
                          "request without it", param="reasoning")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = {"model": body.model, "messages": system + earlier + input_messages(body.input),
            "max_tokens": body.max_output_tokens, "stream": body.stream, "user": body.user,
            **_tools(body), **_format(body.text),
            **extensions(body.model_extra, STREAMED_EXTENSIONS)}
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    return translated_chat(chat)


def _store(request: Request):
    return request.app.state.office.responses


def _earlier(request: Request, body: ResponsesRequest) -> list[dict]:
    """The turns of the response this one continues (the caller's own only)."""
    if body.previous_response_id is None:
        return []
    found = _store(request).get(_owner(request), body.previous_response_id)
    if found is None:
        raise _not_stored(body.previous_response_id, "previous_response_id")
    return found["messages"]


def _not_stored(response_id: str, param: str | None = None) -> OpenAIError:
    """Another key's response is answered the same as none: its id tells nothing."""
    return OpenAIError(404, f"No response with id '{response_id}' is stored for this key",
                       code="response_not_found", param=param)


@router.post("/responses")
@bare_router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request,
                          admitted: Admitted = Depends(admit)):
    earlier = await in_store_thread(request, _earlier, request, body)
    chat = as_chat(body, earlier)
    if body.store and (limit := _stored_answer_limit(request, body, earlier)) is not None:
        chat.max_tokens = limit
    host, stream, plan = await start_chat(admitted, chat, "/v1/responses")
    reply = ResponseReply(host.model_id, body, stream.n_prompt_tokens, plan,
                          reasons(host))
    reply.turns = earlier + input_messages(body.input)
    reply.keep = (lambda response, messages: _save(request, response, messages)) if body.store else None
    headers = ignored_header(sorted(set(body.model_extra or {}) - set(REFUSED)
                                    - set(STREAMED_EXTENSIONS)))
    return await respond_with(reply.collect, reply.events, stream, request, body.stream, headers)


# What one answer token takes in the store at most, written twice (the turns and the
# response object), JSON-escaped: room reserved for max_output_tokens before generating.
STORED_BYTES_PER_TOKEN = 2 * 12
STORED_OVERHEAD = 1024  # a response object's own fields (ids, status, usage, settings)


def _fits_the_store(request: Request, body: ResponsesRequest, earlier: list[dict]) -> int:
    """Refused before any work (and billed nothing) when what is known to be stored already
    cannot fit: the chain so far, the input, the instructions and metadata, and room for an
    answer of max_output_tokens (of one token when none is given). Else the tokens an answer
    may take and still be stored: one sent without max_output_tokens is held to them, so a
    store never refuses an answer after it was made (and billed)."""
    known = STORED_OVERHEAD + len(json.dumps([  # what the stored turns and response echo
        earlier, body.input, body.instructions, body.metadata, body.tools, body.text,
        body.tool_choice, body.user]))
    answer = (body.max_output_tokens or 1) * STORED_BYTES_PER_TOKEN
    room = min(_store(request).room(_owner(request)), MAX_CONVERSATION_BYTES)
    if known + answer > room:
        raise OpenAIError(413, f"this response could not be stored: its input, instructions "
                          f"and chain take {known} bytes"
                          + (f", and an answer of up to {body.max_output_tokens} tokens up to "
                             f"{answer} more," if body.max_output_tokens else "")
                          + f" and the store has {room} left for this key; send store: false, "
                          f"lower max_output_tokens, or start a new chain",
                          code="response_too_large")
    return (room - known) // STORED_BYTES_PER_TOKEN


def _stored_answer_limit(request: Request, body: ResponsesRequest, earlier: list) -> int | None:
    """An answer to store, sent without max_output_tokens, is held to what the store can
    still take (it then ends "incomplete", as one cut by max_output_tokens), unless the
    server's -n holds it to less already. None: as asked."""
    room = _fits_the_store(request, body, earlier)
    default = request.app.state.office.settings.n_predict
    return room if body.max_output_tokens is None and room < (default or room + 1) else None


async def _save(request: Request, response: dict, messages: list[dict]) -> None:
    try:
        await in_store_thread(request, _store(request).save, _owner(request), response["id"], "",
                              {"messages": messages, "response": response})
    except TooLarge as exc:
        raise OpenAIError(413, f"the response could not be stored: {exc}; send store: false, "
                          f"or start a new chain", code="response_too_large") from None


@stored_router.get("/v1/responses/{response_id}")
@stored_router.get("/responses/{response_id}", include_in_schema=False)
async def get_response(response_id: str, request: Request):
    found = await in_store_thread(request, _store(request).get, _owner(request), response_id)
    if found is None:
        raise _not_stored(response_id)
    return found["response"]


@stored_router.delete("/v1/responses/{response_id}")
@stored_router.delete("/responses/{response_id}", include_in_schema=False)
async def delete_response(response_id: str, request: Request):
    if not await in_store_thread(request, _store(request).delete, _owner(request), response_id):
        raise _not_stored(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/responses/input_tokens")
async def input_tokens(body: ResponsesRequest, request: Request,
                       admitted: Admitted = Depends(admit)):
    chat = as_chat(body, await in_store_thread(request, _earlier, request, body))
    async with admitted.lease(chat.model) as host:
        tokens = (await chat_tokens(host, chat, admitted.caller.key)).tokens
    return {"object": "response.input_tokens", "input_tokens": len(tokens)}
