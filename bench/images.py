#!/usr/bin/env python3
"""What one colleague's images cost the others (issue 70): two colleagues (alice, bob: each
their own key) chat, a short question each (new each round), streamed, while a third (carol)
sends 10 different images, one request each, all at once just before; their time to first
token against the same two chats alone. The embedded model with a random-weight projector of
its width (scripts/make-projector; no hub download), the defaults otherwise (`-t 2`, keys on,
so each colleague has a share). Alternating rounds; the median and spread of each, and the
ratio.

    bench/run images [--rounds 5] [--mmproj FILE] [--as-text]
Run it alone on the machine: llama.cpp's threads spin, and any other load skews it.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
from conftest import key_file, running  # noqa: E402  (the tests' own start/stop helpers)
from PIL import Image  # noqa: E402

CLIENT = httpx.Client(timeout=600)  # made once: a client's set-up is CPU the server would pay
QUESTIONS = ["How do I keep basil alive on a windowsill, round {}?",
             "What is a good name for a cat born on day {}?"]
KEYS = {"alice": "sk-alice-0000000000", "bob": "sk-bob-00000000000", "carol": "sk-carol-000000000"}


def auth(name: str) -> dict:
    return {"authorization": f"Bearer {KEYS[name]}"}


def image_part(seed: int) -> dict:
    buffer = io.BytesIO()
    Image.effect_noise((320, 240), 40 + seed).convert("RGB").save(buffer, "PNG")
    data = base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def text_part(seed: int) -> dict:
    return {"type": "text", "text": f"Picture {seed}: " + "a red barn beside a green field "
            "under a grey sky, " * 4}


def first_token_s(url: str, who: str, question: str, out: list) -> None:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 16,
            "stream": True, "temperature": 0}
    started = time.monotonic()
    with CLIENT.stream("POST", url + "/v1/chat/completions", json=body, headers=auth(who)) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", "") \
                    and '"content":""' not in line.replace(" ", ""):
                break
    out.append(time.monotonic() - started)


def describe(url: str, part: dict) -> None:
    CLIENT.post(url + "/v1/chat/completions", headers=auth("carol"), json={
                "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "What is in this picture?"}, part]}]})


def chats(url: str, images: list[dict], n: int) -> list[float]:
    """The two chatters' first-token times (their questions' round `n`), with `images` sent
    just before them."""
    threads = [threading.Thread(target=describe, args=(url, p)) for p in images]
    for t in threads:
        t.start()
    if images:
        time.sleep(0.05)  # the images arrive first: the chats come in behind them
    times: list[float] = []
    chatters = [threading.Thread(target=first_token_s, args=(url, who, q.format(n), times))
                for who, q in zip(("alice", "bob"), QUESTIONS)]
    for t in chatters:
        t.start()
    for t in chatters + threads:
        t.join()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mmproj", help="a projector for the embedded model (default: the random one)")
    ap.add_argument("--as-text", action="store_true",
                    help="the control: carol sends a 60-word description instead of each image")
    args = ap.parse_args()
    mmproj = args.mmproj or subprocess.run([str(ROOT / "scripts/make-projector")], check=True,
                                           text=True, capture_output=True).stdout.strip()
    alone, beside = [], []
    keys = key_file(Path(tempfile.mkdtemp()), *(f"{name}:{key}" for name, key in KEYS.items()))
    with running("-t", "2", "--mmproj", mmproj, "--api-key-file", str(keys),
                 log_name="bench-images") as srv:
        chats(srv.url, [], -1)  # warm up: the template, the first step
        for r in range(args.rounds):
            images = [text_part(100 * r + i) if args.as_text else image_part(100 * r + i)
                      for i in range(10)]
            for k, (times, sent) in enumerate(((alone, []), (beside, images))[:: 1 if r % 2 == 0
                                                                               else -1]):
                times.append(statistics.median(chats(srv.url, sent, 2 * r + k)))
    ratios = [b / a for a, b in zip(alone, beside)]
    spread = lambda xs: f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"  # noqa: E731
    print(f"chatters' first token alone:            {spread(alone)} s")
    what = "descriptions" if args.as_text else "images"
    print(f"beside a colleague's 10 {what}:{' ' * (15 - len(what))}{spread(beside)} s")
    print(f"ratio (median of {args.rounds} rounds, min-max):  {spread(ratios)}x")


if __name__ == "__main__":
    main()
