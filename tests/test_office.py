"""Small-office features on the real server: keys, exposure warning, CORS, size limits,
/props, the memory refusal, and draining on SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import ROOT, RunningServer, running, wait_for

KEY = "alice-secret-key-123"


@pytest.fixture(scope="module")
def office(tmp_path_factory):
    keyfile = tmp_path_factory.mktemp("keys") / "keys.txt"
    keyfile.write_text(f"# office keys\nalice:{KEY}\n\nbob: bob-secret-key-456\n")
    with running("-c", "2048", "-np", "2", "-t", "2", "--api-key-file", str(keyfile),
                 "--api-key", "plain-cli-key-789", "--cors-origin", "http://chat.office:3000",
                 "--max-body-bytes", "4096", log_name="office") as srv:
        yield srv


def post(srv, headers=None, **body):
    body.setdefault("messages", [{"role": "user", "content": "Say hi"}])
    body.setdefault("max_tokens", 3)
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60)


def test_keys_in_either_header_and_clear_401s(office):
    assert post(office, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert post(office, {"X-Api-Key": "bob-secret-key-456"}).status_code == 200
    assert post(office, {"Authorization": "Bearer plain-cli-key-789"}).status_code == 200
    missing = post(office)
    wrong = post(office, {"Authorization": "Bearer nope-nope-nope"})
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"]["code"] == "missing_api_key"
    assert wrong.json()["error"]["type"] == "authentication_error"


def test_health_is_open_but_monitoring_needs_a_key(office):
    assert httpx.get(office.url + "/health").status_code == 200
    for path in ("/slots", "/slots?view=full", "/metrics", "/props", "/v1/models"):
        assert httpx.get(office.url + path).status_code == 401, path
        assert httpx.get(office.url + path, headers={"X-Api-Key": KEY}).status_code == 200, path


def test_key_name_is_the_identity_in_slots(office):
    seen = set()
    body = {"messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 60,
            "ignore_eos": True, "user": "spoofed"}
    worker = threading.Thread(target=post, args=(office, {"X-Api-Key": KEY}), kwargs=body)
    worker.start()
    while worker.is_alive():
        snap = httpx.get(office.url + "/slots?view=full", headers={"X-Api-Key": KEY}).json()
        seen |= {s["user"] for s in snap["slots"] if s["user"]}
        time.sleep(0.02)
    assert seen == {"alice"}


def test_a_user_key_reads_a_colleagues_cells_only_coarsely(office):
    """bob's document runs; alice (a user key) sees the pool's fill with everyone else's cells
    rounded up to 256 and no family in /metrics that counts prompt tokens or cells; the admin
    sees them exactly (issue 80, case 6)."""
    body = {"messages": [{"role": "user", "content": "Tell a long story " * 40}],
            "max_tokens": 120, "ignore_eos": True}
    worker = threading.Thread(target=post, args=(office, {"X-Api-Key": "bob-secret-key-456"}),
                              kwargs=body)
    worker.start()
    seen_admin, seen_alice = set(), set()
    while worker.is_alive():
        admin = httpx.get(office.url + "/slots?view=full",
                          headers={"X-Api-Key": "plain-cli-key-789"}).json()
        alice = httpx.get(office.url + "/slots?view=full", headers={"X-Api-Key": KEY}).json()
        seen_admin.add(admin["cache"]["used_tokens"])
        seen_alice.add(alice["cache"]["used_tokens"])
        assert "prompt_tokens_computed" not in alice["engine"]
    worker.join()
    assert all(used % 256 == 0 for used in seen_alice) and len(seen_alice) < len(seen_admin)
    users = httpx.get(office.url + "/metrics", headers={"X-Api-Key": KEY}).text
    admins = httpx.get(office.url + "/metrics", headers={"X-Api-Key": "plain-cli-key-789"}).text
    for family in ("localserve:prompt_tokens_total", "localserve:kv_cache_usage_perc",
                   "localserve:iteration_tokens_total", "localserve:prefix_cache_queries"):
        assert family in admins and family not in users, family
    assert "localserve:generation_tokens_total" in users  # the dashboard's tokens per second


def test_cors_preflight_allows_the_configured_origin_only(office):
    def preflight(origin):
        return httpx.options(office.url + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
    ok = preflight("http://chat.office:3000")
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://chat.office:3000"
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers


def test_oversized_bodies_get_413_declared_or_chunked(office):
    big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
    r = httpx.post(office.url + "/v1/chat/completions", json=big, headers={"X-Api-Key": KEY})
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]

    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"y" * 1000
        yield b'"}]}'

    r = httpx.post(office.url + "/v1/chat/completions", content=chunks(),
                   headers={"X-Api-Key": KEY, "content-type": "application/json"})
    assert r.status_code == 413
    assert post(office, {"X-Api-Key": KEY}).status_code == 200


def test_props_describe_model_backend_split_and_scheduler(office):
    props = httpx.get(office.url + "/props", headers={"X-Api-Key": KEY}).json()
    assert props["model"]["n_layers"] == 30 and props["model"]["quantization"] == "Q4_1"
    assert props["model"]["n_params"] > 100e6 and props["model"]["path"].endswith(".gguf")
    assert props["backend"]["name"] == "cpu" and props["backend"]["n_gpu_layers"] == 0
    assert props["n_slots"] == 2 and props["n_ctx_per_slot"] == 2048 and props["ctx_size"] == 2048
    assert props["n_ctx_guaranteed"] == 1024 and props["context"]["why"] == "-c 2048"
    assert props["scheduler"]["policy"] == "continuous" and props["version"]


def test_listening_off_loopback_without_a_key_warns_loudly():
    srv = RunningServer("--host", "0.0.0.0", "-c", "512", "-np", "1", log_name="exposed")
    try:
        srv.wait_ready()
        assert "WITHOUT an API key" in srv.log() and "--api-key" in srv.log()
    finally:
        srv.stop()


def test_a_huge_context_is_refused_before_loading_with_numbers():
    run = subprocess.run([sys.executable, "-m", "localserve", "up", "-c", "50000000", "--port", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "not enough memory" in run.stderr and "-c 50000000" in run.stderr
    assert "smaller -c" in run.stderr


def test_bad_environment_value_is_refused_naming_the_variable():
    run = subprocess.run([sys.executable, "-m", "localserve", "up"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "LOCALSERVE_PARALLEL": "many"})
    assert run.returncode == 2 and "LOCALSERVE_PARALLEL='many'" in run.stderr


def stream_text(url, max_tokens, out):
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(line)
    out.append(events)


def busy_slots(srv) -> int:
    return sum(s["state"] != "idle" and s["n_decoded"] > 0 for s in srv.slots()["slots"])


def test_sigterm_drains_running_streams_and_refuses_new_ones():
    srv = RunningServer("-c", "2048", "-np", "2", "-t", "2", "--drain-timeout", "300",
                        log_name="drain")  # 300: the streams finish whatever else runs
    try:
        srv.wait_ready()
        results = []
        workers = [threading.Thread(target=stream_text, args=(srv.url, 400, results))
                   for _ in range(2)]
        for w in workers:
            w.start()
        wait_for(lambda: busy_slots(srv) == 2, what="both streams decoding")
        srv.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(srv.url + "/health").json()["status"] == "draining",
                 what="the server to say it is draining")
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        for w in workers:
            w.join(timeout=120)
        assert srv.proc.wait(timeout=60) == 0
        assert len(results) == 2
        for events in results:
            assert '"finish_reason":"length"' in events[-1].replace(" ", "")
    finally:
        srv.stop()


def test_drain_timeout_ends_leftovers_with_an_error_event():
    srv = RunningServer("-c", "2048", "-np", "1", "-t", "2", "--drain-timeout", "1",
                        log_name="drain-timeout")
    try:
        srv.wait_ready()
        results = []
        worker = threading.Thread(target=stream_text, args=(srv.url, 1000, results))
        worker.start()
        wait_for(lambda: busy_slots(srv) == 1, what="the stream decoding")
        srv.proc.send_signal(signal.SIGTERM)
        worker.join(timeout=60)
        assert srv.proc.wait(timeout=60) == 0
        assert results and "shutting down" in results[0][-1]
        assert json.loads(results[0][-2][6:])["choices"][0]["finish_reason"] == "error"
    finally:
        srv.stop()


def embedding_at_sigterm(ctx: str, drain_timeout: str, inputs: list[str], name: str):
    """One embedding request in flight when SIGTERM comes: its status, its body as JSON (a
    reply that is none fails here) and the server's log, once the server has exited."""
    srv = RunningServer("-c", ctx, "-np", "1", "-t", "2", "--drain-timeout", drain_timeout,
                        log_name=name)
    try:
        srv.wait_ready()
        results = []
        worker = threading.Thread(target=lambda: results.append(httpx.post(
            srv.url + "/v1/embeddings", json={"input": inputs}, timeout=600)))
        worker.start()
        wait_for(lambda: srv.slots()["embeddings_running"] == 1, timeout=120,
                 what="the embedding request in flight")
        srv.proc.send_signal(signal.SIGTERM)
        worker.join(timeout=600)
        assert srv.proc.wait(timeout=120) == 0
        return results[0].status_code, results[0].json(), srv.log()
    finally:
        srv.stop()


@pytest.mark.parametrize("drain_timeout, n_inputs", [("60", 3), ("1", 256)])
def test_an_embedding_in_flight_at_sigterm_finishes_in_the_drain_or_ends_clearly(
        drain_timeout, n_inputs):
    """Accepted before the signal: answered in full within the drain, or, when the drain runs
    out first, a 503 saying so (never a 500, never cut after a pause between two inputs)."""
    inputs = [f"{i} " + "lantern harbor meadow quartz " * 100 for i in range(n_inputs)]
    status, body, _ = embedding_at_sigterm("2048", drain_timeout, inputs,
                                           f"drain-embed-{drain_timeout}")
    if drain_timeout == "60":
        assert status == 200 and len(body["data"]) == n_inputs
    else:
        assert status == 503 and "shutting down" in body["error"]["message"]


def test_a_drain_that_runs_out_inside_a_long_embedding_input_answers_503_at_once():
    """One input of thousands of tokens is inside llama.cpp when the drain runs out: the
    request is answered 503 then, not when the input leaves llama.cpp (on a busy machine after
    uvicorn's own shutdown deadline, which cancelled it with no answer: a 500)."""
    long_input = "lantern harbor meadow quartz " * 1500
    status, body, said = embedding_at_sigterm("8192", "1", [long_input], "drain-embed-long")
    assert status == 503 and "shutting down" in body["error"]["message"]
    assert "timeout graceful shutdown exceeded" not in said and "Traceback" not in said


def test_dashboard_says_when_its_key_is_wrong(office):
    import asyncio

    from tui.app import Dashboard, http_fetcher

    async def run():
        app = Dashboard(http_fetcher(office.url, "not-the-key-000"), url=office.url, interval=0.1)
        async with app.run_test(size=(90, 24)) as pilot:
            for _ in range(30):
                await pilot.pause(0.1)
                if app.polls >= 1:
                    break
            assert "wrong or missing API key" in app.status and app.view is None
        good = Dashboard(http_fetcher(office.url, KEY), url=office.url, interval=0.1)
        async with good.run_test(size=(90, 24)) as pilot:
            for _ in range(30):
                await pilot.pause(0.1)
                if good.view is not None:
                    break
            assert good.status == "live" and len(good.view.slots) == 2

    asyncio.run(run())


def test_conversation_stores_keep_per_owner_and_server_wide_byte_totals(tmp_path, monkeypatch):
    """A save checks its bounds against running totals (no sum under the lock), a delete and
    the count bound give bytes back, and everyone's total is bounded too."""
    import localserve.office.conversations as conv

    store = conv.Conversations(tmp_path)
    body = {"messages": [{"role": "user", "content": "x" * 1000}]}
    size = len(json.dumps(body))
    ids = [store.save("alice", None, "t", body) for _ in range(3)]
    store.save("alice", ids[0], "t", body)  # replaced, not added
    assert store._bytes == {"alice": 3 * size}
    assert store.delete("alice", ids[1]) and store._bytes["alice"] == 2 * size
    assert conv.Conversations(tmp_path)._bytes == {"alice": 2 * size}  # read back at start
    monkeypatch.setattr(conv, "MAX_TOTAL_BYTES", 3 * size)
    store.save("bob", None, "t", body)
    with pytest.raises(conv.TooLarge, match="store is full"):
        store.save("carol", None, "t", body)
    assert store.room("carol") == 0 and store.room("alice") == 0


def test_conversation_ids_are_each_owners_own_so_a_save_reveals_nothing(tmp_path):
    """bob saving under alice's id makes bob's own conversation (200 both ways, no 404 to
    tell him the id is taken); rows saved before names existed are still found."""
    import sqlite3

    import localserve.office.conversations as conv

    old = sqlite3.connect(tmp_path / "conversations.db")  # a store from before this change
    old.executescript(conv.SCHEMA)
    old.execute("INSERT INTO conversations VALUES ('legacy', 'alice', 't', '{}', 0, 0)")
    old.commit()
    old.close()
    store = conv.Conversations(tmp_path)
    assert store.get("alice", "legacy") is not None and store.get("bob", "legacy") is None
    store.save("alice", "c1", "alice's", {"messages": ["a"]})
    store.save("bob", "c1", "bob's", {"messages": ["b"]})
    assert store.get("alice", "c1")["messages"] == ["a"]
    assert store.get("bob", "c1")["messages"] == ["b"]
    assert [c["id"] for c in store.list("bob")] == ["c1"]
    assert store.delete("bob", "c1") and store.get("alice", "c1") is not None
    store.save("alice", "legacy", "t", {"messages": ["again"]})  # the old row, replaced
    assert len(store.list("alice")) == 2
