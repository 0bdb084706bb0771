"""Random GBNF grammars and JSON schemas (hypothesis) against the real server: each is refused
with a 400 or served, never a crash, a 5xx or a freeze past a generous bound."""

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from conftest import running

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
BOUND_S = 30.0  # generous: the server's own bounds refuse costly input in milliseconds
# A fixed sequence of cases by default, so that the suite gives the same answer twice; set
# FUZZ_RANDOM=1 to explore new ones. No shrinking: a case that freezes the server
# is reported as found (replaying near-copies of a freeze would take minutes each).
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize=not os.environ.get("FUZZ_RANDOM"),
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))

literal = st.sampled_from(['"a"', '"("', '"\\\\"', "[0-9]", "[^\\n]", "[a-z]", '"#"', "x", "root"])
repeat = st.sampled_from(["", "*", "+", "?", "{2}", "{0,3}", "{5000}", "{1,}"])
element = st.recursive(
    st.tuples(literal, repeat).map("".join),
    lambda inner: st.tuples(st.lists(inner, min_size=1, max_size=4), repeat).map(
        lambda parts: "(" + " | ".join(parts[0]) + ")" + parts[1]),
    max_leaves=30)
grammar = st.one_of(
    st.lists(element, min_size=1, max_size=5).map(lambda es: "root ::= " + " ".join(es)
                                                  + '\nx ::= "y" x?'),
    st.integers(1, 30_000).map(lambda d: "root ::= " + "(" * d + '"a"' + ")" * d),
    st.text(max_size=200))
leaf_schema = st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number",
                                                              "boolean"])},
                                    optional={"maxLength": st.integers(0, 10**9),
                                              "minLength": st.integers(0, 10**6),
                                              "pattern": st.sampled_from(["^[a-z]{0,9}$", "a{99999}",
                                                                          "(ab)+", "["]),
                                              "minimum": st.integers(-10**9, 10**9)})
schema = st.recursive(leaf_schema, lambda inner: st.one_of(
    st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                          optional={"maxItems": st.integers(0, 10**7)}),
    st.fixed_dictionaries({"type": st.just("object"),
                           "properties": st.dictionaries(st.sampled_from("abcde"), inner, max_size=4)}),
    st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs})), max_leaves=12)


@pytest.fixture(scope="module")
def fuzz_server():
    with running("-c", "512", "-np", "2", "-t", "2", "--rate-limit", "0",
                 log_name="fuzz-grammar") as srv:
        yield srv


def send(srv, extra: dict) -> int:
    started = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra},
                   timeout=BOUND_S * 2)
    assert time.monotonic() - started < BOUND_S, extra
    assert r.status_code in (200, 400), (r.status_code, r.text[:300], json.dumps(extra)[:300])
    return r.status_code


def test_random_grammars(fuzz_server):
    @FUZZ
    @given(text=grammar)
    def check(text):
        send(fuzz_server, {"grammar": text})

    check()
    assert fuzz_server.proc.poll() is None and fuzz_server.slots()["engine"]["alive"]


def test_random_schemas(fuzz_server):
    @FUZZ
    @given(body=schema)
    def check(body):
        send(fuzz_server, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": body}}})

    check()
    assert fuzz_server.proc.poll() is None and fuzz_server.slots()["engine"]["alive"]
