"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) for agents and
editors that speak it: a thin adapter. The body is translated into a chat completion request
and goes through the very same admission, template, grammar and engine path
(routes_openai.start_chat); only the shapes differ:

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
import uuid

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from localserve.api.admission import lease
from localserve.api.reasoning import ThinkSplitter, split_reasoning
from localserve.api.replies import collect_one, failure, ignored_header, respond_with, think
from localserve.api.routes_openai import chat_tokens, reasons, start_chat
from localserve.api.schemas import (EXTENSIONS, ChatCompletionRequest, OpenAIError, extensions,
                                    translated_chat)
from localserve.api.structured import parse_tool_answer, tool_finish

router = APIRouter(prefix="/v1")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
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
    parts = []
    for block in blocks or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise OpenAIError(400, f"{where}: content blocks of type {kind!r} are not supported: "
                              f"this server's model reads text only", param=where)
        parts.append(str(block.get("text", "")))
    return "".join(parts)


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
        text, calls = [], []
        for block in blocks:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_result" and role == "user":
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _text(block.get("content", ""), where)})
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                    "name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning is not sent back to the model
            else:
                text.append(_text([block], where))
        if text or calls or role == "assistant":
            message = {"role": role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
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


def as_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request this Messages request means (validated as one)."""
    for name in REFUSED:
        if name in (body.model_extra or {}):
            raise OpenAIError(400, f"'{name}' is not supported by this server", param=name)
    if body.thinking and body.thinking.get("type") != "disabled":
        raise OpenAIError(400, "'thinking' is not supported by this server's model; send the "
                          "request without it", param="thinking")
    chat = {"model": body.model, "messages": _messages(body), "max_tokens": body.max_tokens,
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
async def messages(body: MessagesRequest, request: Request):
    chat = as_chat(body)
    host, stream, plan = await start_chat(request, chat, "/v1/messages")
    message = MessageReply(host.model_id, stream.requests[0].num_prompt_tokens, plan,
                           reasons(host))
    headers = ignored_header(sorted(set(body.model_extra or {}) - set(EXTENSIONS)))
    return await respond_with(message.collect, message.events, stream, request, body.stream, headers)


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    chat = as_chat(body.model_copy(update={"max_tokens": body.max_tokens or 1}))
    async with lease(request, chat.model) as host:
        tokens, _, _ = await chat_tokens(host, chat)
    return {"input_tokens": len(tokens)}


class MessageReply:
    def __init__(self, model: str, input_tokens: int, tools, reasoning: bool = False):
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model, self.input_tokens, self.tools = model, input_tokens, tools
        self.reasoning = reasoning and tools is None  # <think> blocks become thinking blocks

    def _blocks(self, text: str) -> tuple[list[dict], bool]:
        """Content blocks of a finished answer; True when it called tools."""
        if self.tools is None:
            thought, text = split_reasoning(text) if self.reasoning else ("", text)
            thinking = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
            return thinking + [{"type": "text", "text": text}], False
        content, calls = parse_tool_answer(text, self.tools)
        blocks = [{"type": "text", "text": content}] if content else []
        blocks += [{"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                    "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"])} for call in calls]
        return blocks, bool(calls)

    def _message(self, content: list, stop_reason, output_tokens: int, cached: int = 0) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": None,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens,
                          "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}

    async def collect(self, stream, request: Request) -> dict:
        text, last = await collect_one(stream, request)
        blocks, called = self._blocks(text)
        reason = STOP_REASONS.get(tool_finish(str(last.finish_reason), called), "end_turn")
        return self._message(blocks, reason, last.completion_tokens, last.cached_tokens)

    @staticmethod
    def _event(kind: str, **data) -> dict:
        return {"event": kind, "data": json.dumps({"type": kind, **data})}

    async def events(self, stream):
        """Text streams as it comes, after a thinking block when the model reasons (tool
        answers are parsed once complete, as in chat)."""
        held, index, opened = [], 0, None  # opened: the kind of block being streamed
        splitter = ThinkSplitter() if self.reasoning else None
        try:
            yield self._event("message_start", message=self._message([], None, 0))
            async for _, event in stream:
                if (failed := failure(event)) is not None:
                    yield {"event": "error", "data": json.dumps(anthropic_error(failed))}
                    return
                if event.text and self.tools is not None:
                    held.append(event.text)
                    pieces = ()
                elif splitter is not None:
                    thought, text, _ = think(splitter, event)
                    pieces = (("thinking", thought), ("text", text))
                else:
                    pieces = (("text", event.text),)
                for kind, piece in pieces:
                    if not piece:
                        continue
                    if opened not in (None, kind):
                        yield self._event("content_block_stop", index=index)
                        index, opened = index + 1, None
                    if opened is None:
                        yield self._event("content_block_start", index=index, content_block=(
                            {"type": "text", "text": ""} if kind == "text"
                            else {"type": "thinking", "thinking": "", "signature": ""}))
                        opened = kind
                    yield self._event("content_block_delta", index=index, delta=(
                        {"type": "text_delta", "text": piece} if kind == "text"
                        else {"type": "thinking_delta", "thinking": piece}))
                if not event.finished:
                    continue
                if opened is not None:
                    yield self._event("content_block_stop", index=index)
                    index += 1
                called = False
                if self.tools is not None:
                    blocks, called = self._blocks("".join(held))
                    for block in blocks:
                        for piece in self._block_events(index, block):
                            yield piece
                        index += 1
                reason = STOP_REASONS.get(tool_finish(str(event.finish_reason), called), "end_turn")
                yield self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": None},
                                  usage={"output_tokens": event.completion_tokens})
                yield self._event("message_stop")
        finally:
            stream.cancel()

    def _block_events(self, index: int, block: dict):
        if block["type"] == "text":
            yield self._event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            yield self._event("content_block_delta", index=index,
                              delta={"type": "text_delta", "text": block["text"]})
        else:
            yield self._event("content_block_start", index=index, content_block={**block, "input": {}})
            yield self._event("content_block_delta", index=index, delta={
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield self._event("content_block_stop", index=index)


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(exc: OpenAIError) -> dict:
    """Anthropic's error body for the same refusal."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"),
                                       "message": exc.message}}
