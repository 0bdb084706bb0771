"""A step's rows in llama.cpp's token batch, and a failed call's rows taken out again: what the
runner's step (core.py) and its image runs (image_steps.py) both do around llama_decode."""

from __future__ import annotations

import llama_cpp as C

from localserve.engine.errors import CacheFull, DecodeError, Interrupted
from localserve.engine.plan import SeqChunk, StepPlan
from localserve.engine.runner.calls import Span


def fill_tokens(batch, spans: list[Span]) -> tuple[int, list[tuple[SeqChunk, int]]]:
    """Put the spans' tokens in the batch: its size, and each sampled chunk with its first
    sampled row (a span that ends a sampled chunk holds its sampled rows: calls.py)."""
    rows: list[tuple[SeqChunk, int]] = []
    i = 0
    for chunk, start, end in spans:
        for offset in range(start, end):
            batch.token[i] = chunk.tokens[offset]
            batch.pos[i] = chunk.start_pos + offset
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = chunk.slot_id
            batch.logits[i] = 0
            i += 1
        if chunk.sample and end == len(chunk.tokens):  # the last row, and each draft's
            for row in range(i - 1 - chunk.drafts, i):
                batch.logits[row] = 1
            rows.append((chunk, i - 1 - chunk.drafts))
    batch.n_tokens = i
    return i, rows


def undo_step(memory, plan: StepPlan, rc: int, n: int, saved) -> None:
    """A call failed: the step's rows leave the cache (an earlier call's too), and the error
    says why. llama.cpp places nothing when it finds no room (1) and removes the ubatch it
    stopped in when interrupted (2); the rest is ours to remove."""
    keep_none = rc not in (1, 2)
    for chunk in plan.chunks:
        first = -1 if keep_none else chunk.start_pos
        C.llama_memory_seq_rm(memory, chunk.slot_id, first, -1)
    if rc == 1:
        raise CacheFull(f"no free cache cells for a batch of {n} tokens")
    if rc == 2:
        raise Interrupted(f"a step of {n} tokens was interrupted", saved)
    raise DecodeError(f"llama_decode returned {rc} for a batch of {n} tokens "
                      f"from {len(plan.chunks)} sequences")
