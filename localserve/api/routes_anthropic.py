"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) for agents and
editors that speak it: a thin adapter. The body is translated into a chat completion request
and goes through the very same admission, template, grammar and engine path
(serving.start_chat); only the shapes differ:

    system + messages (text, tool_use, tool_result blocks)  ->  chat messages (tool calls, tool role)
    tools (input_schema), tool_choice auto/any/tool/none   ->  tools, tool_choice auto/required/named/none
    stop_sequences, metadata.user_id                       ->  stop, user
    the answer                                             ->  text and tool_use content blocks,
                                                               stop_reason end_turn/max_tokens/tool_use
Streaming sends Anthropic's typed events (message_start, content_block_*, message_delta,
message_stop, ping). Errors come in Anthropic's error shape (see app.py).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from localserve.api.admission import Admitted, admit
from localserve.api.chat_message import base64_image_part, image_part, joined_parts
from localserve.api.message_reply import MessageReply
from localserve.api.replies import ignored_header, respond_with
from localserve.api.serving import chat_tokens, reasons, start_chat
from localserve.api.schemas import (EXTENSIONS, ChatCompletionRequest, OpenAIError, extensions,
                                    translated_chat)

router = APIRouter(prefix="/v1")
# Fields of Anthropic's API that would change the answer and this server cannot honour.
REFUSED = ("mcp_servers", "container", "context_management")


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int = Field(..., ge=1)
    messages: list[dict] = Field(..., min_length=1)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    metadata: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None  # {"format": {"type": "json_schema", "schema": {...}}}


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = None


def _text(blocks, where: str) -> str:
    """A string, or text blocks joined; any other block kind is refused by name."""
    if isinstance(blocks, str):
        return blocks
    return joined_parts(_parts(blocks, where, images=False))


def _parts(blocks, where: str, images: bool = True) -> list[dict]:
    """Text and image blocks as OpenAI's content parts; any other kind is refused by name."""
    if isinstance(blocks, str):
        return [{"type": "text", "text": blocks}]
    parts = []
    for block in blocks or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image" and images:
            parts.append(_image(block.get("source"), where))
        elif kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        else:
            raise OpenAIError(400, f"{where}: content blocks of type {kind!r} are not supported "
                              f"here: this server reads text{' and images' if images else ''}",
                              param=where)
    return parts


def _image(source, where: str) -> dict:
    """An image block's source: base64 (or a URL, which the chat path refuses to fetch)."""
    if isinstance(source, dict) and source.get("type") == "base64":
        return base64_image_part(str(source.get("media_type", "image/*")),
                                 str(source.get("data", "")))
    if isinstance(source, dict) and source.get("type") == "url":
        return image_part(str(source.get("url", "")))
    raise OpenAIError(400, f"{where}: an image's source must be base64 data", param=where)


def _messages(body: MessagesRequest) -> list[dict]:
    """Anthropic's turns as chat messages: tool_result blocks become 'tool' messages before
    the user's text; an assistant's tool_use blocks become its tool_calls."""
    out = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    for i, turn in enumerate(body.messages):
        role, content = turn.get("role"), turn.get("content", "")
        where = f"messages[{i}].content"
        if role not in ("user", "assistant"):
            raise OpenAIError(400, f"messages[{i}].role must be user or assistant", param=where)
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise OpenAIError(400, f"{where}: a string or a list of blocks", param=where)
        text, calls, thoughts = [], [], []
        for block in blocks:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_result" and role == "user":
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": joined_parts(_parts(block.get("content", ""), where))})
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                    "name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "thinking" and role == "assistant":  # kept in a tool loop, as
                thoughts.append(str(block.get("thinking", "")))  # Anthropic and llama-server do
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by another server: nothing a model here could read
            else:
                text += _parts([block], where, images=role == "user")
        if text or calls or role == "assistant":
            message = {"role": role, "content": joined_parts(text)}
            if calls:
                message["tool_calls"] = calls
            if thoughts:
                message["reasoning_content"] = "".join(thoughts)
            out.append(message)
    return out


def _tool_choice(choice: dict | None):
    kind = (choice or {}).get("type", "auto")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise OpenAIError(400, f"tool_choice type {kind!r}: use auto, any, tool or none",
                      param="tool_choice")


def _output_format(config: dict | None) -> dict:
    """output_config.format json_schema: the answer follows the schema (the grammar path)."""
    extra = set(config or {}) - {"format"}
    if extra:
        raise OpenAIError(400, f"output_config: {', '.join(sorted(extra))} not supported",
                          param="output_config")
    fmt = (config or {}).get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise OpenAIError(400, "output_config.format: only json_schema is supported",
                          param="output_config.format")
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": fmt.get("schema") or {}}}}


THINKING_TYPES = ("enabled", "adaptive", "disabled")


def thinking_ignored(body: MessagesRequest, reasoning: bool) -> list[str]:
    """What of `thinking` this server does not do, for X-Ignored-Fields. Accepted, as
    llama-server and Ollama accept it, so that agents that turn thinking on by default can
    connect: on a model that does not reason, an enabled thinking; on one that does, its
    budget (it thinks as long as it does) and a "disabled" (it thinks anyway)."""
    thinking = body.thinking or {}
    enabled = thinking.get("type") in ("enabled", "adaptive")
    if not reasoning:
        return ["thinking"] if enabled else []
    if not enabled:
        return ["thinking"] if thinking else []
    return ["thinking.budget_tokens"] if "budget_tokens" in thinking else []


def as_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request this Messages request means (validated as one)."""
    for name in REFUSED:
        if name in (body.model_extra or {}):
            raise OpenAIError(400, f"'{name}' is not supported by this server", param=name)
    if body.thinking and body.thinking.get("type") not in THINKING_TYPES:
        raise OpenAIError(400, f"thinking.type: one of {', '.join(THINKING_TYPES)}",
                          param="thinking")
    messages = _messages(body)
    last = messages[-1] if messages else {}
    chat = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens,
            # Anthropic's prefill: a final assistant message is continued, not answered
            "continue_final_message": last.get("role") == "assistant" and not last.get("tool_calls"),
            "stream": body.stream, "stop": body.stop_sequences,
            "user": (body.metadata or {}).get("user_id")}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    chat.update(_output_format(body.output_config))
    chat.update(extensions(body.model_extra))
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}}
            for t in body.tools]
        chat["tool_choice"] = _tool_choice(body.tool_choice)
        if (body.tool_choice or {}).get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    return translated_chat(chat)


@router.post("/messages")
async def messages(body: MessagesRequest, request: Request,
                   admitted: Admitted = Depends(admit)):
    chat = as_chat(body)
    host, stream, plan = await start_chat(admitted, chat, "/v1/messages")
    message = MessageReply(host.model_id, stream.n_prompt_tokens, plan,
                           reasons(host))
    headers = ignored_header(sorted(set(body.model_extra or {}) - set(EXTENSIONS))
                             + thinking_ignored(body, reasons(host)))
    return await respond_with(message.collect, message.events, stream, request, body.stream, headers)


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request,
                       admitted: Admitted = Depends(admit)):
    chat = as_chat(body.model_copy(update={"max_tokens": body.max_tokens or 1}))
    async with admitted.lease(chat.model) as host:
        tokens = (await chat_tokens(host, chat, admitted.caller.key)).tokens
    return {"input_tokens": len(tokens)}
