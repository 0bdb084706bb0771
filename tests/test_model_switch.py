"""With one model loaded at a time, a request for another model waits for the loaded one's
requests at most --model-switch-timeout. Once a switch is pending, the loaded model takes no
new requests (they wait behind the switch): its running and queued ones finish, so one key's
sustained load cannot starve another key's model."""

import threading
import time

import httpx

from conftest import running, wait_for
from localserve.common.config import resolve_model


def two_models(tmp_path, timeout):
    path = resolve_model(None)
    config = tmp_path / "models.toml"
    config.write_text(f"max_loaded_models = 1\nmodel_switch_timeout = {timeout}\n"
                      f'[models.a]\npath = "{path}"\nctx_size = 2048\nparallel = 2\n'
                      f'[models.b]\npath = "{path}"\nctx_size = 1024\nparallel = 1\n')
    return running("--config", str(config), "-t", "2", log_name="switch")


def complete(srv, model, **extra):
    return httpx.post(srv.url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": "Count:", "max_tokens": 4, **extra})


def test_a_switch_waits_at_most_its_timeout_and_never_cuts_a_running_answer(tmp_path):
    with two_models(tmp_path, 3) as srv:
        streamed, answers = [], {}

        def long_stream():
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=300, json={
                    "model": "a", "prompt": "Once upon a time", "max_tokens": 600,
                    "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    streamed.append(line)

        def want_b():
            started = time.monotonic()
            answers["b"] = complete(srv, "b")
            answers["b_at"] = time.monotonic()
            answers["b_s"] = answers["b_at"] - started

        reader = threading.Thread(target=long_stream)
        reader.start()
        wait_for(lambda: len(streamed) > 2, timeout=60, what="a's stream to start")
        switcher = threading.Thread(target=want_b)
        switcher.start()
        wait_for(lambda: "b_at" in answers, timeout=120, what="b's answer")
        behind = complete(srv, "a")  # after the refused switch: a serves again
        switcher.join()
        reader.join(timeout=300)
    assert answers["b"].status_code == 503, answers["b"].text
    assert answers["b"].json()["error"]["code"] == "model_switch_timeout"
    assert answers["b_s"] < 60  # bounded by the 3 s timeout, with room for a busy machine
    assert behind.status_code == 200, behind.text
    assert "data: [DONE]" in streamed  # the running answer was never cut


def test_one_keys_sustained_load_on_a_model_cannot_starve_a_switch(tmp_path):
    """Four of alice's clients keep model a busy without a pause; bob's request for b is
    answered (a takes no new requests once b's switch is pending), and alice's go on after."""
    with two_models(tmp_path, 60) as srv:
        stop, statuses = threading.Event(), []

        def alice():
            while not stop.is_set():
                statuses.append(complete(srv, "a", max_tokens=8).status_code)

        flood = [threading.Thread(target=alice) for _ in range(4)]
        for thread in flood:
            thread.start()
        wait_for(lambda: len(statuses) >= 4, timeout=120, what="alice's load to run")
        bob = complete(srv, "b")
        done = len(statuses)
        wait_for(lambda: len(statuses) >= done + 4, timeout=180, what="alice served again")
        stop.set()
        for thread in flood:
            thread.join(timeout=300)
    assert bob.status_code == 200, bob.text
    assert bob.json()["model"] == "b"
    assert set(statuses) <= {200, 503}, statuses  # a wait past her own timeout is a clean 503
    assert statuses[-1] == 200
