"""The devices llama.cpp can offload layers to, with the memory each has free now: what
fitting the model to them needs (models/fit.py, llama-server's --fit). Empty on a CPU build."""

from __future__ import annotations

import ctypes

import llama_cpp.llama_cpp as C

from localserve.engine.runner.rpc import DEVICE_TYPE_CPU, DEVICE_TYPE_IGPU, ggml_lib


def offload_devices() -> list[dict]:
    """Every non-CPU device in llama.cpp's order: name, free bytes, and whether its memory is
    the host's RAM (an integrated GPU, Apple's Metal)."""
    if not C.llama_supports_gpu_offload():
        return []
    C.llama_backend_init()
    ggml = ggml_lib()
    ggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    found = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        kind = ggml.ggml_backend_dev_type(dev)
        if kind == DEVICE_TYPE_CPU or kind > DEVICE_TYPE_IGPU:  # the CPU, accelerators (BLAS)
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        registry = ggml.ggml_backend_reg_name(ggml.ggml_backend_dev_backend_reg(dev))
        found.append({"name": ggml.ggml_backend_dev_name(dev).decode(), "free": free.value,
                      "unified": kind == DEVICE_TYPE_IGPU or registry in (b"MTL", b"Metal")})
    return found
