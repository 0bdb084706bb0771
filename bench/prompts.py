#!/usr/bin/env python3
"""Long new prompts, against llama-server (issue 82, item 1): how fast each server computes
several colleagues' documents that arrive at once, and one document beside colleagues decoding.

Both servers run the same file with the same pool and slots (--pool, default `-c 32768 -np 8`),
both up at once, each working alone in turn, the order alternated every round. Each round sends
text neither server has seen (seeded varied words, a new seed per round, the same text to both):

- `at-once`: --colleagues (8) prompts of about --prompt-tokens (3,000) sent together, answers
  of --answer (256) tokens, greedy, `ignore_eos`. Per side: prompt tokens/s (every prompt token
  over the time until the last first token), the median and last first token, the wall time.
- `beside`: one such prompt sent while --colleagues - 1 short chats stream their answers. Per
  side: the long prompt's first token, and the colleagues' largest gap between two chunks
  while it was computed (what the document costs the people already reading an answer).

    bench/run prompts --llama-server "$(scripts/build-llama-server)" [--model M] \\
        [--rounds 5] [--mode at-once|beside] [--localserve-args "..."] \\
        [--llama-server-args "..."]

Run it alone on the machine: llama.cpp's worker threads spin, so anything beside it skews it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from localserve.common.config import resolve_model  # noqa: E402


def document(seed: int, tokens: int) -> str:
    """Varied words, about `tokens` tokens long (a word is about 1.3 tokens)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(int(tokens / 1.3)))


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                 t0: float, times: list[float] | None = None) -> dict:
    """One greedy streamed completion: its prompt tokens, first-token time and chunk times
    (appended to `times` as they come, where the caller watches them)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    times, usage = [] if times is None else times, {}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter() - t0)
    return {"prompt_tokens": usage.get("prompt_tokens", 0), "first": times[0], "times": times}


async def at_once(url: str, seed: int, args) -> dict:
    prompts = [document(seed * 100 + i, args.prompt_tokens) for i in range(args.colleagues)]
    async with httpx.AsyncClient(timeout=1800) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(stream(client, url, p, args.answer, t0) for p in prompts))
        wall = time.perf_counter() - t0
    firsts = sorted(d["first"] for d in done)
    return {"prompt_tok_s": sum(d["prompt_tokens"] for d in done) / firsts[-1],
            "first_median_s": statistics.median(firsts), "first_last_s": firsts[-1],
            "wall_s": wall}


async def beside(url: str, seed: int, args) -> dict:
    """Colleagues streaming long answers; once each has its first token, the document."""
    rng = random.Random(seed)
    chats = [f"Write about {' '.join(rng.choice(WORDS) for _ in range(8))}."
             for _ in range(args.colleagues - 1)]
    async with httpx.AsyncClient(timeout=1800) as client:
        t0, seen = time.perf_counter(), [[] for _ in chats]
        readers = [asyncio.create_task(stream(client, url, c, 4 * args.answer, t0, times))
                   for c, times in zip(chats, seen)]
        while not all(seen):  # every chat decoding before the document goes in
            if any(r.done() for r in readers):
                await asyncio.gather(*readers)  # raises what ended one early
                raise RuntimeError("a chat ended before every chat had its first token")
            await asyncio.sleep(0.01)
        sent = time.perf_counter() - t0
        long = await stream(client, url, document(seed, args.prompt_tokens), 8, t0)
        done = await asyncio.gather(*readers)
    window = (sent, long["first"])
    gaps = [b - a for d in done for a, b in zip(d["times"], d["times"][1:])
            if a < window[1] and b > window[0]]
    return {"long_first_s": long["first"] - sent, "colleague_gap_max_s": max(gaps, default=0.0),
            "prompt_tok_s": long["prompt_tokens"] / (long["first"] - sent)}


MODES = {"at-once": (at_once, ["prompt_tok_s", "first_median_s", "first_last_s", "wall_s"]),
         "beside": (beside, ["prompt_tok_s", "long_first_s", "colleague_gap_max_s"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--pool", default="-c 32768 -np 8")
    parser.add_argument("--mode", choices=sorted(MODES), default="at-once")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--colleagues", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--answer", type=int, default=256)
    parser.add_argument("--localserve-args", default="")
    parser.add_argument("--llama-server-args", default="", help="e.g. --kv-unified")
    args = parser.parse_args()
    model = args.model or str(resolve_model(None))
    pool = args.pool.split()
    sides = {
        "localserve": RunningServer("-m", model, *pool, *args.localserve_args.split(),
                                    log_name="prompts-localserve"),
        "llama-server": RunningServer("-m", model, *pool, *args.llama_server_args.split(),
                                      log_name="prompts-llama",
                                      program=[args.llama_server]),
    }
    measure, keys = MODES[args.mode]
    results: dict[str, list[dict]] = {name: [] for name in sides}
    try:
        for server in sides.values():
            server.wait_ready(300)
        for rnd in range(args.rounds):
            for name in (list(sides) if rnd % 2 == 0 else list(reversed(sides))):
                figures = asyncio.run(measure(sides[name].url, 1000 + rnd, args))
                results[name].append(figures)
                print(f"round {rnd + 1} {name:12} " + ", ".join(
                    f"{k} {figures[k]:.2f}" for k in keys), flush=True)
    finally:
        for server in sides.values():
            server.stop()
    print(f"\n{args.mode}, medians of {args.rounds} rounds; {Path(model).name} {args.pool}, "
          f"{args.colleagues} colleagues, {args.prompt_tokens}-token prompts; "
          f"localserve {args.localserve_args or '(defaults)'}; "
          f"llama-server {args.llama_server_args or '(defaults)'}")
    for key in keys:
        ls, peer = results["localserve"], results["llama-server"]
        ratios = [a[key] / b[key] for a, b in zip(ls, peer) if b[key]]
        print(f"{key:20} localserve {statistics.median(r[key] for r in ls):8.2f}  "
              f"llama-server {statistics.median(r[key] for r in peer):8.2f}  "
              f"ratio {spread(ratios)}")


if __name__ == "__main__":
    main()
