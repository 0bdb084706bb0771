"""Pure tests of what admission is made of: quota reservations under a burst, keys taking turns
for embeddings, the bounds on grammars and schemas, and the bounded audit of refused keys."""

import asyncio

import pytest

from localserve.api.auth import RefusalLog
from localserve.api.grammar_bounds import BoundError, check_gbnf, check_schema
from localserve.models.turns import Turns
from localserve.office.quotas import Quota, QuotaError, QuotaKeeper, next_month


def test_max_concurrent_counts_reservations_until_released():
    keeper = QuotaKeeper({"alice": Quota(max_concurrent=2)})
    held = [keeper.reserve("alice", 0, 0) for _ in range(2)]
    with pytest.raises(QuotaError) as refused:
        keeper.reserve("alice", 0, 0)
    assert refused.value.limit == "max_concurrent"
    held[0].release()
    held[0].release()  # twice is once
    keeper.reserve("alice", 0, 0)
    with pytest.raises(QuotaError):
        keeper.reserve("alice", 0, 0)


def test_a_request_refused_for_its_body_does_not_use_up_requests_per_minute():
    keeper = QuotaKeeper({"alice": Quota(requests_per_minute=2)}, clock=lambda: 100.0)
    for _ in range(5):
        keeper.reserve("alice", 0, 0).release(refused=True)  # 400s: a client fixing its body
    kept = keeper.reserve("alice", 0, 0)
    kept.release()
    keeper.reserve("alice", 0, 0).release()
    with pytest.raises(QuotaError) as refused:
        keeper.reserve("alice", 0, 0)
    assert refused.value.limit == "requests_per_minute"
    kept.release(refused=True)  # released once: a late "refused" gives nothing back
    with pytest.raises(QuotaError):
        keeper.reserve("alice", 0, 0)


def test_reserved_tokens_count_against_the_daily_quota_until_settled():
    keeper = QuotaKeeper({"default": Quota(tokens_per_day=1500)})
    first = keeper.reserve("carol", 0, 0)
    first.reserve_tokens(1000, 0, 0)
    second = keeper.reserve("carol", 0, 0)
    second.reserve_tokens(600, 0, 0)  # 1000 held < 1500: allowed, overshoot <= one reservation
    with pytest.raises(QuotaError) as refused:
        keeper.reserve("carol", 0, 0)  # 1600 held
    assert refused.value.limit == "tokens_per_day" and "held" in str(refused.value)
    first.release()
    second.release()
    keeper.reserve("carol", 700, 700).reserve_tokens(10, 700, 700)  # the ledger's 700 + 0 held
    assert keeper.quota("nobody") == Quota(tokens_per_day=1500)


def test_embedding_turns_go_round_the_keys():
    async def scenario():
        turns, order = Turns(), []

        async def one(user, tag):
            await turns.take(user)
            order.append(tag)
            await asyncio.sleep(0)
            turns.give_back()

        await turns.take("holder")  # the turn is taken: everyone below queues
        tasks = [asyncio.create_task(one("flooder", f"f{i}")) for i in range(4)]
        tasks.append(asyncio.create_task(one("colleague", "c0")))
        await asyncio.sleep(0)
        turns.give_back()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["f0", "c0", "f1", "f2", "f3"]


def test_a_cancelled_wait_for_a_turn_neither_blocks_nor_leaks_it():
    async def scenario():
        turns = Turns()
        await turns.take("a")
        waiting = asyncio.create_task(turns.take("b"))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        turns.give_back()
        await asyncio.wait_for(turns.take("c"), 5)  # free again

    asyncio.run(scenario())


@pytest.mark.parametrize("gbnf, problem", [
    ("root ::= " + "(" * 65 + '"a"' + ")" * 65, "nests"),
    ("\n".join(f"r{i} ::= \"a\"" for i in range(2001)) + "\nroot ::= r0", "rules"),
    ('root ::= "a"{0,1001}', "repetitions"),
    ('root ::= "a"{600} "b"{0,600}', "repetitions"),
])
def test_grammars_past_a_bound_are_refused(gbnf, problem):
    with pytest.raises(BoundError, match=problem):
        check_gbnf(gbnf)


def test_grammar_bounds_skip_literals_and_comments():
    check_gbnf('root ::= "((((((((" [(){}] # ' + "(" * 100 + '\n  ("a"{3,5})')
    check_gbnf('root ::= "\\"(((" x\nx ::= [^\\]((]')


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 100_000_000},
    {"type": "array", "items": {"type": "string", "minLength": 5000}},
    {"anyOf": [{"type": "string", "pattern": "[a-z]{0,10000000}"}]},
    {"type": "string", "pattern": "a{600}b{600}"},
])
def test_schemas_past_a_bound_are_refused(schema):
    with pytest.raises(BoundError):
        check_schema(schema)


def test_ordinary_schemas_pass():
    check_schema({"type": "object", "properties": {"name": {"type": "string", "maxLength": 100},
                  "tags": {"type": "array", "maxItems": 10, "items": {"pattern": "^[a-z]{2,8}$"}}}})


def test_refused_keys_write_one_short_row_a_minute_per_address():
    class Ledger:
        rows = []

        def audit(self, event, key, detail=""):
            self.rows.append(detail)

    now = [0.0]
    log, ledger = RefusalLog(clock=lambda: now[0]), Ledger()
    for _ in range(100):
        log.note(ledger, "10.0.0.9", "GET /v1/models/" + "A" * 15_000)
    log.note(ledger, "10.0.0.8", "GET /")
    now[0] = 61.0
    log.note(ledger, "10.0.0.9", "GET /")
    assert len(ledger.rows) == 3 and all(len(row) < 300 for row in ledger.rows)
    assert "99 more" in ledger.rows[2]


def test_a_key_reload_audits_additions_removals_rotations_and_role_changes(tmp_path):
    from localserve.common.config import Settings
    from localserve.office.office import Office

    keys = tmp_path / "keys.txt"
    keys.write_text("alice:alice-key-000:user\nbob:bob-key-0000:user\ncarol:carol-key-00\n")
    keys.chmod(0o600)
    office = Office(Settings(api_key_file=str(keys)))
    assert len(office.keys) == 3

    class Ledger:
        rows = []

        def audit(self, event, key, detail=""):
            self.rows.append((event, key, detail))

    office.ledger = Ledger()
    keys.write_text("alice:alice-key-000:admin\nbob:bob-key-1111:user\ndave:dave-key-000\n")
    added, removed = office.reload_keys()
    assert (added, removed) == ({"dave"}, {"carol"})
    assert sorted(Ledger.rows) == [("key_added", "dave", ""), ("key_removed", "carol", ""),
                                   ("key_rotated", "bob", ""),
                                   ("role_changed", "alice", "user -> admin")]


def test_a_caller_is_named_one_way_everywhere():
    """One typed Caller (api/auth.py) instead of None, "local" and getattr defaults spelt per
    route: the key's name wins; without keys the body's user names ledger rows, stored chats
    belong to the local user, and the one desktop user is an admin."""
    from localserve.api.auth import NOBODY, Caller

    alice = Caller("alice", "user")
    assert (alice.user("spoofed"), alice.owner, alice.is_admin) == ("alice", "alice", False)
    assert (NOBODY.user("bob"), NOBODY.user(), NOBODY.owner, NOBODY.is_admin) == \
        ("bob", None, "local", True)


def test_a_frontend_rotating_colleague_names_is_bounded_as_a_whole():
    """Each forwarded name has its own bucket; the frontend's key as a whole gets
    FRONTEND_SCALE keys' worth, so names it rotates (each a full bucket) cannot pass it."""
    from types import SimpleNamespace

    from localserve.api.admission import FRONTEND_SCALE, limit_rate
    from localserve.api.auth import Caller
    from localserve.api.rate_limit import RateLimiter
    from localserve.api.schemas import OpenAIError

    limiter = RateLimiter(rate=2.0, burst=3, clock=lambda: 0.0)

    def ask(name):
        request = SimpleNamespace(
            state=SimpleNamespace(caller=Caller(f"webui:{name}", "user", frontend="webui")),
            app=SimpleNamespace(state=SimpleNamespace(rate_limiter=limiter)),
            url=SimpleNamespace(path="/v1/chat/completions"))
        try:
            asyncio.run(limit_rate(request))
            return 200
        except OpenAIError as exc:
            return exc.status, exc.message

    statuses = [ask(f"n{i}") for i in range(3 * FRONTEND_SCALE + 5)]
    assert statuses[:3 * FRONTEND_SCALE] == [200] * (3 * FRONTEND_SCALE)
    assert all(s[0] == 429 and "'webui'" in s[1] for s in statuses[3 * FRONTEND_SCALE:])
    assert ask("n0")[0] == 429  # a name seen before passes no more than a new one


def test_a_grammar_sent_again_is_checked_once_and_the_memory_is_bounded():
    from types import SimpleNamespace

    from localserve.api.structured import CheckedGrammars

    calls = []
    host = SimpleNamespace(model_path="/m.gguf",
                           grammar_error=lambda g: calls.append(g) or ("slow" if "b" in g else None))
    checked = CheckedGrammars(kept=2)
    assert [checked.problem(host, 'root ::= "a"') for _ in range(3)] == [None] * 3
    assert checked.problem(host, 'root ::= "b"') == "invalid grammar: slow"
    assert checked.problem(host, 'root ::= "b"') == "invalid grammar: slow" and len(calls) == 2
    checked.problem(host, 'root ::= "c"')
    checked.problem(host, 'root ::= "a"')  # pushed out by two newer ones: checked again
    assert len(calls) == 4 and len(checked._found) == 2


def test_admit_takes_the_quota_hold_that_the_route_then_carries():
    """The one admission dependency takes the key's quota hold: with max_concurrent 1, a
    second admission while the first is held is refused with 429 naming the limit. (A copy of
    admit without hold_quota lets it through: the break this guards.)"""
    from types import SimpleNamespace

    from starlette.requests import Request

    from localserve.api.admission import admit
    from localserve.api.schemas import OpenAIError

    state = SimpleNamespace(
        keys=SimpleNamespace(identify=lambda request: ("alice", "user")),
        office=SimpleNamespace(ledger=None, settings=SimpleNamespace(trusted_frontends=())),
        rate_limiter=None, models=None,
        quotas=QuotaKeeper({"alice": Quota(max_concurrent=1)}))
    app = SimpleNamespace(state=state)

    def request() -> Request:
        return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                        "headers": [], "query_string": b"", "app": app})

    first = request()
    admitted = asyncio.run(admit(first))
    assert admitted.hold is not None and admitted.hold is first.state.quota_hold
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(admit(request()))
    assert refused.value.status == 429 and refused.value.param == "max_concurrent"
    admitted.hold.release()
    asyncio.run(admit(request())).hold.release()


def test_a_monthly_quota_resets_at_midnight_starting_the_next_month():
    from datetime import datetime

    assert next_month(datetime(2026, 12, 31, 23, 59, 59, 999)) == datetime(2027, 1, 1)
    assert next_month(datetime(2026, 1, 31, 12, 30, 5, 7)) == datetime(2026, 2, 1)
    assert next_month(datetime(2026, 11, 1)) == datetime(2026, 12, 1)


def test_a_keys_refusals_are_paced_apart_and_held_no_longer_than_the_bound():
    """A key's refusals are answered REFUSAL_PACE_S apart (a flood on many connections gets
    that rate of answers, not one per connection per round trip), never held past
    MAX_REFUSAL_HOLD_S; another key's refusal does not queue behind them, and a frontend as a
    whole is paced `scale` times faster."""
    from localserve.api.rate_limit import MAX_REFUSAL_HOLD_S, REFUSAL_PACE_S, RateLimiter

    now = [0.0]
    limiter = RateLimiter(rate=10.0, burst=1, clock=lambda: now[0])
    flood = [limiter.refusal_delay("alice") for _ in range(400)]
    assert flood[:3] == pytest.approx([REFUSAL_PACE_S, 2 * REFUSAL_PACE_S, 3 * REFUSAL_PACE_S])
    assert max(flood) == pytest.approx(MAX_REFUSAL_HOLD_S)
    assert flood[-1] == pytest.approx(MAX_REFUSAL_HOLD_S)
    assert limiter.refusal_delay("bob") == pytest.approx(REFUSAL_PACE_S)
    assert limiter.refusal_delay("webui", scale=8) == pytest.approx(REFUSAL_PACE_S / 8)
    now[0] = 60.0  # the line has long been answered: a lone refusal is quick again
    assert limiter.refusal_delay("alice") == pytest.approx(REFUSAL_PACE_S)


def test_an_over_rate_refusal_is_answered_paced():
    """limit_rate's 429 carries the pacing as delay_s (the error handler sleeps it, free)."""
    from types import SimpleNamespace

    from localserve.api.admission import limit_rate
    from localserve.api.auth import Caller
    from localserve.api.rate_limit import REFUSAL_PACE_S, RateLimiter
    from localserve.api.schemas import OpenAIError

    limiter = RateLimiter(rate=1.0, burst=1, clock=lambda: 0.0)
    request = SimpleNamespace(
        state=SimpleNamespace(caller=Caller("alice", "user", None)),
        app=SimpleNamespace(state=SimpleNamespace(rate_limiter=limiter)),
        url=SimpleNamespace(path="/v1/chat/completions"))
    asyncio.run(limit_rate(request))
    delays = []
    for _ in range(3):
        with pytest.raises(OpenAIError) as refused:
            asyncio.run(limit_rate(request))
        assert refused.value.status == 429
        delays.append(refused.value.delay_s)
    assert delays == pytest.approx([REFUSAL_PACE_S * n for n in (1, 2, 3)])
