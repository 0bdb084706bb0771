"""The scheduler's own cost per step, pure Python (no model, no server): schedule() + update()
with N requests decoding, at the host benchmark's pool and slots (-c 32768 -np 64), the prompt
cache and n-gram drafts on, against tests/fakes.py's sequences answering with tokens of a
150,000-token vocabulary (as a random-weight model writes: drafts seldom found). What the
engine thread spends planning a step beside llama_decode and sampling (issue 82, item 2); it
needs no quiet CPU to compare two trees, only the same machine.

    bench/run planning [--decoding 1 8 32 64] [--steps 400] [--trials 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"),
                str(Path(__file__).resolve().parents[1])]

from fakes import FakeVocab, PositionalRunner  # noqa: E402
from localserve.engine.prompt_cache import PromptCache  # noqa: E402
from localserve.engine.request import Request, SamplingParams  # noqa: E402
from localserve.engine.scheduler import Scheduler  # noqa: E402
from localserve.engine.slots import SlotPool  # noqa: E402

POOL, SLOTS, BUDGET = 32768, 64, 512
WARM_STEPS = 60  # every request admitted and decoding before the timed steps


class WordsRunner(PositionalRunner):
    """PositionalRunner's sequences, answering with tokens spread over a large vocabulary."""

    def decode(self, plan):
        out = super().decode(plan)
        out.sampled = {slot: [1 + hash((slot, len(self.cache[slot]))) % 150_000]
                       for slot in out.sampled}
        return out


def microseconds_per_step(decoding: int, steps: int) -> float:
    """One trial: `decoding` requests in a fresh scheduler, then `steps` timed steps."""
    sched = Scheduler(SlotPool(POOL, SLOTS, n_ctx_per_slot=POOL), FakeVocab(), BUDGET, SLOTS,
                      None, 4 * BUDGET, PromptCache(1 << 28), True, None)
    runner = WordsRunner(POOL)
    for i in range(decoding):
        sched.add(Request([1] * 12 + [2 + i] * 12, SamplingParams(max_tokens=1 << 20),
                          request_id=f"r{i}"))
    for _ in range(WARM_STEPS):
        plan = sched.schedule()
        sched.update(plan, runner.decode(plan))
    if sched.waiting or len(sched.running) != decoding:
        raise SystemExit(f"{decoding} requests did not all start in {WARM_STEPS} steps")
    spent = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        sched.has_work()
        plan = sched.schedule()
        planned = time.perf_counter()
        out = runner.decode(plan)
        decoded = time.perf_counter()
        sched.update(plan, out)
        spent += (planned - started) + (time.perf_counter() - decoded)
    return spent / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decoding", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    if max(args.decoding) * (24 + WARM_STEPS + args.steps) > POOL:
        raise SystemExit("that many steps would fill the pool: fewer --steps")
    print("decoding | schedule + update, us per step: median (min-max) of trials")
    for n in args.decoding:
        runs = [microseconds_per_step(n, args.steps) for _ in range(args.trials)]
        print(f"{n:8} | {statistics.median(runs):8.1f} ({min(runs):.1f}-{max(runs):.1f})")


if __name__ == "__main__":
    main()
