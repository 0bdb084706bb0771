"""llama-server's knobs that its clients and tests rely on: server-wide sampling defaults
(--temp, -n), --chat-template, logit_bias, n_probs on /completion, /props fields, and its flags
for what localserve always does."""

import httpx
import pytest

from conftest import running


@pytest.fixture(scope="module")
def srv():
    with running("-c", "1024", "-np", "2", "-t", "2", "--temp", "0", "-n", "6",
                 "--chat-template", "llama3", "--alias", "tinyllama-2,fim,code", "--tags",
                 "chat,fim,small", *LLAMA_SERVER_ALWAYS, log_name="knobs") as server:
        yield server


# llama-server's flags for what localserve always does (its own test suite starts it so).
LLAMA_SERVER_ALWAYS = ("--kv-unified", "-cb", "--jinja", "--metrics", "--slots")


def test_llama_servers_flags_for_what_is_always_on_start_it_and_are_said_to_change_nothing(srv):
    line = next(line for line in srv.log().splitlines() if "--kv-unified" in line)
    for flag in ("--kv-unified", "--cont-batching", "--jinja", "--metrics", "--slots"):
        assert f"{flag}: nothing to change" in line
    assert httpx.get(srv.url + "/metrics").status_code == 200


def test_aliases_and_tags_are_listed_as_llama_servers_own_test_reads_them(srv):
    """llama-server's tests/unit/test_basic.py: --alias takes several names (the id is the
    first in sorted order), --tags some tags, and /models lists both."""
    model = httpx.get(srv.url + "/models").json()["data"][0]
    assert set(model["aliases"]) == {"tinyllama-2", "fim", "code"}
    assert set(model["tags"]) == {"chat", "fim", "small"} and model["id"] == "code"
    assert httpx.get(srv.url + "/v1/models/fim").json()["id"] == "code"


def post(srv, path, body):
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_defaults_apply_to_requests_that_leave_them_out(srv):
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}]}
    first, second = (post(srv, "/v1/chat/completions", body) for _ in range(2))
    assert first["usage"]["completion_tokens"] <= 6  # -n 6
    assert first["choices"][0]["message"] == second["choices"][0]["message"]  # --temp 0: greedy
    longer = post(srv, "/v1/chat/completions", {**body, "max_tokens": 12})  # the body wins
    assert longer["usage"]["completion_tokens"] > 6
    params = httpx.get(srv.url + "/props").json()["default_generation_settings"]["params"]
    assert params["temperature"] == 0 and params["n_predict"] == 6


def test_chat_template_override_is_what_renders(srv):
    props = httpx.get(srv.url + "/props").json()
    assert "<|start_header_id|>" in props["chat_template"] and props["model_path"].endswith(".gguf")
    shown = post(srv, "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]})
    assert "<|start_header_id|>user<|end_header_id|>" in shown["prompt"]
    assert "<|im_start|>user" not in shown["prompt"]  # (SmolLM2's BOS is <|im_start|>)


def test_logit_bias_forces_and_bans_tokens(srv):
    prompt = {"prompt": "1, 2, 3, 4,", "max_tokens": 3, "temperature": 0}
    greedy = post(srv, "/v1/completions", prompt)["choices"][0]["text"]
    first = post(srv, "/tokenize", {"content": greedy})["tokens"][0]
    banned = post(srv, "/v1/completions", {**prompt, "logit_bias": {str(first): -100}})
    assert post(srv, "/tokenize", {"content": banned["choices"][0]["text"]})["tokens"][0] != first
    forced_id = post(srv, "/tokenize", {"content": " zebra"})["tokens"][0]
    forced = post(srv, "/v1/completions", {**prompt, "max_tokens": 1,
                                           "logit_bias": {str(forced_id): 100}})
    assert post(srv, "/tokenize", {"content": forced["choices"][0]["text"]})["tokens"] == [forced_id]
    for bad in ({"zebra": 5}, {"99999999": 5}, {"3": 500}):
        r = httpx.post(srv.url + "/v1/completions", json={**prompt, "logit_bias": bad}, timeout=60)
        assert r.status_code == 400 and "logit_bias" in r.text, bad


def test_n_probs_gives_completion_probabilities(srv):
    reply = post(srv, "/completion", {"prompt": "The sky is", "n_predict": 4, "n_probs": 3})
    probabilities = reply["completion_probabilities"]
    assert len(probabilities) == reply["tokens_predicted"]
    assert all(len(p["top_logprobs"]) == 3 and p["logprob"] <= 0 for p in probabilities)
    assert "".join(p["token"] for p in probabilities) == reply["content"]


def test_bad_template_names_are_refused_at_start_up():
    from localserve.models.chat_template import BUILTIN
    from localserve.common.config import BUILTIN_TEMPLATES, Settings, SettingsError

    assert set(BUILTIN) == set(BUILTIN_TEMPLATES)
    with pytest.raises(SettingsError, match="chatml, llama3, gemma"):
        Settings(chat_template="vicuna-ish").validate()
    with pytest.raises(SettingsError, match="no such file"):
        Settings(chat_template_file="/nonexistent.jinja").validate()


def test_rerank_validates_the_body_and_refuses_a_model_that_cannot_rank(srv):
    ok = {"query": "fruit", "documents": ["apple", {"text": "car"}], "top_n": 1}
    for path in ("/v1/rerank", "/rerank", "/v1/reranking"):
        r = httpx.post(srv.url + path, json=ok, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_cannot_rank", path
        assert "reranker" in r.json()["error"]["message"]
    for bad, named in (({"documents": ["a"]}, "query"), ({"query": "q", "documents": []}, "documents"),
                       ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
                       ({"query": "q", "documents": [{"txt": 1}]}, "documents[0]")):
        r = httpx.post(srv.url + "/v1/rerank", json=bad, timeout=30)
        assert r.status_code == 400 and named in r.json()["error"]["message"], bad
    named = httpx.post(srv.url + "/v1/rerank", json={**ok, "model": "gpt-4"}, timeout=30)
    assert named.json()["error"]["code"] == "model_cannot_rank"  # one model answers any name
