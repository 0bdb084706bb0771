"""The chat page's newer parts in Chromium, at desktop and phone size: the phone's drawer and
Server panel closing, a reopened chat keeping its model and settings, answer versions on
Regenerate, Continue, and a text file attached to a message."""

import pytest

from conftest import running, wait_for
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
