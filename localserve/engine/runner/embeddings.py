"""Embedder: /v1/embeddings from a second llama_context on the generating context's model.

The context has embeddings on and LAST-token pooling: measured on these machines, LAST was
stable batched vs solo, while MEAN pooling over several sequences gave wrong vectors (and
aborted at context creation with n_seq_max=3). So it holds one sequence and embeds one input
at a time, under a lock, on the HTTP side's worker threads: the generation loop never waits
for it (the two contexts share the CPU, not a lock). Vectors are L2-normalised, as OpenAI's are.
"""

from __future__ import annotations

import threading

import llama_cpp as C
import numpy as np

from localserve.engine.errors import DecodeError
from localserve.engine.runner.image_steps import attention_for, image_rows, image_runs
from localserve.engine.runner.interrupt import StepInterrupt
from localserve.engine.runner.upper_state import clear_upper_state


class Embedder:
    """own_pooling: a model made for embeddings (kind = "embedding", e.g. a BERT-family GGUF)
    pools as its GGUF says (mean, CLS, ...), and an encoder-only one runs llama_encode; a chat
    model, or a model whose GGUF names no pooling, pools the last token."""

    def __init__(self, model, n_ctx: int, n_threads: int, own_pooling: bool = False,
                 projector=None):
        self.ctx = self._context(model, n_ctx, n_threads, C.LLAMA_POOLING_TYPE_UNSPECIFIED
                                 if own_pooling else C.LLAMA_POOLING_TYPE_LAST)
        if own_pooling and C.llama_pooling_type(self.ctx) == C.LLAMA_POOLING_TYPE_NONE:
            C.llama_free(self.ctx)
            self.ctx = self._context(model, n_ctx, n_threads, C.LLAMA_POOLING_TYPE_LAST)
        self.pooling = C.llama_pooling_type(self.ctx)
        encoder_only = C.llama_model_has_encoder(model) and not C.llama_model_has_decoder(model)
        self._run = C.llama_encode if encoder_only else C.llama_decode
        self.n_ctx = n_ctx
        self.n_embd = C.llama_model_n_embd(model)
        self.batch = C.llama_batch_init(n_ctx, 0, 1)
        self.lock = threading.Lock()
        self._stop = StepInterrupt(self.ctx)
        self.projector = projector  # the model's (images.Projector): images in inputs
        self.embd_batch = None  # made for the first input with an image

    def stop(self) -> None:
        """Any thread, at a drain's end: the input inside llama.cpp stops at its next graph
        node (its embed raises DecodeError), and so does every later one."""
        self._stop.request()

    def embed(self, tokens: list[int], images: dict | None = None) -> list[float]:
        """One input's vector; `images` by hash for the image rows among its tokens (their
        placeholder ids: engine/image_rows.py). The caller has checked 1 <= len(tokens) <=
        n_ctx, and that images come only where the projector is and the last token pools."""
        if not 0 < len(tokens) <= self.n_ctx:
            raise ValueError(f"an input must be 1 to {self.n_ctx} tokens")
        with self.lock:
            if not self.ctx:
                raise DecodeError("the model was unloaded")
            C.llama_memory_clear(C.llama_get_memory(self.ctx), True)
            # an image's rows go as its embeddings, in calls of their own (image_steps.py)
            runs = image_runs(tokens, len(tokens)) if images else [(0, len(tokens), None)]
            for start, stop, h in runs:
                self._decode_run(tokens, start, stop, images[h] if h is not None else None)
            vector = np.ctypeslib.as_array(C.llama_get_embeddings_seq(self.ctx, 0),
                                           shape=(self.n_embd,)).astype(np.float64)
        norm = float(np.linalg.norm(vector))
        return (vector / norm if norm > 0 else vector).tolist()

    def _decode_run(self, tokens: list[int], start: int, stop: int, image) -> None:
        """tokens[start:stop] into the context: text as tokens, an image's rows as the
        projector's embeddings of it (image_steps.image_rows, as a step places them)."""
        if image is None:
            batch = self.batch
            for i in range(stop - start):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tokens[start + i], start + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, 1
            batch.n_tokens = stop - start
        else:
            if self.embd_batch is None:
                self.embd_batch = C.llama_batch_init(self.n_ctx, self.n_embd, 1)
            batch = image_rows(self.embd_batch, self.projector, image, tokens[start:stop],
                               self.n_embd, start, 0, logits=1)
        with attention_for(self.ctx, image):
            failed = self._run(self.ctx, batch) != 0
        clear_upper_state()  # the vector's handling would pay for it (upper_state.py)
        if failed:
            raise DecodeError(f"llama_decode refused an embedding batch of {stop - start} rows")

    @staticmethod
    def _context(model, n_ctx: int, n_threads: int, pooling: int):
        params = C.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
        params.n_seq_max = 1  # one input at a time: MEAN pooling over several misbehaves
        params.embeddings = True
        params.pooling_type = pooling
        params.n_threads = params.n_threads_batch = n_threads
        params.no_perf = True
        ctx = C.llama_init_from_model(model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create the embedding context")
        return ctx

    def close(self) -> None:
        """Waits for an input being embedded: freeing the context (and then the model) under
        a running llama_decode crashes the process."""
        with self.lock:
            if self.ctx:
                C.llama_batch_free(self.batch)
                if self.embd_batch is not None:
                    C.llama_batch_free(self.embd_batch)
                C.llama_free(self.ctx)
                self.ctx = None
