#!/usr/bin/env python3
"""Embeddings beside chat, one run on the real server (`-c 8192 -np 8 -t 2`):

1. embeddings per second, requests of 32 short texts each, nothing else running;
2. chat output tok/s of 4 greedy streams, nothing else running;
3. both at once: the same 4 streams while batches of 32 texts are embedded back to back.

    bench/run embeddings [--batches 8] [--tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402
from conftest import RunningServer  # noqa: E402  (the tests' own start/stop helper)

TEXTS = [f"Note {i}: the {w} report for the {t} team is due on {d}." for i, (w, t, d) in enumerate(
    (w, t, d) for w in ("weekly", "monthly", "quarterly", "annual")
    for t in ("sales", "support", "research", "legal") for d in ("Monday", "Friday"))]


async def embed_batches(client: httpx.AsyncClient, url: str, batches: int) -> tuple[int, float]:
    started = time.perf_counter()
    for _ in range(batches):
        r = await client.post(url + "/v1/embeddings", json={"input": TEXTS})
        assert r.status_code == 200, r.text
    return batches * len(TEXTS), time.perf_counter() - started


async def chat_streams(client: httpx.AsyncClient, url: str, tokens: int) -> tuple[int, float]:
    async def one(i):
        r = await client.post(url + "/v1/completions", json={
            "prompt": f"Story {i}: once upon a time", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True})
        return r.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(4)))
    return sum(done), time.perf_counter() - started


async def measure(url: str, batches: int, tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await embed_batches(client, url, 1)  # warm-up: creates the embedding context
        n, s = await embed_batches(client, url, batches)
        alone_emb = n / s
        n, s = await chat_streams(client, url, tokens)
        alone_chat = n / s
        chat_task = asyncio.create_task(chat_streams(client, url, tokens))
        embedded, emb_s = 0, 0.0
        while not chat_task.done():
            n, s = await embed_batches(client, url, 1)
            embedded, emb_s = embedded + n, emb_s + s
        n, s = chat_task.result()
        return {"embeddings_per_s_alone": alone_emb, "chat_tok_s_alone": alone_chat,
                "chat_tok_s_while_embedding": n / s,
                "embeddings_per_s_while_chatting": embedded / emb_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    server = RunningServer("-c", "8192", "-np", "8", "-t", str(args.threads),
                           log_name="bench-embeddings").wait_ready()
    try:
        r = asyncio.run(measure(server.url, args.batches, args.tokens))
    finally:
        server.stop()
    print(f"embeddings, batches of {len(TEXTS)} short texts: {r['embeddings_per_s_alone']:.1f}/s alone, "
          f"{r['embeddings_per_s_while_chatting']:.1f}/s while 4 chat streams run")
    print(f"4 greedy chat streams of {args.tokens} tokens: {r['chat_tok_s_alone']:.1f} tok/s alone, "
          f"{r['chat_tok_s_while_embedding']:.1f} tok/s while embedding "
          f"({r['chat_tok_s_while_embedding'] / r['chat_tok_s_alone']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
