"""Load generator for any OpenAI-compatible server: a seeded, mixed, streaming workload.

Each request streams a chat completion; we time the first content chunk (TTFT), the gaps
between chunks (inter-token latency) and the whole request, and count output tokens from the
server's usage report. Lengths are enforced with `ignore_eos` (llama-server and vLLM honour
it), so every policy and server is asked for the same work.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point government company number group problem fact river garden window letter music "
         "mountain kitchen market station engine library question answer morning evening story "
         "history science paper table doctor teacher village city ocean forest winter summer").split()


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int


def make_workload(n: int, seed: int, prompt_words=(30, 400), output_tokens=(16, 128)) -> list[Job]:
    """Mixed prompt lengths (uniform) and heavy-tailed outputs (most short, a few long)."""
    rng = random.Random(seed)
    jobs = []
    lo, hi = output_tokens
    for _ in range(n):
        words = rng.randint(*prompt_words)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        out = min(hi, lo + int(rng.expovariate(1 / ((hi - lo) / 4))))
        jobs.append(Job(f"Summarise these notes in one paragraph: {text}", out))
    return jobs


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str = ""


async def run_one(client: httpx.AsyncClient, url: str, model: str | None, job: Job) -> Result:
    body = {"messages": [{"role": "user", "content": job.prompt}], "max_tokens": job.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    last = None
    result = Result(ok=False)
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.gaps.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = repr(exc)
    return result


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


@dataclass
class LevelSummary:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    output_tok_s: float
    prompt_tok_s: float
    requests_s: float
    ttft_p50: float
    ttft_p95: float
    itl_p50: float
    itl_p95: float
    itl_max: float
    e2e_p95: float

    def row(self) -> str:
        return (f"{self.concurrency:>5} {self.output_tok_s:>9.1f} {self.prompt_tok_s:>8.1f} "
                f"{self.requests_s:>7.2f} "
                f"{self.ttft_p50:>7.2f} {self.ttft_p95:>7.2f} {self.itl_p50 * 1000:>7.0f} "
                f"{self.itl_p95 * 1000:>7.0f} {self.itl_max * 1000:>7.0f} {self.e2e_p95:>7.2f} "
                f"{self.errors:>4}")


HEADER = "  conc  out tok/s prompt/s   req/s  ttft50  ttft95 itl50ms itl95ms itlmax  e2e95  err"


async def run_level(url: str, jobs: list[Job], concurrency: int, model: str | None = None,
                    progress=None, api_key: str | None = None) -> LevelSummary:
    """Send every job with at most `concurrency` in flight; summarise."""
    queue = list(reversed(jobs))
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits,
                                 headers=headers) as client:
        async def worker():
            while queue:
                results.append(await run_one(client, url, model, queue.pop()))
                if progress:
                    progress(len(results), len(jobs))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    good = [r for r in results if r.ok]
    gaps = [g for r in good for g in r.gaps]
    return LevelSummary(
        concurrency=concurrency, requests=len(results), errors=len(results) - len(good), wall_s=wall,
        output_tok_s=sum(r.output_tokens for r in good) / wall,
        prompt_tok_s=sum(r.prompt_tokens for r in good) / wall, requests_s=len(good) / wall,
        ttft_p50=pct([r.ttft for r in good], 0.5), ttft_p95=pct([r.ttft for r in good], 0.95),
        itl_p50=pct(gaps, 0.5), itl_p95=pct(gaps, 0.95), itl_max=max(gaps, default=0.0),
        e2e_p95=pct([r.e2e for r in good], 0.95))


def summary_json(levels: list[LevelSummary], **meta) -> str:
    return json.dumps({**meta, "levels": [asdict(s) for s in levels]}, indent=2)

