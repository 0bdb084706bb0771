"""The answer, read once (llama.cpp's task_result_state): the one reader of engine event streams
in api/. It turns a request's events into typed pieces; every API shape (OpenAI chat and text
completions, Anthropic Messages, Responses, llama-server's /completion, Ollama) only writes its
shape from them.

    Text(text, logprobs, token_ids)   answer text as it streams
    Thought(text)                     reasoning, from a leading <think> block (reasoning.py)
    ToolCalls(prose, calls)           once the answer is complete: prose still held, its calls
    Finish(reason, stop, usage,       the end: the reason as clients see it ("tool_calls" when
           timings, tokens)           it called), llama-server's stop type, the counts billed,
                                      the request's timings and its answer's token ids
                                      (llama_timings: llama-server's timings object)
    Failed(error)                     no answer: 503 queue timeout, 500 engine error, 400 a
                                      grammar grown too costly, 499 the client left

Rules written here once, for every shape: a failure ends the answer; <think> is split off only
without tools; with tools in the model's own format and tool_choice "auto", prose streams until
the format's trigger and the calls are parsed once complete; otherwise a tools answer (JSON
constrained) is held and parsed once complete; a choice that ends without its final event (the
client left, a cancel) is a 499. read() cancels the request when its reader leaves, and for a
whole (non-streamed) answer also when the client hangs up.

Writers (replies.py and the *_reply.py modules) read pieces only: everything they say about an
answer is in them (llama.cpp's result_timings), so no writer goes back to the engine request.
`Choices` is the handle on a request's n choices that a writer reads from and may cancel.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import AsyncIterator, Protocol, Union

from fastapi import Request

from localserve.api.gemma4 import GemmaReader
from localserve.api.harmony import HarmonyReader
from localserve.api.reasoning import GEMMA4, HARMONY, ThinkSplitter
from localserve.api.schemas import OpenAIError
from localserve.api.structured import ToolPlan, parse_tool_answer, tool_finish
from localserve.api.tool_formats import ProseThenCalls
from localserve.engine.finish import FinishReason
from localserve.engine.request import Request as EngineRequest
from localserve.engine.request import TokenEvent
from localserve.engine.streams import ChoiceStreams


class Answers(Protocol):
    """One request's choices as a writer holds them (engine/streams.ChoiceStreams): how many,
    whether all ended, and a cancel for a client gone. Only answer.py reads their events."""

    @property
    def n(self) -> int: ...
    @property
    def finished(self) -> bool: ...
    def cancel(self) -> None: ...


@dataclass(frozen=True)
class Text:
    text: str
    logprobs: tuple = ()  # the (token, logprob, top) entries of the tokens behind it, if asked
    token_ids: tuple[int, ...] = ()
    timings: dict | None = None  # llama-server's timings so far, for timings_per_token


def timed(piece: Text) -> dict:
    """A streamed piece's llama-server timings, for a request that asked timings_per_token."""
    return {"timings": piece.timings} if piece.timings is not None else {}


@dataclass(frozen=True)
class Thought:
    text: str


@dataclass(frozen=True)
class ToolCalls:
    prose: str | None  # text not yet sent as Text (None: the answer has no text)
    calls: list[dict]  # OpenAI's shape: {id, type, function: {name, arguments}}


@dataclass(frozen=True)
class Usage:
    """Tokens as the engine billed them (a prompt is billed once for n choices)."""

    prompt: int
    completion: int
    cached: int  # of the prompt, found in cache
    reasoning: int = 0  # of the completion, spent in a <think> block


@dataclass(frozen=True)
class Timings:
    """Seconds: waiting for a slot, computing the prompt, generating the answer."""

    queued: float
    prompt: float
    decode: float


def llama_timings(usage: Usage, timings: Timings) -> dict:
    """llama-server's `timings` object (server_slot_stats::to_json): the prompt computed (its
    cached part apart) and the answer, in milliseconds, per token and per second; the first
    answer token comes with the prompt's last step, so the answer's rates count the rest."""
    prompt_n, steps = usage.prompt - usage.cached, max(usage.completion - 1, 0)
    prompt_ms = timings.prompt * 1000
    # llama-server's clock: 1 us at least once a token came, none before
    decode_ms = max(timings.decode * 1000, 1e-3) if usage.completion else 0.0
    return {"cache_n": usage.cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": usage.completion, "predicted_ms": decode_ms,
            "predicted_per_token_ms": decode_ms / steps if steps else 0.0,
            "predicted_per_second": 1e3 * steps / decode_ms if decode_ms > 0 else 0.0}


@dataclass(frozen=True)
class Finish:
    reason: str  # as clients see it: stop, length, tool_calls
    stop: str  # llama-server's stop_type: eos, word (a stop string), limit, none
    usage: Usage
    timings: Timings
    tokens: tuple[int, ...]  # the answer's token ids

    @property
    def llama_timings(self) -> dict:
        return llama_timings(self.usage, self.timings)

    @property
    def cut(self) -> bool:
        """Cut at its token limit or its context (finish_reason "length", stop_type "limit"):
        the one test every writer asks."""
        return self.reason == "length"


def finish(reason: str, event: TokenEvent, request: EngineRequest, reasoning: int) -> Finish:
    """The end piece, from the final event's billed counts and the engine request's clocks:
    the one place a writer's figures come from."""
    usage = Usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens, reasoning)
    return Finish(reason, event.stop_type, usage, clocks(request), tuple(request.output_tokens))


def clocks(request: EngineRequest) -> Timings:
    """The engine request's timings until now."""
    now = time.monotonic()
    first = request.first_token_time or now
    admitted = request.admitted_time or first
    return Timings(admitted - request.arrival_time, first - admitted, now - first)


def timings_so_far(request: EngineRequest) -> dict:
    """llama-server's timings of an answer still running (timings_per_token)."""
    usage = Usage(request.num_prompt_tokens, request.num_output_tokens, request.cached_tokens)
    return llama_timings(usage, clocks(request))


@dataclass(frozen=True)
class Failed:
    error: OpenAIError


@dataclass(frozen=True)
class Progress:
    """How far the prompt is computed, before the first token (llama-server's prompt_progress,
    for a request that sent return_progress)."""

    total: int
    cache: int
    processed: int
    time_ms: int

    def as_json(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed,
                "time_ms": self.time_ms}


# The finish_reason a stream's open choices end with when the answer fails midway (a drain
# that ran out), before the error itself: the engine's own word for it.
FAILED_REASON = str(FinishReason.ERROR)


Piece = Union[Text, Thought, ToolCalls, Finish, Failed, Progress]


def failure(event: TokenEvent) -> OpenAIError | None:
    """The error a finished-by-failure event is answered with, its status from
    FinishReason.status (the one table): a queue timeout is a 503 to retry, an engine error a
    500, a grammar grown too costly a 400."""
    reason = event.finish_reason
    if reason is None or reason.completed or reason is FinishReason.ABORT:
        return None
    timeout = reason is FinishReason.TIMEOUT
    kind = "server_error" if reason.status >= 500 else "invalid_request_error"
    return OpenAIError(reason.status, event.error or "generation failed", kind,
                       code={"timeout": "queue_timeout", "grammar_cost": "grammar_cost"}.get(reason),
                       headers={"Retry-After": "2"} if timeout else None)


def client_closed() -> OpenAIError:
    return OpenAIError(499, "the client closed the request", code="client_closed")


# Formats whose reasoning and calls are read together, by their control tokens
READERS = {HARMONY: HarmonyReader, GEMMA4: GemmaReader}


class ChoiceReader:
    """One choice's events -> pieces (see the module doc)."""

    def __init__(self, tools: ToolPlan | None = None, reasoning: str | bool = False,
                 timed: bool = False):
        self.tools = tools
        self.timed = timed  # timings_per_token: each Text carries the timings so far
        native = tools.native.name if tools is not None and tools.native is not None else None
        kind = native if native in READERS else reasoning if reasoning in READERS else None
        self.whole = READERS[kind]() if kind else None  # reasoning and calls in a model's words
        streams_prose = native is not None and not kind and tools.allow_text_response
        self.prose = ProseThenCalls(tools.native) if streams_prose else None
        # a leading reasoning block, before the answer or the prose and calls of a model's own
        # format (a constrained answer has none: its grammar starts at the first token)
        free = tools is None or streams_prose
        self.thinking = ThinkSplitter(reasoning) if reasoning and free and not kind else None
        self.held: list[str] = []  # a tools answer parsed once complete
        self.reasoning_tokens = 0

    def read(self, event: TokenEvent, request: EngineRequest) -> list[Piece]:
        """The pieces of one of `request`'s events."""
        if (failed := failure(event)) is not None:
            return [Failed(failed)]
        if event.finish_reason is FinishReason.ABORT:
            return [Failed(client_closed())]
        if event.progress is not None:
            return [Progress(*event.progress)]
        pieces = self._text(event, request)
        if self.timed:
            pieces = [replace(p, timings=timings_so_far(request)) if isinstance(p, Text) else p
                      for p in pieces]
        if event.finished:
            pieces += self._end(event, request)
        return pieces

    def _text(self, event: TokenEvent, request: EngineRequest) -> list[Piece]:
        if self.whole is not None:
            said = self.whole.feed(event.text) + (self.whole.flush() if event.finished else [])
            if said and all(kind == "thought" for kind, _ in said):
                self.reasoning_tokens += len(event.token_ids)
            return [Thought(text) if kind == "thought" else Text(text) for kind, text in said]
        if self.thinking is None and self.tools is None:
            if event.text or event.logprobs:
                return [Text(event.text, (event.logprobs,) if event.logprobs else (),
                             event.token_ids)]
            return []
        thought, text = (self._think(event, request) if self.thinking is not None
                         else ("", event.text))
        if self.tools is not None:
            if self.prose is None:
                self.held.append(text)
                return []
            text = self.prose.feed(text)
        return ([Thought(thought)] if thought else []) + ([Text(text)] if text else [])

    def _think(self, event: TokenEvent, request: EngineRequest) -> tuple[str, str]:
        """(reasoning, the rest) of an event's text; an answer whose prompt opened the block
        starts inside it."""
        if request.reasoning_open:
            self.thinking.opened()
        thought, text = self.thinking.feed(event.text)
        if event.finished:
            rest = self.thinking.flush()
            thought, text = thought + rest[0], text + rest[1]
        if thought and not text:  # tokens spent reasoning: Finish.usage.reasoning
            self.reasoning_tokens += len(event.token_ids)
        return thought, text

    def _end(self, event: TokenEvent, request: EngineRequest) -> list[Piece]:
        pieces: list[Piece] = []
        called = False
        if self.whole is not None and self.tools is not None:  # calls it made unasked: none
            pieces.append(ToolCalls(None, self.whole.calls))
            called = bool(self.whole.calls)
        elif self.tools is not None:
            prose, calls = (self.prose.finish() if self.prose is not None
                            else parse_tool_answer("".join(self.held), self.tools))
            pieces.append(ToolCalls(prose, calls))
            called = bool(calls)
        reason = tool_finish(str(event.finish_reason), called)
        return pieces + [finish(reason, event, request, self.reasoning_tokens)]


async def read(stream: ChoiceStreams, readers: list[ChoiceReader],
               request: Request | None = None) -> AsyncIterator[tuple[int, Piece]]:
    """Every choice's pieces as (index, piece), in the order they come. Leaving (or closing the
    generator) cancels what still runs; with `request` (a whole answer) a client that hangs
    up cancels it too. Use it with contextlib.aclosing, so that leaving early frees the slot
    at once."""
    watcher = asyncio.create_task(cancel_on_disconnect(request, stream)) if request else None
    ended: set[int] = set()
    try:
        async for index, event in stream:
            for piece in readers[index].read(event, stream.requests[index]):
                if isinstance(piece, (Finish, Failed)):
                    ended.add(index)
                yield index, piece
        for index in range(len(readers)):
            if index not in ended:
                yield index, Failed(client_closed())
    finally:
        stream.cancel()
        if watcher is not None:
            watcher.cancel()


async def cancel_on_disconnect(request: Request, stream: ChoiceStreams) -> None:
    """A non-streaming client that hangs up frees its slot too (streams notice by themselves:
    sse-starlette cancels their generator)."""
    while not stream.finished:
        await asyncio.sleep(0.25)
        if await request.is_disconnected():
            stream.cancel()
            return


@dataclass(frozen=True)
class WholeAnswer:
    """One choice read to its end (a reply that is not streamed)."""

    thought: str
    text: str  # what streamed as Text (the prose held with tool calls is in tools.prose)
    tools: ToolCalls | None
    end: Finish
    logprobs: list  # the Text pieces' entries, in order


async def whole_answers(stream: ChoiceStreams, readers: list[ChoiceReader],
                        request: Request) -> list[WholeAnswer]:
    """Every choice's whole answer, by index; a failure (a client that left included) is
    raised."""
    n = len(readers)
    thoughts, texts = [[] for _ in range(n)], [[] for _ in range(n)]
    logprobs, tools, ends = [[] for _ in range(n)], [None] * n, [None] * n
    async with aclosing(read(stream, readers, request)) as pieces:
        async for i, piece in pieces:
            if isinstance(piece, Failed):
                raise piece.error
            if isinstance(piece, Thought):
                thoughts[i].append(piece.text)
            elif isinstance(piece, Text):
                texts[i].append(piece.text)
                logprobs[i] += piece.logprobs
            elif isinstance(piece, ToolCalls):
                tools[i] = piece
            elif isinstance(piece, Finish):
                ends[i] = piece
    return [WholeAnswer("".join(thoughts[i]), "".join(texts[i]), tools[i], ends[i], logprobs[i])
            for i in range(n)]


async def whole_answer(stream: ChoiceStreams, reader: ChoiceReader,
                       request: Request) -> WholeAnswer:
    """One choice's whole answer; a failure (a client that left included) is raised."""
    return (await whole_answers(stream, [reader], request))[0]


def joined_content(streamed: str, tools: ToolCalls | None) -> str | None:
    """A whole answer's text: what streamed, then the prose held with its calls; with calls,
    stripped (None when empty), as the model's own format reads it."""
    if tools is None:
        return streamed
    if not streamed:
        return tools.prose
    text = streamed + (tools.prose or "")
    return (text.strip() or None) if tools.calls else text
