"""What `localserve bench` concludes from its levels: the knee, and a PNG of the curve."""

from __future__ import annotations

import statistics

from localserve.bench.load import LevelSummary

# Throughput must grow by at least this much from one level to the next to be worth it...
MIN_GAIN = 0.10
# ...and a level whose p95 latency grows more than this while throughput does not is past the knee.
MAX_LATENCY_GROWTH = 0.25


def find_knee(levels: list[LevelSummary]) -> tuple[int | None, str]:
    """The operating limit: the last concurrency level before throughput flattens while p95
    end-to-end latency keeps climbing. Returns (level or None, reason in words)."""
    levels = sorted(levels, key=lambda s: s.concurrency)
    if len(levels) < 2:
        return None, "need at least two concurrency levels to find a knee"
    for prev, cur in zip(levels, levels[1:]):
        gain = cur.output_tok_s / prev.output_tok_s - 1 if prev.output_tok_s else 0.0
        growth = cur.e2e_p95 / prev.e2e_p95 - 1 if prev.e2e_p95 else 0.0
        if gain < MIN_GAIN and growth > MAX_LATENCY_GROWTH:
            return prev.concurrency, (
                f"from concurrency {prev.concurrency} to {cur.concurrency} throughput grew "
                f"{gain:+.0%} ({prev.output_tok_s:.1f} -> {cur.output_tok_s:.1f} tok/s) while p95 "
                f"latency grew {growth:+.0%} ({prev.e2e_p95:.2f} -> {cur.e2e_p95:.2f} s): more "
                f"concurrency than {prev.concurrency} only adds waiting")
    last = levels[-1]
    return None, (f"throughput still grew up to concurrency {last.concurrency} "
                  f"({last.output_tok_s:.1f} tok/s): no knee within the levels measured; try higher")


def plot(levels: list[LevelSummary], path: str, title: str = "localserve bench") -> None:
    """Throughput and p95 latency against concurrency, on two y axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(levels, key=lambda s: s.concurrency)
    xs = [s.concurrency for s in levels]
    fig, left = plt.subplots(figsize=(7, 4.2), dpi=110)
    left.plot(xs, [s.output_tok_s for s in levels], "o-", color="tab:blue", label="output tok/s")
    left.set_xlabel("concurrency")
    left.set_ylabel("aggregate output tokens/s", color="tab:blue")
    left.set_ylim(bottom=0)
    left.set_xscale("log", base=2)
    left.set_xticks(xs, [str(x) for x in xs])
    right = left.twinx()
    right.plot(xs, [s.e2e_p95 for s in levels], "s--", color="tab:red", label="p95 latency")
    right.plot(xs, [s.ttft_p95 for s in levels], "^:", color="tab:orange", label="p95 TTFT")
    right.set_ylabel("seconds (p95)", color="tab:red")
    knee, _ = find_knee(levels)
    if knee is not None:
        left.axvline(knee, color="gray", linestyle=":")
        left.annotate("knee", (knee, max(s.output_tok_s for s in levels)), color="gray")
    # Below the axes: inside them the legend covered the concurrency-1 point.
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    left.set_title(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def spread(values: list[float], unit: str = "x") -> str:
    """Rounds' figures (ratios unless `unit` says otherwise) as printed: median (min-max)."""
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"
