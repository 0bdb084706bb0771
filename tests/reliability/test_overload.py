"""200 requests at concurrency 64 against --max-queue 8: each completes correctly or gets 503
with Retry-After; afterwards nothing is left running or queued and memory is back near where
it started."""

import asyncio

import httpx
import psutil

from reliability.conftest import wait_idle

N_REQUESTS, CONCURRENCY, MAX_TOKENS = 200, 64, 8


async def one(client, url, i):
    try:
        r = await client.post(url + "/v1/completions", json={
            "prompt": f"Request {i}: list some colours.", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0})
    except httpx.HTTPError as exc:
        return ("transport", repr(exc))
    if r.status_code == 200:
        body = r.json()
        ok = body["usage"]["completion_tokens"] == MAX_TOKENS and body["choices"][0]["text"]
        return ("ok" if ok else "bad", body)
    if r.status_code == 503:
        ok = r.headers.get("retry-after") and r.json()["error"]["code"] == "queue_full"
        return ("refused" if ok else "bad", r.text)
    return ("bad", f"{r.status_code} {r.text[:200]}")


def test_overload_every_request_completes_or_is_refused_cleanly(rserver):
    process = psutil.Process(rserver.proc.pid)
    baseline_rss = process.memory_info().rss

    async def run():
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=80)) as client:
            async def limited(i):
                async with gate:
                    return await one(client, rserver.url, i)
            return await asyncio.gather(*(limited(i) for i in range(N_REQUESTS)))

    outcomes = asyncio.run(run())
    kinds = [k for k, _ in outcomes]
    problems = [o for o in outcomes if o[0] in ("bad", "transport")]
    assert not problems, problems[:3]
    assert kinds.count("ok") >= 4 and kinds.count("refused") >= 50, kinds
    assert kinds.count("ok") + kinds.count("refused") == N_REQUESTS
    snap = wait_idle(rserver)
    assert snap["engine"]["alive"]
    grown = process.memory_info().rss - baseline_rss
    assert grown < 64 * 1024 ** 2, f"RSS grew {grown / 2**20:.0f} MiB"
    print(f"overload: sent {N_REQUESTS}, completed {kinds.count('ok')}, refused 503 "
          f"{kinds.count('refused')}, 5xx other than 503: 0, RSS growth {grown / 2**20:.1f} MiB")
