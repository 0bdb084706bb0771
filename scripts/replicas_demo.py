#!/usr/bin/env python3
"""Driver of scripts/replicas-demo (which installs LiteLLM first): two replicas behind the
LiteLLM proxy on loopback. Prints how a burst spreads, what a drained replica does to the
requests in flight, and the proxy's tok/s against one replica at the same concurrency."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
from conftest import RunningServer, answers_200, free_port, wait_for  # noqa: E402


def served(replica: RunningServer) -> int:
    text = httpx.get(replica.url + "/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(r'^localserve:request_success_total\{[^}]*\} (\S+)',
                                                 text, re.M)))


MASTER_KEY = "sk-demo-" + secrets.token_hex(16)


async def burst(url: str, n: int, tokens: int, model: str) -> list[tuple[int, int, str]]:
    """n concurrent streaming chats: (status, tokens streamed, error text) each."""
    headers = {"Authorization": f"Bearer {MASTER_KEY}"}
    async def one(i):
        body = {"model": model, "messages": [{"role": "user", "content": f"Story {i}:"}],
                "max_tokens": tokens, "ignore_eos": True, "stream": True, "user": f"member-{i % 4}"}
        count, status, error = 0, 0, ""
        try:
            async with httpx.AsyncClient(timeout=600, headers=headers) as client:
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    status = r.status_code
                    async for line in r.aiter_lines():
                        if '"content"' in line and '"role"' not in line:
                            count += 1
                        if '"error"' in line:
                            error = line[:200]
        except httpx.HTTPError as exc:
            error = repr(exc)
        return status, count, error

    return await asyncio.gather(*(one(i) for i in range(n)))


def start_proxy(litellm: str, ports: list[int], port: int, log: Path) -> subprocess.Popen:
    config = (ROOT / "examples" / "litellm.yaml").read_text()
    for default, real in zip((8101, 8102), ports):
        config = config.replace(f"127.0.0.1:{default}/", f"127.0.0.1:{real}/")
    path = Path(tempfile.mkdtemp()) / "litellm.yaml"
    path.write_text(config)
    return subprocess.Popen([litellm, "--config", str(path), "--host", "127.0.0.1", "--port",
                             str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "LITELLM_MASTER_KEY": MASTER_KEY})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--litellm", required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    replicas = [RunningServer("-c", "2048", "-np", "2", "-t", "1", "--drain-timeout", "120",
                              log_name=f"replica-{i}") for i in (1, 2)]
    proxy_port = free_port()
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    proxy = None
    try:
        for r in replicas:
            r.wait_ready()
        proxy = start_proxy(args.litellm, [r.port for r in replicas], proxy_port,
                            Path("/tmp/localserve-litellm-proxy.log"))
        wait_for(lambda: answers_200(proxy_url + "/health/liveliness"), timeout=180, what="the proxy")
        start = time.perf_counter()
        results = asyncio.run(burst(proxy_url, args.requests, args.tokens, "localserve"))
        proxy_s = time.perf_counter() - start
        ok = sum(1 for s, n, e in results if s == 200 and n and not e)
        print(f"burst through the proxy: {ok}/{args.requests} succeeded; served by replica 1: "
              f"{served(replicas[0])}, replica 2: {served(replicas[1])}")
        print(f"aggregate: {sum(n for _, n, _ in results) / proxy_s:.1f} tok/s through the proxy")
        start = time.perf_counter()
        alone = asyncio.run(burst(replicas[0].url, args.requests, args.tokens, "localserve"))
        alone_s = time.perf_counter() - start
        print(f"one replica alone, same burst: {sum(n for _, n, _ in alone) / alone_s:.1f} tok/s "
              f"(2 replicas share the same 2 cores here: no speed-up is expected)")
        before = [served(r) for r in replicas]

        async def drain_mid_run():
            first = asyncio.create_task(burst(proxy_url, args.requests // 2, args.tokens,
                                              "localserve"))
            await asyncio.sleep(2.0)  # the demo's own pacing: the first wave is in flight
            replicas[0].proc.send_signal(signal.SIGTERM)
            wait_for(lambda: not answers_200(replicas[0].url + "/health"), what="replica 1 draining")
            second = await burst(proxy_url, args.requests // 2, args.tokens, "localserve")
            return await first, second

        first, second = asyncio.run(drain_mid_run())
        results = first + second
        failed = [(s, e) for s, n, e in results if s != 200 or e]
        print(f"replica 1 drained (SIGTERM) with the first wave in flight, then a second wave: "
              f"{len(results) - len(failed)}/{len(results)} succeeded; 5xx seen by clients: "
              f"{sum(1 for s, _ in failed if s >= 500)}; replica 2 served "
              f"{served(replicas[1]) - before[1]} (every request of the second wave answered: "
              f"{all(s == 200 for s, _, _ in second)})")
        for status, error in failed[:3]:
            print(f"  failed: {status} {error}")
        return 0 if not failed else 1
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=30)
        for r in replicas:
            r.stop()


if __name__ == "__main__":
    sys.exit(main())
