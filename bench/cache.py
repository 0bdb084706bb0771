#!/usr/bin/env python3
"""Cache benchmarks, in one run:
1. prefix caching: time to first token for questions behind a shared ~1,000-token system
   prompt, each user's first question (cold: the prompt is computed) against later ones
   (warm: the prompt comes from a slot's cache);
2. preemption: how often the one pool preempts under a chosen load.

    bench/run cache [--threads 2]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import running  # noqa: E402

from localserve.bench import load as bench  # noqa: E402

POLICY = ("You are the assistant of a small engineering office. Follow the office handbook: "
          "answer in plain English, cite the relevant section, never invent numbers, and say "
          "when you do not know. ")


def system_prompt(variant: int) -> str:
    """About 1,000 tokens; variants differ from the first word, so nothing is shared between them."""
    return f"Handbook edition {variant}. " + POLICY * 30


async def ttft(client, url, system, question) -> tuple[float, int]:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, cached = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first or (time.perf_counter() - start), cached


def prefix_benchmark(threads: str) -> dict:
    with running("-c", "8192", "-np", "4", "-t", threads, log_name="prefix") as srv:
        async def run():
            cold, warm, cached = [], [], []
            async with httpx.AsyncClient(timeout=300) as client:
                for variant in range(4):  # four teams, each with its own system prompt
                    system = system_prompt(variant)
                    t, c = await ttft(client, srv.url, system, "Where is the printer?")
                    cold.append(t)
                    for q in ("Who approves drawings?", "When is the office open?", "How do I book a room?"):
                        t, c = await ttft(client, srv.url, system, q)
                        warm.append(t)
                        cached.append(c)
            return cold, warm, cached

        cold, warm, cached = asyncio.run(run())
        engine = srv.slots()["engine"]
    return {"cold_ttft_s": statistics.median(cold), "warm_ttft_s": statistics.median(warm),
            "median_cached_tokens": statistics.median(cached),
            "hit_rate": engine["prefix_cache_hits"] / max(engine["prefix_cache_queries"], 1)}


def preemption_benchmark(threads: str) -> dict:
    """8 slots sharing a 1,024-token pool under the chat workload at concurrency 8."""
    jobs = bench.make_workload(32, 1, (10, 60), (64, 256))
    with running("-c", "1024", "-np", "8", "-t", threads, log_name="preempt") as srv:
        summary = asyncio.run(bench.run_level(srv.url, jobs, 8))
        engine = srv.slots()["engine"]
        warned = "cache is too small for this traffic" in srv.log()
    return {"requests": summary.requests, "errors": summary.errors, "wall_s": summary.wall_s,
            "preemptions": engine["preemptions"],
            "per_minute": engine["preemptions"] / summary.wall_s * 60, "warned": warned,
            "output_tok_s": summary.output_tok_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="2")
    ap.add_argument("--out", default="bench-out/cache.json")
    args = ap.parse_args()
    prefix = prefix_benchmark(args.threads)
    print(f"prefix caching, shared ~1,000-token system prompt (-c 8192 -np 4): TTFT median "
          f"cold {prefix['cold_ttft_s']:.2f}s, warm {prefix['warm_ttft_s']:.2f}s "
          f"({prefix['cold_ttft_s'] / prefix['warm_ttft_s']:.1f}x faster); "
          f"median cached tokens {prefix['median_cached_tokens']:.0f}; "
          f"prompt-token hit rate {prefix['hit_rate']:.0%}")
    pre = preemption_benchmark(args.threads)
    print(f"preemption, -c 1024 -np 8, 32 chat requests (64-256 tokens out) at "
          f"concurrency 8: {pre['preemptions']} preemptions in {pre['wall_s']:.0f}s "
          f"({pre['per_minute']:.1f}/min), errors {pre['errors']}, {pre['output_tok_s']:.1f} tok/s, "
          f"'cache too small' warning logged: {pre['warned']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "prefix": prefix,
                                          "preemption": pre}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
