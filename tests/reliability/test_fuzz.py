"""schemathesis against the server's own OpenAPI document: valid and invalid bodies for every
operation, bounded in count; no 5xx, no hang. Ollama's bodies, whose options and messages the
document gives only as objects, are fuzzed field by field from Ollama's docs/api.md."""

import itertools
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from conftest import running

EXAMPLES = 20


@pytest.fixture(scope="module")
def fuzz_server():
    """A pool of 256 tokens and answers of 16 unless a body asks otherwise: any generated request,
    however large its max_tokens, ends fast; what the fuzz looks for is in the fields, not in how
    long an answer runs."""
    with running("-c", "256", "-np", "4", "-n", "16", "-t", "2", log_name="fuzz") as srv:
        yield srv


@pytest.mark.timeout(1800)  # bounded by its work (EXAMPLES per operation), not by the clock
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors_for_generated_requests(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    seen, expected = {}, 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to break in a GET without parameters
        expected += 1
        strategy = operation.as_strategy(generation_mode=mode)

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def check(case):
            response = case.call(timeout=60)
            key = f"{operation.method.upper()} {operation.path}"
            seen.setdefault(key, set()).add(response.status_code)
            assert response.status_code < 500, (key, case.body, response.text[:300])

        check()
    assert len(seen) == expected >= (14 if mode is GenerationMode.POSITIVE else 7)
    assert fuzz_server.slots()["engine"]["alive"]


MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the embedded model's name
# Any JSON value: what a wrong client may put in any one place.
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=3), max_leaves=6)
OPTIONS = {"num_predict": st.integers(1, 16), "num_ctx": st.integers(64, 100_000),
           "temperature": st.floats(0, 2), "top_k": st.integers(1, 50), "top_p": st.floats(0, 1),
           "min_p": st.floats(0, 1), "seed": st.integers(0, 9), "stop": st.lists(st.text(max_size=3)),
           "repeat_penalty": st.floats(0.5, 2), "repeat_last_n": st.integers(0, 64),
           "mirostat": st.integers(0, 2), "tfs_z": st.just(1), "num_gpu": st.integers(0, 9)}
CALL = st.fixed_dictionaries({"function": st.fixed_dictionaries({
    "name": st.sampled_from(["get_weather", "f"]), "arguments": st.dictionaries(
        st.text(max_size=5), st.text(max_size=5), max_size=2)})})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                 "content": st.text(max_size=40)},
                                optional={"tool_calls": st.lists(CALL, max_size=2),
                                          "thinking": st.text(max_size=10),
                                          "tool_name": st.sampled_from(["get_weather", "f"])})
COMMON = {"stream": st.booleans(), "options": st.fixed_dictionaries({}, optional=OPTIONS),
          "keep_alive": st.sampled_from([0, "5m", -1, 30]), "think": st.booleans(),
          "format": st.sampled_from(["json", {"type": "object"}])}
TOOLS = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.just("get_weather"), "parameters": st.just({"type": "object"})})}), max_size=1)
OLLAMA_FIELDS = {
    "/api/chat": {"messages": st.lists(MESSAGE, min_size=1, max_size=3), "tools": TOOLS, **COMMON},
    "/api/generate": {"prompt": st.text(max_size=40), "suffix": st.text(max_size=10),
                      "system": st.text(max_size=20), "raw": st.booleans(), **COMMON},
    "/api/embed": {"input": st.text(max_size=20) | st.lists(st.text(max_size=10), max_size=3),
                   "truncate": st.booleans(), "dimensions": st.integers(1, 600),
                   "options": COMMON["options"]},
    "/api/embeddings": {"prompt": st.text(max_size=20), "options": COMMON["options"]},
    "/api/show": {"model": st.just(MODEL), "verbose": st.booleans()},
}
# The places a wrong value is put, one per body: every field, every option, a message's
# fields and a call's arguments (round 5's 500s were in options.num_ctx and tool_calls).
DEEP_PLACES = [("options", name) for name in OPTIONS] + [
    ("messages", 0, f) for f in ("role", "content", "tool_calls", "images", "tool_name")] + [
    ("messages", 0, "tool_calls", 0, "function", f) for f in ("name", "arguments")] + [
    ("tools", 0, "function", "parameters")]


def put(body: dict, place: tuple, value) -> dict:
    """`body` with `value` at `place`, making the containers on the way (a message, a call)."""
    here = body
    for key, inner in zip(place, place[1:]):
        empty = [] if isinstance(inner, int) else {}
        if isinstance(key, int):
            while len(here) <= key:
                here.append({"role": "assistant", "content": ""} if place[0] == "messages" else {})
            if not isinstance(here[key], (dict, list)):
                here[key] = empty
        elif not isinstance(here.get(key), (dict, list)) or (isinstance(inner, int) and not isinstance(here[key], list)):
            here[key] = empty
        here = here[key]
    here[place[-1]] = value
    return body


def places(route: str) -> list[tuple]:
    fields = OLLAMA_FIELDS[route]
    return [(name,) for name in fields] + [p for p in DEEP_PLACES if p[0] in fields]


@st.composite
def ollama_body(draw, route: str) -> dict:
    """A body Ollama's docs allow, or one with a single wrong value somewhere in it: a body
    wrong in many places is refused at its first, and the checks behind it never run."""
    body = draw(st.fixed_dictionaries({}, optional=OLLAMA_FIELDS[route]))
    if draw(st.booleans()):
        body = put(body, draw(st.sampled_from(places(route))), draw(ANY_JSON))
    return body


# Every place also gets each of these in turn, on a body that is otherwise right.
WRONG_VALUES = [None, "abc", -1, 0, 10**30, 1.5, True, [], {}, [{"x": 1}], "\ud800"]
RIGHT_BODY = {"model": MODEL, "stream": False, "options": {"num_predict": 2},
              "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi"}


@pytest.mark.timeout(1800)  # bounded by its work (EXAMPLES per route), not by the clock
@pytest.mark.parametrize("route", sorted(OLLAMA_FIELDS))
def test_no_server_errors_for_generated_ollama_bodies(fuzz_server, route):
    """Round 5 found 500s in options.num_ctx and messages[].tool_calls that the OpenAPI-driven
    fuzz could not reach: every field Ollama documents, with its own kind of value or any."""
    statuses = set()

    @settings(max_examples=EXAMPLES * 2, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=ollama_body(route))
    def check(body):
        response = httpx.post(fuzz_server.url + route, json=body, timeout=60)
        statuses.add(response.status_code)
        assert response.status_code < 500, (route, body, response.text[:300])
        assert "internal error" not in response.text, (route, body, response.text[:300])

    check()
    raw = [{"raw": True}, {"suffix": "x"}] if route == "/api/generate" else []  # other paths
    for place, value, path in itertools.product(places(route), WRONG_VALUES, [{}, *raw]):
        body = put(json.loads(json.dumps({**RIGHT_BODY, **path})), place, value)
        response = httpx.post(fuzz_server.url + route, content=json.dumps(body), timeout=60,
                              headers={"Content-Type": "application/json"})  # \ud800 as is
        statuses.add(response.status_code)
        assert response.status_code < 500, (route, body, response.text[:300])
    assert 200 in statuses and statuses & {400, 404}, statuses  # accepted and refused bodies
    assert fuzz_server.slots()["engine"]["alive"]
