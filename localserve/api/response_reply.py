"""The Responses API's answer (routes_responses.py), written from the answer's pieces
(answer.py): output items (a reasoning item, a message, function_call items), whole or as
typed stream events, each with its sequence_number; stored when the request asked (store)."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing

from fastapi import Request

from localserve.api.answer import (ChoiceReader, Failed, Finish, Progress, Text, Thought,
                                   ToolCalls, joined_content, read, timed, whole_answer)
from localserve.api.schemas import OpenAIError
from localserve.api.structured import ToolPlan


class ResponseReply:
    """One response: its output items from the finished text, whole or as typed events."""

    def __init__(self, model: str, body, input_tokens: int,
                 tools: ToolPlan | None, reasoning: str):
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.reasoning = reasoning  # a <think> block becomes a reasoning item (not with tools)
        self.reasoning_id = "rs_" + uuid.uuid4().hex[:24]
        self.message_index = 0  # 1 after a reasoning item
        self.message_id = "msg_" + uuid.uuid4().hex[:24]
        self.model, self.body, self.input_tokens, self.tools = model, body, input_tokens, tools
        self.created = int(time.time())
        self.turns: list[dict] = []  # the conversation so far, stored with the answer
        self.keep = None  # async (response, messages) -> None when the response is stored
        self.sequence = 0

    def _reader(self) -> ChoiceReader:
        timed = bool((self.body.model_extra or {}).get("timings_per_token"))
        return ChoiceReader(self.tools, self.reasoning, timed)

    def _items(self, thought: str, text: str, tools: ToolCalls | None,
               with_message: bool = False) -> list[dict]:
        content = joined_content(text, tools)
        calls = tools.calls if tools is not None else []
        items = [self._reasoning_item(thought)] if thought else []
        items += [self._message(content)] if content or not calls or with_message else []
        return items + [{"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"),
                         "call_id": call["id"], "name": call["function"]["name"],
                         "arguments": call["function"]["arguments"], "status": "completed"}
                        for call in calls]

    def _message(self, text: str | None, status: str = "completed") -> dict:
        content = [] if text is None else [self._part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": content}

    def _reasoning_item(self, thought: str) -> dict:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": thought}], "status": "completed"}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _response(self, status: str, output: list, end: Finish | None = None) -> dict:
        body = self.body
        cut = end is not None and end.cut
        used = end.usage.completion if end is not None else 0
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": "incomplete" if cut and status == "completed" else status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id, "store": body.store,
                "temperature": body.temperature, "top_p": body.top_p,
                "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
                "reasoning": {"effort": None, "summary": None}, "metadata": body.metadata or {},
                "user": body.user,
                "usage": None if end is None else {
                    "input_tokens": self.input_tokens,
                    "input_tokens_details": {"cached_tokens": end.usage.cached},
                    "output_tokens": used,
                    "output_tokens_details": {"reasoning_tokens": end.usage.reasoning},
                    "total_tokens": self.input_tokens + used}}

    async def _finish(self, items: list[dict], end: Finish) -> dict:
        response = self._response("completed", items, end)
        if self.keep is not None:
            await self.keep(response, self.turns + [self._as_turn(response["output"])])
        return response

    @staticmethod
    def _as_turn(output: list[dict]) -> dict:
        """The answer as the assistant's chat message, for previous_response_id."""
        turn = {"role": "assistant", "content": "".join(
            part["text"] for item in output if item["type"] == "message" for part in item["content"])}
        calls = [{"id": item["call_id"], "type": "function", "function": {
            "name": item["name"], "arguments": item["arguments"]}}
            for item in output if item["type"] == "function_call"]
        return {**turn, "tool_calls": calls} if calls else turn

    async def collect(self, stream, request: Request) -> dict:
        answer = await whole_answer(stream, self._reader(), request)
        return await self._finish(self._items(answer.thought, answer.text, answer.tools),
                                  answer.end)

    def _event(self, kind: str, **data) -> dict:
        self.sequence += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.sequence,
                                                   **data})}

    async def events(self, stream):
        """Text streams as output_text deltas (after the reasoning item, when the model
        reasons; before tool calls, when the model's format lets prose come first); the rest
        of the items once the answer is complete."""
        thoughts, texts, tools, opened = [], [], None, False
        async with aclosing(read(stream, [self._reader()])) as pieces:
            yield self._event("response.created", response=self._response("in_progress", []))
            yield self._event("response.in_progress", response=self._response("in_progress", []))
            async for _, piece in pieces:
                if isinstance(piece, Failed):
                    yield self._event("response.failed", response={
                        **self._response("failed", []), "error": {
                            "code": "server_error", "message": piece.error.message}})
                    return
                if isinstance(piece, Thought):
                    thoughts.append(piece.text)
                elif isinstance(piece, Text):
                    texts.append(piece.text)
                    if not opened:
                        for event in (*self._announce_reasoning("".join(thoughts)),
                                      *self._open_message()):
                            yield event
                        opened = True
                    yield self._event("response.output_text.delta", item_id=self.message_id,
                                      output_index=self.message_index, content_index=0,
                                      delta=piece.text, logprobs=[], **timed(piece))
                elif isinstance(piece, ToolCalls):
                    tools = piece
                elif isinstance(piece, Progress):  # return_progress: llama-server's shape
                    yield self._event("response.in_progress", prompt_progress=piece.as_json(),
                                      response=self._response("in_progress", []))
                elif isinstance(piece, Finish):
                    items = self._items("".join(thoughts), "".join(texts), tools, opened)
                    try:
                        response = await self._finish(items, piece)
                    except OpenAIError as exc:
                        yield self._event("error", code=exc.code, message=exc.message, param=None)
                        return
                    for event in self._close_items(response, opened):
                        yield event
                    kind = ("response.incomplete" if response["status"] == "incomplete"
                            else "response.completed")
                    yield self._event(kind, response=response, timings=piece.llama_timings)

    def _close_items(self, response: dict, opened: bool):
        for index, item in enumerate(response["output"]):
            if item["type"] == "reasoning":
                if not opened:  # else sent whole before the message began
                    yield from self._announce_reasoning(item["content"][0]["text"])
                continue
            yield from self._close_item(index, item, announced=opened and item["type"] == "message")

    def _announce_reasoning(self, thought: str):
        """A reasoning item, whole, before the answer's message (which then has index 1)."""
        if not thought:
            return
        item = self._reasoning_item(thought)
        yield self._event("response.output_item.added", output_index=0,
                          item={**item, "content": [], "status": "in_progress"})
        yield self._event("response.output_item.done", output_index=0, item=item)
        self.message_index = 1

    def _open_message(self):
        yield self._event("response.output_item.added", output_index=self.message_index,
                          item=self._message(None, "in_progress"))
        yield self._event("response.content_part.added", item_id=self.message_id,
                          output_index=self.message_index, content_index=0, part=self._part(""))

    def _close_item(self, index: int, item: dict, announced: bool):
        """The events that finish one output item (and open it first when not yet open)."""
        if item["type"] == "message":
            if not announced:
                for piece in self._open_message():
                    yield piece
                for part in item["content"]:
                    yield self._event("response.output_text.delta", item_id=item["id"],
                                      output_index=index, content_index=0, delta=part["text"],
                                      logprobs=[])
            for part in item["content"]:
                yield self._event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=part["text"],
                                  logprobs=[])
                yield self._event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0, part=part)
        else:
            yield self._event("response.output_item.added", output_index=index,
                              item={**item, "arguments": "", "status": "in_progress"})
            yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"], arguments=item["arguments"])
        yield self._event("response.output_item.done", output_index=index, item=item)
