"""A GGUF file's string metadata, read without llama.cpp: what the bench needs to give
llama-server the chat template localserve uses where the file carries none (each server
then falls back to a different one, and the two would answer different prompts)."""

from __future__ import annotations

import struct
from pathlib import Path

from localserve.models.chat_template import fallback_for

# GGUF value types: sizes of the fixed-width ones; 8 is a string, 9 an array.
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


def string_metadata(path: str | Path) -> dict[str, str]:
    """Every string-valued key of the file's header (arrays and numbers are skipped)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _version, _tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        found = {}
        for _ in range(n_kv):
            key = _string(f)
            kind, = struct.unpack("<I", f.read(4))
            if kind == STRING:
                found[key] = _string(f)
            else:
                _skip(f, kind)
        return found


def template_for_peer(path: str | Path) -> str | None:
    """The built-in template localserve falls back to for this file, or None where the file
    has a template of its own (both servers use that)."""
    meta = string_metadata(path)
    if meta.get("tokenizer.chat_template"):
        return None
    return fallback_for(meta.get("general.architecture"))[1]


def _string(f) -> str:
    n, = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", "replace")


def _skip(f, kind: int) -> None:
    if kind in FIXED:
        f.seek(FIXED[kind], 1)
    elif kind == STRING:
        n, = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif kind == ARRAY:
        item, n = struct.unpack("<IQ", f.read(12))
        if item in FIXED:
            f.seek(FIXED[item] * n, 1)
        else:
            for _ in range(n):
                _skip(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")
