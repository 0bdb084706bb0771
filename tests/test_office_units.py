"""Pure tests of the office's rules (office.py) and of what the ledger's observer writes
(ledger.py): whose cached prompts a request may reuse with keys on or off and with
--shared-prefix-cache, which kept prompts outlive a key change, names in the config that are
no key's, what a key reload audits, which observers a model gets, and the row of a finished
request (n > 1: the prompt billed once)."""

import time

import pytest

from localserve.common.config import Settings
from localserve.office.conversations import Conversations
from localserve.engine.finish import FinishReason
from localserve.engine.request import Request, SamplingParams, TokenEvent
from localserve.office.ledger import LedgerObserver, refusal_row, request_row
from localserve.office.office import Office

from conftest import key_file


class FakeLedger:
    def __init__(self):
        self.rows, self.audits = [], []

    def record(self, row):
        self.rows.append(row)

    def audit(self, event, key, detail=""):
        self.audits.append((event, key, detail))


def test_cache_scopes_follow_keys_and_the_shared_flag(tmp_path):
    keys = str(key_file(tmp_path, "alice:alice-key-0001", "owui:owui-key-0002"))
    assert Office(Settings()).cache_scope("alice") is None  # one desktop user: all one scope
    assert Office(Settings(api_key_file=keys)).cache_scope("alice") == "alice"
    assert Office(Settings(api_key_file=keys)).cache_scope(None) is None
    shared = Office(Settings(api_key_file=keys, shared_prefix_cache=True))
    assert shared.cache_scope("alice") is None


def test_kept_prompts_live_while_their_key_or_frontend_does(tmp_path):
    keys = str(key_file(tmp_path, "alice:alice-key-0001", "owui:owui-key-0002"))
    office = Office(Settings(api_key_file=keys, trusted_frontends=("owui",)))
    assert office.live_scope("alice") and office.live_scope("owui")
    assert office.live_scope("owui:bob@example.com")  # a colleague of a trusted frontend
    assert office.live_scope("owui:bob:x")  # the colleague's name came with a colon
    assert office.live_scope(None)  # the shared scope
    assert not office.live_scope("carol") and not office.live_scope("alice:bob")
    assert Office(Settings()).live_scope("anyone")  # keys off: nothing is anyone's
    untrusted = Office(Settings(api_key_file=keys))
    assert not untrusted.live_scope("owui:bob")


def test_names_in_the_config_that_are_no_keys_are_named(tmp_path):
    keys = str(key_file(tmp_path, "alice:alice-key-0001", "owui:owui-key-0002"))
    office = Office(Settings(api_key_file=keys, trusted_frontends=("owui", "webui"),
                             quotas={"default": {}, "alice": {}, "bbo": {}, "owui:bob": {},
                                     "x:bob": {}}))
    assert office.unknown_names() == ["[quotas.bbo]", "[quotas.x:bob]",
                                      "--trust-user-header webui"]


def test_a_key_reload_audits_each_change_and_says_who_came_and_went(tmp_path):
    path = key_file(tmp_path, "alice:alice-key-0001", "bob:bob-key-00002:admin",
                    "carol:carol-key-003")
    office = Office(Settings(api_key_file=str(path)))
    office.ledger = FakeLedger()
    assert office.keys_enabled and len(office.keys) == 3
    path.write_text("alice:alice-key-0009\nbob:bob-key-00002:user\ndave:dave-key-0004\n")
    assert office.reload_keys() == ({"dave"}, {"carol"})
    assert office.ledger.audits == [("key_added", "dave", ""), ("key_removed", "carol", ""),
                                    ("key_rotated", "alice", ""),
                                    ("role_changed", "bob", "admin -> user")]
    assert office.keys["alice-key-0009"] == ("alice", "user", None)


def test_a_model_gets_the_per_key_counters_only_with_keys_and_the_ledger_when_kept(tmp_path):
    keys = str(key_file(tmp_path, "alice:alice-key-0001"))
    with_keys = Office(Settings(api_key_file=keys, state_dir=str(tmp_path / "a")))
    observers = with_keys.observers(lambda: "m")
    assert observers[0] is with_keys.key_metrics and isinstance(observers[1], LedgerObserver)
    assert observers[1].ledger is with_keys.ledger and observers[1].model_id() == "m"
    assert len(observers) == 2 and with_keys.ledger is not None
    assert (tmp_path / "a" / "ledger.db").exists() and with_keys.responses is not None
    assert with_keys.conversations is not None  # the page is on by default
    with_keys.close()
    desktop = Office(Settings(ledger=False, web=False, state_dir=str(tmp_path / "b")))
    assert desktop.observers(lambda: "m") == [] and desktop.ledger is None
    assert desktop.conversations is None and isinstance(desktop.responses, Conversations)
    desktop.close()


def finished(request, reason=FinishReason.STOP, prompt=0, completion=0, cached=0):
    return TokenEvent("", finish_reason=reason, prompt_tokens=prompt,
                      completion_tokens=completion, cached_tokens=cached)


def test_the_ledger_writes_one_row_per_finished_request_with_what_its_event_billed():
    ledger = FakeLedger()
    observer = LedgerObserver(ledger, lambda: "smol")
    request = Request([1] * 12, SamplingParams(), user="alice", endpoint="/v1/chat/completions",
                      arrival_time=100.0)
    request.admitted_time = 100.5
    observer.on_step(None, 0.1)
    observer.on_event(request, TokenEvent("hi", token_ids=(5,)))  # not finished: no row
    assert ledger.rows == []
    observer.on_event(request, finished(request, FinishReason.LENGTH, 0, 7, 0))
    [row] = ledger.rows
    assert row["prompt_tokens"] == 0  # what the event billed (a second choice), not the prompt
    assert (row["key"], row["endpoint"], row["model"], row["completion_tokens"],
            row["finish_reason"], row["status"], row["queue_s"]) == (
        "alice", "/v1/chat/completions", "smol", 7, "length", 200, 0.5)
    assert row["cached_tokens"] == 0
    assert row["duration_s"] == pytest.approx(time.monotonic() - 100.0, abs=1.0)
    observer.on_event(request, finished(request, FinishReason.STOP, 12, 1, 8))
    assert (ledger.rows[1]["prompt_tokens"], ledger.rows[1]["cached_tokens"]) == (12, 8)


def test_a_row_names_nobody_as_anonymous_and_takes_its_status_from_the_reason():
    row = request_row(None, "/v1/embeddings", "m", 3, 1, 0, "abort", 0.123456, 2.123456)
    assert (row["key"], row["prompt_tokens"], row["cached_tokens"], row["status"],
            row["queue_s"], row["duration_s"]) == ("anonymous", 3, 1, 499, 0.1235, 2.1235)


@pytest.mark.parametrize("reason, status", [("stop", 200), ("length", 200), ("abort", 499)])
def test_statuses_of_rows(reason, status):
    assert request_row("a", "/x", "m", 1, 0, 1, reason, 0, 0)["status"] == status


def test_the_ledger_file_sums_rows_by_key_model_and_day_and_keeps_totals_across_a_restart(
        tmp_path):
    from localserve.office.ledger import Ledger, audit_log, usage

    ledger = Ledger(tmp_path)
    ledger.record(request_row("alice", "/v1/chat/completions", "m1", 10, 4, 5, "stop", 0, 1))
    ledger.record(request_row("alice", "/v1/completions", "m2", 3, 0, 2, "length", 0, 1))
    ledger.record(request_row("bob", "/v1/chat/completions", "m1", 7, 0, 1, "abort", 0, 1))
    ledger.record(refusal_row("bob", "/v1/chat/completions", 400, "context_length_exceeded"))
    ledger.audit("quota", "bob", "tokens_per_day")
    assert ledger.tokens_used("alice") == (20, 20) and ledger.tokens_used("carol") == (0, 0)
    ledger.close()
    path = tmp_path / "ledger.db"
    assert usage(path) == [
        {"key": "alice", "prompt_tokens": 13, "cached_tokens": 4, "completion_tokens": 7,
         "requests": 2, "refused": 0},
        {"key": "bob", "prompt_tokens": 7, "cached_tokens": 0, "completion_tokens": 1,
         "requests": 2, "refused": 1}]
    assert [r["model"] for r in usage(path, group_by="model")] == [
        "context_length_exceeded", "m1", "m2"]  # a refusal's row says why where the model goes
    assert usage(path, key="bob")[0]["requests"] == 2
    assert usage(path, since=0, until=1) == []
    [day] = usage(path, group_by="day")
    assert day["requests"] == 4 and day["refused"] == 1
    with pytest.raises(ValueError) as refused:
        usage(path, group_by="endpoint")
    assert str(refused.value) == "group_by must be one of key, model, day"
    assert usage(tmp_path / "none.db") == [] and audit_log(tmp_path / "none.db") == []
    [audit] = audit_log(path)
    assert (audit["event"], audit["key"], audit["detail"]) == ("quota", "bob", "tokens_per_day")
    assert audit_log(path, since=audit["ts"] + 1) == []
    again = Ledger(tmp_path)  # today's and this month's totals are read back
    assert again.tokens_used("alice") == (20, 20) and again.tokens_used("bob") == (8, 8)
    again.close()


def test_a_flush_writes_requests_or_audits_alone_and_keeps_the_audit_bounded(tmp_path,
                                                                             monkeypatch):
    import localserve.office.ledger as ledger_module
    from localserve.office.ledger import Ledger, audit_log, usage

    monkeypatch.setattr(ledger_module, "MAX_AUDIT_ROWS", 2)
    ledger = Ledger(tmp_path)
    ledger._stop.set()  # the writer thread stops: this test flushes by hand
    ledger._writer.join()
    ledger.record(request_row("alice", "/x", "m", 1, 0, 1, "stop", 0, 1))
    ledger._flush()
    assert usage(tmp_path / "ledger.db")[0]["requests"] == 1
    for event in ("a", "b", "c"):
        ledger.audit(event, None)
    ledger._flush()
    assert [row["event"] for row in audit_log(tmp_path / "ledger.db")] == ["b", "c"]


def test_a_ledger_that_cannot_write_warns_once_until_it_can_again(tmp_path, caplog):
    import sqlite3

    from localserve.office.ledger import Ledger

    ledger = Ledger(tmp_path)
    ledger._stop.set()
    ledger._writer.join()
    working = ledger._db
    broken = sqlite3.connect(":memory:")
    broken.close()
    ledger._db = broken

    def fail_twice():
        for _ in range(2):
            ledger.record(request_row("alice", "/x", "m", 1, 0, 1, "stop", 0, 1))
            ledger._flush()

    with caplog.at_level("WARNING", logger="localserve.office.ledger"):
        fail_twice()
        ledger._db = working
        ledger.audit("x", None)
        ledger._flush()  # writable again: the next failure warns again
        ledger._db = broken
        fail_twice()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert warnings[0].startswith(f"could not write the ledger {ledger.path} (")
    assert warnings[0].endswith("); usage of 1 requests is lost until it is writable again")


def test_todays_totals_start_again_on_a_new_day(tmp_path):
    from localserve.office.ledger import Ledger

    ledger = Ledger(tmp_path)
    ledger.record(request_row("alice", "/x", "m", 5, 0, 5, "stop", 0, 1))
    assert ledger.tokens_used("alice") == (10, 10)
    ledger._day = "2000-01-01"  # the server ran past midnight
    assert ledger.tokens_used("alice") == (0, 10)
    ledger._month = "2000-01"
    assert ledger.tokens_used("alice") == (0, 0)
    ledger.record(request_row("alice", "/x", "m", 1, 0, 0, "stop", 0, 1))
    assert ledger.tokens_used("alice") == (1, 1)
    ledger.close()


def test_key_changes_and_the_ledger_path_are_logged(tmp_path, caplog):
    path = key_file(tmp_path, "alice:alice-key-0001:admin")
    office = Office(Settings(api_key_file=str(path), state_dir=str(tmp_path / "s")))
    assert office.keys
    path.write_text("alice:alice-key-0001:user\nbo_b:bob-key-00002\n")
    with caplog.at_level("INFO", logger="localserve"):
        office.reload_keys()
        office.open_state()
    assert [r.getMessage() for r in caplog.records] == [
        "SIGHUP: key added bo_b", "SIGHUP: role changed alice admin -> user",
        f"ledger: {office.ledger.path}"]
    assert (tmp_path / "s" / "responses.db").exists()
    office.close()


def test_per_key_counters_are_kept_in_the_offices_own_registry(tmp_path):
    office = Office(Settings(api_key_file=str(key_file(tmp_path, "alice:alice-key-0001"))))
    request = Request([1, 2, 3], SamplingParams(), user="alice")
    office.key_metrics.on_event(request, finished(request, prompt=3, completion=2))
    assert office.key_registry.get_sample_value("localserve:key_prompt_tokens_total",
                                                {"key": "alice"}) == 3
    assert office.draining is False and office.responses is None


def test_a_frontends_colleagues_get_series_up_to_a_bound_and_the_rest_count_as_other():
    from prometheus_client import CollectorRegistry

    from localserve.common.metrics import KeyUsageMetrics

    registry = CollectorRegistry()
    metrics = KeyUsageMetrics(registry)
    metrics.MAX_COLLEAGUES = 2
    for user in ["owui:ann", "owui:bo", "owui:cy", "owui:dee", "owui:ann", "alice"]:
        request = Request([1, 2, 3], SamplingParams(), user=user)
        metrics.on_event(request, finished(request, prompt=3, completion=2))

    def requests(key):
        return registry.get_sample_value("localserve:key_requests_total", {"key": key})
    assert (requests("owui:ann"), requests("owui:bo"), requests("owui:other")) == (2, 1, 2)
    assert requests("owui:cy") is None and requests("alice") == 1  # the key file's own names


def test_forwarded_names_that_clean_alike_stay_apart():
    from localserve.api.auth import colleague_name

    assert colleague_name("o_brien@office.lan") == "o_brien@office.lan"  # nothing to clean
    cleaned = colleague_name("o'brien@office.lan")
    assert cleaned.startswith("o_brien@office.lan~") and len(cleaned) == len("o_brien@office.lan") + 9
    long_a, long_b = "a" * 64 + "@one.lan", "a" * 64 + "@two.lan"
    assert colleague_name(long_a) != colleague_name(long_b)
    assert colleague_name(long_a)[:64] == "a" * 64 and colleague_name(long_a) == colleague_name(long_a)


def test_the_state_folder_is_systemds_else_the_users_data_folder(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from localserve.office.ledger import default_state_dir, state_dir

    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/a:{tmp_path}/b")
    assert default_state_dir() == tmp_path / "a"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "localserve"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".local" / "share" / "localserve"
    assert state_dir(SimpleNamespace(state_dir=str(tmp_path / "s"))) == tmp_path / "s"
    assert state_dir(SimpleNamespace(state_dir=None)) == default_state_dir()


@pytest.mark.parametrize("room, max_output, n_predict, expected", [
    (1024 + 200 + 24 * 50, None, None, 50),  # held to the 50 tokens the store can take
    (1024 + 200 + 24 * 50, None, 20, None),  # the server's -n holds it to less already
    (1024 + 200 + 24 * 50, 50, None, None),  # max_output_tokens fits: as asked
    (1024 + 200 + 24 * 50, 51, None, 413),  # does not fit: refused before it runs
    (1024 + 200 + 23, None, None, 413),  # not one token fits
])
def test_a_stored_answer_without_a_limit_is_held_to_what_the_store_can_take(
        room, max_output, n_predict, expected):
    """Round 5: an answer that overflowed the store once made was refused with a 413 and
    billed. Now it never runs past what can be stored (pure: a store with `room` bytes)."""
    from types import SimpleNamespace

    from localserve.api import routes_responses
    from localserve.api.routes_responses import ResponsesRequest
    from localserve.api.schemas import OpenAIError

    input_text = "x" * (200 - len('[[], "", null, null, null, null, null, null]'))
    body = ResponsesRequest(model="m", input=input_text, max_output_tokens=max_output)
    store = SimpleNamespace(room=lambda owner: room)
    office = SimpleNamespace(responses=store, settings=SimpleNamespace(n_predict=n_predict))
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(office=office)),
                              state=SimpleNamespace())
    if expected == 413:
        with pytest.raises(OpenAIError) as refused:
            routes_responses._stored_answer_limit(request, body, [])
        assert refused.value.status == 413 and refused.value.code == "response_too_large"
    else:
        assert routes_responses._stored_answer_limit(request, body, []) == expected


def test_a_quota_reads_as_its_toml_table_says_it():
    from localserve.office.quotas import Quota

    two = Quota(tokens_per_day=50, max_concurrent=2)
    assert str(two) == "tokens_per_day = 50, max_concurrent = 2"
    assert str(Quota()) == "no limit"
