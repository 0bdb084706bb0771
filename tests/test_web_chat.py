"""The chat page's newer parts in Chromium, at desktop and phone size: the phone's drawer and
Server panel closing, a reopened chat keeping its model and settings, answer versions on
Regenerate, Continue, and a text file or an image attached to a message."""

import base64
import io
import subprocess
from pathlib import Path

import httpx
import pytest
from PIL import Image

from conftest import ROOT, ledger_rows, running, wait_for
from web_pages import CHROMIUM, browser, open_page, send  # noqa: F401 (browser: a fixture)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: scripts/setup-browser "
                                                         "installs it (needs root apt-get)")

@pytest.fixture(scope="module")
def two_models():
    from localserve.common.config import default_model_path

    path = str(default_model_path())
    with running("-c", "2048", "-np", "2", "-t", "2", "--model", f"chat={path}",
                 "--model", f"coder={path}", "--max-loaded-models", "2",
                 log_name="web-chat") as srv:
        yield srv


def test_the_phone_drawer_and_server_panel_close_without_choosing_a_chat(two_models, browser):
    context = browser.new_context(viewport={"width": 390, "height": 800})
    page = context.new_page()
    page.goto(two_models.url + "/")
    page.wait_for_selector("#app", state="visible", timeout=30_000)
    page.click("#menu")
    assert page.locator("#sidebar").is_visible()
    page.keyboard.press("Escape")
    assert not page.locator("#sidebar").is_visible()
    page.click("#menu")
    page.mouse.click(370, 400)  # beside the drawer
    assert not page.locator("#sidebar").is_visible()
    page.click("#menu")
    page.click("#close-menu")
    assert not page.locator("#sidebar").is_visible()
    page.click("#menu")
    page.click("#toggle-server")
    page.wait_for_selector("#server:not([hidden])")
    page.click("#close-server")
    assert not page.locator("#server").is_visible()
    context.close()


def finished(page, answers):
    page.wait_for_selector(f".message.assistant >> nth={answers - 1}", timeout=120_000)
    page.wait_for_selector("#send:not([hidden])", timeout=120_000)
    page.wait_for_selector(f".message.assistant .meta >> nth={answers - 1}", timeout=120_000)


def test_a_reopened_chat_keeps_its_model_settings_and_answer_versions(two_models, browser, tmp_path):
    page = open_page(browser, two_models.url)
    page.wait_for_selector("#model-picker:not([hidden])", timeout=30_000)
    page.select_option("#model", "coder")
    page.locator("#settings summary").click()
    page.fill("#system", "Answer briefly.")
    page.locator("#settings summary").click()
    notes = tmp_path / "notes.txt"
    notes.write_text("The meeting is on Tuesday at 10.\n")
    with page.expect_file_chooser() as chooser:
        page.click("#attach")
    chooser.value.set_files(str(notes))
    # (polled from here: wait_for_function evals in the page, which its CSP rightly forbids)
    wait_for(lambda: "Tuesday" in page.input_value("#input"), what="the file's text in the input")
    page.fill("#input", page.input_value("#input") + "\nWhen is the meeting?")
    send(page, page.input_value("#input"), max_tokens=6)
    finished(page, 1)
    assert "notes.txt" in page.inner_text(".message.user")
    first = page.inner_text(".message.assistant .body")
    page.click("#regenerate")
    finished(page, 1)
    assert "2/2" in page.inner_text(".message.assistant .versions")
    page.click(".message.assistant .versions button >> nth=0")  # back to the first answer
    assert page.inner_text(".message.assistant .body") == first
    page.click("#continue")
    finished(page, 1)
    assert page.inner_text(".message.assistant .body").startswith(first)  # it went on
    page.wait_for_selector("#conversations li.current", timeout=30_000)
    page.select_option("#model", "chat")
    page.click("#new-chat")
    page.click("#conversations li button.open >> nth=0")  # the chat just had, reopened
    page.wait_for_selector(".message.assistant", timeout=30_000)
    assert page.input_value("#model") == "coder" and page.input_value("#system") == "Answer briefly."
    assert page.input_value("#max-tokens") == "6"
    page.close()


def picture(tmp_path):
    path = tmp_path / "red.png"
    Image.new("RGB", (1600, 900), (200, 30, 40)).save(path)
    return path


def attach(page, path):
    with page.expect_file_chooser() as chooser:
        page.click("#attach")
    chooser.value.set_files(str(path))
    page.wait_for_selector("#pending-images img.attached", timeout=30_000)


def test_an_image_attached_on_the_page_goes_with_the_message(browser, tmp_path):
    """Served with a projector (the random-weight one: its answers are noise), an image picked
    on the page goes with the next message as OpenAI's image part, shrunk to 1024 pixels a
    side; the message shows it, and the stored chat keeps it."""
    projector = subprocess.run([str(ROOT / "scripts/make-projector")], check=True, text=True,
                               capture_output=True).stdout.strip()
    with running("-c", "2048", "-np", "2", "-t", "2", "--mmproj", projector,
                 log_name="web-images") as srv:
        page = open_page(browser, srv.url)
        attach(page, picture(tmp_path))
        send(page, "What colour is it?", max_tokens=4)
        finished(page, 1)
        assert page.locator(".message.user img.attached").count() == 1
        assert page.locator("#pending-images").is_hidden()
        # the model read it: the image's rows among the prompt's tokens (the ledger's row)
        text_only = httpx.post(srv.url + "/v1/chat/completions", json={"max_tokens": 1, "messages": [
            {"role": "user", "content": "What colour is it?"}]}).json()["usage"]["prompt_tokens"]
        wait_for(lambda: len(ledger_rows(Path(srv.state_dir), "/v1/chat/completions")) == 2,
                 what="both requests in the ledger")
        assert ledger_rows(Path(srv.state_dir), "/v1/chat/completions")[0][1] == text_only + 16
        page.wait_for_selector("#conversations li.current", timeout=30_000)
        chats = httpx.get(srv.url + "/web/api/conversations").json()["data"]
        stored = httpx.get(srv.url + "/web/api/conversations/" + chats[0]["id"]).json()
        image = stored["messages"][0]["images"][0]
        assert image.startswith("data:image/jpeg;base64,")
        with Image.open(io.BytesIO(base64.b64decode(image.split(",", 1)[1]))) as sent:
            assert sent.size == (1024, 576)
        page.close()


def test_an_image_sent_to_a_text_model_is_refused_and_given_back(two_models, browser, tmp_path):
    page = open_page(browser, two_models.url)
    attach(page, picture(tmp_path))
    send(page, "What colour is it?")
    wait_for(lambda: "reads text only" in page.inner_text("#status"), what="the refusal")
    assert page.input_value("#input") == "What colour is it?"
    assert page.locator("#pending-images img.attached").count() == 1
    assert page.locator(".message").count() == 0
    page.close()
