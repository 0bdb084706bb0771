"""Fixtures that start the real server (real model, real llama.cpp) on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def png(color=(200, 30, 40), size=(100, 80), kind="PNG") -> str:
    """A plain picture's file, base64 (what a data URI carries)."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, kind)
    return base64.b64encode(buffer.getvalue()).decode()


def random_projector() -> str:
    """The path of a random-weight image projector of the embedded model's width
    (scripts/make-projector, made once and cached: no hub download)."""
    return subprocess.run([str(ROOT / "scripts/make-projector")], check=True, text=True,
                          capture_output=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """`localserve up ARGS` on a free port (or another server's `program`, e.g. llama-server)."""

    def __init__(self, *args: str, log_name: str = "server", program: list[str] | None = None,
                 preexec_fn=None, cwd: Path = ROOT):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir = Path(os.environ.get("PYTEST_LOG_DIR", "/tmp"))
        self.log_path = log_dir / f"localserve-{log_name}-{self.port}.log"
        self._log = open(self.log_path, "w")
        program = program or [sys.executable, "-m", "localserve", "up"]
        # Each server's ledger in its own fresh folder, never the user's data directory.
        self.state_dir = tempfile.mkdtemp(prefix="localserve-state-")
        env = {**os.environ, "LOCALSERVE_STATE_DIR": self.state_dir}
        self.proc = subprocess.Popen([*program, "--port", str(self.port), *args],
                                     cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=preexec_fn, env=env)

    def wait_ready(self, timeout: float = 120) -> "RunningServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def slots(self, headers: dict | None = None) -> dict:
        return httpx.get(self.url + "/slots?view=full", headers=headers, timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def key_file(folder: Path, *lines: str) -> Path:
    """`folder/keys.txt` holding `name:key[:role]` lines, readable by its owner only (as the
    server wants it)."""
    path = folder / "keys.txt"
    path.write_text("".join(line + "\n" for line in lines))
    path.chmod(0o600)
    return path


def ledger_rows(state_dir: Path, endpoint: str,
                columns: str = "key, prompt_tokens, completion_tokens") -> list[tuple]:
    """The ledger's rows for one endpoint (by default: key, prompt and completion tokens)."""
    db = sqlite3.connect(f"file:{state_dir / 'ledger.db'}?mode=ro", uri=True)
    try:
        return db.execute(f"SELECT {columns} FROM requests WHERE endpoint = ?",
                          (endpoint,)).fetchall()
    finally:
        db.close()


def answers_200(url: str) -> bool:
    """Whether a GET of `url` answers 200 now (a server, a proxy or a frontend being up)."""
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(condition, timeout: float = 30.0, what: str = "condition", interval: float = 0.05):
    """Poll `condition` until it returns something truthy (returned), or fail at the deadline.
    The only way tests wait: never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


async def until(condition, timeout: float = 30.0, what: str = "condition", interval: float = 0.01):
    """wait_for inside an event loop: the loop's other tasks run while it polls."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
    return value


@contextlib.contextmanager
def loaded_host(**settings):
    """A model host on the real model, loaded for the duration of a with-block (in-process
    tests of the engine and the API's helpers, no server)."""
    from localserve.common.config import Settings
    from localserve.models.model_host import ModelHost

    host = ModelHost(Settings(threads=2, **settings))
    host.load()
    assert host.ready, host.load_error
    try:
        yield host
    finally:
        host.stop()


@contextlib.contextmanager
def running(*args: str, log_name: str, preexec_fn=None):
    """A started, ready server for the duration of a with-block (module fixtures use it)."""
    srv = RunningServer(*args, log_name=log_name, preexec_fn=preexec_fn)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def server():
    """A pool of 4,096 tokens for 4 slots (1,024 guaranteed to each), small step budget so
    chunked prefill is exercised."""
    with running("-c", "4096", "-np", "4", "--max-num-batched-tokens", "128", "-t", "2",
                 log_name="main") as srv:
        yield srv


@pytest.fixture(scope="module")
def runner():
    """The engine's runner on the real model, without a server (a pool of 2,048 tokens, 2
    slots), for tests that drive StepPlans through llama_decode themselves."""
    from localserve.common.config import resolve_model
    from localserve.engine.runner import LlamaRunner, RunnerConfig

    runner = LlamaRunner(RunnerConfig(str(resolve_model(None)), ctx_size=2048, n_slots=2,
                                      n_batch=512, n_threads=2))
    yield runner
    runner.close()


@pytest.fixture()
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def make_aclient(server):
    """A factory: an AsyncOpenAI client belongs to one event loop, so make one per asyncio.run."""
    from openai import AsyncOpenAI

    return lambda: AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
