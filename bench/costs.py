#!/usr/bin/env python3
"""The costs slot shares did not count (hardening round 5), measured on the real server with
four keys: what one colleague's grammars or model switches cost another's answers.

1. grammars (`-c 8192 -np 4 -t 2`): bob's free stream (tok/s) alone, then beside eve's
   attacks: (a) three requests under a grammar just under the per-token bound, 400 tokens at
   temperature 1; (b) a grammar that turns costly after its start, sent again and again on 3
   connections (each ends with grammar_cost; the key's resends are refused).
2. switches (two names for the embedded model, `--max-loaded-models 1`): carol's 4-token chats
   on model a (median seconds) alone, beside alice's stream on a (no switch: the base), then
   (a) while alice streams on a and bob asks for b every 4 s, (b) while dave alternates Ollama
   load calls for a and b (no prompt). Bob's longest wait for b is reported too.
3. flood (`-c 4096 -t 2`, `--rate-limit` at its default): bob's 4-token chats (median and
   worst seconds) alone, then while alice loops GETs of a stored response on 120 connections
   (most of them refused as over her rate), with the count of alice's answers by status.

    bench/run costs [--chats 20] [--only grammars|switches|flood]
Run it alone on the machine: llama.cpp's threads spin, and any other load skews it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402
from conftest import key_file, running  # noqa: E402  (the tests' own start/stop helpers)
from reliability.conftest import LATE_COSTLY  # noqa: E402  (round 4's grammar)

from localserve.common.config import default_model_path  # noqa: E402

KEYS = {name: f"{name}-bench-key-0001" for name in ("alice", "bob", "carol", "dave", "eve")}
NEAR_BUDGET = 'root ::= "Sure" ( ' + " | ".join(f'[0-9]* "#{i:04d}"' for i in range(60)) + " )+"


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def stream_rate(url: str, name: str, tokens: int = 200, model: str | None = None) -> float:
    """Tokens per second of one free streamed answer, from its first token to its last."""
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True,
            "stream": True, "temperature": 0, **({"model": model} if model else {})}
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth(name),
                      timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


def keep_sending(stop: threading.Event, send) -> threading.Thread:
    def loop():
        while not stop.is_set():
            try:
                send()
            except httpx.HTTPError:
                time.sleep(0.2)
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def under(attack, n_threads: int, measure):
    stop = threading.Event()
    threads = [keep_sending(stop, attack) for _ in range(n_threads)]
    time.sleep(3)  # the attack is running
    try:
        return measure()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)


def grammars(folder: Path, rounds: int) -> None:
    keys = key_file(folder, *(f"{n}:{k}" for n, k in KEYS.items()))
    with running("-c", "8192", "-np", "4", "-t", "2", "--api-key-file", str(keys),
                 log_name="bench-costs-grammar") as srv:
        post = lambda body: httpx.post(srv.url + "/v1/completions", json=body,  # noqa: E731
                                       headers=auth("eve"), timeout=600)
        near = lambda: post({"prompt": "Say sure", "max_tokens": 400, "temperature": 1,  # noqa: E731
                             "grammar": NEAR_BUDGET})
        late = lambda: post({"prompt": "Say sure", "max_tokens": 40,  # noqa: E731
                             "grammar": LATE_COSTLY})
        for i in range(rounds):
            alone = stream_rate(srv.url, "bob")
            a = under(near, 3, lambda: stream_rate(srv.url, "bob"))
            b = under(late, 3, lambda: stream_rate(srv.url, "bob"))
            print(f"grammars round {i + 1}: bob alone {alone:.1f} tok/s; near-budget grammars "
                  f"{a:.1f} ({a / alone:.2f}x); late-costly loop {b:.1f} ({b / alone:.2f}x)",
                  flush=True)


def carol_median(url: str, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.monotonic()
        r = httpx.post(url + "/v1/completions", headers=auth("carol"), timeout=600, json={
            "model": "a", "prompt": "Count: 1, 2,", "max_tokens": 4, "temperature": 0})
        r.raise_for_status()
        times.append(time.monotonic() - started)
        time.sleep(0.5)
    return statistics.median(times)


def switches(folder: Path, chats: int) -> None:
    keys = key_file(folder, *(f"{n}:{k}" for n, k in KEYS.items()))
    config = folder / "models.toml"
    path = default_model_path()
    config.write_text(f'max_loaded_models = 1\n[models.a]\npath = "{path}"\nctx_size = 4096\n'
                      f'parallel = 4\n[models.b]\npath = "{path}"\nctx_size = 2048\nparallel = 2\n')
    with running("--config", str(config), "-t", "2", "--api-key-file", str(keys),
                 log_name="bench-costs-switch") as srv:
        alone = carol_median(srv.url, chats)
        waits: list[float] = []

        def alice():
            stream_rate(srv.url, "alice", tokens=150, model="a")

        def bob():
            started = time.monotonic()
            httpx.post(srv.url + "/v1/completions", headers=auth("bob"), timeout=600, json={
                "model": "b", "prompt": "Hi", "max_tokens": 4}).raise_for_status()
            waits.append(time.monotonic() - started)
            time.sleep(4)

        beside = under(alice, 1, lambda: carol_median(srv.url, chats))  # no switch: the base
        stop = threading.Event()
        threads = [keep_sending(stop, alice), keep_sending(stop, bob)]
        time.sleep(3)
        switching = carol_median(srv.url, chats)
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
        flip = iter(["a", "b"] * 10_000)
        loads = lambda: httpx.post(srv.url + "/api/generate", headers=auth("dave"),  # noqa: E731
                                   json={"model": next(flip)}, timeout=600)
        loading = under(loads, 1, lambda: carol_median(srv.url, chats))
        print(f"switches: carol alone {alone:.2f} s, beside alice's stream on a {beside:.2f} s; "
              f"with bob asking for b every 4 s too {switching:.2f} s ({switching / alone:.2f}x "
              f"alone, {switching / beside:.2f}x beside alice), bob's longest wait for b "
              f"{max(waits, default=0):.1f} s over {len(waits)} requests; with dave's "
              f"alternating load calls {loading:.2f} s ({loading / alone:.2f}x)", flush=True)


def flood(folder: Path, chats: int) -> None:
    keys = key_file(folder, *(f"{n}:{k}" for n, k in KEYS.items()))
    with running("-t", "2", "-c", "4096", "--api-key-file", str(keys), "--state-dir",
                 str(folder / "flood-state"), log_name="bench-costs-flood") as srv:
        asyncio.run(_flood(srv.url, chats))


async def _flood(url: str, chats: int) -> None:
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as c:
        stored = await c.post(url + "/v1/responses", headers=auth("alice"), json={
            "input": "word " * 1500, "max_output_tokens": 200, "store": True})
        path = f"{url}/v1/responses/{stored.raise_for_status().json()['id']}"

        async def bob() -> list[float]:
            times = []
            for i in range(chats):
                started = time.monotonic()
                r = await c.post(url + "/v1/chat/completions", headers=auth("bob"), json={
                    "messages": [{"role": "user", "content": f"Say hi {i}"}], "max_tokens": 4})
                r.raise_for_status()
                times.append(time.monotonic() - started)
                await asyncio.sleep(0.2)
            return times

        async def alice(stop: asyncio.Event) -> None:
            while not stop.is_set():
                status = (await c.get(path, headers=auth("alice"))).status_code
                statuses[status] = statuses.get(status, 0) + 1

        alone, stop = await bob(), asyncio.Event()
        flooding = [asyncio.create_task(alice(stop)) for _ in range(120)]
        await asyncio.sleep(1)
        crowded = await bob()
        stop.set()
        await asyncio.gather(*flooding)
    print(f"flood: bob alone median {statistics.median(alone):.3f} s, worst {max(alone):.3f} s; "
          f"beside alice's flood median {statistics.median(crowded):.3f} s, worst "
          f"{max(crowded):.3f} s; alice's answers by status {statuses}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="grammar rounds (alone, a, b)")
    parser.add_argument("--chats", type=int, default=20, help="carol's chats per condition")
    parser.add_argument("--only", choices=("grammars", "switches", "flood"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        if args.only in (None, "grammars"):
            grammars(Path(folder), args.rounds)
        if args.only in (None, "switches"):
            switches(Path(folder), args.chats)
        if args.only in (None, "flood"):
            flood(Path(folder), args.chats)


if __name__ == "__main__":
    main()
