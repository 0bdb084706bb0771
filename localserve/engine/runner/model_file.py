"""llama.cpp set-up and facts read from a GGUF without loading it: the log hook (llama.cpp's
chatter out of the console, its warnings passed on), GPU support, the cache types as
llama-server spells them, the memory a model and its cache will take, load progress."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections import Counter

import llama_cpp as C

log = logging.getLogger("localserve.llama")

_LOG_LEVEL_WARN = 3  # ggml_log_level: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 cont


# What llama.cpp says that the engine expects: a step interrupted (the graph stopped, ggml
# status 1: aborted, twice; the stopped ubatch's cells removed; llama_decode's return code 2),
# and the hint that tensor overrides to CPU go with a --load-mode localserve does not have.
_EXPECTED = ("failed with error 1", "compute status: 1", "removing memory module entries",
             "ret = 2", "tensor overrides to CPU are used with mmap")


# Tensors the loader placed by a tensor override, per buffer type (placement.py): counted from
# its log, reset before each load.
OVERRIDDEN: Counter = Counter()


@C.llama_log_callback
def _llama_log(level, text, _user_data):
    """Keep llama.cpp's chatter out of the console; pass on its warnings and errors, except
    those the engine expects (an interrupted step: runner/interrupt.py); count the
    tensors the loader placed by an override."""
    message = text.decode("utf-8", "replace").rstrip() if text else ""
    if " buffer type overridden to " in message:
        OVERRIDDEN[message.rsplit(" ", 1)[-1]] += 1
    if level in (_LOG_LEVEL_WARN, _LOG_LEVEL_WARN + 1) and message \
            and not any(part in message for part in _EXPECTED):
        log.warning(message)


def supports_gpu_offload() -> bool:
    """True when this llama.cpp build has a GPU backend (CUDA, Metal, ...). An RPC build says
    it can offload even on a CPU-only machine (to workers): there only a local GPU device
    counts, so step sizes and the memory check stay those of a CPU."""
    if not C.llama_supports_gpu_offload():
        return False
    if not C.llama_supports_rpc():
        return True
    from localserve.engine.runner.rpc import has_local_gpu

    return has_local_gpu()


# Cache types as llama-server spells them: ggml type and bytes per element (blocks of 32).
CACHE_TYPES = {"f16": (C.GGML_TYPE_F16, 2.0), "q8_0": (C.GGML_TYPE_Q8_0, 34 / 32),
               "q4_0": (C.GGML_TYPE_Q4_0, 18 / 32)}
FLASH_ATTN = {"on": C.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": C.LLAMA_FLASH_ATTN_TYPE_DISABLED,
              "auto": C.LLAMA_FLASH_ATTN_TYPE_AUTO}


def memory_needs(model_path: str, ctx_size: int, type_k: str = "f16", type_v: str = "f16") -> dict:
    """Bytes the model and a cache of ctx_size tokens (of these K and V types) will take, read
    from the GGUF's hyper-parameters without loading the weights (a vocab-only load)."""
    _quiet_llama()
    params = C.llama_model_default_params()
    params.vocab_only = True
    model = C.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not read {model_path}")
    try:
        def meta_int(key: str, default: int) -> int:
            buf = ctypes.create_string_buffer(64)
            n = C.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
            try:
                return int(buf.value) if n >= 0 else default
            except ValueError:  # a per-layer array: take the largest entry's worth
                return default

        arch = ctypes.create_string_buffer(64)
        C.llama_model_meta_val_str(model, b"general.architecture", arch, len(arch))
        a = arch.value.decode()
        n_layer = meta_int(f"{a}.block_count", 32)
        n_head = max(meta_int(f"{a}.attention.head_count", 32), 1)
        n_head_kv = meta_int(f"{a}.attention.head_count_kv", n_head)
        head_dim = meta_int(f"{a}.attention.key_length", meta_int(f"{a}.embedding_length", 4096) // n_head)
        elements = n_layer * n_head_kv * head_dim  # per token, for K and again for V
        kv_per_token = int(elements * (CACHE_TYPES[type_k][1] + CACHE_TYPES[type_v][1]))
        f16_per_token = elements * 4
        n_ctx_train = meta_int(f"{a}.context_length", 0)
    finally:
        C.llama_model_free(model)
    return {"model_bytes": os.path.getsize(model_path), "kv_bytes": kv_per_token * ctx_size,
            "kv_bytes_per_token": kv_per_token, "f16_bytes_per_token": f16_per_token,
            "n_ctx_train": n_ctx_train}


_PROGRESS = {"last": -1}


def load_progress() -> float:
    """The current (or last) model load's progress, 0 to 1 (loads happen one at a time)."""
    return max(_PROGRESS["last"], 0) / 100


def reset_load_progress() -> None:
    _PROGRESS["last"] = -1


@ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_float, ctypes.c_void_p)
def _load_progress(progress, _user_data):
    """llama.cpp's load progress, drawn as a bar on a terminal (every 5%)."""
    pct = int(progress * 100)
    if pct // 5 != _PROGRESS["last"] // 5 and sys.stderr.isatty():
        bar = "#" * (pct // 4)
        print(f"\rloading model [{bar:<25}] {pct:3d}%", end="\n" if pct >= 100 else "",
              file=sys.stderr, flush=True)
    _PROGRESS["last"] = pct
    return True


def _quiet_llama() -> None:
    C.llama_log_set(_llama_log, ctypes.c_void_p(0))
    C.llama_backend_init()
