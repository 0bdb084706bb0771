"""Open WebUI in front of localserve, as scripts/openwebui-demo runs it (skipped where Open WebUI
is not installed in .venv-openwebui: it is a heavy install, `scripts/openwebui-demo` makes it).
Two colleagues sign up and chat through Open WebUI's own API (what its page calls); one uploads
a document, which Open WebUI embeds through localserve; localserve's ledger then has each
colleague under their own name and the document's embeddings."""

import os
import subprocess

import httpx
import pytest

from conftest import ROOT, free_port, key_file, ledger_rows, running, wait_for

WEBUI = ROOT / ".venv-openwebui" / "bin" / "open-webui"
pytestmark = pytest.mark.skipif(not WEBUI.exists(), reason="Open WebUI not installed: run "
                                                           "scripts/openwebui-demo once")
FRONTEND_KEY = "webui-key-000999"


@pytest.fixture(scope="module")
def office(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openwebui")
    keys = key_file(folder, f"webui:{FRONTEND_KEY}:user")
    with running("-c", "8192", "-np", "4", "-t", "2", "--api-key-file", str(keys),
                 "--trust-user-header", "webui", "--state-dir", str(folder / "state"),
                 log_name="openwebui-localserve") as server:
        port = free_port()
        env = {**os.environ, "DATA_DIR": str(folder / "webui"), "PORT": str(port),
               "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "WEBUI_SECRET_KEY": "test-secret",
               "ENABLE_FORWARD_USER_INFO_HEADERS": "true", "DEFAULT_USER_ROLE": "user",
               "ENABLE_SIGNUP": "true", "BYPASS_MODEL_ACCESS_CONTROL": "true",
               "OPENAI_API_BASE_URL": server.url + "/v1", "OPENAI_API_KEY": FRONTEND_KEY,
               "ENABLE_OLLAMA_API": "false", "RAG_EMBEDDING_ENGINE": "openai",
               "RAG_OPENAI_API_BASE_URL": server.url + "/v1", "RAG_OPENAI_API_KEY": FRONTEND_KEY,
               "RAG_EMBEDDING_MODEL": "any", "ENABLE_TITLE_GENERATION": "true"}
        log = open(folder / "openwebui.log", "w")
        webui = subprocess.Popen([str(WEBUI), "serve", "--host", "127.0.0.1", "--port", str(port)],
                                 env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _up(url), timeout=600, interval=1, what="Open WebUI to start")
            yield server, url, folder / "state"
        finally:
            webui.terminate()
            webui.wait(timeout=60)
            log.close()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def sign_up(url: str, name: str, admin: dict | None = None) -> dict:
    """The first colleague signs up (and is Open WebUI's admin); the admin adds the next."""
    who = {"name": name, "email": f"{name}@office.lan", "password": "correct horse battery"}
    if admin is not None:
        added = httpx.post(url + "/api/v1/auths/add", headers=admin, timeout=60,
                           json={**who, "role": "user"})
        assert added.status_code == 200, added.text
    r = httpx.post(url + ("/api/v1/auths/signin" if admin else "/api/v1/auths/signup"),
                   timeout=60, json=who)
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def ask(url: str, who: dict, text: str, **extra) -> httpx.Response:
    models = httpx.get(url + "/api/models", headers=who, timeout=60).json()["data"]
    return httpx.post(url + "/api/chat/completions", headers=who, timeout=300, json={
        "model": models[0]["id"], "stream": False, "max_tokens": 16,
        "messages": [{"role": "user", "content": text}], **extra})


def test_two_colleagues_and_a_document_through_open_webui(office):
    server, url, state = office
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
