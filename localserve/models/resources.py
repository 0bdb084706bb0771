"""Before loading: will the model and its cache fit in free memory? Refuse clearly if not,
rather than let the machine swap or the process be killed mid-load."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace

import psutil

from localserve.common.config import Settings, SettingsError
from localserve.engine.drafts import ROLLBACK_DRAFTS
from localserve.models.fit import (FIT_MIN_CTX, PROJECTOR_COMPUTE, Device, FitError, ModelSize,
                                   fit)
from localserve.models.model_specs import find_model
from localserve.models.gguf_meta import model_size

GIB = 1024 ** 3
# llama.cpp's compute buffers, the Python process and the HTTP side: a fixed allowance.
OVERHEAD_BYTES = 512 * 1024 ** 2


# With -c unset, the pool is the model's trained context, fitted to free memory with this
# margin left over, and never under FIT_MIN_CTX unless the model is smaller (llama-server's
# --fit and --fit-ctx; on GPUs, fit.py).
FIT_MARGIN_BYTES = GIB


@dataclass(frozen=True)
class ContextChoice:
    """The cache pool's size and why: what the start-up log and /props say."""

    ctx_size: int
    n_ctx_train: int  # the model's trained context (0: the file does not say)
    kv_bytes_per_token: int  # layers that keep every position
    why: str
    n_gpu_layers: int | None = None  # fitted to GPU memory (fit.py); None: as -ngl says
    n_cpu_moe: int = 0  # the first layers whose experts stay in host memory (fit.py, flags)
    gpu_bytes: tuple[tuple[str, int, int], ...] = ()  # each device: name, needed, free
    kv_fixed_bytes: int = 0  # window layers' cells and recurrent states: not per token
    # llama.cpp's figures at ctx_size (cache_needs), where they were asked at it: reading the
    # file's header for them costs 0.1 s on a small model, 0.5-0.8 s on Gemma 3's vocabulary
    needs: dict | None = field(default=None, compare=False, repr=False)

    def as_json(self) -> dict:
        return {"ctx_size": self.ctx_size, "n_ctx_train": self.n_ctx_train,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_fixed_bytes": self.kv_fixed_bytes, "why": self.why,
                "n_gpu_layers": self.n_gpu_layers, "n_cpu_moe": self.n_cpu_moe,
                "devices": [{"name": n, "needed_bytes": need, "free_bytes": free}
                            for n, need, free in self.gpu_bytes]}


def choose_context(settings: Settings, model_path: str, gpu_offload: bool) -> ContextChoice:
    """With layers on GPUs, fitted to their memory (fit.py, llama-server's --fit). Else -c as
    given; with -c 0 (the default) the model's trained context, bounded by the RAM free now
    less the weights, the caches that do not grow with the context and FIT_MARGIN_BYTES,
    rounded down to 256 and never under FIT_MIN_CTX (or the trained context). The figures
    asked for it come with the choice where its context is the one they were asked at."""
    needs = cache_needs(settings, model_path, settings.ctx_size, gpu_offload)
    chosen = _choose(settings, model_path, gpu_offload, needs)
    return replace(chosen, needs=needs) if chosen.ctx_size == needs["ctx_size"] else chosen


def needs_at(settings: Settings, model_path: str, context: ContextChoice,
             gpu_offload: bool) -> dict:
    """cache_needs at the chosen context: the ones the choice carries, else asked."""
    if context.needs is not None:
        return context.needs
    return cache_needs(settings, model_path, context.ctx_size, gpu_offload)


def _choose(settings: Settings, model_path: str, gpu_offload: bool, needs: dict) -> ContextChoice:
    trained, per_token = needs["n_ctx_train"], max(needs["kv_bytes_per_token"], 1)
    fixed = needs["kv_fixed_bytes"]
    on_gpu = gpu_offload and settings.n_gpu_layers != 0
    fitted = fit_to_gpus(settings, model_path, trained, per_token, fixed) if on_gpu else None
    if fitted is not None:
        return fitted
    choice = functools.partial(ContextChoice, n_ctx_train=trained, kv_bytes_per_token=per_token,
                               kv_fixed_bytes=fixed)
    if settings.ctx_size:
        return choice(settings.ctx_size, why=f"-c {settings.ctx_size}")
    wanted = trained or FIT_MIN_CTX
    if on_gpu:
        return choice(wanted, why=f"the model's trained context ({wanted} tokens); GPU memory "
                      f"is not checked")
    free = psutil.virtual_memory().available
    room = free - OVERHEAD_BYTES - FIT_MARGIN_BYTES - needs["model_bytes"] - fixed
    fitting = max(0, room // per_token) // 256 * 256
    if fitting >= wanted:
        return choice(wanted, why=f"the model's trained context ({wanted} tokens, "
                      f"{(wanted * per_token + fixed) / GIB:.2f} GiB of cache)")
    ctx = max(fitting, min(FIT_MIN_CTX, wanted))
    more = (wanted - ctx) * per_token
    return choice(ctx, why=f"fitted to free memory ({free / GIB:.1f} GiB free): the model's "
                  f"trained {wanted} tokens would need {more / GIB:.2f} GiB more")


def rollback_drafts(settings: Settings) -> int:
    """Drafts asked for where the cache cannot be cut back (a hybrid's earlier states llama.cpp
    keeps for them; engine/drafts.py): only when --spec ngram is. A drafted step computes its
    rows in one batch, which llama.cpp's kernels sum in another order than a row alone: on
    these models greedy text then parts from llama-server's (docs/flags.md), so `auto` keeps
    them undrafted, and a hybrid without the states' memory."""
    return ROLLBACK_DRAFTS if settings.spec == "ngram" else 0


def cache_needs(settings: Settings, model_path: str, ctx_size: int, gpu_offload: bool) -> dict:
    """runner.memory_needs for the context the runner will make (core.py): a sequence per
    slot, in one pool or a stream each, the window layers' rule, the physical batch (a window
    layer holds it beside each sequence's window). A file llama.cpp cannot read stops the
    start."""
    from localserve.engine.runner import memory_needs

    try:
        return memory_needs(model_path, ctx_size, settings.cache_type_k, settings.cache_type_v,
                            n_seq=settings.parallel, swa_full=settings.swa_full,
                            n_batch=settings.prefill_token_budget(gpu_offload),
                            kv_unified=settings.kv_unified,
                            draft_rollback=rollback_drafts(settings))
    except RuntimeError as exc:
        raise SettingsError(f"-m {model_path}: {exc} (a damaged or truncated file?)") from None


def fit_to_gpus(settings: Settings, model_path: str, trained: int, per_token: int,
                fixed: int = 0) -> ContextChoice | None:
    """The context and layers that fit the GPUs llama.cpp sees; None where it sees none (or
    the file's tensors cannot be read: then nothing is checked, as before). A -c or -ngl that
    does not fit stops the start with the numbers, unless --no-memory-check."""
    from localserve.engine.runner import offload_devices

    devices = [Device(d["name"], d["free"], d["unified"]) for d in offload_devices()]
    try:
        size = model_size(model_path) if devices else None
    except (ValueError, OSError):
        size = None
    if size is None:
        return None
    shape = ModelSize(tuple(size["layers"]), size["output"], size["embeddings"], per_token,
                      trained, size["n_vocab"], size["n_embd"], projector_bytes(settings),
                      tuple(size["experts"]), fixed)
    moe = len(shape.layers) if settings.cpu_moe else settings.n_cpu_moe or None
    try:
        chosen = fit(shape, devices, settings.ctx_size, settings.n_gpu_layers,
                     settings.tensor_split, moe)
    except FitError as exc:
        if settings.memory_check:
            raise SettingsError(f"{exc} (--no-memory-check loads it anyway)") from None
        return ContextChoice(settings.ctx_size or trained or FIT_MIN_CTX, trained, per_token,
                             f"as given, not checked (--no-memory-check): {exc}",
                             kv_fixed_bytes=fixed)
    room = tuple((d.name, n, d.free) for d, n in zip(devices, chosen.needs))
    return ContextChoice(chosen.ctx_size, trained, per_token, chosen.why, chosen.n_gpu_layers,
                         chosen.n_cpu_moe, room, fixed)


def projector_bytes(settings: Settings) -> int:
    """What an image projector takes on the GPU: its file's weights and an encoder's compute
    buffer (0 without one)."""
    if not settings.mmproj:
        return 0
    return os.path.getsize(find_model(settings.mmproj, "--mmproj")) + PROJECTOR_COMPUTE


def check_memory(settings: Settings, model_path: str, gpu_offload: bool,
                 context: ContextChoice) -> str:
    """Raise SettingsError with the numbers and a suggestion when RAM is short; else return a
    one-line summary for the start-up log. With layers on a GPU only the host share is
    checked here (the GPUs' was, by fit_to_gpus, where llama.cpp sees them)."""
    ctx_size = context.ctx_size
    needs = needs_at(settings, model_path, context, gpu_offload)
    on_gpu = gpu_offload and settings.n_gpu_layers != 0
    host_bytes = OVERHEAD_BYTES + (0 if on_gpu else needs["model_bytes"] + needs["kv_bytes"])
    free = psutil.virtual_memory().available
    fixed = needs["kv_fixed_bytes"]  # window layers' cells, recurrent states
    summary = (f"memory: model {needs['model_bytes'] / GIB:.2f} GiB + cache "
               f"{needs['kv_bytes'] / GIB:.2f} GiB for -c {ctx_size}"
               + (f" ({fixed / 1024 ** 2:.1f} MiB of it whatever -c: windows and recurrent "
                  f"states)" if fixed else "")
               + f"{_on_gpus(context) if on_gpu else ''}; {free / GIB:.1f} GiB free")
    if (settings.cache_type_k, settings.cache_type_v) != ("f16", "f16"):
        gain = needs["f16_bytes_per_token"] / max(needs["kv_bytes_per_token"], 1)
        summary += (f"; cache K {settings.cache_type_k} / V {settings.cache_type_v}: "
                    f"{gain:.2f}x the tokens an f16 cache fits in the same memory")
    if settings.cache_ram:  # filled only as slots are overwritten, and never past this
        ram_tier = min(settings.cache_ram * 1024 ** 2, free // 4)
        summary += f"; prompt cache in RAM up to {ram_tier / GIB:.2f} GiB (--cache-ram)"
    if host_bytes <= free:
        return summary
    room = free - OVERHEAD_BYTES - needs["model_bytes"] - needs["kv_fixed_bytes"]
    fitting = max(0, int(room / max(needs["kv_bytes_per_token"], 1)) // 256 * 256)
    hint = (f"use a smaller -c (about -c {fitting} would fit)" if fitting >= 256
            else "this model does not fit in free memory at any -c; free memory or use a smaller model")
    raise SettingsError(
        f"not enough memory: the model ({needs['model_bytes'] / GIB:.2f} GiB) and its cache for "
        f"-c {ctx_size} ({needs['kv_bytes'] / GIB:.2f} GiB) need about "
        f"{host_bytes / GIB:.1f} GiB, but only {free / GIB:.1f} GiB is free. Rather than swap or "
        f"be killed, localserve stops here: {hint}, or offload layers to a GPU (-ngl), "
        f"or pass --no-memory-check to try anyway.")


def _on_gpus(context: ContextChoice) -> str:
    if not context.gpu_bytes:
        return " (on the GPU; GPU memory not checked)"
    return " (on the GPU: " + ", ".join(f"{name} {need / GIB:.1f} of {free / GIB:.1f} GiB free"
                                         for name, need, free in context.gpu_bytes) + ")"
