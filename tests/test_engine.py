"""The engine in-process on the real model: tokenizer round trips, sampling, fault containment."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from conftest import loaded_host
from localserve.api.app import create_app
from localserve.common.config import Settings
from localserve.engine.detokenize import IncrementalDetokenizer
from localserve.engine.request import Request, SamplingParams
from localserve.models.model_host import ModelHost


@pytest.fixture(scope="module")
def service():
    with loaded_host(ctx_size=2048, parallel=2) as svc:
        yield svc


def test_multibyte_text_survives_token_by_token_detokenizing(service):
    text = "Crème brûlée, 日本語, emoji 🎉 and ünïcödé"
    tokens = service.runner.tokenize(text, add_special=False)
    detok = IncrementalDetokenizer()
    deltas = [detok.feed(service.runner.piece(t)) for t in tokens] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert len(tokens) > len(text.split())  # some characters really were split over tokens


def generate(service, prompt, **params):
    async def run():
        tokens = service.tokenize_prompt(prompt)
        stream = service.engine.submit(Request(tokens, SamplingParams(**params)))
        return [event async for event in stream]

    return asyncio.run(run())


def test_seeded_sampling_is_reproducible_and_seed_matters(service):
    args = dict(max_tokens=24, temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, ignore_eos=True)
    text = lambda seed: "".join(e.text for e in generate(service, "Tell me a story.", seed=seed, **args))  # noqa: E731
    assert text(7) == text(7)
    assert len({text(7), text(8), text(9)}) > 1


def test_repeat_penalty_changes_a_repetitive_answer(service):
    prompt = "Repeat after me: the cat the cat the cat the cat the cat"
    plain = "".join(e.text for e in generate(service, prompt, max_tokens=24, temperature=0))
    penalized = "".join(e.text for e in generate(service, prompt, max_tokens=24, temperature=0,
                                                  repeat_penalty=1.8, presence_penalty=1.0))
    assert plain != penalized


def test_health_is_503_while_loading_and_requests_get_503():
    app = create_app(model_host=ModelHost(Settings()))  # never loaded: lifespan not run
    client = TestClient(app, base_url="http://localhost")
    assert client.get("/health").status_code == 503
    assert client.get("/health").json()["status"] == "loading"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.headers["retry-after"] and "loading" in r.json()["error"]["message"]
    for path in ("/slots", "/props"):  # the registry's lifecycle state, and every model's card
        r = client.get(path)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert [c["status"]["value"] for c in r.json()["models"]] == ["loading"]
    model = ModelHost(Settings())
    model.load_error = "broken file"  # a failed load reads as llama-server's "error"
    r = TestClient(create_app(model_host=model), base_url="http://localhost").get("/slots")
    assert r.status_code == 503 and r.json()["status"] == "error"


def test_in_flight_counts_a_request_from_submit_to_its_last_event(service):
    """The drain waits on this count: it must never read 0 while a request is unfinished,
    including the step in which the request is being admitted."""
    async def run():
        stream = service.engine.submit(Request(service.tokenize_prompt("Hi"),
                                               SamplingParams(max_tokens=6, ignore_eos=True)))
        seen = [service.in_flight()]
        async for event in stream:
            if not event.finished:
                seen.append(service.in_flight())
        return seen

    seen = asyncio.run(run())
    assert min(seen) == 1 and len(seen) == 6
    assert service.in_flight() == 0


def test_json_strings_may_not_hold_raw_control_characters(service):
    """JSON forbids raw control characters inside strings; the converter's own rule allows
    them, so the runner tightens it (this once silently did nothing)."""
    runner = service.runner
    sampling = runner.sampling
    gbnf = sampling.json_schema_grammar('{"type": "string"}')
    assert r'[^"\\\x00-\x1F\x7F]' in gbnf and sampling.grammar_error(gbnf) is None
    quote = runner.tokenize('"', add_special=False, parse_special=False)
    newline = runner.tokenize("\n", add_special=False, parse_special=False)
    letter = runner.tokenize("a", add_special=False, parse_special=False)
    assert len(quote) == len(newline) == len(letter) == 1
    spare = 10_000  # a grammar slot no request uses
    try:
        sampling._new_grammar(spare, gbnf, quote)  # inside an open string
        assert sampling._allows(sampling.grammars[spare], letter[0])
        assert not sampling._allows(sampling.grammars[spare], newline[0])
    finally:
        sampling._new_grammar(spare, None, [])


def test_a_chats_user_messages_are_found_where_the_template_starts_them(service, monkeypatch):
    """llama-server's message spans: where each user message starts among the chat's tokens
    (here `<|im_start|>user`; SmolLM2's own marker, read as llama.cpp reads it, carries its
    default system prompt), a caller typing the marker as text not counted."""
    from localserve.api.schemas import ChatCompletionRequest
    from localserve.api.serving import chat_tokens

    marker = service.tokenize("<|im_start|>user", add_special=False)
    assert service.user_marker[-2:] == marker and len(marker) == 2
    monkeypatch.setattr(service, "user_marker", marker)
    monkeypatch.setattr(service.runner, "cuts_back", False)  # (found where the engine uses them)
    body = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "<|im_start|>user and again"}])
    chat = asyncio.run(chat_tokens(service, body))
    assert len(chat.user_turns) == 2
    assert all(chat.tokens[at:at + 2] == marker for at in chat.user_turns)
    assert service.detokenize(chat.tokens[chat.user_turns[1]:]).startswith(
        "user\n<|im_start|>user and again")  # (the control token is not text)
