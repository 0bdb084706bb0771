#!/usr/bin/env python3
"""The server's own cost per token, against llama-server, on a model whose compute is
negligible (issue 65): what a GPU's fast steps look like to the server, on this CPU.

Both servers run the fast random-weight model (scripts/make-fast-model: a few small layers, a
real office model's 128k-token vocabulary) with the same pool and slots (-c 32768 -np 64),
both up at once, each working alone in turn, the order rotated every round. At each level N
of --streams, N colleagues stream chat answers of 64-256 tokens (seeded, `ignore_eos`, the
same jobs on both sides), temperature 1, --waves (2) waves a level. Per side and level: output
tokens/s (all tokens over the wall time of the level), the gap between a stream's chunks
(p50, p95), and the server process's CPU time per output token (/proc: every thread, HTTP
and engine). --sampler defaults sends only the temperature (each server's own defaults);
--sampler equal also sends llama-server's defaults (top_k 40, top_p 0.95, min_p 0.05).

    bench/run host --llama-server "$(scripts/build-llama-server)" \\
        --model "$(scripts/make-fast-model)" [--rounds 5] [--streams 1 8 32 64] \\
        [--sampler defaults|equal] [--localserve-args "..."]

Run it alone on the machine: llama.cpp's worker threads spin, so anything beside it skews it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import RunningServer  # noqa: E402

from localserve.bench.load import WORDS  # noqa: E402
from localserve.bench.report import spread  # noqa: E402

POOL = ("-c", "32768", "-np", "64")
EQUAL_SAMPLER = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}


def jobs(n: int, seed: int) -> list[tuple[str, int]]:
    """n (prompt, answer length) pairs: short varied questions, 64-256 tokens each."""
    rng = random.Random(seed)
    return [(f"Write about {' '.join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))}.",
             rng.randint(64, 256)) for _ in range(n)]


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of the process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                     sampler: dict, gaps: list[float]) -> int:
    body = {"model": "fast", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **sampler}
    last, tokens = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return tokens


async def level(url: str, pid: int, streams: int, seed: int, sampler: dict,
                waves: int = 2) -> dict:
    """`waves` waves of `streams` answers at once: tokens/s, gaps and CPU per token."""
    gaps: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        for wave in range(waves):
            batch = jobs(streams, seed * 1000 + wave)
            done = await asyncio.gather(*(stream_one(client, url, p, n, sampler, gaps)
                                          for p, n in batch))
            tokens += sum(done)
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    gaps.sort()
    pick = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1000 if gaps else 0.0  # noqa: E731
    return {"tok_s": tokens / wall, "gap_p50_ms": pick(0.5), "gap_p95_ms": pick(0.95),
            "cpu_ms_per_token": 1000 * cpu / max(1, tokens), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--sampler", choices=["defaults", "equal"], default="defaults")
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--localserve-args", default="")
    parser.add_argument("--out", help="write every round's figures here (JSON)")
    args = parser.parse_args()
    sampler = EQUAL_SAMPLER if args.sampler == "equal" else {}
    sides = {
        "localserve": RunningServer("-m", args.model, *POOL, *args.localserve_args.split(),
                                    log_name="host-localserve"),
        "llama-server": RunningServer("-m", args.model, *POOL, log_name="host-llama",
                                      program=[args.llama_server]),
    }
    results: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in args.streams} for s in sides}
    try:
        for server in sides.values():
            server.wait_ready(300)
        for name, server in sides.items():  # one unmeasured warm-up answer each
            asyncio.run(level(server.url, server.proc.pid, 1, 999, sampler))
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
            for name in order:
                server = sides[name]
                for n in args.streams:
                    figures = asyncio.run(level(server.url, server.proc.pid, n, rnd, sampler,
                                                 args.waves))
                    results[name][n].append(figures)
                    print(f"round {rnd + 1} {name:12} {n:3} streams: {figures['tok_s']:7.1f} tok/s, "
                          f"gap p50 {figures['gap_p50_ms']:.1f} ms, p95 {figures['gap_p95_ms']:.1f} "
                          f"ms, CPU {figures['cpu_ms_per_token']:.2f} ms/token", flush=True)
    finally:
        for server in sides.values():
            server.stop()
    report(results, args)


def report(results: dict[str, dict[int, list[dict]]], args) -> None:
    print(f"\nmedians of {args.rounds} rounds, sampler: {args.sampler}; "
          f"localserve {args.localserve_args or '(defaults)'}; both {' '.join(POOL)}")
    print("streams | llama-server tok/s | localserve tok/s | ratio (min-max) | "
          "gap p50 ms (ls / llama) | CPU ms/token (ls / llama)")
    for n in args.streams:
        ls, peer = results["localserve"][n], results["llama-server"][n]
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(ls, peer)]
        med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
        print(f"{n:7} | {med(peer, 'tok_s'):18.1f} | {med(ls, 'tok_s'):16.1f} | "
              f"{spread(ratios)} | "
              f"{med(ls, 'gap_p50_ms'):.1f} / {med(peer, 'gap_p50_ms'):.1f} | "
              f"{med(ls, 'cpu_ms_per_token'):.2f} / {med(peer, 'cpu_ms_per_token'):.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
