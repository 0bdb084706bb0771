#!/usr/bin/env python3
"""Greedy answers of localserve and llama-server on one model file, one request at a time: a
conversation's turn 1, its follow-up, Regenerate, turn 1 again, then seven colleagues at once
(every slot taken), the conversation's next turn brought back, and the one after. Each side
runs its own defaults (-t alone given); printed: each answer equal or where it parts, and the
cached prompt tokens each side reported, of the prompt's.

llama.cpp's numbers depend on how a prompt's rows are batched, and a random-weight model's
near-ties turn the last bits into another token: equal text means both sides computed the same
rows in the same calls (reuse.prompt_stops). Where one side reuses more of its cache than the
other, the two compute different rows and may part.

    bench/run greedy --model FILE [--llama-server "$(scripts/build-llama-server)"] [-t 2]
        [--localserve-args "-np 4"]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from conftest import RunningServer  # noqa: E402
from office import peer_template  # noqa: E402

SYSTEM = "You answer the office's questions about its rooms, its printers and its schedule. " * 4
QUESTIONS = ("Which printer is on the second floor?", "And who books the meeting rooms?",
             "Thanks. When does the office close?", "And on Fridays?")


def chat(url: str, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    usage = body["usage"]
    return body["choices"][0]["message"]["content"], \
        f'{usage["prompt_tokens_details"]["cached_tokens"]} of {usage["prompt_tokens"]}'


async def colleagues(url: str, count: int) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*[client.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Colleague {i} asks about room {i * 7}."}],
            "max_tokens": 8, "temperature": 0}) for i in range(count)])


def conversation(url: str, max_tokens: int) -> list[tuple[str, str, int]]:
    """(step, answer, "cached of prompt tokens") for each step of the module's conversation."""
    steps = []

    def turn(name, messages):
        answer, cached = chat(url, messages, max_tokens)
        steps.append((name, answer, cached))
        return messages + [{"role": "assistant", "content": answer}]

    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    second = turn("turn 1", first) + [{"role": "user", "content": QUESTIONS[1]}]
    third = turn("follow-up", second) + [{"role": "user", "content": QUESTIONS[2]}]
    turn("regenerate", second)
    turn("turn 1 again", first)
    asyncio.run(colleagues(url, 7))
    fourth = turn("turn 3 after 7", third) + [{"role": "user", "content": QUESTIONS[3]}]
    turn("turn 4", fourth)
    return steps


def side(program: list[str] | None, args: list[str], name: str, max_tokens: int):
    srv = RunningServer(*args, log_name=f"greedy-{name}", program=program).wait_ready(300)
    try:
        return conversation(srv.url, max_tokens)
    finally:
        srv.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--llama-server", default=None,
                        help="llama-server's path (default: scripts/build-llama-server's)")
    parser.add_argument("-t", "--threads", default="2")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--localserve-args", default="")
    args = parser.parse_args()
    peer = args.llama_server or subprocess.run(
        [str(ROOT / "scripts/build-llama-server")], check=True, capture_output=True,
        text=True).stdout.strip()
    common = ["-m", args.model, "-t", args.threads]
    theirs = side([peer], [*common, *peer_template(args.model)], "llama-server", args.max_tokens)
    mine = side(None, [*common, *shlex.split(args.localserve_args)], "localserve",
                args.max_tokens)
    for (step, a, ca), (_, b, cb) in zip(mine, theirs):
        parts = len(os.path.commonprefix([a, b]))
        verdict = "equal" if a == b else f"parts at {parts} of {len(b)} characters"
        print(f"{step:15s} {verdict:32s} cached: localserve {ca}, llama-server {cb}")
    print(f"{sum(a == b for (_, a, _), (_, b, _) in zip(mine, theirs))} of {len(mine)} equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
