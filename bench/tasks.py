#!/usr/bin/env python3
"""What Open WebUI's background tasks cost a colleague's chat (issue: the frontends): a chat's
time to first token alone, then sent just after its own chat's title and tags tasks (Open
WebUI's default prompts, no max_tokens, as it sends them), on an idle server with the
defaults (`-t 2`, no keys). Alternating rounds; the median and spread of each, and the ratio.

    bench/run tasks [--rounds 5]
Run it alone on the machine: llama.cpp's threads spin, and any other load skews it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402
from conftest import running  # noqa: E402  (the tests' own start/stop helpers)

HISTORY = ("USER: How do I keep basil alive on a windowsill?\nASSISTANT: Give it four to six "
           "hours of sun, water when the top of the soil is dry, and pinch off flower buds.")
TASKS = [
    "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n"
    "### Output:\nJSON format: { \"title\": \"your concise title here\" }\n"
    f"### Chat History:\n<chat_history>\n{HISTORY}\n</chat_history>",
    "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history.\n"
    "### Output:\nJSON format: { \"tags\": [\"tag1\", \"tag2\", \"tag3\"] }\n"
    f"### Chat History:\n<chat_history>\n{HISTORY}\n</chat_history>",
]
CHAT = [{"role": "user", "content": "How do I keep basil alive on a windowsill?"},
        {"role": "assistant", "content": "Give it sun, and water when the soil is dry."},
        {"role": "user", "content": "And how often should I pinch it back?"}]


# One client made up front: making an httpx client (its SSL context) costs ~30 ms of the
# bench's own CPU, and on 2 cores beside a busy server that cost doubles and was measured
# as the server's (1.85x, of which most was the client's).
CLIENT = httpx.Client(timeout=600)


def first_token_s(url: str, messages: list[dict]) -> float:
    body = {"messages": messages, "max_tokens": 16, "stream": True, "temperature": 0}
    started = time.monotonic()
    with CLIENT.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", "") \
                    and '"content":""' not in line.replace(" ", ""):
                return time.monotonic() - started
    return time.monotonic() - started


def task(url: str, prompt: str) -> None:
    CLIENT.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "stream": False})


def with_tasks(url: str) -> float:
    senders = [threading.Thread(target=task, args=(url, p)) for p in TASKS]
    for sender in senders:
        sender.start()
    time.sleep(0.05)  # the tasks arrive first, as Open WebUI's do after an answer
    ttft = first_token_s(url, CHAT)
    for sender in senders:
        sender.join()
    return ttft


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    alone, beside = [], []
    with running("-t", "2", log_name="bench-tasks") as server:
        first_token_s(server.url, CHAT)  # warm: the chat's prefix in cache, as in an office
        for _ in range(args.rounds):
            alone.append(first_token_s(server.url, CHAT))
            beside.append(with_tasks(server.url))
    ratios = [b / a for a, b in zip(alone, beside)]
    print(f"chat TTFT alone:        median {statistics.median(alone):.3f} s "
          f"({min(alone):.3f}-{max(alone):.3f})")
    print(f"chat TTFT beside tasks: median {statistics.median(beside):.3f} s "
          f"({min(beside):.3f}-{max(beside):.3f})")
    print(f"ratio per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
