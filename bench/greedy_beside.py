#!/usr/bin/env python3
"""Greedy text beside neighbours (issue 82, item 3): four greedy probes of 48 tokens, each sent
alone and then beside 3, 5 and 7 colleagues' sampled requests sent with it, on localserve and
on llama-server, one server at a time; printed: how many of the 12 probes beside neighbours
gave the text the probe gave alone, per side and per probe.

llama.cpp's CPU kernels pick their method by each call's shape (one row or several, how many
cells a row's attention spans), each summing in its own order, and a model's near-ties turn
the last bits into another token: a probe's text beside others is its text alone only where
its rows are computed alike (docs/api.md, "When a greedy answer is the same text").

    bench/run greedy_beside [--model FILE] [--llama-server "$(scripts/build-llama-server)"]
        [--rounds 1] [--localserve-args "-c 4096 -np 4"] [--llama-server-args "-c 4096 -np 4"]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from conftest import RunningServer  # noqa: E402
from localserve.common.config import resolve_model  # noqa: E402
from office import peer_template  # noqa: E402

PROBES = ("The capital of France is", "Write a short poem about the sea.",
          "List three uses of a paperclip.", "Explain what a cache is, in two sentences.")
NEIGHBOURS = (3, 5, 7)


async def ask(client: httpx.AsyncClient, url: str, content: str, greedy: bool, seed: int) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 48 if greedy else 96}
    body.update({"temperature": 0} if greedy else {"temperature": 1.0, "seed": seed})
    r = await client.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


async def probe_beside(url: str, probe: str, n: int, seed: int) -> str:
    """The probe's text, sent with n colleagues' sampled requests."""
    async with httpx.AsyncClient(timeout=600) as client:
        answers = await asyncio.gather(
            ask(client, url, probe, True, 0),
            *[ask(client, url, f"Tell colleague {i} a story about room {seed + i}.", False,
                  seed + i) for i in range(n)])
    return answers[0]


def equal_beside(url: str, seed: int) -> dict[str, int]:
    """Per probe: how many of its runs beside 3, 5 and 7 neighbours gave its text alone. The
    text alone is its second run alone: the first computes the whole prompt, later ones find
    it cached (both servers) and compute its last token only, as the runs beside others do."""
    alone = {p: [asyncio.run(probe_beside(url, p, 0, seed)) for _ in range(2)][-1]
             for p in PROBES}
    return {p: sum(asyncio.run(probe_beside(url, p, n, seed + 100 * n)) == alone[p]
                   for n in NEIGHBOURS) for p in PROBES}


def side(program: list[str] | None, args: list[str], name: str, rounds: int) -> list[dict]:
    srv = RunningServer(*args, log_name=f"greedy-beside-{name}", program=program).wait_ready(300)
    try:
        return [equal_beside(srv.url, 1000 * r) for r in range(rounds)]
    finally:
        srv.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    parser.add_argument("--llama-server", default=None,
                        help="llama-server's path (default: scripts/build-llama-server's)")
    parser.add_argument("-t", "--threads", default="2")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--localserve-args", default="")
    parser.add_argument("--llama-server-args", default="")
    args = parser.parse_args()
    peer = args.llama_server or subprocess.run(
        [str(ROOT / "scripts/build-llama-server")], check=True, capture_output=True,
        text=True).stdout.strip()
    model = str(resolve_model(args.model))
    common = ["-m", model, "-t", args.threads]
    results = {
        "llama-server": side([peer], [*common, *peer_template(model),
                                      *shlex.split(args.llama_server_args)], "llama-server",
                             args.rounds),
        "localserve": side(None, [*common, *shlex.split(args.localserve_args)], "localserve",
                           args.rounds)}
    total = len(PROBES) * len(NEIGHBOURS)
    for name, rounds in results.items():
        counts = [sum(r.values()) for r in rounds]
        per_probe = ", ".join(f"{sum(r[p] for r in rounds)}" for p in PROBES)
        print(f"{name:13s} {' / '.join(map(str, counts))} of {total} the same as alone "
              f"(per probe, all rounds: {per_probe})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
