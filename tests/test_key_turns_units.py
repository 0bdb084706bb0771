"""KeyTurns, the per-key places of image fetching and decoding: a key's requests beyond its
places wait, another key's go beside them, and no key stays in the table once its requests left
(a table keyed by every key ever seen grew with the keys)."""

import asyncio

from conftest import until
from localserve.api.key_turns import KeyTurns


async def crowd(turns: KeyTurns, keys: list[str]) -> tuple[dict, list, asyncio.Event, list]:
    """One request per entry of `keys`, each holding its place until the event is set; returns
    once every request has asked for its place (those beyond a key's places wait in it)."""
    inside, peak, release, asked = {k: 0 for k in keys}, [], asyncio.Event(), []

    async def request(key):
        asked.append(key)
        async with turns.turn(key):
            inside[key] += 1
            peak.append(dict(inside))
            await release.wait()
            inside[key] -= 1

    tasks = [asyncio.create_task(request(k)) for k in keys]
    await until(lambda: len(asked) == len(keys), timeout=10, what="every request to ask")
    return inside, peak, release, tasks


def test_a_keys_requests_take_turns_beside_another_keys_and_leave_no_entry_behind():
    async def scene():
        turns = KeyTurns(1)
        inside, peak, release, tasks = await crowd(turns, ["alice", "alice", "bob"])
        held, keys_then = dict(inside), turns.keys()
        release.set()
        await asyncio.gather(*tasks)
        return held, keys_then, peak, turns.keys()

    held, keys_then, peak, keys_left = asyncio.run(scene())
    assert held == {"alice": 1, "bob": 1}  # alice's second waits; bob's goes beside her first
    assert keys_then == 2
    assert max(state["alice"] for state in peak) == 1 and len(peak) == 3
    assert keys_left == 0


def test_two_places_let_two_of_a_keys_requests_in():
    async def scene():
        turns = KeyTurns(2)
        inside, peak, release, tasks = await crowd(turns, ["alice"] * 5)
        held = inside["alice"]
        release.set()
        await asyncio.gather(*tasks)
        return held, max(state["alice"] for state in peak), len(peak), turns.keys()

    assert asyncio.run(scene()) == (2, 2, 5, 0)
