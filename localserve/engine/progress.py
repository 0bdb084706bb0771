"""llama-server's prompt progress (`return_progress`): a request that asks is told, before its
first token, what its cache held and then, after each step's chunk of its prompt, how much
of the prompt is computed. Reports only: what the client sees of a long prompt's wait."""

from __future__ import annotations

import time

from localserve.engine.plan import SeqChunk
from localserve.engine.request import Request, TokenEvent


def prompt_progress(chunk: SeqChunk) -> list[tuple[Request, TokenEvent]]:
    """The reports one computed chunk brings: at its prompt's first chunk also the one before
    it (processed == cache, as llama-server's first report); none unless asked for."""
    req = chunk.request
    total, cache = req.num_prompt_tokens, req.cached_tokens
    if not req.params.progress or chunk.start_pos >= total:
        return []
    since = req.admitted_time or req.arrival_time
    ms = int((time.monotonic() - since) * 1000)
    done = min(chunk.start_pos + len(chunk.tokens), total)
    marks = ([cache] if chunk.start_pos == cache else []) + [done]
    return [(req, TokenEvent("", progress=(total, cache, n, ms))) for n in marks]
