#!/usr/bin/env python3
"""Grammar-constrained decoding: what a constrained token costs, and what constrained
streams cost the free ones sharing their steps. Two measurements in one run:

1. The runner alone (no HTTP): 4 sequences decoding under a JSON-schema grammar beside 4
   free ones, one llama_decode per step; sampling time per constrained token (the
   check-then-resample path) against a free token.
2. The real server (`-c 8192 -np 8 -t 2`): aggregate tok/s of 8 free streams, then of
   4 schema-constrained + 4 free streams, same prompts and lengths, back to back.

    bench/run grammar [--tokens 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402
from conftest import RunningServer  # noqa: E402  (the tests' own start/stop helper)

from localserve.common.config import resolve_model  # noqa: E402

SCHEMA = {"type": "object", "required": ["people"], "properties": {"people": {
    "type": "array", "items": {"type": "object", "required": ["name", "age", "city"],
                               "properties": {"name": {"type": "string"},
                                              "age": {"type": "integer"},
                                              "city": {"type": "string"}}}}}}
PROMPT = "List some people with their name, age and city."


def runner_sampling_cost(tokens: int, threads: int) -> tuple[float, float]:
    """ms of sampling per token: (constrained, free), 4 of each decoding in the same steps."""
    from localserve.engine.request import Request, SamplingParams
    from localserve.engine.runner import LlamaRunner, RunnerConfig
    from localserve.engine.plan import Admission, SeqChunk, StepPlan

    runner = LlamaRunner(RunnerConfig(str(resolve_model(None)), 8192, 8, 512, threads))
    grammar = runner.sampling.json_schema_grammar(json.dumps(SCHEMA))
    prompt = runner.tokenize(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    reqs = [Request(prompt, SamplingParams(temperature=0, grammar=grammar if i < 4 else None))
            for i in range(8)]
    plan = StepPlan([SeqChunk(i, r, prompt, 0, True) for i, r in enumerate(reqs)],
                    [Admission(i, r, 0) for i, r in enumerate(reqs)])
    sampled, pos = runner.decode(plan), len(prompt)
    timings = {True: 0.0, False: 0.0}
    original = runner.sampling.sample

    def timed(slot_id, row):
        start = time.perf_counter()
        token = original(slot_id, row)
        timings[slot_id < 4] += time.perf_counter() - start
        return token

    runner.sampling.sample = timed
    for _ in range(tokens):
        plan = StepPlan([SeqChunk(i, r, [sampled[i]], pos, True) for i, r in enumerate(reqs)])
        sampled, pos = runner.decode(plan), pos + 1
    runner.close()
    per_token = 1000 / (4 * tokens)
    return timings[True] * per_token, timings[False] * per_token


async def aggregate(url: str, constrained: int, tokens: int) -> tuple[float, float, list[int]]:
    """(aggregate tok/s of all 8, mean tok/s of one free stream, tokens per request)."""
    async def one(i):
        body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                "max_tokens": tokens, "stream": False}
        if i < constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": SCHEMA}}
        else:
            body["ignore_eos"] = True
        async with httpx.AsyncClient(timeout=600) as client:
            begun = time.perf_counter()
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"], time.perf_counter() - begun

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(8)))
    total = sum(n for n, _ in results) / (time.perf_counter() - start)
    free = [n / t for n, t in results[constrained:]]
    return total, sum(free) / len(free), [n for n, _ in results]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    constrained_ms, free_ms = runner_sampling_cost(args.tokens, args.threads)
    print(f"sampling per token, 4 constrained + 4 free in the same steps: constrained "
          f"{constrained_ms:.2f} ms, free {free_ms:.2f} ms")
    server = RunningServer("-c", "8192", "-np", "8", "-t", str(args.threads), log_name="bench-grammar")
    try:
        server.wait_ready()
        asyncio.run(aggregate(server.url, 0, 8))  # warm-up
        free_total, free_one, _ = asyncio.run(aggregate(server.url, 0, args.tokens))
        mixed_total, mixed_one, counts = asyncio.run(aggregate(server.url, 4, args.tokens))
    finally:
        server.stop()
    print(f"server, 8 streams of up to {args.tokens} tokens: 8 free {free_total:.1f} tok/s "
          f"aggregate, {free_one:.1f} tok/s per free stream; 4 constrained + 4 free "
          f"{mixed_total:.1f} tok/s aggregate, {mixed_one:.1f} tok/s per free stream "
          f"({mixed_one / free_one:.2f}x); tokens per request {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
