"""Calls into the SQLite stores (stored responses, the page's conversations: conversations.py)
run within a bound of their own, STORE_THREADS threads at once, not within the worker threads'
shared bound (40, what run_in_threadpool takes from). Each call waits for its store's lock and
a disk write; a colleague's flood of them would otherwise hold the whole shared bound, and
everyone's prompt tokenizing, which takes from it too (prompt.py), would wait behind them.
Calls beyond STORE_THREADS wait in the event loop, holding no thread."""

from __future__ import annotations

import anyio
from fastapi import Request

STORE_THREADS = 2  # the store's lock lets one call in at a time: a second keeps the next ready


async def in_store_thread(request: Request, call, *args):
    """`call(*args)` on a worker thread, at most STORE_THREADS of them for the stores at once."""
    state = request.app.state
    limiter = getattr(state, "store_limiter", None)
    if limiter is None:  # made in the event loop that uses it
        limiter = state.store_limiter = anyio.CapacityLimiter(STORE_THREADS)
    return await anyio.to_thread.run_sync(call, *args, limiter=limiter)
