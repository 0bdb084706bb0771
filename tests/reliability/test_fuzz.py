"""schemathesis against the server's own OpenAPI document: valid and invalid bodies for every
operation, bounded in count; no 5xx, no hang."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from conftest import running

EXAMPLES = 20


@pytest.fixture(scope="module")
def fuzz_server():
    """Slots of 128 tokens: any generated request, however large its max_tokens, ends fast."""
    with running("-c", "512", "-np", "4", "-t", "2", log_name="fuzz") as srv:
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
