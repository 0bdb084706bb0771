"""Where a model's weights go, as llama-server places them (--cpu-moe, --n-cpu-moe, -ot): the
tensors a pattern finds, to a named buffer type (a mixture of experts' expert weights in host
memory, the rest on the GPU: how gpt-oss or Qwen3.5-MoE run on one 16-24 GB card), through
llama_model_params.tensor_buft_overrides. llama.cpp's loader reports each tensor it placed so
(model_file._llama_log counts them): the start-up log and /props say what moved."""

from __future__ import annotations

import ctypes

from localserve.engine.runner.aborts import loaded_lib

EXPERTS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llama.cpp's LLM_FFN_EXPS_REGEX


def placements(cpu_moe: bool, n_cpu_moe: int, overrides: tuple[str, ...] = ()) -> tuple:
    """(pattern, buffer name) pairs, llama-server's order: -ot entries first, then the
    experts of every layer (--cpu-moe) or of the first `n_cpu_moe` layers in host memory."""
    pairs = [tuple(entry.rsplit("=", 1)) for entry in overrides]
    if cpu_moe:
        pairs.append((EXPERTS, "CPU"))
    else:
        pairs += [(rf"blk\.{i}{EXPERTS}", "CPU") for i in range(n_cpu_moe)]
    return tuple(pairs)


class _Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def buffer_types() -> dict[str, int]:
    """Every buffer type llama.cpp can place weights in, by its name (CPU, CUDA0, ...)."""
    ggml = loaded_lib("ggml")
    for fn, args in (("ggml_backend_cpu_buffer_type", []),
                     ("ggml_backend_dev_get", [ctypes.c_size_t]),
                     ("ggml_backend_dev_buffer_type", [ctypes.c_void_p]),
                     ("ggml_backend_dev_host_buffer_type", [ctypes.c_void_p]),
                     ("ggml_backend_buft_name", [ctypes.c_void_p])):
        getattr(ggml, fn).restype = ctypes.c_char_p if fn.endswith("_name") else ctypes.c_void_p
        getattr(ggml, fn).argtypes = args
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    found = [ggml.ggml_backend_cpu_buffer_type()]
    for i in range(ggml.ggml_backend_dev_count()):
        device = ggml.ggml_backend_dev_get(i)
        found += [ggml.ggml_backend_dev_buffer_type(device),
                  ggml.ggml_backend_dev_host_buffer_type(device)]
    return {ggml.ggml_backend_buft_name(b).decode(): b for b in reversed(found) if b}


class TensorOverrides:
    """The NULL-terminated array llama.cpp reads while it loads (kept alive by this object)."""

    def __init__(self, pairs: tuple):
        known = buffer_types() if pairs else {}
        unknown = sorted({name for _, name in pairs if name not in known})
        if unknown:
            raise RuntimeError(f"no buffer type named {', '.join(unknown)} for --override-tensor "
                               f"(this build has: {', '.join(sorted(known))})")
        self._patterns = [pattern.encode() for pattern, _ in pairs]
        self.array = (_Override * (len(pairs) + 1))(
            *[_Override(p, known[name]) for p, (_, name) in zip(self._patterns, pairs)])

    @property
    def pointer(self) -> ctypes.c_void_p | None:
        return ctypes.cast(self.array, ctypes.c_void_p) if self._patterns else None
