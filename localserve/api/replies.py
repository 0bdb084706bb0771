"""Where a request's text leaves: engine events shaped into OpenAI's chat or text completion
objects, whole or as SSE chunks.

Stream rules (what OpenAI and llama-server send, and clients rely on):
- the first chat chunk carries the role; text chunks carry only text;
- the finish_reason comes in a chunk of its own with an empty delta, never with the last
  text (a client that reads text while finish_reason is null would lose it);
- events are separated by LF, as OpenAI and llama-server do (CRLF is valid SSE, but many
  clients split on "\\n\\n");
- with tools, the JSON answer is parsed after generation and sent as delta.tool_calls, one
  chunk per call, each with its stable index and id.
"""

from __future__ import annotations

import asyncio
import json
import re
from itertools import accumulate
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from localserve import __version__
from localserve.api.reasoning import ThinkSplitter
from localserve.api.schemas import OpenAIError, _Sampling
from localserve.api.structured import ToolPlan, parse_tool_answer, tool_finish
from localserve.api.tool_formats import ProseThenCalls
from localserve.engine.streams import ChoiceStreams
from localserve.engine.finish import FinishReason
from localserve.engine.request import TokenEvent


def usage(last: dict[int, TokenEvent], reasoning_tokens: int = 0) -> dict:
    """Every choice's final event, by index, summed: what the engine billed each (it bills a
    prompt once for n > 1: scheduler.py, the one place that decides)."""
    prompt = sum(e.prompt_tokens for e in last.values())
    completion = sum(e.completion_tokens for e in last.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(e.cached_tokens for e in last.values())},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def error_payload(event: TokenEvent) -> dict:
    return {"error": {"message": event.error or "generation failed", "type": "server_error",
                      "param": None, "code": str(event.finish_reason)}}


def failure(event: TokenEvent) -> OpenAIError | None:
    """The error a finished-by-failure event is answered with (one rule for every API shape,
    its status from FinishReason.status): a queue timeout is a 503 to retry, an engine error
    a 500."""
    reason = event.finish_reason
    if reason not in (FinishReason.TIMEOUT, FinishReason.ERROR):
        return None
    timeout = reason is FinishReason.TIMEOUT
    return OpenAIError(reason.status, event.error or "generation failed", "server_error",
                       code="queue_timeout" if timeout else None,
                       headers={"Retry-After": "2"} if timeout else None)


def ignored_header(names: list[str]) -> dict | None:
    """X-Ignored-Fields naming body fields nobody defines (none: no header)."""
    return {"X-Ignored-Fields": header_list(names)} if names else None


async def collect_one(stream: ChoiceStreams, request: Request,
                      each=None) -> tuple[str, TokenEvent]:
    """A one-choice answer's whole text and final event (the Messages and Responses shapes),
    each event also handed to `each` when given; a failure raises its error, a client that
    left a 499."""
    parts, last = [], None
    watcher = asyncio.create_task(cancel_on_disconnect(request, stream))
    try:
        async for _, event in stream:
            parts.append(event.text)
            if each is not None:
                each(event)
            if (failed := failure(event)) is not None:
                raise failed
            if event.finished:
                last = event
    finally:
        stream.cancel()
        watcher.cancel()
    if last is None or last.finish_reason is FinishReason.ABORT:
        raise OpenAIError(499, "the client closed the request", code="client_closed")
    return "".join(parts), last


async def respond_with(collect, events, stream: ChoiceStreams, request: Request,
                       streaming: bool, headers: dict | None, ping: int = 10):
    """One JSON body (`await collect(stream, request)`) or the SSE of `events(stream)`."""
    if not streaming:
        return JSONResponse(await collect(stream, request), headers=headers)
    try:
        return EventSourceResponse(events(stream), ping=ping, sep="\n", headers=headers)
    except BaseException:
        stream.cancel()  # the generator never ran: its finally cannot free the slot
        raise


async def cancel_on_disconnect(request: Request, stream: ChoiceStreams) -> None:
    """A non-streaming client that hangs up should free its slot too (streams notice by
    themselves: sse-starlette cancels their generator)."""
    while not stream.finished:
        await asyncio.sleep(0.25)
        if await request.is_disconnected():
            stream.cancel()
            return


def think(splitter: ThinkSplitter, event: TokenEvent) -> tuple[str, str, int]:
    """(reasoning, answer, tokens spent reasoning) of one event's text (api/reasoning.py)."""
    thought, text = splitter.feed(event.text)
    if event.finished:
        rest = splitter.flush()
        thought, text = thought + rest[0], text + rest[1]
    return thought, text, len(event.token_ids) if thought and not text else 0


class Reply:
    def __init__(self, kind: str, model: str, body: _Sampling, fingerprint: str,
                 tools: ToolPlan | None = None, piece=None, reasoning: bool = False):
        self.kind, self.model, self.body, self.tools = kind, model, body, tools
        # <think> blocks to reasoning_content (api/reasoning.py); not in tool answers (JSON)
        self.reasoning = reasoning and tools is None and kind == "chat.completion"
        self.piece = piece  # token id -> bytes, for logprobs entries
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.fingerprint = fingerprint
        self.prefix = ""

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    async def respond(self, stream: ChoiceStreams, request: Request):
        """SSE or one JSON body; fields nobody defines are named in X-Ignored-Fields."""
        return await respond_with(self.collect, self.sse, stream, request, self.body.stream,
                                  ignored_header(self.body.ignored_fields), ping=15)

    # ---- streaming ---------------------------------------------------------------------
    def _delta(self, index: int, delta: dict, finish: str | None = None,
               logprobs: list | None = None, offset: int = 0) -> dict:
        shaped = self._logprobs(logprobs, offset) if logprobs else None
        if not self.chat:
            return {"index": index, "text": delta.get("content", ""), "logprobs": shaped,
                    "finish_reason": finish}
        return {"index": index, "delta": delta, "logprobs": shaped, "finish_reason": finish}

    # ---- logprobs, in OpenAI's chat and completions shapes ------------------------------
    def _entry(self, token: int, logprob: float) -> dict:
        raw = self.piece(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    def _logprobs(self, found: list, offset: int) -> dict | None:
        """found: the events' (token, logprob, top) triples, control tokens left out."""
        found = [f for f in found if self.piece(f[0])]
        if self.chat:
            return {"content": [{**self._entry(t, lp), "top_logprobs": [
                self._entry(tt, tlp) for tt, tlp in top]} for t, lp, top in found], "refusal": None}
        text = lambda t: self.piece(t).decode("utf-8", "replace")  # noqa: E731
        texts = [text(t) for t, _, _ in found]
        offsets = list(accumulate((len(x) for x in texts), initial=offset))[:len(texts)]
        return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in found],
                "top_logprobs": [{text(tt): tlp for tt, tlp in top} for _, _, top in found],
                "text_offset": offsets}

    def _chunk(self, choices: list, **extra) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"data": json.dumps({"id": self.id, "object": obj, "created": self.created,
                                    "model": self.model, "system_fingerprint": self.fingerprint,
                                    "choices": choices, **extra})}

    async def sse(self, stream: ChoiceStreams):
        """Each choice's chunks carry its index; they interleave as the choices progress."""
        n = len(stream.requests)
        held = {i: [] for i in range(n)}  # with tools, each JSON answer is parsed once complete
        last: dict[int, TokenEvent] = {}
        thinking = {i: ThinkSplitter() for i in range(n)} if self.reasoning else None
        reasoning_tokens = 0
        native = self.tools is not None and self.tools.native is not None \
            and self.tools.allow_text_response  # prose streams until the model calls
        prose = {i: ProseThenCalls(self.tools.native) for i in range(n)} if native else None
        offsets = {i: len(self.prefix) for i in range(n)}  # text sent so far: text_offset
        try:
            for i in range(n):
                if self.chat:
                    yield self._chunk([self._delta(i, {"role": "assistant", "content": ""})])
                if self.prefix:
                    yield self._chunk([self._delta(i, {"content": self.prefix})])
            async for i, event in stream:
                if failure(event) is not None:
                    yield {"data": json.dumps(error_payload(event))}
                    break
                if event.text and prose is not None:
                    if text := prose[i].feed(event.text):
                        yield self._chunk([self._delta(i, {"content": text})])
                elif event.text and self.tools is not None:
                    held[i].append(event.text)
                elif thinking is not None:
                    thought, text, spent = think(thinking[i], event)
                    reasoning_tokens += spent
                    if thought:
                        yield self._chunk([self._delta(i, {"reasoning_content": thought})])
                    if text:
                        yield self._chunk([self._delta(i, {"content": text})])
                elif event.text or event.logprobs:
                    found = [event.logprobs] if event.logprobs else None
                    yield self._chunk([self._delta(i, {"content": event.text}, logprobs=found,
                                                   offset=offsets[i])])
                    offsets[i] += len(event.text)
                if event.finished:
                    finish = str(event.finish_reason)
                    if self.tools is not None:
                        content, calls = (prose[i].finish() if prose is not None else
                                          parse_tool_answer("".join(held[i]), self.tools))
                        for chunk, finish in self._tool_chunks(i, content, calls, finish):
                            yield chunk
                    yield self._chunk([self._delta(i, {}, finish)])
                    last[i] = event
            if self.body.include_usage and len(last) == n:
                yield self._chunk([], usage=usage(last, reasoning_tokens))
            yield {"data": "[DONE]"}
        finally:
            stream.cancel()

    def _tool_chunks(self, i: int, content: str | None, calls: list[dict], finish: str):
        if content:
            yield self._chunk([self._delta(i, {"content": content})]), finish
        for index, call in enumerate(calls):
            yield (self._chunk([self._delta(i, {"tool_calls": [{"index": index, **call}]})]),
                   tool_finish(finish, bool(calls)))

    # ---- one response ------------------------------------------------------------------
    async def collect(self, stream: ChoiceStreams, request: Request) -> dict:
        n = len(stream.requests)
        parts = {i: [self.prefix] for i in range(n)}
        found: dict[int, list] = {i: [] for i in range(n)}
        last: dict[int, TokenEvent] = {}
        thinking = {i: ThinkSplitter() for i in range(n)} if self.reasoning else None
        thoughts: dict[int, list] = {i: [] for i in range(n)}
        reasoning_tokens = 0
        watcher = asyncio.create_task(cancel_on_disconnect(request, stream))
        try:
            async for i, event in stream:
                if thinking is not None:
                    thought, text, spent = think(thinking[i], event)
                    reasoning_tokens += spent
                    thoughts[i].append(thought)
                    parts[i].append(text)
                else:
                    parts[i].append(event.text)
                if event.logprobs:
                    found[i].append(event.logprobs)
                if (failed := failure(event)) is not None:
                    raise failed
                if event.finished:
                    last[i] = event
        finally:
            stream.cancel()
            watcher.cancel()
        if len(last) < n or any(e.finish_reason is FinishReason.ABORT for e in last.values()):
            raise OpenAIError(499, "the client closed the request", code="client_closed")
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [self._choice(i, "".join(parts[i]), str(last[i].finish_reason), found[i],
                                         "".join(thoughts[i])) for i in range(n)],
                "usage": usage(last, reasoning_tokens)}

    def _choice(self, index: int, text: str, finish: str, found: list, thought: str = "") -> dict:
        wanted = self.body.logprob_n is not None
        shaped = self._logprobs(found, offset=len(self.prefix)) if wanted else None
        if not self.chat:
            return {"index": index, "text": text, "logprobs": shaped, "finish_reason": finish}
        message = {"role": "assistant", "content": text, "refusal": None}
        if thought:
            message["reasoning_content"] = thought
        if self.tools is not None:
            content, calls = parse_tool_answer(text, self.tools)
            message["content"] = content
            if calls:
                message["tool_calls"], finish = calls, tool_finish(finish, bool(calls))
        return {"index": index, "message": message, "logprobs": shaped, "finish_reason": finish}


PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def header_list(names: list[str], most: int = 16) -> str:
    """Client-chosen names made safe for a header: ASCII only (escaped like JSON), bounded;
    a name that is not a plain word (" ", "", "a b") is shown in quotes, since a header value
    may not start or end with a space."""
    shown = [n if PLAIN_NAME.fullmatch(n) else json.dumps(n[:64]) for n in names[:most]]
    return ", ".join(shown) + (f", and {len(names) - most} more" if len(names) > most else "")


def fingerprint(host) -> str:
    """system_fingerprint: this build and the model file, so a client can tell when either changed."""
    model = host.model_path.name if host.model_path else "?"
    return f"localserve-{__version__}-{uuid.uuid5(uuid.NAMESPACE_URL, model).hex[:8]}"
