"""A sequence's cache state out of and back into the context (llama_state_seq_get/set_data):
what the prompt cache keeps in RAM. The state holds the sequence's KV cells (about 23 KB per
token for the embedded model), copied in milliseconds where recomputing takes a second."""

from __future__ import annotations

import ctypes
import hashlib
import os

import llama_cpp as C


def read_sequence(ctx, seq_id: int) -> tuple[ctypes.Array, int]:
    """(buffer, bytes written); 0 bytes when llama.cpp could not serialize it."""
    size = C.llama_state_seq_get_size(ctx, seq_id)
    buffer = (ctypes.c_uint8 * size)()
    written = C.llama_state_seq_get_data(ctx, buffer, size, seq_id)
    return buffer, written


def write_sequence(ctx, seq_id: int, state: ctypes.Array | bytes, size: int) -> bool:
    """Load a state read by read_sequence (or its bytes, read back from a file) into `seq_id`
    (which must be empty)."""
    if isinstance(state, bytes):
        state = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    return C.llama_state_seq_set_data(ctx, state, size, seq_id) > 0


def state_fingerprint(model_path: str, type_k: str, type_v: str) -> str:
    """What a saved state is only valid for: this model file (its size and the hash of its
    first and last MiB: cheap for a 40 GB file), the cache types and this llama.cpp."""
    digest = hashlib.sha256()
    with open(model_path, "rb") as fh:
        digest.update(fh.read(1 << 20))
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - (1 << 20)))
        digest.update(fh.read())
    return f"{digest.hexdigest()[:32]}-{size}-{type_k}-{type_v}-llama.cpp{C.__version__}"
