#!/usr/bin/env python3
"""Proof in one run: the same seeded workload against localserve's three scheduling policies
(continuous, static, serial), optionally llama.cpp's own llama-server, beside the raw decode
ceiling of the runner; then the chunked-prefill demonstration. Every figure printed here
comes from this run, measured one server at a time on the same machine.

    bench/run policies [--concurrency 8] [--requests 24] \
        [--llama-server PATH/TO/llama-server] [--skip-prefill-demo] [--repeat 3] \
        [--policies continuous,static,serial]

With --repeat N every side runs N times in alternating order (reversed every other round, so
no side always runs first or on a warmer machine); the table shows each side's median run,
and each ratio is the median of the per-round ratios with its spread (min-max): one noisy
run never makes a claim.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from core import raw_ceiling  # noqa: E402  (bench/core.py, beside this file)
from conftest import RunningServer  # noqa: E402

from localserve.bench import load as bench  # noqa: E402
from localserve.common.config import resolve_model  # noqa: E402

WORKLOADS = {  # name: (prompt words, output tokens)
    "mixed": ((30, 400), (16, 128)),  # the serving-core issue's: prompt-heavy
    "chat": ((10, 60), (32, 256)),  # short questions, longer answers: decode-heavy
}


def llama_server(binary: str, threads: int) -> RunningServer:
    """llama.cpp's C++ server on the same model and split, for comparison."""
    return RunningServer("-m", str(resolve_model(None)), "-c", "8192", "-np", "8", "-t", str(threads),
                         "--cont-batching", log_name="llama-server", program=[binary])


def measure(server, jobs, concurrency):
    server.wait_ready()
    try:
        asyncio.run(bench.run_level(server.url, jobs[:2], 2))  # warm-up
        return asyncio.run(bench.run_level(server.url, jobs, concurrency))
    finally:
        server.stop()


async def prefill_stall(url: str, long_prompt: str) -> float:
    """Worst inter-token gap of 3 running streams while a long prompt arrives."""
    gaps: list[float] = []

    async def stream(client, i):
        body = {"prompt": f"Stream {i}: once upon a time", "max_tokens": 150, "ignore_eos": True,
                "stream": True}
        last = None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    async def intruder(client):
        await asyncio.sleep(2.0)
        await client.post(url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 1})

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(stream(client, i) for i in range(3)), intruder(client))
    return max(gaps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default="mixed,chat", help="comma-separated; empty for none")
    ap.add_argument("--llama-server", help="path to llama.cpp's llama-server binary, to compare")
    ap.add_argument("--skip-prefill-demo", action="store_true")
    ap.add_argument("--out", default="bench-out/policies.json")
    ap.add_argument("--repeat", type=int, default=1, help="rounds per side, alternating order")
    ap.add_argument("--policies", default="continuous,static,serial")
    args = ap.parse_args()
    t = str(args.threads)
    results: dict = {"command": " ".join(sys.argv), "workloads": {}}
    for name in filter(None, args.workloads.split(",")):
        words, outs = WORKLOADS[name]
        jobs = bench.make_workload(args.requests, args.seed, words, outs)
        sides = args.policies.split(",") + (["llama-server"] if args.llama_server else [])
        runs: dict[str, list] = {side: [] for side in sides}
        for round_no in range(args.repeat):
            for side in (sides if round_no % 2 == 0 else sides[::-1]):
                server = (llama_server(args.llama_server, args.threads) if side == "llama-server"
                          else RunningServer("-c", "8192", "-np", "8", "-t", t, "--scheduler", side,
                                             log_name=side))
                runs[side].append(measure(server, jobs, args.concurrency))
        rows = {side: sorted(r, key=lambda x: x.output_tok_s)[len(r) // 2] for side, r in runs.items()}
        print(f"\nworkload '{name}': {args.requests} requests, prompts {words[0]}-{words[1]} words, "
              f"{outs[0]}-{outs[1]} tokens out, concurrency {args.concurrency}, seed {args.seed}")
        print(f"{'server':>14} " + bench.HEADER)
        for label, summary in rows.items():
            print(f"{label:>14} " + summary.row())
        first = sides[0]
        for label in sides[1:]:
            ratios = [a.output_tok_s / b.output_tok_s for a, b in zip(runs[first], runs[label])]
            print(f"  {first} / {label}: median {statistics.median(ratios):.2f}x output tok/s over "
                  f"{len(ratios)} round(s) (spread {min(ratios):.2f}-{max(ratios):.2f})")
        results["workloads"][name] = {k: [v.__dict__ for v in r] for k, r in runs.items()}

    if results["workloads"]:
        ceiling = raw_ceiling([1, args.concurrency], args.threads)
        print("\nraw runner decode ceiling: " + ", ".join(f"B={b}: {v:.1f} tok/s"
                                                      for b, v in ceiling.items()))
        results["raw_ceiling_tok_s"] = ceiling

    if not args.skip_prefill_demo:
        long_prompt = "The committee reviewed the quarterly figures in detail. " * 190
        print("\nchunked prefill: worst inter-token gap of 3 running streams while a "
              "~1,900-token prompt arrives (-c 8192 -np 4)")
        results["prefill_stall_s"] = {}
        stall_sides = [f"--max-num-batched-tokens {b}" for b in ("64", "256", "2048")]
        for side in stall_sides + (["llama-server"] if args.llama_server else []):
            server = (RunningServer("-m", str(resolve_model(None)), "-c", "8192", "-np", "4",
                                    "-t", t, "--cont-batching", log_name="prefill-llama-server",
                                    program=[args.llama_server]) if side == "llama-server" else
                      RunningServer("-c", "8192", "-np", "4", "-t", t, *side.split(),
                                    log_name="prefill" + side.split()[-1])).wait_ready()
            try:
                worst = asyncio.run(prefill_stall(server.url, long_prompt))
            finally:
                server.stop()
            results["prefill_stall_s"][side] = worst
            print(f"  {side:>30}: worst gap {worst * 1000:.0f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
