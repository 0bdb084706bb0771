"""With one model loaded at a time, a request for another model waits for the loaded one's
requests at most --model-switch-timeout, and meanwhile the loaded model keeps serving its own
requests instead of queuing them behind the pending switch."""

import threading
import time

import httpx

from conftest import running, wait_for
from localserve.config import resolve_model


def test_a_switch_waits_at_most_its_timeout_and_the_loaded_model_keeps_serving(tmp_path):
    path = resolve_model(None)
    config = tmp_path / "models.toml"
    config.write_text(f"max_loaded_models = 1\nmodel_switch_timeout = 3\n"
                      f'[models.a]\npath = "{path}"\nctx_size = 2048\nparallel = 2\n'
                      f'[models.b]\npath = "{path}"\nctx_size = 1024\nparallel = 1\n')
    with running("--config", str(config), "-t", "2", log_name="switch") as srv:
        def complete(model, **extra):
            return httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": "Count:", "max_tokens": 4, **extra})

        streamed, answers = [], {}

        def long_stream():
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=300, json={
                    "model": "a", "prompt": "Once upon a time", "max_tokens": 600,
                    "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    streamed.append(line)

        def want_b():
            started = time.monotonic()
            answers["b"] = complete("b")
            answers["b_at"] = time.monotonic()
            answers["b_s"] = answers["b_at"] - started

        reader = threading.Thread(target=long_stream)
        reader.start()
        wait_for(lambda: len(streamed) > 2, timeout=60, what="a's stream to start")
        switcher = threading.Thread(target=want_b)
        switcher.start()
        served_meanwhile = []
        while switcher.is_alive():
            r = complete("a")
            assert r.status_code == 200, r.text  # a keeps serving while b waits
            served_meanwhile.append(time.monotonic())
        switcher.join()
        reader.join(timeout=300)
    assert answers["b"].status_code == 503, answers["b"].text
    assert answers["b"].json()["error"]["code"] == "model_switch_timeout"
    assert answers["b_s"] < 60  # bounded by the 3 s timeout, with room for a busy machine
    # requests for a were answered while the switch was pending, not queued behind it
    assert served_meanwhile and served_meanwhile[0] < answers["b_at"]
