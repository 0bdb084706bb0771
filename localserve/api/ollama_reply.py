"""Ollama's answer shapes (routes_ollama.py), written from the answer's pieces (answer.py): NDJSON
lines while streaming (Ollama's default), or one object; the last carries `done: true`, the
`done_reason`, the token counts and the durations in nanoseconds, as Ollama writes them.

    /api/chat      {"model", "created_at", "message": {"role", "content", "thinking"?,
                    "tool_calls"?: [{"function": {"name", "arguments": {...}}}]}, "done": false}
    /api/generate  {"model", "created_at", "response", "thinking"?, "done": false}
    final          ... "done": true, "done_reason": "stop" | "length", "total_duration",
                   "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                   "eval_duration"
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from datetime import datetime, timezone

from fastapi import Request

from localserve.api.answer import (ChoiceReader, Failed, Finish, Text, Thought, ToolCalls,
                                   joined_content, read, whole_answer)
from localserve.api.structured import ToolPlan


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def ollama_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's calls (arguments as a JSON string) in Ollama's shape (arguments as an object)."""
    return [{"function": {"name": call["function"]["name"],
                          "arguments": json.loads(call["function"]["arguments"] or "{}")}}
            for call in calls]


class OllamaReply:
    def __init__(self, model: str, chat: bool, tools: ToolPlan | None, reasoning: str,
                 show_thinking: bool, started: float, loaded: float):
        self.model, self.chat, self.tools = model, chat, tools
        self.reasoning, self.show_thinking = reasoning, show_thinking
        self.started, self.loaded = started, loaded  # monotonic: arrival, model leased

    def _line(self, text: str = "", thinking: str = "", calls: list[dict] | None = None) -> dict:
        line = {"model": self.model, "created_at": now_iso()}
        if self.chat:
            message = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = ollama_calls(calls)
            return {**line, "message": message}
        return {**line, "response": text, **({"thinking": thinking} if thinking else {})}

    def _final(self, end: Finish, **whole) -> dict:
        return {**self._line(**whole), "done": True,
                "done_reason": "length" if end.cut else "stop",
                "total_duration": ns(time.monotonic() - self.started),
                "load_duration": ns(self.loaded - self.started),
                "prompt_eval_count": end.usage.prompt,
                "prompt_eval_duration": ns(end.timings.prompt),
                "eval_count": end.usage.completion, "eval_duration": ns(end.timings.decode)}

    def _reader(self) -> ChoiceReader:
        return ChoiceReader(self.tools, self.reasoning)

    async def collect(self, stream, request: Request) -> dict:
        answer = await whole_answer(stream, self._reader(), request)
        calls = answer.tools.calls if answer.tools else []
        return self._final(answer.end, text=joined_content(answer.text, answer.tools) or "",
                           thinking=answer.thought if self.show_thinking else "", calls=calls)

    async def lines(self, stream):
        """NDJSON: a line per piece of text or thinking, the calls in one line, then the final
        one; a failure is one {"error": ...} line (what the ollama client raises from)."""
        async with aclosing(read(stream, [self._reader()])) as pieces:
            async for _, piece in pieces:
                if isinstance(piece, Failed):
                    yield json.dumps({"error": piece.error.message}) + "\n"
                    return
                if isinstance(piece, Text):
                    line = self._line(text=piece.text)
                elif isinstance(piece, Thought):
                    if not self.show_thinking:
                        continue
                    line = self._line(thinking=piece.text)
                elif isinstance(piece, ToolCalls):
                    if not (piece.prose or piece.calls):
                        continue
                    line = self._line(text=piece.prose or "", calls=piece.calls)
                else:  # the Finish: the last piece of the one choice
                    yield json.dumps(self._final(piece)) + "\n"
                    return
                yield json.dumps({**line, "done": False}) + "\n"
