"""What office frontends (Open WebUI above all) send, on the real server with keys: colleagues
named by a trusted frontend's forwarded-user header, Continue and add_generation_prompt,
Open WebUI's sampling knobs, too many tools for a slot, a burst of embeddings per upload."""

import asyncio

import httpx
import pytest

from conftest import key_file, ledger_rows, running, wait_for

WEBUI, ALICE = "webui-key-000999", "alice-key-000111"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    folder = tmp_path_factory.mktemp("frontends")
    keys = key_file(folder, f"webui:{WEBUI}:user", f"alice:{ALICE}:user")
    with running("-c", "2048", "-np", "2", "-t", "2", "--api-key-file", str(keys),
                 "--trust-user-header", "webui", "--rate-limit", "2", "--rate-burst", "12",
                 "--task-max-tokens", "6", "-n", "9",
                 "--state-dir", str(folder / "state"), log_name="frontends") as server:
        server.state = folder / "state"
        yield server


def chat(srv, key=WEBUI, headers=None, **body):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
            "temperature": 0, **body}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def test_a_trusted_frontends_colleagues_are_billed_under_their_own_names(srv):
    for who in ("carol@office.lan", "dave@office.lan"):
        r = chat(srv, headers={"X-OpenWebUI-User-Email": who, "X-OpenWebUI-User-Name": "x"})
        assert r.status_code == 200, r.text
    chat(srv, key=ALICE, headers={"X-OpenWebUI-User-Email": "mallory@office.lan"})
    chat(srv)  # the frontend's own request (a title): its key's

    def names():
        return {key for key, _, _ in ledger_rows(srv.state, "/v1/chat/completions")}
    wait_for(lambda: len(names()) >= 4, what="four ledger names")
    assert names() == {"webui:carol@office.lan", "webui:dave@office.lan", "alice", "webui"}
    assert "mallory@office.lan" not in str(names())  # alice's header is not read
    odd = chat(srv, headers={"X-OpenWebUI-User-Name": "Erin O'Neil <x>"})
    assert odd.status_code == 200
    wait_for(lambda: any(n.startswith("webui:Erin_O_Neil__x_~") for n in names()),
             what="a name made safe, with a hash of the raw one")
    for look_alike in ("Erin_O_Neil__x_", "Erin O'Neil (x)"):  # the same once cleaned
        assert chat(srv, headers={"X-OpenWebUI-User-Name": look_alike}).status_code == 200
    wait_for(lambda: len([n for n in names() if n.startswith("webui:Erin_O_Neil__x_")]) == 3,
             what="three colleagues whose names clean alike, kept apart")


def test_continue_final_message_leaves_the_last_answer_open(srv):
    turns = [{"role": "user", "content": "Write a poem."},
             {"role": "assistant", "content": "Roses are red,"}]
    closed = chat(srv, messages=turns, add_generation_prompt=True).json()["usage"]["prompt_tokens"]
    opened = chat(srv, messages=turns, continue_final_message=True,
                  add_generation_prompt=False).json()
    assert opened["usage"]["prompt_tokens"] < closed  # no end of turn, no new assistant header
    # neither flag sent (Open WebUI's Continue on a plain OpenAI connection): continued, as
    # llama-server and Ollama do
    assert chat(srv, messages=turns).json()["usage"] == opened["usage"]
    shown = lambda **flags: httpx.post(srv.url + "/apply-template", headers={  # noqa: E731
        "Authorization": f"Bearer {ALICE}"}, json={"messages": turns, **flags}).json()["prompt"]
    plain = shown()
    assert plain.endswith("Roses are red,") and shown(continue_final_message=True) == plain
    assert shown(add_generation_prompt=True).endswith("assistant\n")  # a new answer
    bare = chat(srv, messages=turns[:1], add_generation_prompt=False).json()["usage"]
    assert bare["prompt_tokens"] < chat(srv, messages=turns[:1]).json()["usage"]["prompt_tokens"]
    both = chat(srv, messages=turns, continue_final_message=True, add_generation_prompt=True)
    assert both.status_code == 400 and "add_generation_prompt" in both.text
    prefill = httpx.post(srv.url + "/v1/messages", timeout=120, headers={"x-api-key": ALICE},
                         json={"max_tokens": 4, "messages": turns})
    assert prefill.json()["usage"]["input_tokens"] == opened["usage"]["prompt_tokens"]


def test_open_webuis_sampling_knobs_are_honoured_or_refused_by_name(srv):
    for knobs in ({"typical_p": 0.9, "temperature": 0.8, "seed": 3},
                  {"mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2, "seed": 3,
                   "temperature": 0.8}):
        first, again = chat(srv, **knobs, max_tokens=8), chat(srv, **knobs, max_tokens=8)
        assert first.status_code == 200, first.text
        assert first.json()["choices"][0]["message"] == again.json()["choices"][0]["message"]
    effort = chat(srv, reasoning_effort="high")
    assert effort.status_code == 400 and "reasoning_effort" in effort.text


def test_too_many_tools_for_a_slot_are_refused_saying_what_they_take(srv):
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "Looks things up in the office wiki. " * 8,
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
        for i in range(24)]
    r = chat(srv, tools=tools)
    assert r.status_code == 400, r.text[:200]
    assert "24 tools' definitions" in r.json()["error"]["message"]


def test_a_burst_of_embeddings_waits_its_turn_where_chats_get_429(srv):
    async def burst(path, body, n):
        async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {ALICE}"}) as c:
            return [r.status_code for r in await asyncio.gather(
                *(c.post(srv.url + path, json=body) for _ in range(n)))]

    chunks = asyncio.run(burst("/v1/embeddings", {"input": "a chunk of a document"}, 24))
    assert chunks == [200] * 24  # 12 at once, the others in line at 2 a second
    chats = asyncio.run(burst("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, 24))
    assert 429 in chats



TITLE_TASK = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat "
              "history.\n### Output:\nJSON format: { \"title\": \"your concise title here\" }\n"
              "### Chat History:\n<chat_history>\nUSER: Say hi.\nASSISTANT: Hi!\n</chat_history>")


def test_open_webuis_background_tasks_and_chats_without_max_tokens_get_the_servers_caps(srv):
    """Open WebUI sends its title, tags and follow-up tasks, and its chats, with no max_tokens
    (titles with 1,000): a task gets at most --task-max-tokens, a chat the server's -n, both
    shown in /props."""
    body = {"max_tokens": None, "ignore_eos": True}
    title = chat(srv, messages=[{"role": "user", "content": TITLE_TASK}], **body).json()
    assert title["usage"]["completion_tokens"] == 6 and title["choices"][0]["finish_reason"] == "length"
    plain = chat(srv, **body).json()
    assert plain["usage"]["completion_tokens"] == 9
    asked = chat(srv, messages=[{"role": "user", "content": TITLE_TASK}], max_tokens=3,
                 ignore_eos=True).json()
    assert asked["usage"]["completion_tokens"] == 3  # a task's own smaller max_tokens is kept
    webui = chat(srv, messages=[{"role": "user", "content": TITLE_TASK}], max_tokens=1000,
                 ignore_eos=True).json()  # Open WebUI's titles: capped all the same
    assert webui["usage"]["completion_tokens"] == 6
    props = httpx.get(srv.url + "/props", headers={"Authorization": f"Bearer {ALICE}"}).json()
    params = props["default_generation_settings"]["params"]
    assert (params["task_max_tokens"], params["n_predict"]) == (6, 9)
