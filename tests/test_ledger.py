"""The office's ledger on the real server: per-key usage that matches what clients were told,
survives a restart, and is shown by role; quotas per key; a broken ledger file never fails a
request."""

import json
import logging
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import ROOT, RunningServer, key_file, running, wait_for
from localserve.office.ledger import Ledger, usage

ALICE, BOB, ROOT_KEY = "alice-key-000111", "bob-key-000222", "root-key-000333"


@pytest.fixture(scope="module")
def office_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("team")
    keys = key_file(folder, f"alice:{ALICE}", f"bob:{BOB}:user", f"root:{ROOT_KEY}:admin")
    config = folder / "localserve.toml"
    config.write_text("[quotas.alice]\nmax_concurrent = 1\n[quotas.carol]\ntokens_per_day = 200\n")
    return folder, keys, config


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def chat(srv, key, content="Count from 1 to 5.", **extra):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers=auth(key), timeout=120)


def streamed_usage(srv, key):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, headers=auth(key),
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return chunks[-1]["usage"]


def usage_rows(srv, key, **params):
    r = httpx.get(srv.url + "/v1/usage", params=params, headers=auth(key), timeout=30)
    assert r.status_code == 200, r.text
    return {row[params.get("group_by", "key")]: row for row in r.json()["data"]}


def test_ledger_sums_match_the_clients_survive_a_restart_and_follow_roles(office_files):
    folder, keys, config = office_files
    state = str(folder / "state")
    told = {"alice": [0, 0, 0], "bob": [0, 0, 0]}  # prompt, completion, requests

    def add(name, u):
        told[name][0] += u["prompt_tokens"]
        told[name][1] += u["completion_tokens"]
        told[name][2] += 1

    args = ("-c", "2048", "-np", "2", "-t", "2", "--api-key-file", str(keys), "--state-dir", state)
    with running(*args, log_name="ledger") as srv:
        add("alice", chat(srv, ALICE).json()["usage"])
        add("bob", chat(srv, BOB, "Name three colours.").json()["usage"])
        add("alice", httpx.post(srv.url + "/v1/completions", headers=auth(ALICE), timeout=120,
                                json={"prompt": "1, 2, 3,", "max_tokens": 5}).json()["usage"])
        add("bob", streamed_usage(srv, BOB))
        embedded = httpx.post(srv.url + "/v1/embeddings", headers=auth(BOB), timeout=120,
                              json={"input": ["red", "green and blue"]}).json()["usage"]
        add("bob", {"prompt_tokens": embedded["prompt_tokens"], "completion_tokens": 0})
        with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=auth(ALICE),
                          timeout=120, json={"messages": [{"role": "user", "content": "Tell a story."}],
                                             "max_tokens": 500, "ignore_eos": True,
                                             "stream": True}) as r:
            received = 0
            for line in r.iter_lines():
                received += '"content": "' in line and '"role"' not in line
                if received >= 3:
                    break  # hang up mid-answer: the server aborts the request
        wait_for(lambda: usage_rows(srv, ROOT_KEY).get("alice", {}).get("requests") == 3,
                 what="the cancelled stream in the ledger")
        rows = usage_rows(srv, ROOT_KEY)
        assert set(rows) == {"alice", "bob"}
        db = sqlite3.connect(str(folder / "state" / "ledger.db"))
        [(reason, sent)] = db.execute("SELECT finish_reason, completion_tokens FROM requests "
                                      "WHERE endpoint = '/v1/chat/completions' AND key = 'alice' "
                                      "AND finish_reason = 'abort'").fetchall()
        db.close()
        assert received <= sent < 500  # cut short, and counted with what was sent
        assert (rows["bob"]["prompt_tokens"], rows["bob"]["completion_tokens"],
                rows["bob"]["requests"]) == tuple(told["bob"])
        assert rows["alice"]["prompt_tokens"] > told["alice"][0]  # + the cancelled one's prompt
        assert rows["alice"]["completion_tokens"] >= told["alice"][1] + received
        assert set(usage_rows(srv, ALICE)) == {"alice"}  # a user sees only their own
        assert set(usage_rows(srv, BOB, group_by="model")) == {srv.slots(auth(ROOT_KEY))["model"]}
        day = usage_rows(srv, ROOT_KEY, group_by="day", **{"from": "2000-01-01"})
        assert sum(r["requests"] for r in day.values()) == 6
        admin_metrics = httpx.get(srv.url + "/metrics", headers=auth(ROOT_KEY)).text
        assert 'localserve:key_requests_total{key="bob"} 3.0' in admin_metrics  # + embedding
        assert "key_requests" not in httpx.get(srv.url + "/metrics", headers=auth(BOB)).text
        before = rows
    with running(*args, log_name="ledger-restart") as srv:
        assert usage_rows(srv, ROOT_KEY) == before
    table = subprocess.run([sys.executable, "-m", "localserve", "usage", "--state-dir", state],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "alice" in table.stdout and "bob" in table.stdout


def test_users_see_their_own_slot_rows_by_name_and_others_without(office_files):
    folder, keys, _ = office_files
    with running("-c", "2048", "-np", "2", "-t", "2", "--api-key-file", str(keys),
                 "--state-dir", str(folder / "state2"), log_name="roles") as srv:
        def long(key):
            chat(srv, key, "Tell a story.", max_tokens=300, ignore_eos=True)

        workers = [threading.Thread(target=long, args=(k,)) for k in (ALICE, BOB)]
        for w in workers:
            w.start()
        try:
            seen = wait_for(lambda: (lambda s: s if sum(r["is_processing"] for r in s) == 2 else None)(
                srv.slots(auth(ALICE))["slots"]), what="both streams running")
            assert sorted(str(r["user"]) for r in seen) == ["None", "alice"]
            assert sorted(r["user"] for r in srv.slots(auth(ROOT_KEY))["slots"]) == ["alice", "bob"]
        finally:
            for w in workers:
                w.join(timeout=120)


def test_quotas_refuse_one_key_and_serve_the_others(office_files, tmp_path):
    folder, keys, config = office_files
    keys2 = tmp_path / "keys.txt"
    keys2.write_text(keys.read_text() + "carol:carol-key-000444\n")
    keys2.chmod(0o600)
    with running("-c", "2048", "-np", "2", "-t", "2", "--api-key-file", str(keys2),
                 "--config", str(config), "--state-dir", str(tmp_path / "s"), log_name="quotas") as srv:
        carol = "carol-key-000444"
        spent = 0
        while spent < 200:  # carol's daily quota: 200 tokens
            r = chat(srv, carol, "Say hi.", max_tokens=30)
            assert r.status_code == 200, r.text
            spent += r.json()["usage"]["total_tokens"]
        wait_for(lambda: chat(srv, carol).status_code == 429, what="carol's quota to apply")
        refused = chat(srv, carol)
        error = refused.json()["error"]
        assert error["code"] == "quota_exceeded" and error["param"] == "tokens_per_day"
        assert "resets at midnight" in error["message"] and int(refused.headers["retry-after"]) >= 1
        assert chat(srv, BOB).status_code == 200
        # alice: max_concurrent = 1
        results = []
        first = threading.Thread(target=lambda: results.append(
            chat(srv, ALICE, "Tell a story.", max_tokens=200, ignore_eos=True)))
        first.start()
        wait_for(lambda: any(r["user"] == "alice" for r in srv.slots(auth(ROOT_KEY))["slots"]),
                 what="alice's first request running")
        second = chat(srv, ALICE)
        assert second.status_code == 429 and second.json()["error"]["param"] == "max_concurrent"
        assert chat(srv, BOB).status_code == 200
        first.join(timeout=120)
        assert results[0].status_code == 200
        audit = subprocess.run([sys.executable, "-m", "localserve", "usage", "--audit",
                                "--state-dir", str(tmp_path / "s")], cwd=ROOT, capture_output=True,
                               text=True, timeout=60)
        assert "quota" in audit.stdout and "tokens_per_day" in audit.stdout
        assert "max_concurrent" in audit.stdout


def test_a_broken_ledger_logs_once_and_fails_nothing(tmp_path, caplog):
    ledger = Ledger(tmp_path)
    row = {"ts": time.time(), "key": "alice", "endpoint": "/v1/completions", "model": "m",
           "prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 2, "finish_reason": "stop",
           "queue_s": 0.0, "duration_s": 0.1, "status": 200}

    class Broken:
        def __enter__(self):
            raise sqlite3.OperationalError("database or disk is full")

        def __exit__(self, *exc):
            return False

    with caplog.at_level(logging.WARNING, logger="localserve.office.ledger"):
        ledger._db, good = Broken(), ledger._db
        for _ in range(3):
            ledger.record(row)
            ledger._flush()
        ledger._db = good
        ledger.record(row)
        ledger._flush()
    ledger.close()
    assert len([r for r in caplog.records if "could not write the ledger" in r.getMessage()]) == 1
    assert usage(ledger.path)[0]["requests"] == 1  # writing resumed once the disk came back
    assert ledger.tokens_used("alice")[0] == 20  # quotas kept counting meanwhile


def test_a_deleted_ledger_file_mid_run_fails_no_request(tmp_path):
    srv = RunningServer("-c", "1024", "-np", "1", "-t", "2", "--state-dir", str(tmp_path),
                        log_name="ledger-deleted")
    try:
        srv.wait_ready()
        ok = lambda: httpx.post(srv.url + "/v1/completions", timeout=60,  # noqa: E731
                                json={"prompt": "1, 2,", "max_tokens": 2}).status_code
        assert ok() == 200
        for f in tmp_path.glob("ledger.db*"):
            f.unlink()
        assert [ok() for _ in range(3)] == [200, 200, 200]
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()


def test_sighup_reloads_the_key_file_without_dropping_requests(tmp_path):
    import signal

    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice:{ALICE}\n")
    keys.chmod(0o600)
    with running("-c", "1024", "-np", "1", "-t", "2", "--api-key-file", str(keys),
                 "--state-dir", str(tmp_path / "s"), log_name="sighup") as srv:
        results = []
        long = threading.Thread(target=lambda: results.append(
            chat(srv, ALICE, "Tell a story.", max_tokens=150, ignore_eos=True)))
        long.start()
        wait_for(lambda: any(r["is_processing"] for r in srv.slots(auth(ALICE))["slots"]),
                 what="alice's request running")
        keys.write_text(f"bob:{BOB}\n")
        srv.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: chat(srv, BOB).status_code == 200, what="bob's new key to work")
        assert chat(srv, ALICE).status_code == 401
        long.join(timeout=120)
        assert results[0].status_code == 200  # the request in flight was not dropped
        keys.write_text("# nobody\n")
        srv.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "keeping the current keys" in srv.log(), what="the refused reload")
        assert chat(srv, BOB).status_code == 200  # fail closed: the old keys stay
    audit = subprocess.run([sys.executable, "-m", "localserve", "usage", "--audit",
                            "--state-dir", str(tmp_path / "s")], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert "key_added" in audit.stdout and "bob" in audit.stdout
    assert "key_removed" in audit.stdout and "alice" in audit.stdout


def test_a_sighup_during_an_in_place_save_reads_the_file_again_once_it_is_saved(tmp_path):
    """The SIGHUP reads half a file (alice only); the save ends after: bob's key works without
    a second SIGHUP."""
    import signal

    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    keys.chmod(0o600)
    with running("-c", "1024", "-np", "1", "-t", "2", "--api-key-file", str(keys),
                 "--state-dir", str(tmp_path / "s"), log_name="sighup-save") as srv:
        keys.write_text(f"alice:{ALICE}\n")  # the editor's first write
        srv.proc.send_signal(signal.SIGHUP)
        models = lambda: httpx.get(srv.url + "/v1/models", headers=auth(BOB), timeout=30)  # noqa: E731
        wait_for(lambda: models().status_code == 401, what="the half file loaded")
        keys.write_text(f"alice:{ALICE}\nbob:{BOB}\n")  # the save ends
        wait_for(lambda: chat(srv, BOB).status_code == 200, timeout=60,
                 what="bob's key back without a second SIGHUP")
        assert "a save in progress" in srv.log()


def test_localserve_usage_aligns_long_colleague_names(tmp_path, capsys):
    """A trusted frontend's colleagues are named by e-mail (`webui:alice@office.lan`, 22
    characters): every column still lines up under its heading."""
    from localserve.cli import build_parser, run_usage
    from localserve.office.ledger import Ledger, request_row

    ledger = Ledger(tmp_path)
    for key in ("webui:alice@office.lan", "bob"):
        ledger.record(request_row(key, "/v1/chat/completions", "m", 12, 0, 3, "stop", 0.0, 0.1))
    ledger.close()
    assert run_usage(build_parser().parse_args(["usage", "--state-dir", str(tmp_path)])) == 0
    heading, *rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and {len(row) for row in rows} == {len(heading)}
    assert {row.index(" 1 ") for row in rows} == {heading.index("requests") + 6}


def test_one_models_usage_from_a_ledger_two_servers_share(tmp_path):
    """Servers started without --state-dir write one ledger: a dashboard asks for its own
    model's rows (localserve top passes the model it shows), the CLI sees them all."""
    from localserve.office.ledger import Ledger, request_row

    ledger = Ledger(tmp_path)
    for model, key, prompt in (("small", "alice", 10), ("big", "alice", 700), ("big", "bob", 5)):
        ledger.record(request_row(key, "/v1/chat/completions", model, prompt, 0, 3, "stop", 0.0, 0.1))
    ledger.close()
    small = usage(ledger.path, group_by="key", model="small")
    assert [(r["key"], r["prompt_tokens"]) for r in small] == [("alice", 10)]
    assert {r["key"]: r["prompt_tokens"] for r in usage(ledger.path, group_by="key")} == {
        "alice": 710, "bob": 5}
    assert usage(ledger.path, model="none-such") == []
