"""Stopping a step midway, so that a chat that arrives never waits for a step of background
tasks (engine/loop.py decides when).

llama.cpp's CPU backend asks the context's abort callback after every node of the graph; when
it answers true, llama_decode returns 2 and removes the cells of the ubatch it was computing.
The callback is not Python: a ctypes callback would take the GIL some 700 times a step, and wait
for it whenever the HTTP thread holds it. It is libc's strlen, reading a two-byte flag: b"\\0\\0"
gives 0 (go on), b"\\1\\0" gives 1, returned in the register that carries a C bool (stop).
Raising the flag is a one-byte write, safe from any thread. Backends that never ask (CUDA,
Metal) finish the step, which is where things stood without this.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp as C

log = logging.getLogger("localserve.engine")
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)


class StepInterrupt:
    def __init__(self, ctx):
        self._flag = ctypes.create_string_buffer(2)
        try:
            strlen = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
        except (OSError, AttributeError, TypeError):  # no C library to borrow it from (Windows)
            log.info("steps of background tasks cannot be interrupted on this platform")
            return
        self._callback = ctypes.cast(strlen, _CALLBACK)  # kept alive with the context
        C.llama_set_abort_callback(ctx, self._callback, ctypes.cast(self._flag, ctypes.c_void_p))

    def request(self) -> None:
        """Any thread: the decode in flight stops at its next graph node."""
        self._flag[0] = b"\x01"

    def clear(self) -> None:
        self._flag[0] = b"\x00"
