"""Pure tests of the ASGI middleware every request passes (api/limits.py) and of the quota
rules' edges (quotas.py), driven with hand-made ASGI messages: a body sent without a JSON
content type, a body over the limit (announced or chunked), a quota hold given back however a
response ends, token quotas at their exact bounds and their reset times."""

import asyncio
import json
from datetime import datetime, timedelta

import pytest

from localserve.api.limits import BodySizeLimit, JsonBodyByDefault, ReleaseReservations
from localserve.common.config import SettingsError
from localserve.office.quotas import Quota, QuotaError, QuotaKeeper, parse_quotas


def http(method="POST", headers=(), **extra):
    return {"type": "http", "method": method, "headers": list(headers), **extra}


def drive(middleware, scope, bodies=(b"",)):
    """Run `middleware` on `scope` with the request body in `bodies` chunks: (messages sent,
    messages the app received)."""
    sent, chunks = [], list(bodies)

    async def receive():
        if not chunks:
            return {"type": "http.disconnect"}
        body = chunks.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    return sent


class EchoApp:
    """Reads the whole body, then answers 200 with it; records the scope it was given."""

    def __init__(self, status=200, fail=False):
        self.status, self.fail, self.scope, self.received = status, fail, None, []

    async def __call__(self, scope, receive, send):
        self.scope = scope
        body = b""
        while True:
            message = await receive()
            self.received.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.fail:
            raise RuntimeError("the app failed")
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        await send({"type": "http.response.body", "body": body})


# ---- JsonBodyByDefault ---------------------------------------------------------------

@pytest.mark.parametrize("given", [None, b"", b"text/plain", b"Text/Plain; charset=utf-8",
                                   b"application/x-www-form-urlencoded", b"multipart/form-data",
                                   b"application/octet-stream", b"application/json"])
def test_a_post_is_read_as_json_whatever_its_type(given):
    app = EchoApp()
    headers = [(b"x-other", b"1")] + ([(b"content-type", given)] if given is not None else [])
    drive(JsonBodyByDefault(app), http(headers=headers))
    assert app.scope["headers"] == [(b"x-other", b"1"), (b"content-type", b"application/json")]


@pytest.mark.parametrize("mark", [(b"origin", b"https://evil.example"), (b"origin", b"null"),
                                  (b"sec-fetch-site", b"cross-site"), (b"sec-fetch-mode", b"no-cors")])
@pytest.mark.parametrize("given", [b"text/plain", b"Text/Plain; charset=utf-8",
                                   b"application/x-www-form-urlencoded",
                                   b"multipart/form-data; boundary=x", None, b""])
def test_a_browsers_simple_request_body_is_refused_unread(mark, given):
    """A page elsewhere can POST these types, or none (fetch's no-cors Blob), without a
    preflight: refused (415), the app never runs."""
    app = EchoApp()
    typed = [(b"content-type", given)] if given is not None else []
    sent = drive(JsonBodyByDefault(app), http(headers=[mark, *typed]))
    assert app.scope is None and sent[0]["status"] == 415
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]


@pytest.mark.parametrize("given", [b"application/json", b"application/octet-stream"])
def test_a_browsers_json_and_other_types_pass(given):
    """JSON (which a cross-site page can only send after a preflight) and non-safelisted
    types are not simple requests: read as JSON as from any tool."""
    app = EchoApp()
    headers = [(b"origin", b"http://127.0.0.1:8080")] + (
        [(b"content-type", given)] if given is not None else [])
    drive(JsonBodyByDefault(app), http(headers=headers))
    assert app.scope["headers"][-1] == (b"content-type", b"application/json")


@pytest.mark.parametrize("scope", [
    http(method="GET", headers=[(b"content-type", b"text/plain")]),
    {"type": "websocket", "method": "POST", "headers": [(b"content-type", b"text/plain")]}])
def test_other_types_methods_and_protocols_pass_unchanged(scope):
    app = EchoApp()
    drive(JsonBodyByDefault(app), scope)
    assert app.scope is scope


# ---- BodySizeLimit -------------------------------------------------------------------

def refusal(limit):
    return {"error": {"message": f"Request body is larger than the server's limit of {limit} "
                                 f"bytes (--max-body-bytes).", "type": "invalid_request_error",
                      "param": None, "code": "request_too_large"}}


def assert_refused(sent, limit):
    start, body = sent
    assert start["type"] == "http.response.start" and start["status"] == 413
    payload = body["body"]
    assert start["headers"] == [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]
    assert body["type"] == "http.response.body" and json.loads(payload) == refusal(limit)


def test_an_announced_body_over_the_limit_is_refused_unread():
    app = EchoApp()
    sent = drive(BodySizeLimit(app, 10), http(headers=[(b"content-length", b"11")]), [b"x" * 11])
    assert_refused(sent, 10)
    assert app.scope is None  # the app never ran


def test_a_chunked_body_is_cut_off_past_the_limit_and_the_app_told_the_client_left():
    app = EchoApp()
    sent = drive(BodySizeLimit(app, 10), http(), [b"x" * 6, b"y" * 5, b"z"])
    assert_refused(sent, 10)  # the app's own reply to the cut-off body is dropped
    assert [m["type"] for m in app.received] == ["http.request", "http.disconnect"]


def test_an_app_that_reads_on_after_the_cut_off_is_told_again_that_the_client_left():
    seen, chunks = [], [b"x" * 11, b"more", b"and more"]

    async def app(scope, receive, send):
        seen.extend([(await receive())["type"] for _ in range(3)])

    async def receive():
        return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}

    async def send(message):
        pass
    asyncio.run(BodySizeLimit(app, 10)(http(), receive, send))
    assert seen == ["http.disconnect"] * 3 and len(chunks) == 2  # nothing more is read


def test_a_body_at_the_limit_passes_whole():
    app = EchoApp()
    sent = drive(BodySizeLimit(app, 10), http(headers=[(b"content-length", b"10")]),
                 [b"x" * 4, b"y" * 6])
    assert [m.get("status") for m in sent] == [200, None] and sent[1]["body"] == b"xxxxyyyyyy"
    assert app.scope["method"] == "POST"  # the app gets the request's own scope


def test_a_length_that_is_not_a_number_is_counted_as_the_body_arrives():
    app = EchoApp()
    sent = drive(BodySizeLimit(app, 3), http(headers=[(b"content-length", b"2x")]), [b"abcd"])
    assert_refused(sent, 3)


def test_other_protocols_pass_unchanged():
    app = EchoApp()
    scope = {"type": "lifespan"}
    drive(BodySizeLimit(app, 1), scope, [b"too long"])
    assert app.scope is scope


# ---- ReleaseReservations -------------------------------------------------------------

class Hold:
    def __init__(self):
        self.released = []

    def release(self, refused=False):
        self.released.append(refused)


@pytest.mark.parametrize("status, refused", [(200, False), (400, True), (404, True),
                                             (413, True), (422, True), (429, False),
                                             (499, False), (500, False)])
def test_the_hold_is_given_back_once_the_response_is_sent(status, refused):
    hold, app = Hold(), EchoApp(status)
    sent = drive(ReleaseReservations(app), http(state={"quota_hold": hold}), [b"hi"])
    assert hold.released == [refused]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == status and sent[1]["body"] == b"hi"


def test_the_hold_is_given_back_when_the_app_raises():
    hold = Hold()
    with pytest.raises(RuntimeError):
        drive(ReleaseReservations(EchoApp(fail=True)), http(state={"quota_hold": hold}))
    assert hold.released == [False]  # nothing was sent: not a refusal of the body


def test_requests_without_a_hold_pass():
    sent = drive(ReleaseReservations(EchoApp()), http(), [b"ok"])
    assert sent[1]["body"] == b"ok"
    sent = drive(ReleaseReservations(EchoApp()), http(state={}), [b"ok"])
    assert sent[1]["body"] == b"ok"


# ---- quotas --------------------------------------------------------------------------

def test_a_token_quota_refuses_at_its_exact_bound_and_says_when_it_resets():
    keeper = QuotaKeeper({"alice": Quota(tokens_per_day=100, tokens_per_month=1000)})
    keeper.reserve("alice", 99, 99).release()
    with pytest.raises(QuotaError) as day:
        keeper.reserve("alice", 100, 100)
    now = datetime.now()
    seconds_to_midnight = 86400 - (now.hour * 3600 + now.minute * 60 + now.second)
    assert day.value.limit == "tokens_per_day"
    assert abs(day.value.retry_after_s - max(1.0, seconds_to_midnight)) < 5
    assert str(day.value) == ("key 'alice' used 100 of its 100 tokens today (0 more are held by "
                              "its running requests); the quota resets at midnight (server time)")
    with pytest.raises(QuotaError) as month:
        keeper.reserve("alice", 0, 1000)
    first = (now.replace(day=1) + timedelta(days=32)).replace(day=1)
    assert month.value.limit == "tokens_per_month"
    assert str(month.value) == (f"key 'alice' used 1000 of its 1000 tokens this month (0 more "
                                f"are held by its running requests); the quota resets on "
                                f"{first:%Y-%m-%d}")
    to_first = (datetime.combine(first.date(), datetime.min.time()) - now).total_seconds()
    assert abs(month.value.retry_after_s - to_first) < 5


def test_held_tokens_count_towards_the_month_and_are_given_back_on_release():
    keeper = QuotaKeeper({"bob": Quota(tokens_per_month=500)})
    held = keeper.reserve("bob", 0, 300)
    held.reserve_tokens(150, 0, 300)
    keeper.reserve("bob", 0, 349).release()  # 349 + 150 held < 500
    with pytest.raises(QuotaError) as refused:
        keeper.reserve("bob", 0, 350)
    assert "(150 more are held by its running requests)" in str(refused.value)
    with pytest.raises(QuotaError):
        held.reserve_tokens(1, 0, 350)  # a second reservation is checked too
    held.release()
    keeper.reserve("bob", 0, 499).reserve_tokens(1, 0, 499)


def test_a_key_without_a_quota_is_not_held_and_reserves_freely():
    keeper = QuotaKeeper({"alice": Quota(max_concurrent=1)})
    assert keeper.reserve("bob", 10**9, 10**9) is None
    held = keeper.reserve("alice", 10**9, 10**9)
    held.reserve_tokens(10**6, 10**9, 10**9)  # no token quota: nothing to refuse
    assert held.tokens == 10**6


def test_the_minute_window_slides_and_says_when_a_place_frees():
    now = [1000.0]
    keeper = QuotaKeeper({"alice": Quota(requests_per_minute=2)}, clock=lambda: now[0])
    keeper.reserve("alice", 0, 0).release()
    now[0] = 1010.0
    keeper.reserve("alice", 0, 0).release()
    now[0] = 1030.0
    with pytest.raises(QuotaError) as refused:
        keeper.reserve("alice", 0, 0)
    assert refused.value.retry_after_s == 30  # the first stamp leaves the window at 1060
    assert str(refused.value) == ("key 'alice' sent 2 requests in the last minute "
                                  "(requests_per_minute 2)")
    now[0] = 1060.0  # exactly a minute after the first: it no longer counts
    keeper.reserve("alice", 0, 0).release()
    with pytest.raises(QuotaError):
        keeper.reserve("alice", 0, 0)


def test_the_max_concurrent_refusal_names_the_count():
    keeper = QuotaKeeper({"alice": Quota(max_concurrent=1)})
    keeper.reserve("alice", 0, 0)
    with pytest.raises(QuotaError) as refused:
        keeper.reserve("alice", 0, 0)
    assert refused.value.retry_after_s == 1.0
    assert str(refused.value) == ("key 'alice' already has 1 requests running or waiting "
                                  "(max_concurrent 1); send the next when one finishes")


def test_quota_tables_are_parsed_and_bad_ones_refused():
    assert parse_quotas({"alice": {"tokens_per_day": 5, "requests_per_minute": 0.5}}, "f") == {
        "alice": Quota(tokens_per_day=5, requests_per_minute=0.5)}
    cases = {"x": ("f: [quotas.x] must be a table of limits", 3),
             "y": ("f: [quotas.y] tokens: unknown limit (known: tokens_per_day, "
                   "tokens_per_month, requests_per_minute, max_concurrent)", {"tokens": 1}),
             "z": ("f: [quotas.z] max_concurrent = True: expected a positive number",
                   {"max_concurrent": True}),
             "w": ("f: [quotas.w] tokens_per_day = 0: expected a positive number",
                   {"tokens_per_day": 0}),
             "v": ("f: [quotas.v] tokens_per_day = '9': expected a positive number",
                   {"tokens_per_day": "9"})}
    for name, (message, table) in cases.items():
        with pytest.raises(SettingsError) as refused:
            parse_quotas({name: table}, "f")
        assert str(refused.value) == message


def test_per_name_quota_state_stays_bounded_however_many_names_a_frontend_sends():
    """Round 5: a frontend's colleagues are any number of names. Counts at 0 leave no entry;
    past MAX_NAMES, names quiet for a minute leave the minute window; a busy one stays."""
    now = [0.0]
    keeper = QuotaKeeper({"default": Quota(requests_per_minute=2, max_concurrent=5)},
                         clock=lambda: now[0])
    keeper.MAX_NAMES = 3
    busy = keeper.reserve("owui:busy", 0, 0)
    for i in range(10):
        now[0] += 30.0
        keeper.reserve(f"owui:n{i}", 0, 0).release()
    assert len(keeper._minute) <= 3 and "owui:n9" in keeper._minute
    assert dict(keeper._active) == {"owui:busy": 1} and not keeper._reserved
    busy.release()
    assert not keeper._active
    now[0] = 10_000.0
    keeper.reserve("owui:n0", 0, 0).release()  # a name dropped counts from zero again
    keeper.reserve("owui:n0", 0, 0).release()
    with pytest.raises(QuotaError):
        keeper.reserve("owui:n0", 0, 0)
