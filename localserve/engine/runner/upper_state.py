"""A `vzeroupper` after each llama_decode, on x86-64 CPUs with AVX.

llama.cpp's CPU kernels leave the upper halves of the vector registers dirty on the thread that
called llama_decode (it computes too). Until something clears them, every legacy SSE
instruction that thread runs pays a transition penalty: llama.cpp's own sampler code (built for
baseline x86-64), the C library's `expf` it calls per vocabulary entry, and CPython's floating
point. Measured on this project's 2-core Xeon VM with a 128,256-token vocabulary
(bench/host.py's model): llama_sampler_sample took 16.7 ms a row right after a decode
and 0.9 ms after a `vzeroupper` (the same logits, the same chain), so a sampled token cost
~20 ms of the engine thread where the decode took ~2 ms.

The instruction is four bytes of machine code (`vzeroupper; ret`) in an executable page,
called through ctypes; it only clears state nothing is using between two calls into C. Where
there is no AVX, no POSIX mmap, or the page cannot be made executable, clear() does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from pathlib import Path

log = logging.getLogger("localserve.llama")

VZEROUPPER_RET = b"\xc5\xf8\x77\xc3"


def _has_avx() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return " avx " in f" {flags.split(':', 1)[-1]} "


def _make_clear():
    """The stub as a ctypes function, or None where it cannot be had."""
    if not _has_avx():
        return None
    try:
        import mmap

        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(VZEROUPPER_RET)
        function = ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    except (ImportError, AttributeError, OSError, ValueError) as exc:
        log.info("vector registers are not cleared after each step (%s)", exc)
        return None
    function.page = page  # the page lives as long as the function
    return function


_CLEAR = _make_clear()


def clear_upper_state() -> None:
    """Clear the vector registers' upper halves on this thread (after llama_decode)."""
    if _CLEAR is not None:
        _CLEAR()
