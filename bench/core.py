#!/usr/bin/env python3
"""Serving-core benchmark: localserve's aggregate tokens/s, TTFT and inter-token gaps at
several concurrency levels, beside the raw ceiling of the runner decoding B sequences in a
bare loop (no scheduler, no HTTP). Everything is measured in this one run, side by side.

    bench/run core [--concurrency 1,4,8] [--requests 24] [--threads 2]

Server settings follow the issue: default model, -c 8192, 8 slots; workload: prompts of about
30-400 tokens, 16-128 tokens out (heavy-tailed), streaming, seed 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import RunningServer  # noqa: E402  (the tests' own start/stop helper)

from localserve.bench import load as bench  # noqa: E402
from localserve.common.config import resolve_model  # noqa: E402


def raw_ceiling(batch_sizes: list[int], threads: int, steps: int = 64) -> dict[int, float]:
    """Tokens/s of llama_decode alone with B sequences decoding one token each per step."""
    from localserve.engine.request import Request, SamplingParams
    from localserve.engine.runner import LlamaRunner, RunnerConfig
    from localserve.engine.plan import Admission, SeqChunk, StepPlan

    top = max(batch_sizes)
    runner = LlamaRunner(RunnerConfig(str(resolve_model(None)), 8192, top, 256, threads))
    prompt = runner.tokenize("Once upon a time, in a quiet village by the sea,")
    out = {}
    for b in batch_sizes:
        reqs = [Request(prompt, SamplingParams(temperature=0)) for _ in range(b)]
        plan = StepPlan([SeqChunk(i, reqs[i], prompt, 0, True) for i in range(b)],
                        [Admission(i, reqs[i], 0) for i in range(b)])
        sampled = runner.decode(plan)
        pos = len(prompt)
        start = time.perf_counter()
        for _ in range(steps):
            plan = StepPlan([SeqChunk(i, reqs[i], [sampled[i]], pos, True) for i in range(b)])
            sampled = runner.decode(plan)
            pos += 1
        out[b] = b * steps / (time.perf_counter() - start)
    runner.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", help="server step budget (default: the server's)")
    ap.add_argument("--out", default="bench-out/core.json")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    jobs = bench.make_workload(args.requests, args.seed)

    budget = ["--max-num-batched-tokens", args.max_num_batched_tokens] if args.max_num_batched_tokens else []
    server = RunningServer("-c", "8192", "-np", "8", "-t", str(args.threads), *budget, log_name="bench")
    try:
        server.wait_ready()
        asyncio.run(bench.run_level(server.url, jobs[:2], 2))  # warm-up
        print("localserve up -c 8192 -np 8 -t", args.threads, *budget)
        print(bench.HEADER + "  outside-decode")
        summaries, overheads = [], []
        for level in levels:
            before = server.slots()["engine"]
            summaries.append(asyncio.run(bench.run_level(server.url, jobs, level)))
            after = server.slots()["engine"]
            busy = after["busy_s"] - before["busy_s"]
            overheads.append((busy - (after["llama_decode_s"] - before["llama_decode_s"])) / busy)
            print(summaries[-1].row() + f"  {overheads[-1]:>13.1%}", flush=True)
    finally:
        server.stop()

    ceiling = raw_ceiling(levels, args.threads)
    print("\nraw runner ceiling (llama_decode in a bare loop, B sequences x 1 token per step):")
    for b, tps in ceiling.items():
        print(f"  B={b:<3} {tps:7.1f} tok/s")
    print("\nserver throughput as a share of the raw decode ceiling at the same B:")
    for s in summaries:
        print(f"  concurrency {s.concurrency}: {s.output_tok_s / ceiling[s.concurrency]:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    print("\nshare of engine-step wall time spent outside llama_decode (batch filling, sampling,"
          " stop rules, detokenizing, hand-off): " + ", ".join(
              f"c={s.concurrency}: {o:.1%}" for s, o in zip(summaries, overheads)))
    Path(args.out).write_text(json.dumps({
        "command": " ".join(sys.argv), "server": json.loads(bench.summary_json(summaries))["levels"],
        "outside_decode_share": overheads, "raw_ceiling_tok_s": ceiling}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
