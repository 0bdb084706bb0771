"""A drop-in for llama-server and a stricter OpenAI twin: stream shapes, paths without /v1,
logprobs, llama-server's native routes, cache types and flash attention, JSON logs."""

import json
import math
import subprocess
import sys
import uuid

import httpx
import pytest
from openai import OpenAI

from conftest import ROOT, running

COUNT = [{"role": "user", "content": "Count from 1 to 10."}]


def raw_stream(url, path, body):
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        raw = r.read().decode()
    assert "\r" not in raw  # LF-separated events, as OpenAI and llama-server send
    return [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": COUNT, "max_tokens": 6, "temperature": 0}),
    ("/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0}),
])
def test_the_finish_reason_comes_alone_after_the_last_text(server, path, body):
    chunks = raw_stream(server.url, path, body)
    texts = [c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text")
             for c in chunks]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert not texts[-1]  # the finishing chunk carries no text
    assert sum(1 for t in texts if t) >= 5  # ... and the text before it is all there
    assert all(c["system_fingerprint"] for c in chunks)


def test_openai_client_without_v1_and_any_model_name(server):
    client = OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="gpt-3.5-turbo", messages=COUNT, max_tokens=8,
                                           temperature=0)
    assert reply.model == server.slots()["model"] and reply.choices[0].message.refusal is None
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="gpt-3.5-turbo", messages=COUNT, max_tokens=8, temperature=0, stream=True)
        if c.choices)
    assert streamed == reply.choices[0].message.content
    model = client.models.retrieve(reply.model)
    assert model.id == reply.model and model.created > 0


def test_two_assistant_messages_in_a_row_are_accepted(server):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "assistant", "content": "How can I help?"},
                {"role": "user", "content": "Say yes."}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 4})
    assert r.status_code == 200


def check_entries(entries, greedy_tokens=None):
    for entry in entries:
        assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and len(tops) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the best one
        assert entry["bytes"] == list(entry["token"].encode())


def test_chat_logprobs_whole_and_streamed(server):
    body = {"messages": COUNT, "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    entries = whole["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == whole["choices"][0]["message"]["content"]
    check_entries(entries)
    streamed = [e for c in raw_stream(server.url, "/v1/chat/completions", body)
                for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]
    too_many = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={**body, "top_logprobs": 21})
    assert too_many.status_code == 400 and "top_logprobs" in too_many.json()["error"]["message"]


def test_completion_logprobs_in_the_legacy_shape(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "1, 2, 3,", "max_tokens": 5, "temperature": 0, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert all(x <= 0 for x in lp["token_logprobs"]) and all(len(t) == 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0
    streamed = raw_stream(server.url, "/v1/completions", {
        "prompt": "1, 2, 3,", "max_tokens": 5, "temperature": 0, "logprobs": 2})
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in streamed
               if c["choices"][0]["logprobs"]]
    assert offsets == lp["text_offset"]  # each chunk's offset counts the text sent before it


def test_tokenize_detokenize_apply_template_round_trip(server):
    text = "Crème brûlée <|im_end|> 日本"
    ids = httpx.post(server.url + "/tokenize", json={"content": text}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["content"] == \
        text.replace("<|im_end|>", "")  # a control token has no text of its own
    plain = httpx.post(server.url + "/tokenize", json={"content": text, "parse_special": False,
                                                       "with_pieces": True}).json()["tokens"]
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                   for p in plain)  # a piece that is part of a character comes as bytes
    assert raw == text.encode()
    back = httpx.post(server.url + "/detokenize", json={"tokens": [p["id"] for p in plain]})
    assert back.json()["content"] == text
    prompt = httpx.post(server.url + "/apply-template", json={"messages": COUNT}).json()["prompt"]
    assert "<|im_start|>user\nCount from 1 to 10.<|im_end|>" in prompt


def test_native_completion_whole_and_streamed(server):
    body = {"prompt": "1, 2, 3,", "n_predict": 6, "temperature": 0, "return_tokens": True}
    whole = httpx.post(server.url + "/completion", json=body, timeout=60).json()
    assert whole["stop"] and whole["stop_type"] == "limit" and whole["tokens_predicted"] == 6
    assert len(whole["tokens"]) == 6 and whole["timings"]["predicted_n"] == 6
    tokens = httpx.post(server.url + "/tokenize", json={"content": "1, 2, 3,"}).json()["tokens"]
    by_ids = httpx.post(server.url + "/completion", timeout=60,
                        json={**body, "prompt": tokens, "return_tokens": False}).json()
    assert by_ids["content"] == whole["content"]
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["stop"] and not any(e["stop"] for e in events[:-1])


def test_infill_is_refused_plainly_without_fim_tokens(server):
    r = httpx.post(server.url + "/infill", json={"input_prefix": "def f(", "input_suffix": "):"})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]


def test_props_and_slots_carry_llama_server_fields(server):
    props = httpx.get(server.url + "/props").json()
    assert props["total_slots"] == 4 and "<|im_start|>" in props["chat_template"]
    assert props["cache"] == {"type_k": "f16", "type_v": "f16", "flash_attn": "auto"}
    slots = server.slots()["slots"]
    assert all(s["is_processing"] is (s["state"] != "idle") for s in slots)
    plain = httpx.get(server.url + "/slots").json()  # llama-server's shape: an array
    assert [s["id"] for s in plain] == [0, 1, 2, 3]
    assert all({"n_ctx", "is_processing", "id_task", "next_token"} <= s.keys() for s in plain)


PROMPTS = ["1, 2, 3, 4,", "10, 20, 30,", "The capital of France is"]


def greedy(url):
    return [httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": p, "max_tokens": 24, "temperature": 0}).json()["choices"][0]["text"] for p in PROMPTS]


def test_quantized_cache_with_flash_attention_serves(server, capsys):
    f16 = greedy(server.url)
    with running("-c", "2048", "-np", "2", "-t", "2", "--cache-type-k", "q8_0",
                 "--cache-type-v", "q8_0", "--flash-attn", "on", log_name="q8-cache") as srv:
        q8 = greedy(srv.url)
        log = srv.log()
    assert "cache K q8_0 / V q8_0: 1.88x the tokens an f16 cache fits" in log
    assert all(q8)
    with capsys.disabled():
        print(f"\n  greedy, f16 vs q8_0 cache: {sum(a == b for a, b in zip(f16, q8))}/3 identical")
        for a, b in zip(f16, q8):
            if a != b:
                print(f"    f16 {a!r}\n    q8  {b!r}")


def test_a_quantized_v_cache_without_flash_attention_is_refused():
    run = subprocess.run([sys.executable, "-m", "localserve", "up", "--cache-type-v", "q8_0",
                          "--flash-attn", "auto", "--port", "1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "--cache-type-v" in run.stderr and "--flash-attn on" in run.stderr
    assert "Traceback" not in run.stderr


def test_json_logs_and_version():
    with running("-c", "512", "-np", "1", "-t", "2", "--log-format", "json", log_name="json-logs") as srv:
        httpx.get(srv.url + "/health")
        lines = [line for line in srv.log().splitlines() if line.startswith("{")]
    entries = [json.loads(line) for line in lines]
    assert any(e["logger"] == "localserve" and "listening on" in e["message"] for e in entries)
    assert any(e["logger"] == "uvicorn.access" for e in entries)
    version = subprocess.run([sys.executable, "-m", "localserve", "up", "--version"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("localserve ")


def test_n_choices_prefill_the_prompt_once(server):
    """n=3: one prompt prefill (the others copy it: each computes only the last prompt token),
    the prompt counted once in usage, and greedy choices identical to a lone greedy run."""
    # counting: a continuation so certain that one pool's last-bit noise cannot flip it
    body = {"prompt": f"Note {uuid.uuid4().hex}: 1, 2, 3, 4, 5, 6,", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    before = server.slots()["engine"]["prompt_tokens_computed"]
    reply = httpx.post(server.url + "/v1/completions", json={**body, "n": 3}, timeout=120).json()
    computed = server.slots()["engine"]["prompt_tokens_computed"] - before
    n_prompt = reply["usage"]["prompt_tokens"]
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert computed == n_prompt + 2
    assert reply["usage"]["completion_tokens"] == 3 * 8
    alone = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    assert [c["text"] for c in reply["choices"]] == [alone["choices"][0]["text"]] * 3


def test_n_choices_each_sample_with_their_own_seed_streamed_or_not(client):
    ask = dict(model="any", messages=COUNT, max_tokens=10, temperature=1.0)
    # Choice i is sampled with seed + i. Its text is compared with a lone request's only by
    # its first token: in one cache pool the logits differ in their last bits with the
    # neighbours' layout (README, One pool), and sampling can part after that.
    whole = client.chat.completions.create(n=2, seed=7, **ask)
    texts = [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 2 and all(texts)  # two seeds, two answers
    streamed, finishes = ["", ""], [None, None]
    for chunk in client.chat.completions.create(n=2, seed=7, stream=True, **ask):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            finishes[choice.index] = finishes[choice.index] or choice.finish_reason
    assert all(streamed) and None not in finishes


def test_more_choices_than_slots_is_refused(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": COUNT, "max_tokens": 4, "n": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_infill_refuses_a_prompt_with_images_by_name(server):
    """The fuzzer's find: /infill shares /completion's body, whose prompt may carry images;
    it was a 500 (the image prompt read as token ids)."""
    r = httpx.post(server.url + "/infill", json={"prompt": {"prompt_string": ""}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def data_events(url, path, body):
    """Each SSE event's data (events named with `event:` lines too, as Responses sends)."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and "timings" not in r.headers.get("x-ignored-fields", "")
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    return [json.loads(line[6:]) for line in lines]


TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
           "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.mark.parametrize("path, body, texts", [
    ("/v1/chat/completions", {"messages": COUNT, "max_tokens": 6, "ignore_eos": True},
     lambda e: e["choices"] and e["choices"][0]["delta"].get("content")),
    ("/completion", {"prompt": "1, 2, 3,", "n_predict": 6, "ignore_eos": True},
     lambda e: e.get("content") and not e["stop"]),
    ("/v1/responses", {"input": "Count.", "max_output_tokens": 6, "ignore_eos": True},
     lambda e: e["type"] == "response.output_text.delta"),
])
def test_timings_per_token_and_the_last_events_timings_as_llama_server_sends_them(
        server, path, body, texts):
    """llama-server's `timings` (its test_compat_oai_responses.py telemetry test): on every
    text piece when timings_per_token is sent, and on the last event always."""
    events = data_events(server.url, path, {**body, "timings_per_token": True})
    pieces = [e for e in events if texts(e)]
    assert len(pieces) >= 2 and all(set(e["timings"]) == TIMINGS for e in pieces)
    assert [e["timings"]["predicted_n"] for e in pieces] == sorted(
        e["timings"]["predicted_n"] for e in pieces)  # counted as the answer grows
    last = events[-1]["timings"]
    assert set(last) == TIMINGS and last["predicted_n"] == 6 and last["prompt_n"] > 0
    untimed = data_events(server.url, path, body)
    assert not any("timings" in e for e in untimed if texts(e))


def test_a_whole_chat_answer_carries_llama_servers_timings(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"messages": COUNT, "max_tokens": 4, "ignore_eos": True})
    timings = r.json()["timings"]
    assert set(timings) == TIMINGS and timings["predicted_n"] == 4
    assert timings["predicted_per_second"] > 0 and timings["prompt_n"] + timings["cache_n"] == \
        r.json()["usage"]["prompt_tokens"]
