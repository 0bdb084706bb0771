"""One server for the reliability suite: small slots bound every generation, a small queue;
and what the hardening rounds share: an office's three keys, and the grammar that turns
costly after its start (round 4's, bench/costs.py's too)."""

import httpx
import pytest

from conftest import key_file, running

ALICE, BOB, ROOT_KEY = "alice-key-000111", "bob-key-000222", "root-key-000333"
LATE_COSTLY = ('root ::= "Sure" body\nbody ::= ' + " | ".join(f"r{i}" for i in range(1500)) + "\n"
               + "\n".join(f'r{i} ::= [0-9]* "#{i:04d}"' for i in range(1500)))


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def office_keys(folder):
    """A key file of two colleagues and an admin."""
    return key_file(folder, f"alice:{ALICE}:user", f"bob:{BOB}:user", f"root:{ROOT_KEY}:admin")


def post(srv, path, body, key=ALICE):
    return httpx.post(srv.url + path, json=body, headers=auth(key), timeout=300)


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
