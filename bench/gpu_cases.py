#!/usr/bin/env python3
"""One long prompt through each server with its own defaults (issue 66): what a GPU user gets
without choosing anything. Each side is started with `-m MODEL` alone (localserve also with
--spec off), answers --rounds prompts of --words words (seeded text, a new one each round: none is in
a cache) with --answer tokens, greedy and streamed, one server at a time. Per side: time to first token, prompt tokens
per second, answer tokens per second, and whether the answer's text equals llama-server's.

    bench/run gpu_cases --llama-server PATH --model MODEL.gguf [--words 20000]

Prints a Markdown table (scripts/bench-gpu puts it beside the fast-model tables).
"""

from __future__ import annotations

import argparse
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


def prompt(words: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Summarise this document in one paragraph.\n\n{text}"


def ask(url: str, text: str, answer: int) -> dict:
    """One streamed greedy answer: first-token time, token counts and timings, the text."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": answer,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, pieces, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    pieces.append(choice["delta"]["content"])
    end = time.perf_counter()
    first = first or end
    n_prompt, n_answer = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"ttft_s": first - start, "prompt_tok_s": n_prompt / max(first - start, 1e-9),
            "answer_tok_s": max(n_answer - 1, 0) / max(end - first, 1e-9),
            "n_prompt": n_prompt, "text": "".join(pieces)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--words", type=int, default=20000)
    parser.add_argument("--answer", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    texts = [prompt(args.words, seed) for seed in range(args.rounds)]  # none cached before
    sides = {"llama-server (defaults)": dict(program=[args.llama_server]),
             "localserve (defaults)": {}, "localserve --spec off": dict(extra=("--spec", "off"))}
    rows = {}
    for name, how in sides.items():
        server = RunningServer("-m", args.model, *how.get("extra", ()), log_name="gpu-case",
                               program=how.get("program"))
        try:
            server.wait_ready(600)
            ask(server.url, "Say hello.", 8)  # warm-up
            rows[name] = [ask(server.url, text, args.answer) for text in texts]
        finally:
            server.stop()
        print(f"{name}: {[round(r['ttft_s'], 2) for r in rows[name]]} s to the first token",
              file=sys.stderr, flush=True)
    peer = [run["text"] for run in rows["llama-server (defaults)"]]
    print(f"\nA prompt of {args.words} words ({rows['localserve (defaults)'][0]['n_prompt']} "
          f"tokens), {args.answer}-token greedy answers, medians of {args.rounds}:\n")
    print("| server | first token s | prompt tok/s | answer tok/s | same text as llama-server |")
    print("|---|---|---|---|---|")
    for name, runs in rows.items():
        med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        print(f"| {name} | {med('ttft_s'):.2f} | {med('prompt_tok_s'):.0f} | "
              f"{med('answer_tok_s'):.1f} | {[r['text'] for r in runs] == peer} |")


if __name__ == "__main__":
    main()
