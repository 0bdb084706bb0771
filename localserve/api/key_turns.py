"""Turns per key at a cost the engine does not see (fetching images, decoding them): each key's
requests take at most `at_once` places at a time, while other keys' go beside them. A key's entry
lives only while one of its requests holds or waits for a place, so the table never outgrows the
requests in flight."""

from __future__ import annotations

import asyncio
import contextlib


class KeyTurns:
    def __init__(self, at_once: int):
        self.at_once = at_once
        self._places: dict[str | None, tuple[asyncio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def turn(self, key: str | None):
        """Wait for one of `key`'s places; hold it for the with-block."""
        places, users = self._places.get(key, (asyncio.Semaphore(self.at_once), 0))
        self._places[key] = (places, users + 1)
        try:
            async with places:
                yield
        finally:
            places, users = self._places[key]
            if users == 1:
                del self._places[key]
            else:
                self._places[key] = (places, users - 1)

    def keys(self) -> int:
        """How many keys hold or wait for a place now."""
        return len(self._places)
