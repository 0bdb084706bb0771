"""A sequence's cache state out of and back into the context (llama_state_seq_get/set_data):
what the prompt cache keeps in RAM. The state holds the sequence's KV cells (about 23 KB per
token for the embedded model), copied in milliseconds where recomputing takes a second."""

from __future__ import annotations

import ctypes

import llama_cpp as C


def read_sequence(ctx, seq_id: int) -> tuple[ctypes.Array, int]:
    """(buffer, bytes written); 0 bytes when llama.cpp could not serialize it."""
    size = C.llama_state_seq_get_size(ctx, seq_id)
    buffer = (ctypes.c_uint8 * size)()
    written = C.llama_state_seq_get_data(ctx, buffer, size, seq_id)
    return buffer, written


def write_sequence(ctx, seq_id: int, buffer: ctypes.Array, size: int) -> bool:
    """Load a state read by read_sequence into `seq_id` (which must be empty)."""
    return C.llama_state_seq_set_data(ctx, buffer, size, seq_id) > 0
