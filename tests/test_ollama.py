"""Ollama's API through the official `ollama` client (and plain HTTP for what the client
hides), on the real server with keys: the same admission, billing and answer path as every
other API shape."""

import json

import httpx
import ollama
import pytest

from conftest import key_file, ledger_rows, running, wait_for

ALICE, BOB = "alice-key-000111", "bob-key-000222"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 30}}}}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ollama")
    keys = key_file(folder, f"alice:{ALICE}:user", f"bob:{BOB}:user")
    config = folder / "office.toml"
    config.write_text("[quotas.bob]\nrequests_per_minute = 2\n")
    with running("-c", "2048", "-np", "2", "-t", "2", "--api-key-file", str(keys), "--config",
                 str(config), "--state-dir", str(folder / "state"), log_name="ollama") as server:
        server.state = folder / "state"
        yield server


def client(srv, key=ALICE) -> ollama.Client:
    return ollama.Client(host=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def test_the_catalog_lists_shows_and_reports_loaded_models(srv):
    c = client(srv)
    listed = c.list().models
    assert len(listed) == 1 and listed[0].details.format == "gguf" and listed[0].size > 0
    name = listed[0].model
    loaded = c.ps().models
    assert [m.model for m in loaded] == [name] and loaded[0].context_length == 2048  # the pool
    assert loaded[0].expires_at.year > 2300  # one model is never unloaded: Ollama's "forever"
    shown = c.show(name)
    assert "completion" in shown.capabilities and shown.details.quantization_level == "Q4_1"
    assert "im_start" in shown.template  # the model's own chat template
    assert httpx.get(srv.url + "/api/version", headers={"Authorization": f"Bearer {ALICE}"},
                     timeout=30).json()["version"]


def test_chat_whole_and_streamed_with_options_and_the_final_counts(srv):
    c = client(srv)
    ask = dict(model="any", messages=[{"role": "user", "content": "Count to ten."}],
               options={"num_predict": 6, "temperature": 0, "seed": 1})
    whole = c.chat(**ask)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 6
    assert whole.prompt_eval_count > 5 and whole.total_duration >= whole.eval_duration > 0
    parts = list(c.chat(**ask, stream=True))
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content  # greedy
    assert parts[-1].eval_count == 6 and parts[-1].done_reason == "length"


def test_generate_templated_raw_and_the_load_request(srv):
    c = client(srv)
    templated = c.generate(model="any", prompt="Name a colour.", system="One word only.",
                           options={"num_predict": 4, "temperature": 0})
    assert templated.done and templated.prompt_eval_count > 10  # system + template tokens
    raw = c.generate(model="any", prompt="Once upon a time", raw=True,
                     options={"num_predict": 4, "temperature": 0})
    assert raw.prompt_eval_count <= 6 and raw.response
    streamed = list(c.generate(model="any", prompt="Once upon a time", raw=True, stream=True,
                               options={"num_predict": 4, "temperature": 0}))
    assert "".join(p.response for p in streamed) == raw.response
    load = c.generate(model="any")  # Ollama clients load a model with an empty prompt
    assert load.done and load.done_reason == "load"


def test_format_json_and_a_schema_constrain_the_answer(srv):
    c = client(srv)
    loose = c.chat(model="any", format="json", options={"num_predict": 60, "temperature": 0},
                   messages=[{"role": "user", "content": "A person as JSON."}])
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    strict = c.chat(model="any", format=schema, options={"num_predict": 30},
                    messages=[{"role": "user", "content": "Pick a colour."}])
    if loose.done_reason == "stop":
        assert isinstance(json.loads(loose.message.content), dict)
    assert json.loads(strict.message.content)["colour"] in ("red", "blue")


@pytest.mark.parametrize("stream", [False, True])
def test_tools_give_tool_calls_and_their_results_can_be_sent_back(srv, stream):
    c = client(srv)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        parts = list(c.chat(model="any", messages=messages, tools=[WEATHER], stream=True,
                            options={"num_predict": 60, "temperature": 0}))
        calls = [call for p in parts for call in (p.message.tool_calls or [])]
    else:
        answer = c.chat(model="any", messages=messages, tools=[WEATHER],
                        options={"num_predict": 60, "temperature": 0})
        calls = answer.message.tool_calls or []
    if not calls:
        pytest.skip("the 135M model answered in prose this time")
    assert calls[0].function.name == "get_weather" and isinstance(calls[0].function.arguments, dict)
    history = messages + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": dict(calls[0].function.arguments)}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "22 degrees, sunny"}]
    follow = c.chat(model="any", messages=history, tools=[WEATHER], options={"num_predict": 10})
    assert follow.done


def test_embed_and_embeddings(srv):
    c = client(srv)
    both = c.embed(model="any", input=["hello", "world"])
    assert len(both.embeddings) == 2 and len(both.embeddings[0]) > 100
    assert both.prompt_eval_count >= 2
    one = c.embeddings(model="any", prompt="hello")
    assert len(one.embedding) == len(both.embeddings[0])


def test_refusals_say_what_and_come_in_ollamas_error_shape(srv):
    c = client(srv)
    cases = [
        (lambda: c.chat(model="any", messages=[{"role": "user", "content": "x"}],
                        options={"tfs_z": 0.5}), 400, "tfs_z"),
        (lambda: c.generate(model="any", prompt="x", template="{{ .Prompt }}"), 400, "template"),
        (lambda: c.chat(model="any", think=True, messages=[{"role": "user", "content": "x"}]),
         400, "thinking"),
        (lambda: c.pull("llama3"), 501, "localserve pull"),
        (lambda: c.delete("llama3"), 501, "cannot delete"),
    ]
    for call, status, words in cases:
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == status and words in refused.value.error
    wrong_key = ollama.Client(host=srv.url, headers={"Authorization": "Bearer nope"})
    with pytest.raises(ollama.ResponseError) as refused:
        wrong_key.list()
    assert refused.value.status_code == 401


def test_a_num_ctx_above_what_a_request_may_use_is_held_to_it_as_ollama_does(srv):
    """LlamaIndex's Ollama client sends the trained context from /api/show on every call."""
    c = client(srv)
    trained = next(v for k, v in c.show("any").modelinfo.items() if k.endswith(".context_length"))
    for num_ctx in (trained, 100_000):
        answer = c.chat(model="any", messages=[{"role": "user", "content": "x"}],
                        options={"num_ctx": num_ctx, "num_predict": 2})
        assert answer.done and answer.eval_count <= 2


def test_a_small_num_ctx_is_honoured_and_a_prompt_beyond_it_refused(srv):
    c = client(srv)
    fits = c.generate(model="any", prompt="Hello there", raw=True,
                      options={"num_ctx": 12, "temperature": 0})
    assert fits.prompt_eval_count + fits.eval_count <= 12 and fits.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as refused:
        c.generate(model="any", prompt="word " * 40, raw=True, options={"num_ctx": 12})
    assert refused.value.status_code == 400 and "num_ctx" in refused.value.error


def test_usage_is_billed_to_the_key_and_quotas_apply(srv):
    c = client(srv, BOB)
    c.chat(model="any", messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 3})
    wait_for(lambda: any(key == "bob" and completion == 3
                         for key, _, completion in ledger_rows(srv.state, "/api/chat")),
             what="bob's /api/chat row in the ledger")
    c.generate(model="any", prompt="Hi", raw=True, options={"num_predict": 2})
    with pytest.raises(ollama.ResponseError) as refused:  # bob's requests_per_minute = 2
        c.embed(model="any", input="hi")
    assert refused.value.status_code == 429


def test_streamed_lines_are_ndjson_with_one_final_object(srv):
    with httpx.stream("POST", srv.url + "/api/generate", headers={"Authorization": f"Bearer {ALICE}"},
                      json={"model": "any", "prompt": "Hi", "options": {"num_predict": 3}},
                      timeout=120) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [line["done"] for line in lines].count(True) == 1 and lines[-1]["done"]
    assert all(isinstance(line["response"], str) for line in lines)
    assert lines[-1]["eval_count"] == 3 and isinstance(lines[-1]["total_duration"], int)


def test_embed_truncates_by_default_and_cuts_dimensions_as_ollama_does(srv):
    """docs/api.md: `truncate` (default true) cuts each input to the context; `dimensions`
    keeps the first N values, normalised again."""
    c = client(srv)
    long = c.embed(model="any", input="word " * 3000)
    assert len(long.embeddings) == 1 and long.prompt_eval_count < 3000
    with pytest.raises(ollama.ResponseError) as refused:
        c.embed(model="any", input="word " * 3000, truncate=False)
    assert refused.value.status_code == 400
    short = c.embed(model="any", input="hello", dimensions=8).embeddings[0]
    assert len(short) == 8 and abs(sum(x * x for x in short) - 1) < 1e-4


def test_every_documented_option_is_taken_and_a_load_call_says_what_keep_alive_did(srv):
    """docs/api.md's "every option" request sends repeat_last_n (llama.cpp's penalty_last_n).
    A keep_alive 0 load call on a server of one model (which never unloads it) is answered
    "load", with keep_alive in X-Ignored-Fields."""
    c = client(srv)
    answer = c.generate(model="any", prompt="Why is the sky blue?", options={
        "num_predict": 4, "temperature": 0.8, "repeat_last_n": 33, "repeat_penalty": 1.2,
        "top_k": 20, "top_p": 0.9, "min_p": 0.0, "typical_p": 0.7, "seed": 42, "stop": ["\n\n"],
        "presence_penalty": 1.5, "frequency_penalty": 1.0, "num_ctx": 1024})
    assert answer.done
    r = httpx.post(srv.url + "/api/generate", json={"model": "any", "keep_alive": 0}, timeout=60,
                   headers={"Authorization": f"Bearer {ALICE}"})
    assert r.json()["done_reason"] == "load" and r.headers["x-ignored-fields"] == "keep_alive"


def test_a_body_is_json_whatever_its_content_type_says(srv):
    """LiteLLM's async transport labels its JSON application/octet-stream; Ollama reads it."""
    body = json.dumps({"model": "any", "stream": False, "options": {"num_predict": 2},
                       "messages": [{"role": "user", "content": "Hi"}]})
    for kind in ("application/octet-stream", "text/plain", "multipart/form-data"):
        r = httpx.post(srv.url + "/api/chat", content=body, timeout=60, headers={
            "Authorization": f"Bearer {ALICE}", "Content-Type": kind})
        assert r.status_code == 200 and r.json()["done"], (kind, r.text)
