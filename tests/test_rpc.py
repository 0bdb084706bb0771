"""llama.cpp's RPC backend (a build with LOCALSERVE_RPC=1 scripts/setup; skipped otherwise):
a worker on loopback holds half the layers; greedy text is identical to a local run; killing
the worker fails the running request with a clear error, /health says so, the server lives.
Also, in every build: a ggml fatal error ends the engine, never the process; and on Linux's CPU
backend llama.cpp is the one library scripts/build-libllama makes."""

import ctypes
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, free_port, running, wait_for
from localserve.engine.runner.rpc import supports_rpc

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow:"]


def greedy(url, prompt):
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 24, "temperature": 0})
    return r.json()["choices"][0]["text"]


def test_a_ggml_fatal_error_calls_the_handler_and_the_process_lives():
    from localserve.engine.runner.aborts import loaded_lib, on_fatal_error

    seen = threading.Event()
    forget = on_fatal_error(lambda message: seen.set() if "boom" in message else None)
    try:
        base = loaded_lib("ggml-base")
        base.ggml_abort.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
        threading.Thread(target=base.ggml_abort, args=(b"test", 1, b"boom"), daemon=True).start()
        assert seen.wait(10)  # ... and we are still here: abort() was never reached
    finally:
        forget()


def built_for() -> str:
    """The backend scripts/setup built llama.cpp for, from its stamp in the venv ("" if none)."""
    stamps = list(Path(sys.prefix).glob(".llama-build-*"))
    return stamps[0].read_text().split(" ")[0] if stamps else ""


@pytest.mark.skipif(not sys.platform.startswith("linux") or built_for() != "cpu",
                    reason="one library is setup's build on Linux's CPU backend only")
def test_on_linux_cpu_llama_cpp_is_one_library_and_ggml_is_found_in_it():
    import llama_cpp

    from localserve.engine.runner.aborts import loaded_lib

    folder = Path(llama_cpp.__file__).parent / "lib"
    libs = sorted(p.name for p in folder.glob("lib*.so*"))
    # not the wheel's four: 0.89x on chat (docs/install.md); mtmd is a link into the same file
    assert libs == ["libllama.so", "libmtmd.so"]
    assert (folder / "libmtmd.so").resolve() == (folder / "libllama.so").resolve()
    assert loaded_lib("ggml-base") is llama_cpp.llama_cpp._lib
    assert loaded_lib("ggml-rpc") is None


@pytest.mark.skipif(not supports_rpc(), reason="this llama.cpp build has no RPC backend "
                    "(LOCALSERVE_RPC=1 scripts/setup builds one)")
def test_layers_on_a_worker_give_the_same_text_and_a_dead_worker_fails_cleanly():
    with running("-c", "2048", "-np", "2", "-t", "1", log_name="rpc-local") as local:
        expected = [greedy(local.url, p) for p in PROMPTS]
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "localserve", "rpc-worker", "--port", str(port),
                               "-t", "1"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _listening(port), timeout=30, what="the RPC worker")
        with running("-c", "2048", "-np", "2", "-t", "1", "--rpc", f"127.0.0.1:{port}",
                     "-ngl", "15", log_name="rpc-server") as srv:
            props = httpx.get(srv.url + "/props", timeout=10).json()
            assert [d["description"] for d in props["rpc_devices"]] == [f"127.0.0.1:{port}"]
            assert props["backend"]["n_gpu_layers"] == 15
            assert [greedy(srv.url, p) for p in PROMPTS] == expected
            events = []
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                    "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        if len(events) == 5:
                            worker.kill()
            assert "error" in events[-1] and "RPC" in events[-1]["error"]["message"]
            health = httpx.get(srv.url + "/health", timeout=10)
            assert health.status_code == 503 and "RPC" in health.json()["error"]
            assert srv.proc.poll() is None
    finally:
        worker.kill()
        worker.wait()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
