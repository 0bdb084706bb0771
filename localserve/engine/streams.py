"""The asyncio side of the engine: a request's events as an async iterator, and the mailbox
that carries them from the engine thread to the event loop.

The engine thread delivers every event of a step in one burst. Handing each to the event loop
with its own call_soon_threadsafe would wake the loop (a write to its self-pipe) once per
event, and on a small CPU each wake-up takes a core from llama.cpp's threads mid-step; the
mailbox wakes it once per burst.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Protocol

from localserve.engine.request import Request, TokenEvent


class Aborts(Protocol):
    """What a stream needs of the engine loop (loop.py): to abort its request."""

    def abort(self, request_id: str) -> None: ...


class Mailbox:
    """Calls posted from any thread, run on one event loop in order, with one wake-up for all
    the calls posted before the loop got to them."""

    _by_loop: dict[asyncio.AbstractEventLoop, "Mailbox"] = {}

    def __init__(self, aloop: asyncio.AbstractEventLoop):
        self.aloop = aloop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], None], Any]] = []

    @classmethod
    def of_running_loop(cls) -> "Mailbox":
        aloop = asyncio.get_running_loop()
        mailbox = cls._by_loop.get(aloop)
        if mailbox is None:
            for old in [loop for loop in cls._by_loop if loop.is_closed()]:
                del cls._by_loop[old]
            mailbox = cls._by_loop[aloop] = cls(aloop)
        return mailbox

    def post(self, call: Callable[[Any], None], arg: Any) -> None:
        with self._lock:
            self._pending.append((call, arg))
            if len(self._pending) > 1:
                return  # a wake-up is already on its way
        held = getattr(_held, "mailboxes", None)
        if held is not None:  # the engine thread's: woken when it next lets go (hold_wake_ups)
            held[self] = None
            return
        self._wake()

    def _wake(self) -> None:
        try:
            self.aloop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        with self._lock:
            calls, self._pending = self._pending, []
        for call, arg in calls:
            call(arg)


# Wake-ups the engine thread holds (hold_wake_ups): the mailboxes it posted to since it last
# woke them.
_held = threading.local()


def hold_wake_ups() -> None:
    """On the engine thread: posts wake their event loop only at wake_held(), which the loop
    calls as it is about to let go of the GIL (llama_decode, or waiting for work). Waking the
    event loop at once (a write to its self-pipe, the GIL released around it) handed the GIL
    to the HTTP thread mid-step, and the engine thread waited for it back: 35% of its own time
    outside llama_decode at one stream on a fast model (bench/host.py). Woken just
    before llama_decode, the HTTP thread writes the chunks while the step computes."""
    _held.mailboxes = {}


def wake_held() -> None:
    held = getattr(_held, "mailboxes", None)
    if held:
        boxes = list(held)
        held.clear()
        for box in boxes:
            box._wake()


class ChoiceStreams:
    """The events of a request's n choices (n sibling requests), as (index, event) pairs in the
    order they come. cancel() aborts every choice still running."""

    def __init__(self, loop: Aborts, requests: list[Request]):
        self.requests = requests
        self._loop = loop
        self._open = set(range(len(requests)))
        self._events: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
        mailbox = Mailbox.of_running_loop()
        for index, request in enumerate(requests):
            request.emit = lambda event, i=index: mailbox.post(self._events.put_nowait, (i, event))

    @property
    def finished(self) -> bool:
        return not self._open

    @property
    def n(self) -> int:
        """How many choices."""
        return len(self.requests)

    @property
    def n_prompt_tokens(self) -> int:
        """The prompt's tokens (before any answer: Messages' message_start reports them)."""
        return self.requests[0].num_prompt_tokens

    def __aiter__(self) -> "ChoiceStreams":
        return self

    async def __anext__(self) -> tuple[int, TokenEvent]:
        if not self._open:
            raise StopAsyncIteration
        try:
            index, event = await self._events.get()
        except BaseException:
            self.cancel()
            raise
        if event.finished:
            self._open.discard(index)
        return index, event

    def cancel(self) -> None:
        for index in self._open:
            self._loop.abort(self.requests[index].request_id)
        self._open.clear()


class RequestStream(ChoiceStreams):
    """The events of one submitted request, as an async iterator (no index). cancel() (or
    leaving the iteration through an exception, e.g. a client disconnect) aborts the request,
    so its slot is free by the next step."""

    def __init__(self, loop: Aborts, request: Request):
        super().__init__(loop, [request])
        self.request = request

    async def __anext__(self) -> TokenEvent:
        _, event = await super().__anext__()
        return event
