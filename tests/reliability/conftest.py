"""One server for the reliability suite: small slots bound every generation, a small queue."""

import pytest

from conftest import running


@pytest.fixture(scope="module")
def rserver():
    with running("-c", "2048", "-np", "4", "-t", "2", "--max-queue", "8",
                 "--max-num-batched-tokens", "128", log_name="reliability") as srv:
        yield srv


def wait_idle(srv, timeout=10.0):
    """Poll /slots until every slot is idle and nothing waits; return the snapshot."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        snap = srv.slots()
        if all(s["state"] == "idle" for s in snap["slots"]) and snap["queue"]["waiting"] == 0:
            return snap
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {snap}")
        time.sleep(0.05)
