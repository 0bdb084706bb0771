"""Embedding on one model: the model layer's service that OpenAI's /v1/embeddings and Ollama's
/api/embed write over (api/embedding.py reads a request's inputs and writes the answer), as the
engine loop is for chats. Each input is embedded with last-token pooling
(engine/runner/embeddings.py) on a worker thread, one input at a time per model, keys taking
turns (turns.py); a request counts as in flight from reading its inputs to its last vector (a
drain waits for it), and is billed like any answer to the engine's observers (metrics, per-key
counters, ledger)."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from localserve.common.model_errors import ModelUnavailable
from localserve.engine.errors import DecodeError
from localserve.engine.finish import FinishReason
from localserve.engine.request import Request as EngineRequest
from localserve.engine.request import SamplingParams, TokenEvent
from localserve.models.turns import Turns


# While an input is inside llama.cpp, how often the drain's end is looked at: an input on a busy
# machine may outlast uvicorn's graceful shutdown (5 s), which would cancel the request unanswered.
ENDED_POLL_S = 0.05


def drain_ran_out() -> ModelUnavailable:
    """The 503 of an input that the drain's end finds waiting or inside llama.cpp."""
    return ModelUnavailable("the server is shutting down (--drain-timeout ran out)", param=None)


class ClientGone(Exception):
    """The client closed the request: its inputs left are not embedded."""


class Embeddings:
    def __init__(self, host):
        self.host = host  # its ModelHost: the embedder, the loop's observers, `ended`
        self.turns = Turns()
        self.running = 0  # requests in flight (only the event loop's thread counts: no lock)

    async def embed(self, user: str | None, endpoint: str,
                    read_inputs: Callable[[], list[tuple[list[int], dict]]],
                    client_gone: Callable[[], Awaitable[bool]]) -> tuple[list[list[float]], int]:
        """A vector for each input that `read_inputs` gives (its tokens and the images placed
        among them, by hash; run on a worker thread: it tokenizes), and the tokens embedded, billed to `user` once all are done. ClientGone
        when `client_gone()` says so before an input; ModelUnavailable when the model cannot
        embed now (a drain ran out, or it was unloaded meanwhile)."""
        arrived = time.monotonic()
        self.running += 1
        try:
            inputs = await asyncio.to_thread(read_inputs)
            embedder = await asyncio.to_thread(self.host.embedder)
            vectors = [await self._one(embedder, tokens, images, user, client_gone)
                       for tokens, images in inputs]
        finally:
            self.running -= 1
        n_tokens = sum(len(tokens) for tokens, _ in inputs)
        self._bill(user, endpoint, arrived, n_tokens)
        return vectors, n_tokens

    async def _one(self, embedder, tokens: list[int], images: dict, user: str | None,
                   client_gone: Callable[[], Awaitable[bool]]) -> list[float]:
        """One input, in its key's turn. The model is freed only once no input is inside
        llama.cpp (Embedder.close waits); a drain lets an accepted request finish, as a chat."""
        if await client_gone():
            raise ClientGone("the client closed the request")
        if self.host.ended:
            raise drain_ran_out()
        await self.turns.take(user)
        work = asyncio.ensure_future(asyncio.to_thread(embedder.embed, tokens, images))
        try:
            while not (await asyncio.wait({work}, timeout=ENDED_POLL_S))[0]:
                if self.host.ended:  # answered now: uvicorn's shutdown would cancel it mute
                    embedder.stop()  # and the input leaves llama.cpp at its next graph node
                    raise drain_ran_out()
            vector = work.result()
        except DecodeError as exc:  # unloaded meanwhile (idle, or to make room)
            raise ModelUnavailable(f"the model cannot embed now: {exc}; retry",
                                   param=None) from None
        finally:  # the turn goes back once the input has left llama.cpp, answered or not
            if work.done():
                self.turns.give_back()
            else:
                work.add_done_callback(lambda _: self.turns.give_back())
        return vector

    def _bill(self, user: str | None, endpoint: str, arrived: float, n_tokens: int) -> None:
        """Answered outside the engine loop: billed as a finished answer of `n_tokens` prompt
        tokens to the loop's observers, which bill every answer."""
        loop = self.host.loop
        if loop is None:
            return
        billed = EngineRequest([], SamplingParams(), user=user, arrival_time=arrived,
                               endpoint=endpoint)
        billed.admitted_time = arrived
        event = TokenEvent("", finish_reason=FinishReason.STOP, prompt_tokens=n_tokens)
        for observer in loop.observers:
            observer.on_event(billed, event)
