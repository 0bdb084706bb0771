"""Open WebUI in front of localserve, started with exactly docs/office.md's openwebui.env (skipped
where Open WebUI is not installed in .venv-openwebui: it is a heavy install,
`scripts/openwebui-demo` makes it). Two colleagues sign up and chat through Open WebUI's own API
(what its page calls); one uploads a document, which Open WebUI embeds through localserve;
localserve's ledger then has each colleague under their own name and the document's
embeddings; restarted with other settings, Open WebUI reads them again."""

import json
import os
import re
import subprocess

import httpx
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from conftest import (ROOT, answers_200, free_port, key_file, ledger_rows, png, random_projector,
                      running, wait_for)
from web_pages import browser  # noqa: F401  (a fixture)

WEBUI = ROOT / ".venv-openwebui" / "bin" / "open-webui"
pytestmark = pytest.mark.skipif(not WEBUI.exists(), reason="Open WebUI not installed: run "
                                                           "scripts/openwebui-demo once")
FRONTEND_KEY = "webui-key-000999"


SECOND_KEY = "webui2-key-000888"


def readme_env(server_url: str, key: str) -> dict:
    """docs/office.md's openwebui.env, line for line, as the shell's `.` reads it (a value's
    single quotes go), with this server's address, the key and a secret."""
    page = (ROOT / "docs" / "office.md").read_text()
    block = page.split("# openwebui.env:", 1)[1].split("```", 1)[0]
    env = {}
    for line in block.splitlines()[1:]:
        line = line.strip()
        if line and not line.startswith("#"):
            name, value = line.split("=", 1)
            value = value[1:-1] if value[:1] == value[-1:] == "'" else value
            env[name] = value.replace("http://SERVER:8080", server_url).replace(
                "WEBUI_KEY", key).replace("SECRET", "test-secret-0123456789")
    return env


def documented_start() -> list[str]:
    """The command docs/office.md starts Open WebUI with, after its environment."""
    page = (ROOT / "docs" / "office.md").read_text()
    return re.search(r"open-webui serve[^`]*", page).group(0).split()[1:]


def ollama_variant(settings: dict, server_url: str, key: str) -> dict:
    """The env file with docs/office.md's Ollama connection: its OPENAI_API_* lines and
    ENABLE_OLLAMA_API=false replaced by the two lines the page gives, as the page says."""
    page = (ROOT / "docs" / "office.md").read_text()
    lines = [re.search(r"`(OLLAMA_BASE_URL=[^`]+)`", page).group(1),
             re.search(r"`(OLLAMA_API_CONFIGS='[^`]+')`", page).group(1)]
    out = {k: v for k, v in settings.items()
           if not k.startswith("OPENAI_API_") and k != "ENABLE_OLLAMA_API"}
    for line in lines:  # as the shell's `.` reads them: the quotes go
        name, value = line.split("=", 1)
        out[name] = value.strip("'").replace("http://SERVER:8080", server_url).replace(
            "WEBUI_KEY", key)
    return out


class OpenWebUI:
    """Open WebUI started with docs/office.md's openwebui.env (and what this machine needs: a data
    folder, a port, no internet), restartable on the same data."""

    def __init__(self, server, folder):
        self.server, self.folder, self.port = server, folder, free_port()
        self.url, self.process, self.log = f"http://127.0.0.1:{self.port}", None, None

    def start(self, key: str = FRONTEND_KEY, ollama: bool = False) -> None:
        settings = readme_env(self.server.url, key)
        env = {**os.environ, **(ollama_variant(settings, self.server.url, key) if ollama
                                else settings),
               "DATA_DIR": str(self.folder / "webui"), "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1"}
        self.log = open(self.folder / "openwebui.log", "a")
        command = [arg.replace("3000", str(self.port)) for arg in documented_start()]
        self.process = subprocess.Popen([str(WEBUI), *command, "--host", "127.0.0.1"], env=env,
                                        stdout=self.log, stderr=subprocess.STDOUT,
                                        cwd=self.folder)
        wait_for(lambda: answers_200(self.url + "/health"), timeout=600, interval=1, what="Open WebUI to start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()


@pytest.fixture(scope="module")
def office(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openwebui")
    keys = key_file(folder, f"webui:{FRONTEND_KEY}:user", f"webui2:{SECOND_KEY}:user")
    with running("-c", "8192", "-np", "4", "-t", "2", "--api-key-file", str(keys),
                 "--mmproj", random_projector(),
                 "--trust-user-header", "webui", "--trust-user-header", "webui2",
                 "--state-dir", str(folder / "state"), log_name="openwebui-localserve") as server:
        webui = OpenWebUI(server, folder)
        webui.start()
        try:
            yield server, webui, folder / "state"
        finally:
            webui.stop()


def sign_up(url: str, name: str, admin: dict | None = None) -> dict:
    """The first colleague signs up (and is Open WebUI's admin); the admin adds the next.
    Someone already there signs in."""
    who = {"name": name, "email": f"{name}@office.lan", "password": "correct horse battery"}
    if admin is not None:
        added = httpx.post(url + "/api/v1/auths/add", headers=admin, timeout=60,
                           json={**who, "role": "user"})
        assert added.status_code == 200 or "already registered" in added.text, added.text
    r = httpx.post(url + ("/api/v1/auths/signin" if admin else "/api/v1/auths/signup"),
                   timeout=60, json=who)
    if admin is None and r.status_code != 200:
        r = httpx.post(url + "/api/v1/auths/signin", timeout=60, json=who)
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def ask(url: str, who: dict, text: str, **extra) -> httpx.Response:
    models = httpx.get(url + "/api/models", headers=who, timeout=60).json()["data"]
    return httpx.post(url + "/api/chat/completions", headers=who, timeout=300, json={
        "model": models[0]["id"], "stream": False, "max_tokens": 16,
        "messages": [{"role": "user", "content": text}], **extra})


def test_two_colleagues_and_a_document_through_open_webui(office):
    server, webui, state = office
    url = webui.url
    alice = sign_up(url, "alice")
    bob = sign_up(url, "bob", admin=alice)
    for who in (alice, bob):
        r = ask(url, who, "Name a colour.")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    names = lambda: {key for key, _, _ in ledger_rows(state, "/v1/chat/completions")}  # noqa: E731
    wait_for(lambda: {"webui:alice@office.lan", "webui:bob@office.lan"} <= names(), timeout=60,
             what="both colleagues in localserve's ledger")
    document = ("The office kitchen is cleaned on Fridays. " * 200).encode()
    upload = httpx.post(url + "/api/v1/files/", headers=alice, timeout=300,
                        files={"file": ("kitchen.txt", document, "text/plain")})
    assert upload.status_code == 200, upload.text
    wait_for(lambda: ledger_rows(state, "/v1/embeddings"), timeout=300,
             what="the document's chunks embedded by localserve")
    answer = ask(url, alice, "When is the kitchen cleaned?",
                 files=[{"type": "file", "id": upload.json()["id"]}])
    assert answer.status_code == 200, answer.text


def test_an_image_sent_through_open_webui_is_read_and_billed_to_the_colleague(office):
    """Open WebUI passes an image a colleague attaches on as an OpenAI `image_url` part (a data
    URI): localserve reads it with the model's projector, and bills its tokens to her."""
    server, webui, state = office
    url = webui.url
    carol = sign_up(url, "carol", admin=sign_up(url, "alice"))
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png()}}
    question = {"type": "text", "text": "What is in the picture?"}
    for content in ([question], [question, picture]):
        r = ask(url, carol, content, temperature=0)
        assert r.status_code == 200, r.text
    rows = lambda: [p for key, p, _ in ledger_rows(state, "/v1/chat/completions")  # noqa: E731
                    if key == "webui:carol@office.lan"]
    wait_for(lambda: len(rows()) >= 2, timeout=60, what="carol's two chats in the ledger")
    text_only, with_image = rows()[-2:]
    assert with_image >= text_only + 16  # the random projector's 16 rows an image


def chat_rows(state, who: str) -> list[tuple]:
    """Localserve's ledger rows of one colleague's chat requests: (tokens out, finish, status)."""
    return [(out, finish, status) for key, out, finish, status in ledger_rows(
        state, "/v1/chat/completions", "key, completion_tokens, finish_reason, status")
        if key == f"webui:{who}@office.lan"]


def open_webui_page(browser, url: str, who: dict):
    """Open WebUI's own page, signed in as `who`, on a new chat, its release notes closed.
    The token is in place before any of the page's scripts run: set once the sign-in page had
    loaded, that page's own start-up could still send the browser back to sign in (twice in
    ten runs the chat input never came)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script("try { localStorage.setItem('token', %s) } catch (e) {}"
                            % json.dumps(who["Authorization"][7:]))
    page = context.new_page()
    page.goto(url + "/")
    try:
        page.wait_for_selector("#chat-input", timeout=60_000)
    except PlaywrightTimeout:  # once it never drew its input (120 s, a busy machine): load again
        page.reload()
        page.wait_for_selector("#chat-input", timeout=120_000)
    notes = page.get_by_text("Okay, Let's Go!")
    if notes.count():
        notes.click()
    return page


def new_chat(browser, url: str, state, alice: dict, text: str):
    """A new chat in alice's Open WebUI page with `text` sent: the page, and how many of her
    chat requests localserve had billed before it."""
    page = open_webui_page(browser, url, alice)
    before = len(chat_rows(state, "alice"))
    page.locator("#chat-input").click()
    page.keyboard.type(text)
    page.locator("#send-message-button").click()
    return page, before


def settle(page, state, who: str, before: int) -> list[tuple]:
    """Wait until localserve has billed a new request of `who` and the page's answer is done
    (its Regenerate button back); the new ledger rows."""
    wait_for(lambda: len(chat_rows(state, who)) > before, timeout=300, what="a billed request")
    page.locator("button[aria-label='Regenerate']").last.wait_for(timeout=300_000)
    return chat_rows(state, who)[before:]


def test_open_webuis_page_chats_stops_continues_and_regenerates(office, browser):
    """In a real browser, as a colleague uses it, with the recipe as written (its built-in
    tools off by DEFAULT_MODEL_METADATA: with them, 30 tool definitions went with every chat,
    and the small model called tools in a loop and never answered): chat, Stop (localserve
    ends the request: billed as an abort), Continue (the answer grows from where it stopped)
    and Regenerate (a second version)."""
    server, webui, state = office
    url = webui.url
    alice = sign_up(url, "alice")  # the first to sign up: Open WebUI's admin
    settings = lambda **params: httpx.post(  # noqa: E731
        url + "/api/v1/users/user/settings/update", headers=alice, timeout=60,
        json={"ui": {"params": {"temperature": 0, **params}}}).raise_for_status()
    settings(max_tokens=400)
    page, before = new_chat(browser, url, state, alice,
                            "Write a long story about a dog who travels the world.")
    stop = page.locator("button[aria-label='Stop']")
    stop.wait_for(timeout=120_000)
    wait_for(lambda: page.locator("#response-content-container").last.inner_text().strip(),
             timeout=120, what="the answer streaming")
    stop.click()
    assert (0 < settle(page, state, "alice", before)[0][0] < 400
            and ("abort", 499) in [(f, s) for _, f, s in chat_rows(state, "alice")])

    settings(max_tokens=24)
    page, before = new_chat(browser, url, state, alice, "Tell me about the sea.")
    settle(page, state, "alice", before)
    # the page shows the answer's end a moment before the ledger has its row, and the first
    # chat's title task may be billed in between: wait for the chat's own row
    wait_for(lambda: (24, "length", 200) in chat_rows(state, "alice")[before:], timeout=60,
             what="the 24-token answer billed")
    prompts = [p for key, p, out in ledger_rows(state, "/v1/chat/completions") if out == 24]
    assert prompts[-1] < 1000  # a short question, no tool definitions with it
    answer = page.locator("#response-content-container").last
    first = answer.inner_text().strip()
    assert first
    before = len(chat_rows(state, "alice"))
    page.locator("button[aria-label='Continue Response']").last.click()
    settle(page, state, "alice", before)
    wait_for(lambda: len(answer.inner_text().strip()) > len(first), timeout=60,
             what="the continued answer")
    assert answer.inner_text().strip().startswith(first)
    before = len(chat_rows(state, "alice"))
    page.locator("button[aria-label='Regenerate']").last.click()
    page.get_by_text("Try Again").click()  # its menu: try again, add details, more concise
    settle(page, state, "alice", before)
    wait_for(lambda: page.get_by_text("2/2").count(), timeout=60, what="a second version")


def test_a_restart_reads_the_settings_again_and_colleagues_still_see_the_model(office):
    """Open WebUI copies its variables into its database on the first start and, without
    ENABLE_PERSISTENT_CONFIG=false, reads them from there ever after. Restarted with another
    key, its requests come with that key: the settings were read again; bob, added by the
    admin, still sees the model and chats; a stranger still cannot sign up (ENABLE_SIGNUP)."""
    server, webui, state = office
    alice = sign_up(webui.url, "alice")  # the admin (the first to sign up), if nobody did yet
    stranger = {"name": "mallory", "email": "mallory@office.lan", "password": "hunter2 hunter2"}
    refused = httpx.post(webui.url + "/api/v1/auths/signup", timeout=60, json=stranger)
    assert refused.status_code == 403, refused.text
    sign_up(webui.url, "bob", admin=alice)
    webui.stop()
    webui.start(key=SECOND_KEY)
    refused = httpx.post(webui.url + "/api/v1/auths/signup", timeout=60, json=stranger)
    assert refused.status_code == 403, refused.text
    bob = sign_up(webui.url, "bob")
    assert httpx.get(webui.url + "/api/models", headers=bob, timeout=60).json()["data"]
    r = ask(webui.url, bob, "Name a fruit.")
    assert r.status_code == 200, r.text
    names = lambda: {key for key, _, _ in ledger_rows(state, "/v1/chat/completions")}  # noqa: E731
    wait_for(lambda: "webui2:bob@office.lan" in names(), timeout=120,
             what="bob's chat through the key of the restarted Open WebUI")


def test_the_docs_ollama_connection_chats_under_the_colleagues_name(office):
    """docs/office.md's other variant: Open WebUI's Ollama connection to localserve, with the
    key in OLLAMA_API_CONFIGS. A colleague's chat goes through localserve's /api/chat, billed
    under her name."""
    server, webui, state = office
    sign_up(webui.url, "alice")
    webui.stop()
    webui.start(ollama=True)
    alice = sign_up(webui.url, "alice")
    r = ask(webui.url, alice, "Name a river.")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    names = lambda: {key for key, _, _ in ledger_rows(state, "/api/chat")}  # noqa: E731
    wait_for(lambda: "webui:alice@office.lan" in names(), timeout=120,
             what="alice's chat through the Ollama connection in localserve's ledger")
