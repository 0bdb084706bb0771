"""The chat page in a real browser (Debian's chromium, driven by Playwright): it loads with no
request leaving this server, streams an answer, stops one, keeps history server-side per key,
shows the server's refusals, and never lets text become markup."""

import httpx
import pytest

from conftest import running, wait_for
from web_pages import CHROMIUM, browser, open_page, send  # noqa: F401 (browser: a fixture)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: scripts/setup-browser "
                                                         "installs it (needs root apt-get)")
ALICE, BOB = "alice-web-key-1234", "bob-web-key-5678"


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    with running("-c", "4096", "-np", "4", "-t", "2", log_name="web") as srv:
        yield srv


def test_the_page_is_served_with_a_strict_policy_and_no_outside_assets(web):
    r = httpx.get(web.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert "http" not in r.text.replace("http-equiv", "")  # no CDN: every asset is /web/...


COUNT_UPDATES = """() => {
  window.updates = 0;
  new MutationObserver(() => window.updates++).observe(
    document.getElementById("messages"), {childList: true, subtree: true, characterData: true});
}"""


def test_chat_streams_an_answer_and_history_survives_a_reload(web, browser):
    page = open_page(browser, web.url)
    page.wait_for_selector("#app", state="visible", timeout=30_000)
    assert not page.locator("#login").is_visible()  # no keys: no sign-in panel, really hidden
    page.evaluate(COUNT_UPDATES)
    send(page, "Count from 1 to 20.", max_tokens=40)
    page.wait_for_selector(".message.assistant", timeout=60_000)
    page.wait_for_selector("#send:not([hidden])", timeout=120_000)  # the answer finished
    answer = page.inner_text(".message.assistant")
    assert answer.strip()
    assert page.evaluate("() => window.updates") >= 5  # it arrived token by token
    page.wait_for_selector("#conversations li", timeout=30_000)
    page.reload()
    page.wait_for_selector("#conversations li button.open", timeout=30_000)
    page.click("#conversations li button.open")
    page.wait_for_selector(".message.assistant", timeout=30_000)
    assert page.inner_text(".message.assistant") == answer
    assert page.inner_text(".message.user").endswith("Count from 1 to 20.")
    assert page.outside == [] and page.dialogs == []
    page.close()


def test_stop_cancels_the_request_and_frees_its_slot(web, browser):
    """Stop aborts the request in the engine (counted as aborted, not finished): how fast is a
    benchmark's question, not this test's (it failed once on a machine at load 8 with 1 s)."""
    page = open_page(browser, web.url)
    aborted = web.slots()["engine"]["requests_aborted"]
    send(page, "Write a very long story about a lighthouse.", max_tokens=900)
    # (no wait_for_function: the page's CSP forbids the eval it relies on, as it should)
    wait_for(lambda: page.locator(".message.assistant").count() and
             len(page.inner_text(".message.assistant .body")) > 20, timeout=120,
             what="the answer to start streaming")
    page.click("#stop")
    wait_for(lambda: all(s["state"] == "idle" for s in web.slots()["slots"]), timeout=60,
             what="the slot to be freed after Stop")
    assert web.slots()["engine"]["requests_aborted"] == aborted + 1
    assert "Stopped." in page.inner_text("#status")
    send(page, "Say hi.", max_tokens=4)  # a new request clears the stale "Stopped."
    assert "Stopped." not in page.inner_text("#status")
    page.wait_for_selector("#send:not([hidden])", timeout=120_000)
    page.close()


def test_text_never_becomes_markup(web, browser):
    page = open_page(browser, web.url)
    hostile = ('<img src=x onerror="alert(1)"> [click](javascript:alert(2)) '
               '**bold** `code` <script>alert(3)</script>')
    rendered = page.evaluate("(t) => renderMarkdown(t)", hostile)
    assert "<img" not in rendered and "<script" not in rendered and "javascript:" not in rendered
    assert "<strong>bold</strong>" in rendered and "<code>code</code>" in rendered
    assert "&lt;img" in rendered
    send(page, hostile, max_tokens=4)
    page.wait_for_selector("#send:not([hidden])", timeout=120_000)
    assert page.locator("#messages img").count() == 0
    assert page.locator("#messages script").count() == 0
    assert page.locator("#messages a").count() == 0
    assert page.dialogs == []
    page.close()


def test_keys_sign_in_refusals_shown_and_each_sees_only_their_own(browser, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    keys.chmod(0o600)
    with running("-c", "2048", "-np", "2", "-t", "2", "--api-key-file", str(keys),
                 log_name="web-keys") as srv:
        page = open_page(browser, srv.url)
        page.wait_for_selector("#login", state="visible", timeout=30_000)
        assert not page.locator("#app").is_visible()
        assert page.refused == []  # it asked /web/sign-in, not a route that needs the key
        page.fill("#key", "not-the-key-0000")
        page.click("#login button")
        wait_for(lambda: page.inner_text("#login-error"), what="the sign-in error")
        assert "Incorrect API key" in page.inner_text("#login-error")
        page.fill("#key", ALICE)
        page.click("#login button")
        page.wait_for_selector("#app:not([hidden])", timeout=30_000)
        assert page.evaluate("localStorage.getItem('localserve-key')") == ALICE
        wait_for(lambda: page.inner_text("#whoami") == "Signed in as alice",
                 what="the page to say who is signed in")
        assert ALICE not in page.url
        send(page, "word " * 3000, max_tokens=8)  # beyond the 2048-token pool: the server refuses
        wait_for(lambda: page.get_attribute("#status", "class") == "error", timeout=60,
                 what="the refusal to be shown")
        assert "the whole cache pool" in page.inner_text("#status")
        assert page.input_value("#input").startswith("word word")  # given back to edit
        assert page.locator(".message.user").count() == 0
        send(page, "Say hi.", max_tokens=4)
        page.wait_for_selector("#conversations li", timeout=60_000)
        page.close()
        other = open_page(browser, srv.url)  # a second browser context, bob's key
        other.fill("#key", BOB)
        with other.expect_response(lambda r: r.url.endswith("/web/api/conversations")) as listed:
            other.click("#login button")
        assert listed.value.json() == {"data": []}
        assert other.locator("#conversations li").count() == 0
        other.close()
        mine = httpx.get(srv.url + "/web/api/conversations", headers={"X-Api-Key": ALICE}).json()
        theirs = httpx.get(srv.url + "/web/api/conversations", headers={"X-Api-Key": BOB}).json()
        assert len(mine["data"]) == 1 and theirs["data"] == []
        conversation = mine["data"][0]["id"]
        assert httpx.get(srv.url + "/web/api/conversations/" + conversation,
                         headers={"X-Api-Key": BOB}).status_code == 404
        assert httpx.delete(srv.url + "/web/api/conversations/" + conversation,
                            headers={"X-Api-Key": BOB}).status_code == 404
        exported = httpx.get(srv.url + "/web/api/conversations/export",
                             headers={"X-Api-Key": ALICE}).json()
        assert exported[0]["messages"][0]["content"] == "Say hi."
        assert httpx.delete(srv.url + "/web/api/conversations/" + conversation,
                            headers={"X-Api-Key": ALICE}).status_code == 200


def test_no_web_turns_the_page_off():
    with running("-c", "512", "-np", "1", "-t", "2", "--no-web", log_name="no-web") as srv:
        assert httpx.get(srv.url + "/").status_code == 404
        assert httpx.get(srv.url + "/health").status_code == 200


MARKDOWN = [
    ("7 * 8 = 56, and 2 * 3 = 6", "7 * 8 = 56, and 2 * 3 = 6"),
    ("# Title\n\n## Sub", "<h1>Title</h1><h2>Sub</h2>"),
    ("- one\n- two", "<ul><li>one</li><li>two</li></ul>"),
    ("1. one\n2. *two*", "<ol><li>one</li><li><em>two</em></li></ol>"),
    ("> quoted **text**", "<blockquote><p>quoted <strong>text</strong></p></blockquote>"),
    ("| a | b |\n|---|---|\n| 1 | 2 |", "<table><thead><tr><th>a</th><th>b</th></tr></thead>"
                                         "<tbody><tr><td>1</td><td>2</td></tr></tbody></table>"),
    ("use `a*b*c` here", "use <code>a*b*c</code> here"),
    ("snake_case_name stays", "snake_case_name stays"),
    # as models write it: loose and nested lists, aligned tables, highlighted code, math
    ("1. one\n\n2. two\n\n3. three", "<ol><li>one</li><li>two</li><li>three</li></ol>"),
    ("3. three\n4. four", '<ol start="3"><li>three</li><li>four</li></ol>'),
    ("- a\n  - a1\n  - a2\n- b", "<ul><li>a<ul><li>a1</li><li>a2</li></ul></li><li>b</li></ul>"),
    ("1. step\n   - detail\n2. next", "<ol><li>step<ul><li>detail</li></ul></li><li>next</li></ol>"),
    ("| a | b | c |\n|:--|:-:|--:|\n| 1 | 2 | 3 |",
     '<td class="left">1</td><td class="center">2</td><td class="right">3</td>'),
    ("```python\ndef f():\n    return 'x'  # why\n```",
     '<span class="tok-keyword">def</span> f():\n    <span class="tok-keyword">return</span> '
     '<span class="tok-string">&#39;x&#39;</span>  <span class="tok-comment"># why</span>'),
    ("Euler: $$e^{i\\pi} + 1 = 0$$ indeed", '<div class="math">e^{i\\pi} + 1 = 0</div>'),
    ("```js\nlet s = \"<b>\";\n```", '<span class="tok-string">&quot;&lt;b&gt;&quot;</span>'),
    # a bulleted list after a numbered one is a list of its own; strikethrough; task lists
    ("1. one\n2. two\n- three\n- four",
     "<ol><li>one</li><li>two</li></ol><ul><li>three</li><li>four</li></ul>"),
    ("~~old~~ new, 2~3 ~ 4", "<del>old</del> new, 2~3 ~ 4"),
    ("- [ ] to do\n- [x] done", '<ul><li class="task"><input type="checkbox" disabled> to do</li>'
                              '<li class="task"><input type="checkbox" disabled checked> done</li></ul>'),
]


def test_markdown_renders_blocks_and_keeps_arithmetic(web, browser):
    page = open_page(browser, web.url)
    for text, html in MARKDOWN:
        assert html in page.evaluate("(t) => renderMarkdown(t)", text), text
    page.close()


def test_phone_width_has_navigation_dark_mode_and_an_icon(web, browser):
    context = browser.new_context(viewport={"width": 390, "height": 800}, color_scheme="dark")
    page = context.new_page()
    page.goto(web.url + "/")
    page.wait_for_selector("#app", state="visible", timeout=30_000)
    assert not page.locator("#sidebar").is_visible() and page.locator("#menu").is_visible()
    page.click("#menu")
    assert page.locator("#new-chat").is_visible() and page.locator("#search").is_visible()
    page.click("#new-chat")  # the menu closes again
    assert not page.locator("#sidebar").is_visible()
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert sum(int(x) for x in background[4:-1].split(",")) < 200  # dark
    assert not page.locator("#model-picker").is_visible()  # one model: nothing to pick
    context.close()
    icon = httpx.get(web.url + "/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")


def test_answers_show_their_model_speed_and_copy_and_the_last_chat_reopens(web, browser):
    page = open_page(browser, web.url)
    page.route("**/v1/chat/completions", lambda route: route.abort())
    send(page, "Hello?", max_tokens=4)
    wait_for(lambda: page.get_attribute("#status", "class") == "error", timeout=30,
             what="the unreachable server to be said")
    assert "cannot be reached" in page.inner_text("#status")
    assert page.input_value("#input") == "Hello?"  # given back
    page.unroute("**/v1/chat/completions")
    send(page, "Hello?", max_tokens=4)
    page.wait_for_selector(".message.assistant .meta", timeout=120_000)
    meta = page.inner_text(".message.assistant .meta")
    assert "tokens/s" in meta and "Copy" in meta
    page.wait_for_selector("#conversations li.current", timeout=30_000)
    page.reload()  # the chat just had is open again, no click needed
    page.wait_for_selector(".message.assistant", timeout=30_000)
    assert page.inner_text(".message.user").endswith("Hello?")
    page.click("#conversations li.current button[title=Delete]")
    wait_for(lambda: page.dialogs, what="the delete confirmation")  # dismissed: kept
    assert "cannot be undone" in page.dialogs[0]
    assert page.locator("#conversations li.current").count() == 1
    page.close()


def test_continue_is_offered_only_for_an_answer_cut_short(web, browser):
    """An answer that ended by itself (finish_reason "stop") has nothing to continue; one cut
    at max_tokens has."""
    prompt = "Say hi."
    asked = {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
             "max_tokens": 200}
    whole = httpx.post(web.url + "/v1/chat/completions", json=asked, timeout=300).json()
    assert whole["choices"][0]["finish_reason"] == "stop"  # the case this test is about
    page = open_page(browser, web.url)
    send(page, prompt, max_tokens=200)
    page.wait_for_selector(".message.assistant .meta", timeout=120_000)
    assert page.locator("#regenerate").is_visible() and not page.locator("#continue").is_visible()
    page.click("#new-chat")
    send(page, prompt, max_tokens=2)
    page.wait_for_selector(".message.assistant .meta", timeout=120_000)
    assert page.locator("#continue").is_visible()
    page.close()


def test_on_a_touch_screen_enter_is_a_new_line_and_the_input_says_no_enter_sends(web, browser):
    context = browser.new_context(viewport={"width": 390, "height": 800}, has_touch=True,
                                  is_mobile=True)
    page = context.new_page()
    page.goto(web.url + "/")
    page.wait_for_selector("#app", state="visible", timeout=30_000)
    assert "Enter sends" not in page.get_attribute("#input", "placeholder")
    page.fill("#input", "first line")
    page.press("#input", "Enter")
    page.type("#input", "second line")
    assert page.input_value("#input") == "first line\nsecond line"
    assert page.locator(".message.user").count() == 0  # nothing was sent
    context.close()


def test_two_models_get_a_picker_and_each_answer_names_its_model(browser):
    from localserve.common.config import default_model_path

    path = str(default_model_path())
    with running("-c", "1024", "-np", "2", "-t", "2", "--model", f"chat={path}",
                 "--model", f"coder={path}", "--max-loaded-models", "2", log_name="web-models") as srv:
        page = open_page(browser, srv.url)
        page.wait_for_selector("#model-picker:not([hidden])", timeout=30_000)
        assert page.locator("#model option").all_inner_texts()[1].startswith("coder")
        page.select_option("#model", "coder")
        send(page, "Say hi.", max_tokens=4)
        page.wait_for_selector(".message.assistant .meta", timeout=120_000)
        assert page.inner_text(".message.assistant .meta").startswith("coder")
        page.close()


def test_theme_button_and_reconnecting_after_the_server_was_away(web, browser):
    context = browser.new_context(color_scheme="light")
    page = context.new_page()
    page.route("**/v1/models", lambda route: route.abort())  # the server is away
    page.goto(web.url + "/")
    wait_for(lambda: "Reconnecting" in page.inner_text("#login-error"), timeout=30,
             what="the page to say it is reconnecting")
    page.unroute("**/v1/models")  # it is back: the page gets there by itself
    page.wait_for_selector("#app:not([hidden])", timeout=30_000)
    dark = lambda: sum(int(x) for x in page.evaluate(  # noqa: E731
        "getComputedStyle(document.body).backgroundColor")[4:-1].split(",")) < 200
    assert not dark()
    page.click("#theme")  # auto -> light
    page.click("#theme")  # light -> dark, whatever the OS says
    assert page.inner_text("#theme") == "Theme: dark" and dark()
    page.reload()  # kept in this browser
    page.wait_for_selector("#app:not([hidden])", timeout=30_000)
    assert dark()
    context.close()
