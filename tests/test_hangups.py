"""Every API shape, streamed or not, frees its slot when its client hangs up mid-answer: the
one reader of engine events (api/answer.py) cancels for all of them. Each case opens a raw
connection, waits until its request is decoding, closes the socket, and waits until the engine
counts one more aborted request and every slot is idle."""

import json
import socket
from urllib.parse import urlparse

import pytest

from conftest import running, wait_for

STORY = "Tell me a very long story about a dragon and a lighthouse."


@pytest.fixture(scope="module")
def srv():
    with running("-c", "2048", "-np", "2", "-t", "2", log_name="hangups") as server:
        yield server


CASES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": STORY}],
                                      "max_tokens": 400, "ignore_eos": True}),
    "completions": ("/v1/completions", {"prompt": STORY, "max_tokens": 400, "ignore_eos": True}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": STORY}],
                                  "max_tokens": 400, "ignore_eos": True}),
    "responses": ("/v1/responses", {"input": STORY, "max_output_tokens": 400, "ignore_eos": True}),
    "native": ("/completion", {"prompt": STORY, "n_predict": 400, "ignore_eos": True}),
    "ollama-chat": ("/api/chat", {"messages": [{"role": "user", "content": STORY}],
                                  "options": {"num_predict": 400}}),
    "ollama-generate": ("/api/generate", {"prompt": STORY,
                                          "options": {"num_predict": 400}}),
}


def engine(srv) -> dict:
    return srv.slots()["engine"]


def decoding(srv) -> bool:
    return any(s["state"] == "decode" and s["n_decoded"] >= 2 for s in srv.slots()["slots"])


def hang_up_mid_answer(srv, path: str, body: dict, what: str) -> bool:
    """Send, close the socket once the answer is decoding, wait until every slot is idle:
    whether the engine counted the request as aborted (Ollama's API cannot ignore EOS, so an
    answer may also end by itself before the hang-up is seen)."""
    aborted = engine(srv)["requests_aborted"]
    data = json.dumps(body).encode()
    url = urlparse(srv.url)
    conn = socket.create_connection((url.hostname, url.port))
    conn.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    try:
        wait_for(lambda: decoding(srv), timeout=120, what=f"{what} to decode")
    finally:
        conn.close()
    wait_for(lambda: all(s["state"] == "idle" for s in srv.slots()["slots"]), timeout=120,
             what="every slot idle")
    return engine(srv)["requests_aborted"] > aborted


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shape", list(CASES))
def test_a_client_that_hangs_up_frees_its_slot_in_every_shape(srv, shape, stream):
    path, body = CASES[shape]
    streams_by_default = path.startswith("/api/")
    body = {**body, "stream": stream} if stream or streams_by_default else body
    what = f"{shape} (stream={stream})"
    assert any(hang_up_mid_answer(srv, path, body, what) for _ in range(3)), \
        f"{what}: three answers ran on after their client hung up"
