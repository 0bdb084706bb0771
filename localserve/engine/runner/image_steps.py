"""A step's image rows (images.py): decoded from the image's embeddings, in the order the
sequence needs them, before the step's usual call(s).

llama_decode takes tokens or embeddings in one batch, never both, and a row sees only the cells
already in the cache: so a chunk that holds image rows is decoded up to its last image row
first, run by run (text before an image as tokens, the image as embeddings), and what follows
(at least the generation prompt after the last image, where the sampled row is) goes on with
every other sequence's rows in the step's usual call(s) (calls.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import llama_cpp as C

from localserve.engine.errors import RowsRefused
from localserve.engine.image_rows import image_row
from localserve.engine.plan import SeqChunk, StepPlan
from localserve.engine.runner.batch import fill_tokens, undo_step

if TYPE_CHECKING:  # mtmd's library loads only for a model with a projector
    from localserve.engine.runner.images import ImageInput, Projector


def image_runs(tokens: list[int], end: int) -> list[tuple[int, int, int | None]]:
    """tokens[:end] as runs (start, stop, image hash or None for text); an image's run ends
    where its rows stop following one another (the next image starts)."""
    runs: list[tuple[int, int, int | None]] = []
    start, current, last_row = 0, None, -1
    for i in range(end):
        token = tokens[i]
        h, row, _ = image_row(token) if token < 0 else (None, -1, False)
        if i > start and (h != current or (h is not None and row != last_row + 1)):
            runs.append((start, i, current))
            start = i
        current, last_row = h, row
    if end > start:
        runs.append((start, end, current))
    return runs


class ImagePlacer:
    """A step's image rows, for a model given a projector (--mmproj): the projector, and a
    batch of embeddings beside the runner's batch of tokens (`token_batch`, which the text
    before an image goes through)."""

    def __init__(self, mmproj: str, model, ctx, token_batch, n_batch: int, n_threads: int,
                 on_gpu: bool):
        from localserve.engine.runner.images import Projector

        self.ctx, self.memory, self.token_batch = ctx, C.llama_get_memory(ctx), token_batch
        self.n_embd = C.llama_model_n_embd(model)
        self.projector = Projector(mmproj, model, n_threads, on_gpu)
        self.embd_batch = C.llama_batch_init(n_batch, self.n_embd, 1)

    def encode_ahead(self, images: list) -> None:
        """Runner.encode_ahead: the images admission waits for, to the projector's encoder
        thread (images.Projector.encode_later)."""
        for image in images:
            self.projector.encode_later(image, self.n_embd)

    def close(self) -> None:
        C.llama_batch_free(self.embd_batch)
        self.projector.close()

    def place(self, plan: StepPlan, saved) -> tuple[StepPlan, float]:
        """Decode every chunk's rows up to its last image row; the plan of what is left, and
        the seconds spent in llama_decode. A chunk whose images cannot be placed is refused
        before anything is decoded (RowsRefused): its request alone ends."""
        refused = {chunk.slot_id: why for chunk in plan.chunks
                   if (why := self._unplaceable(chunk)) is not None}
        if refused:
            raise RowsRefused(refused, saved)
        chunks, spent = [], 0.0
        for chunk in plan.chunks:
            last = max((i for i, t in enumerate(chunk.tokens) if t < 0), default=-1)
            if last < 0:
                chunks.append(chunk)
                continue
            for start, stop, h in image_runs(chunk.tokens, last + 1):
                spent += self._decode_run(plan, chunk, start, stop, h, saved)
            if last + 1 < len(chunk.tokens):
                chunks.append(SeqChunk(chunk.slot_id, chunk.request, chunk.tokens[last + 1:],
                                       chunk.start_pos + last + 1, chunk.sample, chunk.drafts))
        return replace(plan, chunks=chunks), spent

    def _unplaceable(self, chunk: SeqChunk) -> str | None:
        """Why this chunk's image rows cannot be decoded (None: they can, or it has none)."""
        last = max((i for i, t in enumerate(chunk.tokens) if t < 0), default=-1)
        if last < 0:
            return None
        if chunk.sample and last == len(chunk.tokens) - 1:
            return "a prompt ends with an image: nothing to answer from"
        for start, stop, h in image_runs(chunk.tokens, last + 1):
            if h is None:
                continue
            image = chunk.request.images.get(h)
            if image is None:
                return "a step reached an image this model cannot place"
            if image.failed is not None:
                return image.failed
            first_row = image_row(chunk.tokens[start])[1]
            if image.non_causal and (first_row != 0 or stop - start != image.n_rows):
                return "an image that attends both ways was split between steps"
        return None

    def _decode_run(self, plan, chunk: SeqChunk, start: int, stop: int, h, saved) -> float:
        image: ImageInput | None = None
        if h is None:
            n, _ = fill_tokens(self.token_batch, [(chunk, start, stop)])
            batch = self.token_batch
        else:  # _unplaceable checked its rows can be placed
            image = chunk.request.images.get(h)
            n, batch = stop - start, image_rows(
                self.embd_batch, self.projector, image, chunk.tokens[start:stop], self.n_embd,
                chunk.start_pos + start, chunk.slot_id, logits=0)
        started = time.perf_counter()
        with attention_for(self.ctx, image):  # the whole image in one call (chunk_length)
            rc = C.llama_decode(self.ctx, batch)
        spent = time.perf_counter() - started
        if rc != 0:
            undo_step(self.memory, plan, rc, n, saved)
        return spent


def image_rows(batch, projector: Projector, image: ImageInput, rows: list[int], n_embd: int,
               pos: int, seq_id: int, logits: int):
    """`batch` (one made with room for embeddings) holding an image's placeholder `rows` as
    the projector's embeddings of them, at positions pos.. of sequence seq_id (`logits` 1
    where their outputs are read): a step's image run, and an embedding input's."""
    first = image_row(rows[0])[1]
    embeddings = projector.encode(image, n_embd)[first:first + len(rows)]
    ctypes.memmove(batch.embd, embeddings.ctypes.data, embeddings.nbytes)
    for i in range(len(rows)):
        batch.pos[i] = pos + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq_id
        batch.logits[i] = logits
    batch.n_tokens = len(rows)
    return batch


@contextlib.contextmanager
def attention_for(ctx, image: ImageInput | None):
    """The call's attention: Gemma 3's images attend both ways (causal attention off for the
    image's call, back on after); text and other images, causally."""
    both_ways = image is not None and image.non_causal
    if both_ways:
        C.llama_set_causal_attn(ctx, False)
    try:
        yield
    finally:
        if both_ways:
            C.llama_set_causal_attn(ctx, True)
