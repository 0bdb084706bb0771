"""KeyTurns, the per-key places of image fetching and decoding: a key's requests beyond its
places wait, another key's go beside them, and no key stays in the table once its requests left
(a table keyed by every key ever seen grew with the keys)."""

import asyncio

from localserve.api.key_turns import KeyTurns


def test_a_keys_requests_take_turns_beside_another_keys_and_leave_no_entry_behind():
    async def scene():
        turns, inside, log = KeyTurns(1), {"alice": 0, "bob": 0}, []
        release = asyncio.Event()

        async def request(key):
            async with turns.turn(key):
                inside[key] += 1
                log.append((key, dict(inside)))
                await release.wait()
                inside[key] -= 1

        tasks = [asyncio.create_task(request(k)) for k in ("alice", "alice", "bob")]
        for _ in range(20):
            await asyncio.sleep(0)
        held = dict(inside)
        assert turns.keys() == 2
        release.set()
        await asyncio.gather(*tasks)
        return held, log, turns.keys()

    held, log, keys_left = asyncio.run(scene())
    assert held == {"alice": 1, "bob": 1}  # alice's second waits; bob's goes beside her first
    assert max(state["alice"] for _, state in log) == 1 and len(log) == 3
    assert keys_left == 0


def test_two_places_let_two_of_a_keys_requests_in():
    async def scene():
        turns, inside, peak = KeyTurns(2), [0], [0]

        async def request():
            async with turns.turn("alice"):
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
                await asyncio.sleep(0.01)
                inside[0] -= 1

        await asyncio.gather(*(request() for _ in range(5)))
        return peak[0], turns.keys()

    assert asyncio.run(scene()) == (2, 0)
