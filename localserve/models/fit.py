"""The model fitted to GPU memory, as llama-server's `--fit` does (llama.cpp `common/fit.cpp`):
with -c unset, the model's trained context, lowered (not under FIT_MIN_CTX) until every
device holds its layers, their cache and a compute buffer with FIT_MARGIN left free; then,
if that is not enough, fewer layers on the GPUs (the first layers stay on the CPU, as
llama.cpp places them). A -c or -ngl given is kept, or refused with the numbers.

Pure: the devices' free memory (runner.offload_devices) and the files' sizes (gguf_meta.
model_size, the projector's) come in; resources.py asks and logs. Layers are shared between
devices by --tensor-split, else by free memory (llama.cpp's default). On Apple's unified memory the
GPU's memory is the host's RAM: what stays on the CPU counts against it too.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024 ** 3
FIT_MARGIN = GIB  # left free on each device (llama-server's --fit-target, 1024 MiB)
FIT_MIN_CTX = 4096  # the context is never lowered under this (llama-server's --fit-ctx)
UBATCH = 512  # llama.cpp's physical batch: the compute buffer grows with it
COMPUTE_SPARE = 256 * 1024 ** 2  # the graph's other buffers, measured loosely
PROJECTOR_COMPUTE = 512 * 1024 ** 2  # an image encoder's compute buffer, loosely (a SigLIP's)


class FitError(ValueError):
    """The -c or -ngl given does not fit the GPUs' memory: the message has the numbers."""


@dataclass(frozen=True)
class Device:
    name: str
    free: int  # bytes free now
    unified: bool = False  # the host's RAM (Apple silicon): the CPU's share counts here too


@dataclass(frozen=True)
class ModelSize:
    layers: tuple[int, ...]  # each repeating layer's weights, bytes
    output: int  # the output layer: on the GPU when every layer is
    embeddings: int  # the token embeddings: always in host memory
    kv_per_token: int  # the caches of layers that keep every position, bytes per token
    n_ctx_train: int
    n_vocab: int
    n_embd: int
    projector: int = 0  # an image projector (--mmproj): on the first GPU when any layer is
    # (as llama.cpp places it), its weights and compute buffer (llama-server's fit counts it too)
    experts: tuple[int, ...] = ()  # each layer's mixture-of-experts weights (part of `layers`)
    kv_fixed: int = 0  # window layers' cells and recurrent states, whatever the context


@dataclass(frozen=True)
class Fit:
    ctx_size: int
    n_gpu_layers: int  # len(layers) + 1: every layer and the output layer
    needs: tuple[int, ...]  # bytes on each device
    why: str
    n_cpu_moe: int = 0  # the first layers whose experts stay in host memory (--n-cpu-moe)


def fit(model: ModelSize, devices: list[Device], ctx_given: int = 0,
        ngl_given: int | None = None, split: tuple[float, ...] = (), moe: int | None = None) -> Fit:
    """The context and layers that fit `devices` (see the module doc); FitError when a value
    given does not. A mixture of experts first keeps the experts of its first layers in host
    memory (`moe`: as many as --n-cpu-moe or --cpu-moe say, None: as many as it takes), as
    llama-server's fit does, before the context is lowered."""
    all_layers = len(model.layers) + 1
    wanted_ctx = ctx_given or model.n_ctx_train or FIT_MIN_CTX
    ngl = all_layers if ngl_given is None else min(ngl_given, all_layers)
    cpu_moe = moe or 0
    if moe is None and model.experts and not _fits(model, devices, split, wanted_ctx, ngl):
        cpu_moe = _smallest(len(model.experts), lambda n: _fits(
            model, devices, split, wanted_ctx, ngl, n))
        if _fits(model, devices, split, wanted_ctx, ngl, cpu_moe):
            kept = _kept(ctx_given, ngl_given, model)
            return _result(model, devices, split, wanted_ctx, ngl, f"{kept} with the experts of "
                           f"the first {cpu_moe} layers in host memory (--n-cpu-moe {cpu_moe})",
                           cpu_moe)
    fits = lambda c, n: _fits(model, devices, split, c, n, cpu_moe)  # noqa: E731
    experts = f", the experts of {cpu_moe} layers in host memory" if cpu_moe else ""
    if fits(wanted_ctx, ngl):
        return _result(model, devices, split, wanted_ctx, ngl,
                       _kept(ctx_given, ngl_given, model) + experts, cpu_moe)
    floor = min(FIT_MIN_CTX, wanted_ctx)
    ctx = wanted_ctx
    if not ctx_given:
        ctx = _largest(floor, wanted_ctx, lambda c: fits(c, ngl), 256)
        if fits(ctx, ngl):
            return _result(model, devices, split, ctx, ngl, f"context lowered from {wanted_ctx} "
                           f"to {ctx} tokens to fit GPU memory, {_placed(ngl, all_layers)}"
                           f"{experts}", cpu_moe)
    if ngl_given is None:
        ngl = _largest(0, all_layers, lambda n: fits(ctx, n), 1)
        if fits(ctx, ngl):
            return _result(model, devices, split, ctx, ngl, f"{ctx} tokens of context"
                           f"{'' if ctx_given else ' (--fit-ctx)'}, {_placed(ngl, all_layers)} "
                           f"to fit GPU memory{experts}", cpu_moe)
    raise FitError(_refusal(model, devices, split, ctx, ngl, ctx_given, ngl_given))


def _smallest(high: int, ok) -> int:
    """The smallest n in [0, high] that is ok, else `high`: ok turns true as n grows (more
    experts in host memory: less on the GPUs)."""
    lo, hi = 0, high
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def needs(model: ModelSize, devices: list[Device], split: tuple[float, ...], ctx: int,
          ngl: int, cpu_moe: int = 0) -> list[int]:
    """Bytes each device needs: its layers' weights and cache (less the experts of the first
    `cpu_moe` layers, kept in host memory), the output layer on the last device when every
    layer is offloaded, a compute buffer where it has layers, the projector on the first when
    any layer is offloaded, and on a unified device the host's share too."""
    n_layer = len(model.layers)
    on_gpu = min(ngl, n_layer)
    counts = _layer_counts(on_gpu, split or tuple(d.free for d in devices))
    per_layer_kv = (model.kv_per_token * ctx + model.kv_fixed) // max(n_layer, 1)
    in_host = [model.experts[i] if i < cpu_moe and i < len(model.experts) else 0
               for i in range(n_layer)]
    out, first = [], n_layer - on_gpu
    for count in counts:
        layers = [b - in_host[first + i] for i, b in enumerate(model.layers[first:first + count])]
        first += count
        out.append(sum(layers) + count * per_layer_kv + (_compute(model) if count else 0))
    last = max((i for i, c in enumerate(counts) if c), default=None)
    if last is not None and ngl > n_layer:
        out[last] += model.output + UBATCH * model.n_vocab * 4  # and its logits
    if on_gpu and out:
        out[0] += model.projector
    host = (model.embeddings + sum(model.layers[:n_layer - on_gpu]) + (n_layer - on_gpu) * per_layer_kv
            + sum(in_host[n_layer - on_gpu:]))
    for i, device in enumerate(devices):
        if device.unified:
            out[i] += host
    return out


def _fits(model, devices, split, ctx, ngl, cpu_moe=0) -> bool:
    return all(need <= d.free - FIT_MARGIN
               for need, d in zip(needs(model, devices, split, ctx, ngl, cpu_moe), devices))


def _largest(low: int, high: int, ok, step: int) -> int:
    """The largest multiple of `step` in [low, high] that is ok, else `low`: ok turns false as
    the value grows (more context, more layers: more memory), so a bisection finds it."""
    lo, hi, best = -(-low // step), high // step, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid * step):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return low if best is None else best * step


def _layer_counts(n: int, shares: tuple[float, ...]) -> list[int]:
    """Layers per device in proportion to `shares`, in device order (llama.cpp's split)."""
    total, done, acc, counts = sum(shares) or 1, 0, 0.0, []
    for share in shares:
        acc += share
        upto = round(n * acc / total)
        counts.append(upto - done)
        done = upto
    return counts


def _compute(model: ModelSize) -> int:
    return UBATCH * model.n_embd * 4 * 8 + COMPUTE_SPARE


def _placed(ngl: int, all_layers: int) -> str:
    if ngl >= all_layers:
        return "every layer on the GPU"
    return f"{ngl} of {all_layers} layers on the GPU" if ngl else "no layer on the GPU"


def _kept(ctx_given: int, ngl_given: int | None, model: ModelSize) -> str:
    ctx = f"-c {ctx_given}" if ctx_given else f"the model's trained context ({model.n_ctx_train} tokens)"
    layers = f"-ngl {ngl_given}" if ngl_given is not None else "every layer on the GPU"
    return f"{ctx} and {layers} fit GPU memory"


def _refusal(model, devices, split, ctx, ngl, ctx_given, ngl_given) -> str:
    shown = "; ".join(f"{d.name} needs {n / GIB:.2f} GiB and has {d.free / GIB:.2f} GiB free"
                      for d, n in zip(devices, needs(model, devices, split, ctx, ngl)))
    given = " and ".join(x for x in (f"-c {ctx_given}" if ctx_given else "",
                                    f"-ngl {ngl_given}" if ngl_given is not None else "") if x)
    hints = []
    if ctx_given:
        c = _largest(256, ctx, lambda v: _fits(model, devices, split, v, ngl), 256)
        hints.append(f"about -c {c}" if _fits(model, devices, split, c, ngl) else "")
    if ngl_given is not None:
        n = _largest(0, ngl, lambda v: _fits(model, devices, split, ctx, v), 1)
        hints.append(f"about -ngl {n}" if _fits(model, devices, split, ctx, n) else "")
    hint = " or ".join(h for h in hints if h) or "both lower, or a smaller model"
    return (f"{given} do not fit GPU memory with {FIT_MARGIN / GIB:.0f} GiB left free on each "
            f"device ({shown}): {hint} would fit, or leave them unset and the server fits them")


def _result(model, devices, split, ctx, ngl, why, cpu_moe=0) -> Fit:
    return Fit(ctx, ngl, tuple(needs(model, devices, split, ctx, ngl, cpu_moe)), why, cpu_moe)
