"""README's first command, done as written on a fresh clone: `scripts/up` sets everything up in
a virtual environment of its own and serves, without the test tools a server does not need.
(The llama.cpp build is the cached one that `scripts/test` made: a new build takes minutes.)"""

import os
import shutil
import signal
import subprocess

import httpx
import pytest

from conftest import ROOT, free_port, wait_for

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git to clone")


@pytest.mark.timeout(900)
def test_scripts_up_on_a_fresh_clone_serves_without_the_test_tools(tmp_path):
    clone, venv, port = tmp_path / "localserve", tmp_path / "venv", free_port()
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    log = (tmp_path / "up.log").open("w")
    env = {**os.environ, "LOCALSERVE_VENV": str(venv), "LOCALSERVE_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.Popen([str(clone / "scripts" / "up"), "--port", str(port), "-t", "2"],
                            cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(healthy, timeout=840, what="scripts/up serving from a fresh clone")
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0,
            "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
    said = (tmp_path / "up.log").read_text()
    assert "installing localserve and its dependencies" in said and "test tools" not in said
    for tool in ("pytest", "playwright", "mutmut"):
        found = subprocess.run([str(venv / "bin" / "python"), "-c", f"import {tool}"],
                               capture_output=True)
        assert found.returncode != 0, f"{tool} was installed by scripts/up"
