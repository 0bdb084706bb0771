"""What a newcomer trips over, from set-up to the first mistake: each ends in one clear line,
no traceback, and a non-zero exit where it is start-up."""

import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from conftest import ROOT, RunningServer, running, wait_for
from localserve.common.config import SettingsError
from localserve.settings_loader import load_settings


def up(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "localserve", "up", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_clear_line(run, *needles):
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert all(n in run.stderr for n in needles), run.stderr


# ---- 1. settings: names derived from flags, misspellings refused -----------------------

def test_singular_and_plural_env_names_both_set_keys():
    assert load_settings({}, environ={"LOCALSERVE_API_KEY": "secret-123456"}).api_keys == (
        "secret-123456",)
    assert load_settings({}, environ={"LOCALSERVE_API_KEYS": "a-long-key1,a-long-key2"}).api_keys == (
        "a-long-key1", "a-long-key2")
    assert load_settings({}, environ={"LOCALSERVE_CORS_ORIGIN": "http://a.lan"}).cors_origins == (
        "http://a.lan",)


def test_unknown_settings_are_refused_with_the_closest_name(tmp_path):
    with pytest.raises(SettingsError, match="LOCALSERVE_API_KYES; did you mean LOCALSERVE_API_KEYS"):
        load_settings({}, environ={"LOCALSERVE_API_KYES": "secret-123456"})
    toml = tmp_path / "s.toml"
    toml.write_text('api-key = ["secret-123456"]\nctx_sise = 4096\n')
    with pytest.raises(SettingsError, match="'ctx_sise'.*did you mean ctx_size"):
        load_settings({}, environ={}, config_path=str(toml))


def test_a_misspelt_variable_stops_start_up():
    one_clear_line(up(env={"LOCALSERVE_API_KYE": "secret-123456"}),
                   "unknown environment variable LOCALSERVE_API_KYE", "LOCALSERVE_API_KEY")


# ---- 3. the interpreter floor --------------------------------------------------------

def test_setup_refuses_an_old_python_in_plain_words(tmp_path):
    old = tmp_path / "python3.10"
    old.write_text('#!/bin/sh\ncase "$2" in *exit*) exit 1;; *print*) echo 3.10;; esac\n')
    old.chmod(0o755)
    run = subprocess.run([str(ROOT / "scripts" / "setup")], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHON": str(old),
                                          "LOCALSERVE_VENV": str(tmp_path / "venv")})
    assert run.returncode == 1
    assert "needs Python 3.11 or newer" in run.stderr and "is 3.10" in run.stderr
    assert not (tmp_path / "venv").exists()


# ---- 7. the first mistakes -----------------------------------------------------------

def test_a_file_that_is_not_gguf_is_named(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>404 Not Found</html>")
    one_clear_line(up("-m", str(fake)), "not a GGUF model file")


def test_a_truncated_gguf_is_named(tmp_path):
    from localserve.common.config import default_model_path

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model_path().read_bytes()[:4096])
    one_clear_line(up("-m", str(cut)), str(cut))


def test_a_port_in_use_is_one_line_before_listening():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        run = up("--port", str(taken.getsockname()[1]), "-c", "512", "-np", "1")
    one_clear_line(run, "cannot listen there", "choose another --port")
    assert "listening on" not in run.stderr


def test_a_flag_typo_suggests_the_flag_in_two_lines_not_the_whole_usage():
    run = up("--ctx-sise", "4096")
    assert run.returncode == 2 and "did you mean --ctx-size?" in run.stderr
    wrong = up("--parallel", "zero")
    assert wrong.returncode == 2 and "--parallel: invalid int value: 'zero'" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 2 and "--help" in wrong.stderr


def test_slots_too_small_for_a_one_line_chat_are_warned_about(caplog):
    """llama.cpp itself gives each sequence at least 256 tokens, enough for this model's
    one-line chat; a model with a long built-in system prompt can still fall short, so the
    check runs on the real template against a pool of 48-token slots."""
    from localserve.common.config import Settings
    from localserve.engine.slots import SlotPool
    from localserve.models.model_host import ModelHost

    svc = ModelHost(Settings(ctx_size=512, parallel=1, threads=2))
    svc.load()
    try:
        with caplog.at_level("WARNING", logger="localserve"):
            svc._warn_if_slots_too_small(SlotPool(192, 4))
            svc._warn_if_slots_too_small(SlotPool(1024, 4))
        [warning] = [r.getMessage() for r in caplog.records]
        assert "each slot holds 48 tokens" in warning and "raise -c to at least" in warning
    finally:
        svc.stop()


def test_request_mistakes_get_plain_sentences(server):
    url = server.url + "/v1/chat/completions"
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}'
    for plain in ("text/plain", "application/x-www-form-urlencoded", None,  # curl -d sends form
                  "application/octet-stream"):  # LiteLLM's async transport
        headers = {"content-type": plain} if plain else {}
        assert httpx.post(url, content=body, headers=headers, timeout=60).status_code == 200, plain
    for browser in ({"origin": "http://127.0.0.1:9"}, {"sec-fetch-site": "cross-site"}):
        forged = httpx.post(url, content=body, timeout=60,
                            headers={"content-type": "text/plain", **browser})
        assert forged.status_code == 415 and "forgery" in forged.json()["error"]["message"]
    not_json = httpx.post(url, content=b"messages=hi", headers={"content-type": "text/plain"})
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    image = httpx.post(url, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    message = image.json()["error"]["message"]
    assert image.status_code == 400 and "reads text only" in message and "--mmproj" in message
    assert "Input should be" not in message and "union" not in message
    broken = httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] is None
    assert "not valid JSON" in broken.json()["error"]["message"]
    assert "lives under /v1" not in httpx.post(server.url + "/v1/nothing").json()["error"]["message"]
    assert "lives under /v1" in httpx.post(server.url + "/chat/complete").json()["error"]["message"]


def test_bench_accepts_a_url_ending_in_v1(server, tmp_path):
    run = subprocess.run([sys.executable, "-m", "localserve", "bench", "--url", server.url + "/v1",
                          "--concurrency", "1", "--requests", "1", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "bench.json").is_file()


def test_a_second_ctrl_c_during_drain_exits_without_a_traceback():
    srv = RunningServer("-c", "1024", "-np", "1", "-t", "2", "--drain-timeout", "60",
                        log_name="second-ctrl-c")
    try:
        srv.wait_ready()
        lines = []

        def stream():
            body = {"prompt": "Once", "max_tokens": 900, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                lines.extend(r.iter_lines())

        worker = threading.Thread(target=stream)
        worker.start()
        wait_for(lambda: srv.slots()["slots"][0]["n_decoded"] > 0, what="the stream decoding")
        srv.proc.send_signal(signal.SIGINT)
        wait_for(lambda: "shutting down" in srv.log(), what="the drain to start")
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(timeout=30) == 0
        worker.join(timeout=30)
        assert "Traceback" not in srv.log() and "exiting now" in srv.log()
        data = [line for line in lines if line.startswith("data:")]
        assert any("shutting down" in line for line in data) and data[-1] == "data: [DONE]"
    finally:
        srv.stop()


# ---- 8. CORS mistakes said out loud ----------------------------------------------------

def test_cors_refusals_are_logged_and_errors_carry_cors_headers():
    origin = "http://chat.office:3000"
    with running("-c", "512", "-np", "1", "-t", "2", "--cors-origin", origin,
                 "--cors-origin", "http://typo.office/", "--cors-origin", "localhost",
                 "--max-body-bytes", "2048", "--api-key", "cors-test-key-0123456789",
                 log_name="cors") as srv:  # a key: the loopback guard stands aside for CORS
        refused = httpx.options(srv.url + "/v1/chat/completions", headers={
            "Origin": "http://chat.other:3000", "Access-Control-Request-Method": "POST"})
        assert refused.status_code == 400
        for loopback in ("http://localhost:5173", "http://127.0.0.1:8081", "http://[::1]:3000"):
            allowed = httpx.options(srv.url + "/v1/chat/completions", headers={
                "Origin": loopback, "Access-Control-Request-Method": "POST"})  # llama-server's
            assert allowed.headers.get("access-control-allow-origin") == loopback  # shorthand
        too_big = httpx.post(srv.url + "/v1/chat/completions", headers={"Origin": origin},
                             json={"messages": [{"role": "user", "content": "x" * 5000}]})
        assert too_big.status_code == 413
        assert too_big.headers.get("access-control-allow-origin") == origin
        log = srv.log()
    assert "refused a CORS preflight from origin 'http://chat.other:3000'" in log
    assert origin in log and "ends with '/'" in log


# ---- 2. API docs behind the key, nothing loaded from a CDN ----------------------------

def test_openapi_needs_the_key_and_there_is_no_cdn_page(tmp_path):
    keyfile = tmp_path / "keys.txt"
    keyfile.write_text("ann:ann-secret-key-1\n")
    keyfile.chmod(0o600)
    with running("-c", "512", "-np", "1", "-t", "2", "--api-key-file", str(keyfile),
                 log_name="docs") as srv:
        assert httpx.get(srv.url + "/openapi.json").status_code == 401
        spec = httpx.get(srv.url + "/openapi.json", headers={"X-Api-Key": "ann-secret-key-1"})
        assert spec.status_code == 200 and "/v1/chat/completions" in spec.json()["paths"]
        assert httpx.get(srv.url + "/docs").status_code == 404
