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

import json
import re
import time
import uuid
from contextlib import aclosing
from itertools import accumulate

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from localserve import __version__
from localserve.api.answer import (FAILED_REASON, Answers, ChoiceReader, Failed, Finish, Progress,
                                   Text, Thought, ToolCalls, joined_content, read, timed,
                                   whole_answers)
from localserve.api.schemas import SamplingBody
from localserve.api.structured import ToolPlan


def usage(ends: dict[int, Finish]) -> dict:
    """Every choice's end, by index, summed: what the engine billed each (it bills a prompt
    once for n > 1: scheduler.py, the one place that decides)."""
    billed = [end.usage for end in ends.values()]
    prompt = sum(u.prompt for u in billed)
    completion = sum(u.completion for u in billed)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached for u in billed)},
            "completion_tokens_details": {"reasoning_tokens": sum(u.reasoning for u in billed)}}


def ignored_header(names: list[str]) -> dict | None:
    """X-Ignored-Fields naming body fields nobody defines (none: no header)."""
    return {"X-Ignored-Fields": header_list(names)} if names else None


async def respond_with(collect, events, stream: Answers, request: Request,
                       streaming: bool, headers: dict | None, ping: int = 10):
    """One JSON body (`await collect(stream, request)`) or the SSE of `events(stream)`."""
    if not streaming:
        return JSONResponse(await collect(stream, request), headers=headers)
    try:
        return EventSourceResponse(events(stream), ping=ping, sep="\n", headers=headers)
    except BaseException:
        stream.cancel()  # the generator never ran: its finally cannot free the slot
        raise


class Reply:
    def __init__(self, kind: str, model: str, body: SamplingBody, fingerprint: str,
                 tools: ToolPlan | None = None, piece=None, reasoning: str = ""):
        self.kind, self.model, self.body, self.tools = kind, model, body, tools
        # reasoning to reasoning_content (api/reasoning.py: how this model writes it), chats only
        self.reasoning = reasoning if kind == "chat.completion" else ""
        self.piece = piece  # token id -> bytes, for logprobs entries
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.fingerprint = fingerprint
        self.prefix = ""

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    async def respond(self, stream: Answers, request: Request):
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

    def readers(self, n: int) -> list[ChoiceReader]:
        return [ChoiceReader(self.tools, self.reasoning, self.body.timings_per_token)
                for _ in range(n)]

    async def sse(self, stream: Answers):
        """Each choice's chunks carry its index; they interleave as the choices progress."""
        n = stream.n
        readers = self.readers(n)
        last: dict[int, Finish] = {}
        offsets = {i: len(self.prefix) for i in range(n)}  # text sent so far: text_offset
        async with aclosing(read(stream, readers)) as pieces:
            for i in range(n):
                if self.chat:
                    yield self._chunk([self._delta(i, {"role": "assistant", "content": ""})])
                if self.prefix:
                    yield self._chunk([self._delta(i, {"content": self.prefix})])
            async for i, piece in pieces:
                if isinstance(piece, Failed):  # e.g. a drain that ran out: every open
                    for j in range(n):  # choice still ends with a reason, then the error
                        if j not in last:
                            yield self._chunk([self._delta(j, {}, FAILED_REASON)])
                    yield {"data": json.dumps(piece.error.body())}
                    break
                if isinstance(piece, Thought):
                    yield self._chunk([self._delta(i, {"reasoning_content": piece.text})])
                elif isinstance(piece, Text):
                    yield self._chunk([self._delta(i, {"content": piece.text},
                                                   logprobs=list(piece.logprobs) or None,
                                                   offset=offsets[i])], **timed(piece))
                    offsets[i] += len(piece.text)
                elif isinstance(piece, ToolCalls):
                    for chunk in self._tool_chunks(i, piece):
                        yield chunk
                elif isinstance(piece, Finish):
                    last[i] = piece  # llama-server's timings ride on the last chunk (or usage's)
                    shown = {} if self.body.include_usage else {"timings": piece.llama_timings}
                    yield self._chunk([self._delta(i, {}, piece.reason)], **shown)
                elif isinstance(piece, Progress):  # llama-server's shape for it
                    delta = {"role": "assistant", "content": None} if self.chat else {"content": ""}
                    yield self._chunk([self._delta(i, delta)], prompt_progress=piece.as_json())
            if self.body.include_usage and len(last) == n:
                yield self._chunk([], usage=usage(last), timings=last[n - 1].llama_timings)
            yield {"data": "[DONE]"}

    def _tool_chunks(self, i: int, tools: ToolCalls):
        if tools.prose:
            yield self._chunk([self._delta(i, {"content": tools.prose})])
        for index, call in enumerate(tools.calls):
            yield self._chunk([self._delta(i, {"tool_calls": [{"index": index, **call}]})])

    # ---- one response ------------------------------------------------------------------
    async def collect(self, stream: Answers, request: Request) -> dict:
        answers = await whole_answers(stream, self.readers(stream.n), request)
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [self._choice(i, self.prefix + a.text, a.end, a.logprobs, a.thought,
                                         a.tools) for i, a in enumerate(answers)],
                "usage": usage(dict(enumerate(a.end for a in answers))),
                "timings": answers[-1].end.llama_timings}

    def _choice(self, index: int, text: str, end: Finish, found: list, thought: str,
                tools: ToolCalls | None) -> dict:
        wanted = self.body.logprob_n is not None
        shaped = self._logprobs(found, offset=len(self.prefix)) if wanted else None
        if not self.chat:
            return {"index": index, "text": text, "logprobs": shaped, "finish_reason": end.reason}
        message = {"role": "assistant", "content": joined_content(text, tools), "refusal": None}
        if thought:
            message["reasoning_content"] = thought
        if tools is not None and tools.calls:
            message["tool_calls"] = tools.calls
        return {"index": index, "message": message, "logprobs": shaped, "finish_reason": end.reason}


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
