"""Soak: mixed traffic with cancellations for a bounded time (LOCALSERVE_SOAK_S, default 45 s):
afterwards no slot in use, nothing queued, no connection left open, memory near its start."""

import asyncio
import os
import random
import time

import httpx
import psutil

from conftest import wait_for
from reliability.conftest import wait_idle

SOAK_S = float(os.environ.get("LOCALSERVE_SOAK_S", "45"))


def established(pid):
    return sum(1 for c in psutil.Process(pid).net_connections("tcp") if c.status == "ESTABLISHED")


async def user(client, url, rng, deadline, tally):
    while time.monotonic() < deadline:
        kind = rng.choice(["chat", "stream", "stream-cancel", "completion"])
        body = {"max_tokens": rng.randint(4, 40), "ignore_eos": True}
        try:
            if kind == "chat":
                r = await client.post(url + "/v1/chat/completions", json={
                    **body, "messages": [{"role": "user", "content": f"Question {rng.random()}"}]})
                tally[r.status_code] = tally.get(r.status_code, 0) + 1
            elif kind == "completion":
                r = await client.post(url + "/v1/completions", json={**body, "prompt": "Once"})
                tally[r.status_code] = tally.get(r.status_code, 0) + 1
            else:
                async def consume():
                    async with client.stream("POST", url + "/v1/completions",
                                             json={**body, "prompt": "A tale", "stream": True}) as r:
                        tally[r.status_code] = tally.get(r.status_code, 0) + 1
                        async for _ in r.aiter_lines():
                            pass
                timeout = rng.uniform(0.05, 1.0) if kind == "stream-cancel" else 120
                try:
                    await asyncio.wait_for(consume(), timeout)
                except asyncio.TimeoutError:
                    tally["cancelled"] = tally.get("cancelled", 0) + 1
        except httpx.HTTPError as exc:
            tally[type(exc).__name__] = tally.get(type(exc).__name__, 0) + 1


def test_soak_leaves_nothing_behind(rserver):
    pid = rserver.proc.pid
    wait_idle(rserver)
    rss_start = psutil.Process(pid).memory_info().rss
    conns_start = established(pid)
    tally: dict = {}

    async def run():
        rng = random.Random(11)
        deadline = time.monotonic() + SOAK_S
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(user(client, rserver.url, random.Random(rng.random()), deadline, tally)
                                   for _ in range(6)))

    asyncio.run(run())
    snap = wait_idle(rserver, timeout=10)
    wait_for(lambda: established(pid) <= conns_start, timeout=10, what="client connections to close")
    # The prompt cache keeps sequences in RAM on purpose (bounded, see test_prompt_cache.py):
    # what it holds is not a leak.
    kept = snap["cache"]["ram"]["bytes"] if snap["cache"]["ram"] else 0
    grown = psutil.Process(pid).memory_info().rss - rss_start - kept
    print(f"soak {SOAK_S:.0f}s: {tally}; RSS growth {grown / 2**20:.1f} MiB besides "
          f"{kept / 2**20:.1f} MiB of prompt cache; "
          f"connections {conns_start} -> {established(pid)}")
    assert not any(isinstance(k, int) and k >= 500 and k != 503 for k in tally)
    assert not any(isinstance(k, str) and k != "cancelled" for k in tally), tally
    assert tally.get(200, 0) > 20 and tally.get("cancelled", 0) > 3
    assert snap["engine"]["alive"] and snap["queue"]["waiting"] == 0
    assert established(pid) <= conns_start
    assert grown < 64 * 1024 ** 2
