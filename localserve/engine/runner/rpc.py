"""llama.cpp's RPC backend: one model's layers spread over machines (a build with
-DGGML_RPC=ON: `LOCALSERVE_RPC=1 scripts/setup`).

A worker is ggml's own RPC server (`ggml_backend_rpc_start_server`, exported by libggml-rpc;
no separate binary), serving this machine's CPU as a device. The server registers workers
as devices (`ggml_backend_rpc_add_server`, as llama.cpp's own --rpc does) before it loads the
model; llama.cpp puts them first in its device list, and -ngl / --tensor-split place layers
on them. The protocol has no authentication and no encryption: loopback, a trusted LAN, or a
tunnel (SSH, WireGuard) only.
"""

from __future__ import annotations

import ctypes

import llama_cpp.llama_cpp as C

from localserve.engine.runner.aborts import loaded_lib

NO_RPC = "this llama.cpp build has no RPC backend: rebuild it with LOCALSERVE_RPC=1 scripts/setup"
DEVICE_TYPE_CPU, DEVICE_TYPE_GPU, DEVICE_TYPE_IGPU = 0, 1, 2  # enum ggml_backend_dev_type


class RpcUnavailable(RuntimeError):
    """This llama.cpp build has no RPC backend."""


def supports_rpc() -> bool:
    return bool(C.llama_supports_rpc())


def _lib(stem: str) -> ctypes.CDLL:
    """The copy of a ggml library that libllama already uses. Opened by its soname: the wheel
    ships libggml.so and libggml.so.0 as two files, and opening the other one would load a
    second ggml with its own device registry, which llama.cpp never sees."""
    lib = loaded_lib(stem)
    if lib is None:
        raise RpcUnavailable(NO_RPC)
    return lib


def ggml_lib() -> ctypes.CDLL:
    ggml = _lib("ggml")
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(ggml, fn).restype = ctypes.c_char_p
        getattr(ggml, fn).argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_name.restype = ctypes.c_char_p
    ggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                             ctypes.POINTER(ctypes.c_size_t)]
    return ggml


def _rpc() -> ctypes.CDLL:
    if not supports_rpc():
        raise RpcUnavailable(NO_RPC)
    rpc = _lib("ggml-rpc")
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    return rpc


def serve_worker(host: str, port: int, threads: int, cache_dir: str | None) -> None:
    """Serve this machine's CPU to RPC clients; blocks until the process ends."""
    rpc, ggml = _rpc(), ggml_lib()
    C.llama_backend_init()
    cpu = ggml.ggml_backend_dev_by_type(DEVICE_TYPE_CPU)
    devices = (ctypes.c_void_p * 1)(cpu)
    rpc.ggml_backend_rpc_start_server(f"{host}:{port}".encode(),
                                      cache_dir.encode() if cache_dir else None, threads, 1, devices)


_added: set[str] = set()  # a worker registered twice would count as two devices


def add_servers(endpoints: list[str]) -> None:
    """Register workers as devices; call before the model loads (llama.cpp lists devices then)."""
    rpc, ggml = _rpc(), ggml_lib()
    for endpoint in endpoints:
        if endpoint in _added:
            continue
        _added.add(endpoint)
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise RuntimeError(f"--rpc {endpoint}: llama.cpp could not add this RPC server")
        ggml.ggml_backend_register(reg)


def has_local_gpu() -> bool:
    """A GPU device of this machine is registered (RPC workers, listed as GPUs, do not count)."""
    ggml = ggml_lib()
    ggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        if (ggml.ggml_backend_dev_type(dev) in (DEVICE_TYPE_GPU, DEVICE_TYPE_IGPU)
                and ggml.ggml_backend_reg_name(ggml.ggml_backend_dev_backend_reg(dev)) != b"RPC"):
            return True
    return False


def rpc_devices() -> list[dict]:
    """The registered RPC devices, for /props: name, description, memory the worker reports."""
    if not supports_rpc():
        return []
    ggml = ggml_lib()
    found = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        if ggml.ggml_backend_reg_name(ggml.ggml_backend_dev_backend_reg(dev)) != b"RPC":
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append({"name": ggml.ggml_backend_dev_name(dev).decode(),
                      "description": ggml.ggml_backend_dev_description(dev).decode(),
                      "memory_free": free.value, "memory_total": total.value})
    return found
