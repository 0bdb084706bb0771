"""Connection hygiene: what keeps one client's sockets from shutting everyone else out.

- A header deadline: a client gets --header-timeout seconds to send its request headers
  (each request on a kept-alive connection too). A slowloris that trickles headers a byte
  at a time is closed when the deadline passes, instead of holding its socket for ever.
- A body deadline: once its headers are in, a request's whole body must arrive within
  --body-timeout (a client that sends one byte every few seconds is closed).
- A connection cap: at --max-connections, a new connection first evicts the connection that
  has waited longest without finishing its headers or body; only when there is none is the newcomer
  turned away. Slow sockets can therefore never crowd out a client that talks normally.
- The open-files soft limit is raised to the hard limit at start-up (a common default of
  1,024 is less than a busy office needs), and repeated accept() failures are logged once
  per interval with a count, not once per event.
- Out of files all the same (a burst larger than the files left: asyncio accepts a whole
  backlog in one go, before any connection is counted against the cap), the connections
  waiting longest for their headers are shed at once and accepting resumes within
  ACCEPT_RETRY_S, not asyncio's 1 s, which a burst would otherwise hit again and again: a
  normal client behind thousands of slow sockets was answered only at the header deadline.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("localserve")

OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)

FD_RESERVE = 64  # files kept for the model, logs and the engine besides client sockets
ACCEPT_RETRY_S = 0.05  # asyncio's pause after accept() ran out of files (its own: 1 s)
SHED_AT_LEAST = 64  # connections shed when out of files: this many, or a quarter of those waiting


def raise_open_files_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # e.g. macOS caps at OPEN_MAX
            log.warning("could not raise the open-files limit from %d: %s", soft, exc)
    return soft


def connection_cap(requested: int, open_files: int) -> int:
    cap = min(requested, open_files - FD_RESERVE)
    if cap < requested:
        log.warning("--max-connections %d lowered to %d: the open-files limit is %d (ulimit -n)",
                    requested, cap, open_files)
    return max(cap, 16)


def guarded_protocol(header_timeout: float, body_timeout: float,
                     max_connections: int) -> type[H11Protocol]:
    """An h11 protocol class for uvicorn with header and body deadlines and a connection cap.
    Its `shed_slowest` is what the loop's error handler calls when accept() runs out of files."""
    awaiting: dict[GuardedH11Protocol, float] = {}  # connections mid-headers, oldest first

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None  # the deadline of the current phase
        _for_body = False

        @staticmethod
        def shed_slowest() -> int:
            """Close the connections waiting longest for their headers or body: SHED_AT_LEAST,
            or a quarter of them; how many were closed."""
            victims = list(awaiting)[:max(SHED_AT_LEAST, len(awaiting) // 4)]
            for victim in victims:
                victim._close()
            if victims:
                log_throttled("out of open files: closed the connections waiting longest for "
                              "their headers or body")
            return len(victims)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections and not self._evict_slowest():
                log_throttled("connection refused: --max-connections %d reached" % max_connections)
                transport.close()
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                self._disarm()
            elif self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                self._arm(header_timeout)  # part of the next request's headers is in
            elif self.conn.their_state is h11.SEND_BODY:
                self._arm(body_timeout, for_body=True)  # headers in: now the body's deadline
            elif self.conn.their_state is not h11.IDLE:
                self._disarm()  # the whole request is in: it is the app's now

        def _arm(self, seconds: float = header_timeout, for_body: bool = False) -> None:
            if self._header_timer is not None and self._for_body == for_body:
                return  # this phase's deadline is already running
            self._disarm()
            self._for_body = for_body
            self._header_timer = self.loop.call_later(seconds, self._too_slow)
            awaiting[self] = time.monotonic()

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            awaiting.pop(self, None)

        def _close(self) -> None:
            self._disarm()
            self.transport.close()

        def _too_slow(self) -> None:
            self._header_timer = None
            awaiting.pop(self, None)
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                log_throttled(f"closed connections that sent no complete body within "
                              f"--body-timeout {body_timeout:g} s" if self._for_body else
                              f"closed connections that sent no complete headers within "
                              f"--header-timeout {header_timeout:g} s")
                self.transport.close()

        def _evict_slowest(self) -> bool:
            victim = next((c for c in awaiting if c is not self), None)
            if victim is None:
                return False
            victim._close()
            log_throttled("at --max-connections %d: closed the connection waiting longest for "
                          "its headers" % max_connections)
            return True

    return GuardedH11Protocol


class _Throttle:
    """Log a message at most once per interval, saying how many repeats were held back."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self.last: dict[str, float] = {}
        self.held: dict[str, int] = {}

    def __call__(self, message: str, level: int = logging.WARNING) -> None:
        now = time.monotonic()
        if now - self.last.get(message, -self.interval_s) < self.interval_s:
            self.held[message] = self.held.get(message, 0) + 1
            return
        held = self.held.pop(message, 0)
        self.last[message] = now
        log.log(level, "%s%s", message, f" ({held} more like this since the last report)" if held else "")


log_throttled = _Throttle()


def install_loop_error_throttle(loop: asyncio.AbstractEventLoop,
                                shed: Callable[[], int] | None = None) -> None:
    """asyncio reports every failed accept() (EMFILE when out of file descriptors) with a
    traceback; under a flood that is thousands a second. Report each kind once per interval.
    Out of files, `shed` (the guarded protocol's) frees some, once per turn of the loop:
    asyncio goes on calling accept() for the rest of its backlog in the same turn. With files
    shed, accepting may resume after ACCEPT_RETRY_S (asyncio reads it at each failure)."""
    if shed:
        asyncio.constants.ACCEPT_RETRY_DELAY = ACCEPT_RETRY_S
    shed_this_turn = False

    def allow_shedding() -> None:
        nonlocal shed_this_turn
        shed_this_turn = False

    def handler(_loop, context: dict) -> None:
        nonlocal shed_this_turn
        exc = context.get("exception")
        what = context.get("message", "event loop error")
        log_throttled(f"{what}: {exc!r}" if exc else what, logging.ERROR)
        if shed and not shed_this_turn and isinstance(exc, OSError) and exc.errno in OUT_OF_FILES:
            shed_this_turn = True
            shed()
            loop.call_soon(allow_shedding)

    loop.set_exception_handler(handler)
