"""/v1/embeddings on the real model: OpenAI's shapes through the official client, normalised
and deterministic vectors, base64, refusals, and generation unaffected meanwhile."""

import base64
import math
import struct
import threading

import httpx
from openai import OpenAI


def test_embeddings_through_the_openai_client(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    texts = ["The cat sat on the mat.", "Quarterly revenue grew by 4%.", "The cat sat on the mat."]
    reply = client.embeddings.create(model="text-embedding-3-small", input=texts)
    vectors = [d.embedding for d in reply.data]
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert len({len(v) for v in vectors}) == 1 and len(vectors[0]) >= 64
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vectors)
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]  # deterministic, input-specific
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 10
    alone = client.embeddings.create(model="x", input=texts[1]).data[0].embedding
    assert max(abs(a - b) for a, b in zip(alone, vectors[1])) < 1e-5  # alone == in a list


def test_base64_token_ids_and_refusals(server):
    url = server.url + "/v1/embeddings"
    as_float = httpx.post(url, json={"input": "hello"}).json()["data"][0]["embedding"]
    packed = httpx.post(url, json={"input": "hello", "encoding_format": "base64"}).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert max(abs(a - b) for a, b in zip(decoded, as_float)) < 1e-6
    ids = httpx.post(server.url + "/tokenize", json={"content": "hello", "add_special": True,
                                                     "parse_special": False}).json()["tokens"]
    by_ids = httpx.post(url, json={"input": ids}).json()["data"][0]["embedding"]
    assert max(abs(a - b) for a, b in zip(by_ids, as_float)) < 1e-5
    short = httpx.post(url, json={"input": "hello", "dimensions": 8}).json()["data"][0]["embedding"]
    assert len(short) == 8 and abs(sum(x * x for x in short) - 1) < 1e-4
    assert max(abs(a * short[0] / as_float[0] - b) for a, b in zip(as_float[:8], short)) < 1e-4
    for body, fragment in (({"input": "x", "dimensions": 0}, "dimensions"),
                           ({"input": "x", "dimensions": 100_000}, "dimensions"),
                           ({"input": "word " * 3000}, "input[0]"),
                           ({"input": ["a"] * 300}, "1 to 256"),
                           ({"input": []}, "1 to 256")):
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], body
    native = httpx.post(server.url + "/embeddings", json={"input": ["hi", "there"]})
    assert native.status_code == 200  # llama-server's own shape there: a vector in a list of one
    assert [(item["index"], len(item["embedding"])) for item in native.json()] == [(0, 1), (1, 1)]
    as_content = httpx.post(url, json={"content": "hi"}).json()  # its key, its shape
    assert as_content[0]["embedding"][0] == native.json()[0]["embedding"][0]


def test_llama_servers_mixed_and_object_inputs_as_its_own_test_sends_them(server):
    """llama-server's tests/unit/test_embedding.py: token ids with text mixed in (one input),
    a list of strings and token lists (one input each), objects with prompt_string or text
    parts (the same vector as the string); an image part or a bare content string refused."""
    url = server.url + "/v1/embeddings"
    for body, n in (([12, 34, "string", 56, 78], 1), (["string1", [12, 34, 56]], 2),
                    ([[12, 34, 56], [12, "string", 34, 56]], 2), ({"prompt_string": "string"}, 1),
                    (["string1", {"prompt_string": "string2"},
                      {"content": [{"type": "text", "text": "string3"}]}], 3)):
        r = httpx.post(url, json={"input": body}, timeout=60)
        assert r.status_code == 200 and len(r.json()["data"]) == n, (body, r.text)
    same = httpx.post(url, json={"input": ["hello world", {"content": [
        {"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]}).json()["data"]
    assert same[0]["embedding"] == same[1]["embedding"]
    for body in ({"content": "string"}, {"content": [{"type": "unknown"}]},
                 {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}):
        r = httpx.post(url, json={"input": body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", body


def test_similar_meanings_are_closer(server):
    data = httpx.post(server.url + "/v1/embeddings", timeout=60, json={
        "input": ["a cat", "a kitten", "quarterly revenue"]}).json()["data"]
    cat, kitten, revenue = (d["embedding"] for d in data)
    cos = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731  (unit vectors)
    assert cos(cat, kitten) > cos(cat, revenue)


def test_four_greedy_streams_keep_their_exact_text_while_embedding(server):
    def greedy(i):
        return httpx.post(server.url + "/v1/completions", timeout=120, json={
            "prompt": f"List {i}: 1, 2, 3,", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0}).json()["choices"][0]["text"]

    solo = [greedy(i) for i in range(4)]
    beside = [None] * 4
    threads = [threading.Thread(target=lambda i=i: beside.__setitem__(i, greedy(i)))
               for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        assert httpx.post(server.url + "/v1/embeddings", timeout=60,
                          json={"input": ["some text"] * 8}).status_code == 200
    for t in threads:
        t.join()
    assert beside == solo
