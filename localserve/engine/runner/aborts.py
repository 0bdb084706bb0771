"""ggml's fatal errors, caught before they end the process.

llama.cpp stops the whole process (GGML_ABORT -> abort()) on errors it cannot return, e.g. an
RPC worker that went away mid-decode. ggml calls an abort callback first; localserve's callback
hands the message to a handler (the engine loop: fail every request, report the failure on
/health) and then parks the calling thread for good instead of returning to abort(). The
context that failed is never used again; the server keeps answering, and says what happened.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Callable

import llama_cpp

log = logging.getLogger("localserve.engine")
_LIB_DIR = Path(llama_cpp.__file__).resolve().parent / "lib"
_CALLBACK_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_handlers: list[Callable[[str], None]] = []
_installed = None  # keeps the ctypes callback alive


def _on_abort(message: bytes) -> None:
    text = message.decode("utf-8", "replace").strip()
    log.error("llama.cpp stopped with a fatal error: %s", text)
    for handler in list(_handlers):
        try:
            handler(text)
        except Exception:  # the thread parks whatever a handler does
            log.exception("while handling llama.cpp's fatal error")
    threading.Event().wait()  # never return: returning means abort()


def loaded_lib(stem: str) -> ctypes.CDLL | None:
    """The ggml library `stem` (e.g. "ggml-base") as libllama loaded it, found by its soname
    (Linux: lib<stem>.so.0, macOS: lib<stem>.0.dylib); libllama itself where ggml is linked
    into it (scripts/build-libllama); else None. Never a second copy: the wheel ships
    lib<stem>.so and lib<stem>.so.0 as two files, and a copy has its own state."""
    for name in (f"lib{stem}.so.0", f"lib{stem}.0.dylib", f"{stem}.dll"):
        for candidate in (name, str(_LIB_DIR / name)):
            try:
                return ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL | getattr(os, "RTLD_NOLOAD", 0))
            except OSError:
                continue
    # One library (scripts/build-libllama) holds ggml, ggml-base and ggml-cpu; never ggml-rpc.
    return llama_cpp.llama_cpp._lib if stem in ("ggml", "ggml-base", "ggml-cpu") else None


def on_fatal_error(handler: Callable[[str], None]) -> Callable[[], None]:
    """Call handler(message) on a ggml fatal error in any thread; returns an undo function."""
    global _installed
    if _installed is None:
        base = loaded_lib("ggml-base")
        if base is not None:
            base.ggml_set_abort_callback.argtypes = [_CALLBACK_TYPE]
            base.ggml_set_abort_callback.restype = ctypes.c_void_p
            _installed = _CALLBACK_TYPE(_on_abort)
            base.ggml_set_abort_callback(_installed)
        else:
            log.warning("ggml's abort callback is unavailable: a fatal llama.cpp error ends the process")
    _handlers.append(handler)
    return lambda: _handlers.remove(handler) if handler in _handlers else None
