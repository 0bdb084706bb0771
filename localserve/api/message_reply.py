"""Anthropic's Messages answer (routes_anthropic.py), written from the answer's pieces
(answer.py): content blocks (thinking, text, tool_use) whole, or as Anthropic's typed stream
events (message_start, content_block_start/delta/stop, message_delta, message_stop)."""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing

from fastapi import Request

from localserve.api.answer import (ChoiceReader, Failed, Finish, Text, Thought, ToolCalls,
                                   joined_content, read, whole_answer)
from localserve.api.schemas import OpenAIError

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(exc: OpenAIError) -> dict:
    """Anthropic's error body for the same refusal."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"),
                                       "message": exc.message}}


def tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}


class MessageReply:
    def __init__(self, model: str, input_tokens: int, tools, reasoning: str):
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model, self.input_tokens, self.tools = model, input_tokens, tools
        self.reasoning = reasoning

    def _reader(self) -> ChoiceReader:
        return ChoiceReader(self.tools, self.reasoning)

    def _message(self, content: list, stop_reason, output_tokens: int, cached: int = 0) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": None,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens,
                          "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}

    async def collect(self, stream, request: Request) -> dict:
        answer = await whole_answer(stream, self._reader(), request)
        calls = answer.tools.calls if answer.tools else []
        text = joined_content(answer.text, answer.tools)
        blocks = [{"type": "thinking", "thinking": answer.thought, "signature": ""}] \
            if answer.thought else []
        if text or self.tools is None:  # a plain answer always has its text block
            blocks.append({"type": "text", "text": text or ""})
        blocks += [tool_use(call) for call in calls]
        end = answer.end
        return self._message(blocks, STOP_REASONS.get(end.reason, "end_turn"),
                             end.usage.completion, end.usage.cached)

    @staticmethod
    def _texts(piece) -> list[tuple[str, str]]:
        """The (block kind, text) a piece adds to the thinking and text blocks."""
        if isinstance(piece, Thought):
            return [("thinking", piece.text)]
        if isinstance(piece, Text):
            return [("text", piece.text)]
        if isinstance(piece, ToolCalls) and piece.prose:
            return [("text", piece.prose)]
        return []

    @staticmethod
    def _event(kind: str, **data) -> dict:
        return {"event": kind, "data": json.dumps({"type": kind, **data})}

    async def events(self, stream):
        """Thinking and text stream as they come (prose before tool calls too); tool_use
        blocks follow once the answer is complete."""
        index, opened = 0, None  # opened: the kind of block being streamed
        async with aclosing(read(stream, [self._reader()])) as pieces:
            yield self._event("message_start", message=self._message([], None, 0))
            async for _, piece in pieces:
                if isinstance(piece, Failed):
                    yield {"event": "error", "data": json.dumps(anthropic_error(piece.error))}
                    return
                for kind, text in self._texts(piece):
                    if opened not in (None, kind):
                        yield self._event("content_block_stop", index=index)
                        index, opened = index + 1, None
                    if opened is None:
                        yield self._event("content_block_start", index=index, content_block=(
                            {"type": "text", "text": ""} if kind == "text"
                            else {"type": "thinking", "thinking": "", "signature": ""}))
                        opened = kind
                    yield self._event("content_block_delta", index=index, delta=(
                        {"type": "text_delta", "text": text} if kind == "text"
                        else {"type": "thinking_delta", "thinking": text}))
                if isinstance(piece, ToolCalls) and piece.calls:
                    if opened is not None:
                        yield self._event("content_block_stop", index=index)
                        index, opened = index + 1, None
                    for call in piece.calls:
                        for event in self._tool_events(index, tool_use(call)):
                            yield event
                        index += 1
                if isinstance(piece, Finish):
                    if opened is not None:
                        yield self._event("content_block_stop", index=index)
                    yield self._event("message_delta", delta={
                        "stop_reason": STOP_REASONS.get(piece.reason, "end_turn"),
                        "stop_sequence": None}, usage={"output_tokens": piece.usage.completion})
                    yield self._event("message_stop")

    def _tool_events(self, index: int, block: dict):
        yield self._event("content_block_start", index=index, content_block={**block, "input": {}})
        yield self._event("content_block_delta", index=index, delta={
            "type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield self._event("content_block_stop", index=index)
