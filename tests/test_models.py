"""Several models behind one address (registry.py): two names for the embedded model with
different -c/-np, loaded on demand, one at a time, unloaded when idle, refused when they can
never fit; and the settings that declare them."""

import json
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import RunningServer, running, wait_for
from localserve.common.config import Settings, SettingsError, default_model_path
from localserve.models.model_specs import model_specs, parse_size, split_model_flags

PROMPT = {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def office(tmp_path_factory):
    path = default_model_path()
    config = tmp_path_factory.mktemp("models") / "models.toml"
    config.write_text(f"""
max_loaded_models = 1
idle_unload = 3
[models.chat]
path = "{path}"
ctx_size = 2048
parallel = 2
[models.wide]
path = "{path}"
ctx_size = 8192
parallel = 4
[models.huge]
path = "{path}"
ctx_size = 4000000
[models.vectors]
path = "{path}"
kind = "embedding"
ctx_size = 1024
parallel = 1
""")
    with running("--config", str(config), "-t", "2", log_name="models") as srv:
        yield srv


def states(srv) -> dict:
    cards = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]
    return {c["id"]: c["status"]["value"] for c in cards}


def complete(srv, model, **extra):
    r = httpx.post(srv.url + "/v1/completions", json={**PROMPT, "model": model, **extra},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def rss(srv) -> int:
    return psutil.Process(srv.proc.pid).memory_info().rss


def test_models_are_listed_with_their_state_and_unknown_names_are_404(office):
    assert states(office) == {"chat": "loaded", "wide": "unloaded", "huge": "unloaded",
                              "vectors": "unloaded"}
    r = httpx.post(office.url + "/v1/completions", json={**PROMPT, "model": "gpt-3.5-turbo"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "chat, wide, huge, vectors" in r.json()["error"]["message"]


def test_a_second_model_waits_for_the_first_to_finish_then_loads_and_unloads_when_idle(office):
    solo = complete(office, "chat")["choices"][0]["text"]
    streamed, done = [], {}

    def stream_chat():
        with httpx.stream("POST", office.url + "/v1/completions", timeout=300,
                          json={**PROMPT, "model": "chat", "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
        done["chat"] = time.monotonic()

    reader = threading.Thread(target=stream_chat)
    reader.start()
    wait_for(lambda: streamed, timeout=60, what="the chat stream's first token")
    wide = complete(office, "wide")  # while chat streams: it must wait, not cut chat off
    done["wide"] = time.monotonic()
    reader.join(timeout=120)
    assert "".join(streamed) == solo  # chat finished intact ...
    assert done["chat"] <= done["wide"]  # ... before wide was served
    assert wide["model"] == "wide" and wide["choices"][0]["text"] == solo  # same weights, greedy
    assert states(office) == {"chat": "unloaded", "wide": "loaded", "huge": "unloaded",
                              "vectors": "unloaded"}
    slots = httpx.get(office.url + "/slots?view=full", timeout=10).json()
    assert slots["model"] == "wide" and slots["n_slots"] == 4 and slots["n_ctx_per_slot"] == 8192
    assert slots["n_ctx_guaranteed"] == 2048
    loaded = rss(office)
    wait_for(lambda: states(office)["wide"] == "unloaded", timeout=30, what="idle unload")
    assert rss(office) < loaded - 50 * 1024 ** 2  # the weights and the 8192-token cache freed


def test_metrics_carry_a_model_label(office):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(office.url + "/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "localserve:generation_tokens_total"]
    assert {s.labels["model"] for s in samples} == {"chat", "wide", "huge", "vectors"}


def test_a_model_that_cannot_fit_is_refused_with_the_numbers_and_others_keep_running(office):
    complete(office, "chat")
    r = httpx.post(office.url + "/v1/completions", json={**PROMPT, "model": "huge"}, timeout=60)
    assert r.status_code == 507, r.text
    assert "GiB" in r.json()["error"]["message"] and r.json()["error"]["param"] == "model"
    assert states(office)["chat"] == "loaded"
    complete(office, "chat")


def test_model_settings_from_flags_and_tables(tmp_path):
    assert split_model_flags(["a.gguf", "coder=b.gguf"]) == ("a.gguf", {"coder": {"path": "b.gguf"}})
    with pytest.raises(SettingsError, match="already"):
        split_model_flags(["a.gguf", "b.gguf"])
    with pytest.raises(SettingsError, match="NAME=PATH"):
        split_model_flags(["=b.gguf"])
    assert parse_size("6G") == 6 * 1024 ** 3 and parse_size("512MiB") == 512 * 1024 ** 2
    path = str(default_model_path())
    (tmp_path / "extra.gguf").symlink_to(path)
    specs = model_specs(Settings(model=path, models={"small": {"path": path, "parallel": 1}},
                                 models_dir=str(tmp_path)))
    assert [s.name for s in specs] == [default_model_path().stem, "small", "extra"]
    assert specs[1].settings(Settings()).parallel == 1
    with pytest.raises(SettingsError, match=r"^\[models.gone\] path = /nowhere.gguf: no such file"):
        model_specs(Settings(models={"gone": {"path": "/nowhere.gguf"}}))


def test_an_embedding_model_embeds_and_refuses_chat(office):
    def embed(model):
        r = httpx.post(office.url + "/v1/embeddings", timeout=120,
                       json={"model": model, "input": ["a cat", "quarterly revenue"]})
        assert r.status_code == 200, r.text
        return [d["embedding"] for d in r.json()["data"]]

    own = embed("vectors")  # the GGUF names no pooling: last-token pooling, as the chat model's
    assert max(abs(a - b) for a, b in zip(own[0], embed("chat")[0])) < 1e-5
    r = httpx.post(office.url + "/v1/chat/completions", timeout=60, json={
        "model": "vectors", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]


def test_a_request_during_start_up_waits_for_that_load_and_starts_no_second_one():
    path = default_model_path()
    srv = RunningServer("--model", f"a={path}", "--model", f"b={path}", "-c", "1024", "-np", "1",
                        "-t", "2", log_name="models-start")
    try:
        def first_answer():
            try:
                return httpx.post(srv.url + "/v1/completions", timeout=120,
                                  json={**PROMPT, "model": "a", "max_tokens": 4})
            except httpx.TransportError:
                return None  # not listening yet
        r = wait_for(first_answer, timeout=120, what="an answer from model a")
        assert r.status_code == 200, r.text
        assert "loading a on demand" not in srv.log()
    finally:
        srv.stop()


def test_unloading_the_default_model_leaves_the_others_running(tmp_path):
    """Two models loaded at once; the default one unloaded when idle: the pinned other keeps
    serving (its engine belongs to it, not to the default model's Service)."""
    config = tmp_path / "two.toml"
    config.write_text(f"""idle_unload = 1
[models.a]
path = "{default_model_path()}"
[models.b]
path = "{default_model_path()}"
pin = true
""")
    with running("--config", str(config), "-c", "1024", "-np", "1", "-t", "2",
                 log_name="models-two") as srv:
        complete(srv, "b")
        wait_for(lambda: states(srv)["a"] == "unloaded", timeout=30, what="a unloaded")
        assert complete(srv, "b")["model"] == "b" and states(srv)["b"] == "loaded"


def test_a_loading_model_shows_its_load_progress():
    from types import SimpleNamespace

    from localserve.engine.runner import model_file
    from localserve.models.model_specs import ModelSpec
    from localserve.models.model_entry import Entry, model_card

    loading = SimpleNamespace(engine=None, unloaded=False, load_error=None, loop=None,
                              settings=Settings(), model_file=Path("/nowhere/big.gguf"))
    model_file._PROGRESS["last"] = 42
    card = model_card(Entry(ModelSpec("big", None), loading))
    assert card["status"] == {"value": "loading", "progress": 0.42}
