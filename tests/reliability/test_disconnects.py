"""A disconnect storm: dozens of streams cancelled at random points (before the first token,
mid-prefill, mid-decode) while one greedy request runs: its text is unchanged, and every slot
is free again within moments."""

import asyncio
import random
import time

import httpx

from reliability.conftest import wait_idle

# A counting prompt: its greedy continuation is so certain that the last bits a neighbour's
# cells change in one cache pool (README, One pool) cannot flip it; a lost or repeated token
# would still show.
REFERENCE = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 60, "temperature": 0,
             "ignore_eos": True}
LONG_PROMPT = "Please read the following notes carefully before answering. " * 40


async def reference_text(client, url):
    r = await client.post(url + "/v1/completions", json=REFERENCE)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def doomed_stream(client, url, rng):
    """Open a stream and hang up at a random point."""
    where = rng.choice(["before-first-token", "mid-prefill", "mid-decode"])
    prompt = LONG_PROMPT if where == "mid-prefill" else "Tell me a long story about a dragon."
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def consume():
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if where == "mid-decode" and chunks >= rng.randint(1, 15):
                        return

    task = asyncio.create_task(consume())
    delay = {"before-first-token": 0.01, "mid-prefill": 0.3, "mid-decode": 30.0}[where]
    try:
        await asyncio.wait_for(task, timeout=delay * rng.uniform(0.5, 1.5))
    except asyncio.TimeoutError:
        pass  # wait_for cancelled the stream: the client is gone
    return where


async def settled(client, url, timeout=30.0):
    """The previous wave's hang-ups processed: nothing waits, at most the reference runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = (await client.get(url + "/slots?view=full")).json()
        if snap["queue"]["waiting"] == 0 and sum(s["state"] != "idle" for s in snap["slots"]) <= 1:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the server did not settle after a wave of hang-ups")


def test_disconnect_storm_leaks_no_slot_and_disturbs_no_one(rserver):
    url = rserver.url
    aborted_before = rserver.slots()["engine"]["requests_aborted"]

    async def solo():
        async with httpx.AsyncClient(timeout=120) as client:
            return await reference_text(client, url)

    async def storm():
        rng = random.Random(7)
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
            ref = asyncio.create_task(reference_text(client, url))
            kinds = []
            for wave in range(6):
                kinds += await asyncio.gather(*(doomed_stream(client, url, rng) for _ in range(8)))
                await settled(client, url)  # else the next wave may find the queue (8) still full
            return await ref, kinds

    expected = asyncio.run(solo())
    got, kinds = asyncio.run(storm())
    assert got == expected
    assert len(kinds) == 48 and set(kinds) == {"before-first-token", "mid-prefill", "mid-decode"}
    started = time.monotonic()
    snap = wait_idle(rserver, timeout=5)
    counts = ", ".join(f"{k}: {kinds.count(k)}" for k in sorted(set(kinds)))
    aborted = snap["engine"]["requests_aborted"] - aborted_before
    print(f"disconnect storm: 48 streams cancelled ({counts}), {aborted} aborted in the engine, "
          f"all slots idle {time.monotonic() - started:.2f}s after the last cancel")
    # hang-ups before the request reached the server abort nothing; the others must all count
    assert aborted >= 20
