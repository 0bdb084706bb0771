#!/usr/bin/env python3
"""What one colleague's images cost the others (issue 70): two colleagues chat (a short
question each, streamed) while a third sends 10 different images, one request each, all at
once; their time to first token against the same two chats alone. The embedded model with a
random-weight projector of its width (scripts/make-projector; no hub download), the defaults
otherwise (`-t 2`). Alternating rounds; the median and spread of each, and the ratio.

    .venv/bin/python scripts/bench_images.py [--rounds 5] [--mmproj FILE]
Run it alone on the machine: llama.cpp's threads spin, and any other load skews it.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
from conftest import running  # noqa: E402  (the tests' own start/stop helpers)
from PIL import Image  # noqa: E402

CLIENT = httpx.Client(timeout=600)  # made once: a client's set-up is CPU the server would pay
QUESTIONS = ["How do I keep basil alive on a windowsill?", "What is a good name for a cat?"]


def image_part(seed: int) -> dict:
    buffer = io.BytesIO()
    Image.effect_noise((320, 240), 40 + seed).convert("RGB").save(buffer, "PNG")
    data = base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def first_token_s(url: str, question: str, out: list) -> None:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 16,
            "stream": True, "temperature": 0}
    started = time.monotonic()
    with CLIENT.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", "") \
                    and '"content":""' not in line.replace(" ", ""):
                break
    out.append(time.monotonic() - started)


def describe(url: str, part: dict) -> None:
    CLIENT.post(url + "/v1/chat/completions", json={"max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "What is in this picture?"}, part]}]})


def chats(url: str, images: list[dict]) -> list[float]:
    """The two chatters' first-token times, with `images` sent just before them."""
    threads = [threading.Thread(target=describe, args=(url, p)) for p in images]
    for t in threads:
        t.start()
    if images:
        time.sleep(0.05)  # the images arrive first: the chats come in behind them
    times: list[float] = []
    chatters = [threading.Thread(target=first_token_s, args=(url, q, times)) for q in QUESTIONS]
    for t in chatters:
        t.start()
    for t in chatters + threads:
        t.join()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mmproj", help="a projector for the embedded model (default: the random one)")
    args = ap.parse_args()
    mmproj = args.mmproj or subprocess.run([str(ROOT / "scripts/make-projector")], check=True,
                                           text=True, capture_output=True).stdout.strip()
    alone, beside = [], []
    with running("-t", "2", "--mmproj", mmproj, log_name="bench-images") as srv:
        chats(srv.url, [])  # warm up: the template, the first step
        for r in range(args.rounds):
            images = [image_part(100 * r + i) for i in range(10)]
            for first in ((alone, []), (beside, images))[:: 1 if r % 2 == 0 else -1]:
                first[0].append(statistics.median(chats(srv.url, first[1])))
    ratios = [b / a for a, b in zip(alone, beside)]
    spread = lambda xs: f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"  # noqa: E731
    print(f"chatters' first token alone:            {spread(alone)} s")
    print(f"beside a colleague's 10 images:         {spread(beside)} s")
    print(f"ratio (median of {args.rounds} rounds, min-max):  {spread(ratios)}x")


if __name__ == "__main__":
    main()
