"""llama.cpp set-up and facts read from a GGUF without loading it: the log hook (llama.cpp's
chatter out of the console, its warnings passed on), GPU support, the cache types as
llama-server spells them, the memory a model and its cache will take, load progress."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import threading
from collections import Counter

import llama_cpp as C

from localserve.engine.plan import PHYSICAL_BATCH

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
# What llama.cpp reports to a thread that sizes a model's caches (memory_needs): its callback
# runs on the thread that called it, so another model's load beside it is not read.
_PROBE = threading.local()


@C.llama_log_callback
def _llama_log(level, text, _user_data):
    """Keep llama.cpp's chatter out of the console; pass on its warnings and errors, except
    those the engine expects (an interrupted step: runner/interrupt.py); count the
    tensors the loader placed by an override; keep what a cache-sizing thread is told."""
    message = text.decode("utf-8", "replace").rstrip() if text else ""
    if getattr(_PROBE, "lines", None) is not None:  # the real load says it again
        _PROBE.lines.append(message)
        return
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


def memory_needs(model_path: str, ctx_size: int = 0, type_k: str = "f16", type_v: str = "f16",
                 n_seq: int = 1, swa_full: bool = False, n_batch: int = 512,
                 kv_unified: bool = True, draft_rollback: int = 0) -> dict:
    """Bytes the model and its caches will take at ctx_size tokens (0: its trained context)
    for n_seq sequences, asked of llama.cpp as llama-server's --fit asks it: the model's
    tensors described without their data (no_alloc) and a context of these settings
    simulated, its caches' sizes read from what it reports (_cache_sizes). So every memory
    kind is counted as llama.cpp will allocate it, whatever its family's rules: layers that
    keep every position grow with the context (kv_bytes_per_token); a window layer's cells
    and a recurrent state per sequence do not (kv_fixed_bytes). A file llama.cpp cannot
    describe (damaged, truncated, an unknown architecture) raises RuntimeError."""
    _quiet_llama()
    params = C.llama_model_default_params()
    params.no_alloc = True
    params.load_mode = C.LLAMA_LOAD_MODE_NONE  # nothing mapped: only the header is read
    params.n_gpu_layers = 0  # the sizes are the same wherever the layers go
    _PROBE.lines = []
    try:
        model = C.llama_model_load_from_file(model_path.encode(), params)
        if not model:
            said = [line for line in _PROBE.lines if "error" in line or "failed" in line]
            raise RuntimeError(f"llama.cpp could not read {model_path}"
                               + (f" ({said[-1].strip()})" if said else ""))
        try:
            n_ctx_train = C.llama_model_n_ctx_train(model)
            cells = _simulate_context(model, ctx_size or n_ctx_train or 4096, n_seq, n_batch,
                                      type_k, type_v, swa_full, kv_unified,
                                      rollback_states(memory_kind(model, swa_full),
                                                      draft_rollback))
        finally:
            C.llama_model_free(model)
        per_token, fixed, f16_per_token = _cache_sizes(_PROBE.lines, cells)
    finally:
        del _PROBE.lines
    return {"model_bytes": os.path.getsize(model_path),
            "kv_bytes": round(per_token * (ctx_size or cells)) + fixed,
            "kv_bytes_per_token": round(per_token), "kv_fixed_bytes": fixed,
            "f16_bytes_per_token": round(f16_per_token), "n_ctx_train": n_ctx_train,
            "ctx_size": ctx_size or cells}  # the context kv_bytes counts


def context_params(n_ctx: int, n_seq: int, n_batch: int, type_k: str, type_v: str,
                   swa_full: bool, kv_unified: bool = True, rollback: int = 0):
    """The context's memory settings, one function for the runner's context (core.py) and the
    one memory_needs simulates, so the estimate cannot drift from the load: one pool of n_ctx
    cells for n_seq sequences (the scheduler keeps each slot's guarantee), or without
    kv_unified a stream of n_ctx / n_seq cells for each, window layers keeping only their
    window unless swa_full, and the physical batch (a window layer holds it beside each
    sequence's window), and a recurrent state's `rollback` earlier states per sequence
    (rollback_states)."""
    cparams = C.llama_context_default_params()
    cparams.n_ctx, cparams.n_seq_max = n_ctx, n_seq
    cparams.n_batch, cparams.n_ubatch = n_batch, min(n_batch, PHYSICAL_BATCH)
    cparams.kv_unified = kv_unified
    cparams.swa_full = swa_full
    cparams.n_rs_seq = rollback
    cparams.type_k, cparams.type_v = CACHE_TYPES[type_k][0], CACHE_TYPES[type_v][0]
    return cparams


def rollback_states(kind: str, drafts: int) -> int:
    """How many earlier states per sequence to ask llama.cpp to keep beside a recurrent state
    (n_rs_seq), so that a step's `drafts` rejected rows can be taken out again: that many on a
    hybrid or recurrent model (memory_kind), none elsewhere (an attention cache cuts back to any
    position). llama.cpp grants them only to the families whose layers write them (Qwen3.5,
    Nemotron-H, LFM2, ...: llm_arch_supports_rs_rollback) and 0 to the others."""
    return drafts if kind in ("hybrid", "recurrent") else 0


def memory_kind(model, swa_full: bool = False) -> str:
    """What a sequence's cache holds: 'attention' (every position's keys and values: it can be
    cut back to any prefix; window layers too with `swa_full`), 'sliding-window' (window
    layers keep their last cells only), 'hybrid' or 'recurrent' (a state that holds no earlier
    position)."""
    if C.llama_model_is_hybrid(model):
        return "hybrid"
    if C.llama_model_is_recurrent(model):
        return "recurrent"
    return "sliding-window" if C.llama_model_n_swa(model) and not swa_full else "attention"


def _simulate_context(model, *settings) -> int:
    """Create and free a context of these settings (context_params) on a model loaded without
    data: llama.cpp reports its caches' sizes and allocates nothing. Its cells."""
    ctx = C.llama_init_from_model(model, context_params(*settings))
    if not ctx:
        raise RuntimeError(f"llama.cpp could not size a context of {settings[0]} tokens")
    try:
        return C.llama_n_ctx(ctx)
    finally:
        C.llama_free(ctx)


# What llama.cpp says of each cache it creates (llama-kv-cache.cpp, llama-memory-recurrent.cpp).
_CACHE_SIZE = re.compile(r"^(llama_kv_cache|llama_memory_recurrent): size = +([\d.]+) MiB "
                         r"\( *(\d+) cells")
_STREAMS = re.compile(r"\d+/(\d+) seqs")  # sequences / streams (one per sequence: not unified)
_KV_PARTS = re.compile(r"K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB")
_MIB = 1024 ** 2


def _cache_sizes(lines: list[str], cells: int) -> tuple[float, int, float]:
    """From a context's creation report: bytes per token of the caches as long as the context
    (layers that keep every position), bytes of the others (a sliding window's cells, for
    every sequence, and recurrent states), and the first again were K and V f16. Without a
    unified cache llama.cpp reports one stream's cells and every stream's bytes."""
    per_token = f16_per_token = 0.0
    fixed = 0
    for line in lines:
        size = _CACHE_SIZE.match(line)
        if not size:
            continue
        streams = _STREAMS.search(line)  # a line's cells are one stream's
        n_bytes, n_cells = float(size[2]) * _MIB, int(size[3]) * (int(streams[1]) if streams else 1)
        if size[1] != "llama_kv_cache" or n_cells < cells:
            fixed += round(n_bytes)
            continue
        per_token += n_bytes / n_cells
        k_type, k_mib, v_type, v_mib = _KV_PARTS.search(line).groups()
        f16_per_token += sum(float(mib) * _MIB * 2 / CACHE_TYPES.get(kind, (0, 2.0))[1]
                             for kind, mib in ((k_type, k_mib), (v_type, v_mib))) / n_cells
    return per_token, fixed, f16_per_token


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
