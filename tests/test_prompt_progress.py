"""llama-server's `return_progress` (its tests/unit/test_chat_completion.py::test_return_progress,
the same assertions): a streamed request that asks is told how far its prompt is computed
before the first token, on /v1/chat/completions, /v1/responses (its response.in_progress
events: test_compat_oai_responses.py) and llama-server's /completion."""

import json

import httpx

PROMPT = "This is a test " * 150  # about 600 tokens: two of the server's 512-token prefill steps


def progress_reports(url: str, path: str, body: dict) -> list[dict]:
    reports = []
    with httpx.stream("POST", url + path, json={**body, "stream": True, "return_progress": True},
                      timeout=120) as r:
        assert r.status_code == 200 and "return_progress" not in r.headers.get("x-ignored-fields", "")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                if "prompt_progress" in data:
                    assert not reports or data.get("choices", [{}])[0].get("delta", {}).get(
                        "content") in (None, "")  # progress carries no text
                    reports.append(data["prompt_progress"])
    return reports


def check(reports: list[dict]) -> None:
    first, last = reports[0], reports[-1]
    assert first["total"] > 0 and first["cache"] == first["processed"]
    for before, after in zip(reports, reports[1:]):
        assert after["total"] == before["total"] and after["cache"] == before["cache"]
        assert after["processed"] > before["processed"] and after["time_ms"] >= before["time_ms"]
    assert last["processed"] == last["total"]


def test_a_long_prompts_progress_is_reported_step_by_step_and_from_the_cache(server):
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    fresh = progress_reports(server.url, "/v1/chat/completions", chat)
    check(fresh)  # (its cache may hold the chat template's opening, from earlier chats)
    total, cache = fresh[0]["total"], fresh[0]["cache"]
    assert cache < total // 2 and len(fresh) == 1 + -(-(total - cache) // 512)  # before, each step
    again = progress_reports(server.url, "/v1/chat/completions", chat)
    check(again)
    assert again[0]["cache"] == total - 1 and len(again) == 2  # its last token, in one step


def test_llama_servers_completion_reports_it_too_and_nobody_unasked_gets_it(server):
    native = progress_reports(server.url, "/completion", {"prompt": "Once " + PROMPT, "n_predict": 2})
    check(native)
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi " + PROMPT}], "max_tokens": 2,
            "stream": True}) as r:
        assert not any("prompt_progress" in line for line in r.iter_lines())


def test_a_responses_stream_reports_progress_in_in_progress_events(server):
    reports = []
    with httpx.stream("POST", server.url + "/v1/responses", timeout=120, json={
            "input": "Now " + PROMPT, "max_output_tokens": 4, "stream": True,
            "return_progress": True}) as r:
        assert "return_progress" not in r.headers.get("x-ignored-fields", "")
        for line in r.iter_lines():
            if line.startswith("data: ") and "prompt_progress" in line:
                data = json.loads(line[6:])
                assert data["type"] == "response.in_progress"
                reports.append(data["prompt_progress"])
    check(reports)
    assert len(reports) >= 2
