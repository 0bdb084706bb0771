"""The chat page's browser tests' shared parts: Debian's chromium driven by Playwright, a page
that records what leaves the server, and sending a message."""

import shutil

import pytest

CHROMIUM = shutil.which("chromium")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def open_page(browser, url):
    """A fresh page in its own browser context (own session storage); it records every
    request that leaves this server, and every dialog."""
    page = browser.new_context().new_page()
    page.outside, page.dialogs, page.refused = [], [], []
    page.on("request", lambda r: None if r.url.startswith(url) else page.outside.append(r.url))
    page.on("response", lambda r: page.refused.append(r.url) if r.status == 401 else None)
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
    page.goto(url + "/")
    return page


def send(page, text, max_tokens=None):
    if max_tokens is not None:
        page.locator("#settings summary").click()
        page.fill("#max-tokens", str(max_tokens))
        page.fill("#temperature", "0")
        page.locator("#settings summary").click()
    page.fill("#input", text)
    page.click("#send")
