"""Hardening round 6 on the real server: what a user key can read of a colleague's work in
/slots and /metrics (a borrowed cell count or a slot's cache share tells the length of their
document)."""

import threading

import httpx
import pytest

from conftest import running, wait_for
from reliability.conftest import ALICE, BOB, ROOT_KEY, auth, office_keys


@pytest.fixture(scope="module")
def office(tmp_path_factory):
    """A 2,048-cell pool for 4 slots: 512 guaranteed to each, so a 900-token prompt borrows."""
    keys = office_keys(tmp_path_factory.mktemp("round6"))
    with running("-c", "2048", "-np", "4", "-t", "2", "--api-key-file", str(keys),
                 log_name="round6") as srv:
        yield srv


def full_slots(srv, key):
    return httpx.get(srv.url + "/slots?view=full", headers=auth(key), timeout=30).json()["slots"]


def test_a_user_sees_neither_a_colleagues_borrowed_cells_nor_any_slots_cache_share(office):
    document = " ".join(["lantern harbor meadow"] * 300)  # ~900 tokens: over the guarantee
    body = {"prompt": document, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    worker = threading.Thread(target=lambda: httpx.post(
        office.url + "/v1/completions", json=body, headers=auth(BOB), timeout=600))
    worker.start()
    try:
        wait_for(lambda: any(row["n_borrowed"] > 0 for row in full_slots(office, ROOT_KEY)),
                 timeout=300, what="bob's document borrowing beyond its guarantee")
        seen = full_slots(office, ALICE)
        busy = [row for row in seen if row["state"] != "idle"]
        assert busy and all(row["n_borrowed"] == 0 and row["n_cached"] == 0 for row in busy)
        mine = httpx.get(office.url + "/metrics", headers=auth(ALICE), timeout=30).text
        admin = httpx.get(office.url + "/metrics", headers=auth(ROOT_KEY), timeout=30).text
        assert "localserve:slot_cache_usage_perc" in admin and "localserve:slot_busy" in admin
        # round 7: nor the pool's fill, which beside one colleague is that colleague's
        assert "localserve:slot_" not in mine and "localserve:kv_cache_usage_perc" not in mine
        assert "localserve:kv_cache_usage_perc" in admin
    finally:
        worker.join(timeout=600)
