"""Turns: one embedding input at a time per model, keys taking turns (round-robin), so one
key's 60 requests of 256 inputs queue behind each other, not in front of a colleague's one."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque


class Turns:
    def __init__(self):
        self._waiting: OrderedDict[str | None, deque[asyncio.Future]] = OrderedDict()
        self._busy = False

    async def take(self, user: str | None) -> None:
        """Wait for this key's turn; the caller must give_back() once done."""
        if not self._busy and not self._waiting:
            self._busy = True
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(user, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give_back()  # handed the turn just as the client left: pass it on
            else:
                self._forget(user, turn)
            raise

    def give_back(self) -> None:
        """Hand the turn to the next key in line (the key served moves to the back)."""
        while self._waiting:
            user, line = next(iter(self._waiting.items()))
            turn = line.popleft()
            del self._waiting[user]
            if line:
                self._waiting[user] = line  # back of the round
            if not turn.done():
                turn.set_result(None)
                return
        self._busy = False

    def _forget(self, user: str | None, turn: asyncio.Future) -> None:
        line = self._waiting.get(user)
        if line is not None and turn in line:
            line.remove(turn)
            if not line:
                del self._waiting[user]
