"""Images through a model's projector (an "mmproj" file), with llama.cpp's mtmd (issue 70).

An image enters a prompt as a run of placeholder ids, one per image token (engine/image_rows.py).
The scheduler, the prompt cache and prefix reuse treat them as any token: the same image in a
follow-up is the same ids, so its cells are reused or restored instead of encoded again. The
runner decodes those rows from the image's embeddings (ImageInput.embeddings: the vision
encoder's output, computed on the encoder's own thread while the request waits to be admitted,
only where its rows are not already cached: reuse.PrefixBook.place).
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llama_cpp.mtmd_cpp as M
import numpy as np

from localserve.engine.image_rows import ROW_BITS, image_id
from localserve.engine.runner.model_file import _llama_log


@dataclass
class ImageInput:
    """One image ready for the engine: its rows' count and, once encoded, their embeddings.
    Owns mtmd's chunk (freed with it)."""

    h: int
    n_rows: int
    chunk: int  # mtmd_input_chunk*, a copy this object owns
    non_causal: bool
    embeddings: np.ndarray | None = None  # written once, by the encoder (Projector.encode)
    failed: str | None = None  # why the encoder could not make them
    queued: bool = False  # handed to the encoder's thread (Projector.encode_later)

    @property
    def ready(self) -> bool:
        """Its rows can be placed, or refused with `failed`: admission waits for this."""
        return self.embeddings is not None or self.failed is not None

    def __del__(self):
        if self.chunk:
            M.mtmd_input_chunk_free(self.chunk)
            self.chunk = 0


class Projector:
    """The mtmd context of a model's projector, for one text model."""

    def __init__(self, path: str, model, n_threads: int, use_gpu: bool):
        M.mtmd_log_set(_llama_log, ctypes.c_void_p(0))  # warnings and errors only, as llama's
        M.mtmd_helper_log_set(_llama_log, ctypes.c_void_p(0))
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False
        self.ctx = M.mtmd_init_from_file(path.encode(), model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not load the projector {path} for this model "
                               f"(a projector made for another model, or not a projector)")
        if not M.mtmd_support_vision(self.ctx):
            M.mtmd_free(self.ctx)
            raise RuntimeError(f"the projector {path} reads no images (an audio projector?)")
        if M.mtmd_decode_use_mrope(self.ctx):
            M.mtmd_free(self.ctx)
            raise RuntimeError(f"the projector {path} places images in 2-D positions (M-RoPE: "
                               "Qwen2-VL and its kin), which localserve does not serve yet")
        self.path = path
        self._prepare_lock = threading.Lock()  # one image preprocessed at a time
        self._encode_lock = threading.Lock()  # one forward pass at a time: one output buffer
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="image-encode")

    def prepare(self, rgb: bytes, width: int, height: int,
                digest: bytes) -> tuple[list[int], dict[int, ImageInput]]:
        """An image (RGB bytes, decoded and bounded by the API) as prompt ids: the text mtmd
        puts around it (e.g. <start_of_image>) and its rows' placeholder ids; and its
        ImageInputs by hash. Any thread: mtmd resizes and normalises here, off the engine
        thread."""
        data = (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb)
        bitmap = M.mtmd_bitmap_init(width, height, data)
        if not bitmap:
            raise ValueError("the image could not be handed to the projector")
        chunks = M.mtmd_input_chunks_init()
        try:
            M.mtmd_bitmap_set_id(bitmap, digest.hex().encode())
            part = M.mtmd_input_part(text=None, bitmap=bitmap)
            parts = (ctypes.POINTER(M.mtmd_input_part) * 1)(ctypes.pointer(part))
            with self._prepare_lock:
                failed = M.mtmd_tokenize_from_parts(self.ctx, chunks, parts, 1, False)
            if failed:
                raise ValueError("the projector could not preprocess the image")
            tokens: list[int] = []
            inputs: dict[int, ImageInput] = {}
            for i in range(M.mtmd_input_chunks_size(chunks)):  # an image in tiles: several
                piece = self._piece(M.mtmd_input_chunks_get(chunks, i), digest + bytes([i % 256]))
                if isinstance(piece, ImageInput):
                    inputs[piece.h] = piece
                    tokens += [image_id(piece.h, row, piece.non_causal)
                               for row in range(piece.n_rows)]
                else:
                    tokens += piece
            return tokens, inputs
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    def _piece(self, chunk, digest: bytes):
        if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            ids = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            return list(ids[:n.value])
        n_rows = M.mtmd_input_chunk_get_n_tokens(chunk)
        if M.mtmd_input_chunk_get_type(chunk) != M.MTMD_INPUT_CHUNK_TYPE_IMAGE \
                or n_rows >= 1 << ROW_BITS:
            raise ValueError("the projector made a piece this server cannot place")
        h = int.from_bytes(hashlib.sha256(digest + self.path.encode()).digest()[:6], "big")
        return ImageInput(h, n_rows, M.mtmd_input_chunk_copy(chunk),
                          bool(M.mtmd_decode_use_non_causal(self.ctx, chunk)))

    def encode_later(self, image: ImageInput, n_embd: int) -> None:
        """Encode the image on the encoder's own thread, once, in the order asked (the engine
        loop asks as admission reaches each request: scheduler order, the key shares'), beside
        the engine's steps: its request waits in the queue until `ready`."""
        if not image.queued:
            image.queued = True
            self._encoder.submit(self._encode_or_fail, image, n_embd)

    def _encode_or_fail(self, image: ImageInput, n_embd: int) -> None:
        try:
            self.encode(image, n_embd)
        except Exception as exc:  # its request alone ends, when a step reaches the image
            image.failed = str(exc)

    def encode(self, image: ImageInput, n_embd: int) -> np.ndarray:
        """The image's embeddings (n_rows x n_embd), computed once: the vision encoder's
        forward pass, on the encoder's thread (encode_later) before the request is admitted;
        the engine thread computes them only for an image no one asked for ahead."""
        with self._encode_lock:
            if image.embeddings is None:
                if M.mtmd_encode_chunk(self.ctx, image.chunk) != 0:
                    raise ValueError("the projector failed to encode an image")
                out = M.mtmd_get_output_embd(self.ctx)
                image.embeddings = np.ctypeslib.as_array(
                    out, shape=(image.n_rows * n_embd,)).reshape(image.n_rows, n_embd).copy()
        return image.embeddings

    def close(self) -> None:
        self._encoder.shutdown(wait=True, cancel_futures=True)
        if self.ctx:
            M.mtmd_free(self.ctx)
            self.ctx = None
