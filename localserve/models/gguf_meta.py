"""A GGUF file's header, read without llama.cpp: its string metadata (what the bench needs to
give llama-server the chat template localserve uses where the file carries none: each server
then falls back to a different one, and the two would answer different prompts), and its
tensors' sizes and shape numbers (what fitting it to GPU memory needs, fit.py)."""

from __future__ import annotations

import struct
from pathlib import Path

from localserve.models.chat_template import fallback_for

# GGUF value types: sizes of the fixed-width ones; 8 is a string, 9 an array.
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
NUMBERS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def string_metadata(path: str | Path) -> dict[str, str]:
    """Every string-valued key of the file's header (arrays and numbers are left out)."""
    with open(path, "rb") as f:
        _n_tensors, meta = _metadata(f, path)
    return {key: value for key, value in meta.items() if isinstance(value, str)}


def model_size(path: str | Path) -> dict:
    """Bytes of each repeating layer's weights (`layers`; `experts`: of which its mixture of
    experts' weights), of the output layer (`output`: the
    token embeddings again where the file ties them), of the token embeddings (`embeddings`,
    kept in host memory by llama.cpp), and the numbers a compute buffer grows with."""
    with open(path, "rb") as f:
        n_tensors, meta = _metadata(f, path)
        offsets = {}
        for _ in range(n_tensors):
            name = _string(f)
            n_dims, = struct.unpack("<I", f.read(4))
            f.seek(8 * n_dims + 4, 1)  # dimensions, type
            offsets[name], = struct.unpack("<Q", f.read(8))
        align = int(meta.get("general.alignment", 32))
        data_start = -(-f.tell() // align) * align
    ends = sorted(offsets.values()) + [Path(path).stat().st_size - data_start]
    size = {name: ends[ends.index(at) + 1] - at for name, at in offsets.items()}
    arch = meta.get("general.architecture", "")
    n_layer = int(meta.get(f"{arch}.block_count", 0))
    layers = [sum(b for n, b in size.items() if n.startswith(f"blk.{i}.")) for i in range(n_layer)]
    embeddings = size.get("token_embd.weight", 0)
    experts = [sum(b for n, b in size.items() if n.startswith(f"blk.{i}.") and "_exps" in n)
               for i in range(n_layer)]
    return {"layers": layers, "embeddings": embeddings, "experts": experts,
            "output": sum(b for n, b in size.items() if n.startswith("output")) + (
                0 if "output.weight" in size else embeddings),
            "n_embd": int(meta.get(f"{arch}.embedding_length", 0)),
            "n_vocab": int(meta.get("tokenizer.ggml.tokens", 0))}


def template_for_peer(path: str | Path) -> str | None:
    """The built-in template localserve falls back to for this file, or None where the file
    has a template of its own (both servers use that)."""
    meta = string_metadata(path)
    if meta.get("tokenizer.chat_template"):
        return None
    return fallback_for(meta.get("general.architecture"))[1]


def _metadata(f, path: str | Path) -> tuple[int, dict]:
    """The header's tensor count and every key's value (_value), `f` left at the tensors."""
    if f.read(4) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    _version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
    meta = {}
    for _ in range(n_kv):
        key = _string(f)
        kind, = struct.unpack("<I", f.read(4))
        meta[key] = _value(f, kind)
    return n_tensors, meta


def _string(f) -> str:
    n, = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", "replace")


def _value(f, kind: int):
    """A number or string as it is; an array as its length (the vocabulary's size)."""
    if kind == STRING:
        return _string(f)
    if kind == ARRAY:
        item, n = struct.unpack("<IQ", f.read(12))
        _skip_items(f, item, n)
        return n
    if kind not in NUMBERS:
        raise ValueError(f"unknown GGUF value type {kind}")
    return struct.unpack("<" + NUMBERS[kind], f.read(FIXED[kind]))[0]


def _skip(f, kind: int) -> None:
    if kind in FIXED:
        f.seek(FIXED[kind], 1)
    elif kind == STRING:
        n, = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif kind == ARRAY:
        _skip_items(f, *struct.unpack("<IQ", f.read(12)))
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def _skip_items(f, item: int, n: int) -> None:
    if item in FIXED:
        f.seek(FIXED[item] * n, 1)
    else:
        for _ in range(n):
            _skip(f, item)
