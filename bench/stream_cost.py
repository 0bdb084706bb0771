#!/usr/bin/env python3
"""What the Python side costs per streamed token, measured two ways in one run:

1. Microbenchmark: shaping one chat chunk (replies.Reply._chunk: dict + json.dumps) and
   encoding it as an SSE event (sse-starlette's ensure_bytes), per token.
2. The real server under N concurrent streams (`-c 8192 -np 8 -t 2`): the engine step's wall
   time outside llama_decode and sampling (Python: scheduling, snapshot, detokenizing, event
   delivery), per generated token, from /slots' own counters.

    bench/run stream_cost [--streams 8] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402
from conftest import RunningServer  # noqa: E402
from sse_starlette.event import ensure_bytes  # noqa: E402

from localserve.api.replies import Reply  # noqa: E402
from localserve.api.schemas import ChatCompletionRequest  # noqa: E402


def per_chunk_us(n: int = 20000) -> tuple[float, float]:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True)
    reply = Reply("chat.completion", "SmolLM2-135M-Instruct.Q4_1", body, "localserve-0.1.0-abcdef12")
    start = time.perf_counter()
    chunks = [reply._chunk([reply._delta({"content": " token"})]) for _ in range(n)]
    shaped = time.perf_counter()
    for chunk in chunks:
        ensure_bytes(chunk, "\n")
    encoded = time.perf_counter()
    return (shaped - start) / n * 1e6, (encoded - shaped) / n * 1e6


async def streams(url: str, n: int, tokens: int) -> int:
    async def one(i):
        body = {"messages": [{"role": "user", "content": f"Story {i}:"}], "max_tokens": tokens,
                "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=600) as client:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
        return tokens

    return sum(await asyncio.gather(*(one(i) for i in range(n))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    shape_us, encode_us = per_chunk_us()
    print(f"per SSE chunk: shaping {shape_us:.1f} µs + encoding {encode_us:.1f} µs")
    server = RunningServer("-c", "8192", "-np", "8", "-t", "2", log_name="bench-http")
    try:
        server.wait_ready()
        before = server.slots()["engine"]
        started = time.perf_counter()
        generated = asyncio.run(streams(server.url, args.streams, args.tokens))
        wall = time.perf_counter() - started
        after = server.slots()["engine"]
    finally:
        server.stop()
    busy = after["busy_s"] - before["busy_s"]
    inside = (after["llama_decode_s"] - before["llama_decode_s"]) + \
        (after["sampling_s"] - before["sampling_s"])
    print(f"{args.streams} streams x {args.tokens} tokens: {generated / wall:.1f} tok/s; engine "
          f"steps {busy:.2f} s of which llama_decode + sampling {inside:.2f} s; Python in the "
          f"engine loop {(busy - inside) / generated * 1000:.3f} ms per token "
          f"({(busy - inside) / busy:.1%} of step time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
