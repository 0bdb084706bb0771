"""What the dashboard shows, computed from two HTTP payloads (/slots JSON, /metrics text).

Pure Python, no Textual: `Tracker.update(slots, metrics_text, now)` turns successive polls
into a `View` (rates come from differences between polls, percentiles from histogram buckets
over the last minute), which the widgets only render.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

WINDOW_S = 60.0  # sparklines and percentiles cover about the last minute


def parse_metrics(text: str, model: str | None = None) -> dict:
    """{sample name: value} for plain samples; {name: [(le, count), ...]} for histogram buckets.
    A server with several models labels every sample with its `model`: only that model's
    samples are read (and unlabelled ones)."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            if labels and labels != {"model": model}:
                continue
            if s.name.endswith("_bucket"):
                out.setdefault(s.name, []).append((float(s.labels["le"]), s.value))
            else:
                out[s.name] = s.value
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus-style quantile from cumulative (upper bound, count) buckets."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            span = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / span if span else 1)
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass
class SlotRow:
    id: int
    state: str
    n_cached: int
    n_ctx: int
    n_decoded: int
    tok_s: float
    age_s: float | None
    user: str | None
    request_id: str | None
    n_borrowed: int = 0  # cells past the slot's guarantee, lent by the pool


@dataclass
class View:
    model: str = "?"
    split: str = ""
    backend: str = ""
    slots: list[SlotRow] = field(default_factory=list)
    waiting: int = 0
    oldest_wait_s: float = 0.0
    next_up: list[dict] = field(default_factory=list)  # first waiting requests, in serving order
    tok_s: float = 0.0
    tok_s_history: list[float] = field(default_factory=list)
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    ttft_p50_history: list[float] = field(default_factory=list)
    preemptions: int = 0
    preempted_just_now: bool = False
    pool: tuple[int, int, int] = (0, 0, 0)  # the cache pool's cells: used, size, borrowed
    cpu_percent: float = 0.0
    cpu_count: int = 0
    rss_bytes: float = 0.0
    mem_total: float = 0.0
    mem_available: float = 0.0
    usage_today: list[dict] = field(default_factory=list)  # ledger rows by key (what the key may see)
    models: list[tuple[str, str]] = field(default_factory=list)  # (id, state) of every model offered
    # the prompt cache beyond the slots and speculative drafts, when the server has them
    cache_hit_rate: float | None = None  # admissions restoring a prefix from the cache
    cache_bytes: float = 0.0
    drafts_kept: float | None = None  # share of speculative drafts the model agreed with


class Tracker:
    """Keeps the previous poll and a minute of history to turn counters into rates."""

    def __init__(self):
        # the previous poll: (time, tokens generated, preemptions, {request_id: n_decoded})
        self._last: tuple[float, float, int, dict] | None = None
        self._history: deque[tuple[float, list]] = deque()  # (time, ttft buckets) over the window
        self.tok_s_history: deque[float] = deque(maxlen=60)
        self.ttft_history: deque[float] = deque(maxlen=60)

    def update(self, slots: dict, metrics_text: str, now: float, props: dict | None = None) -> View:
        m = parse_metrics(metrics_text, slots.get("model"))
        generated = m.get("localserve:generation_tokens_total", 0.0)
        ttft_buckets = m.get("localserve:time_to_first_token_seconds_bucket", [])
        decoded = {s["request_id"]: s["n_decoded"] for s in slots["slots"] if s["request_id"]}
        view = View(model=slots.get("model", "?"), split=slots.get("split", ""),
                    waiting=slots["queue"]["waiting"], oldest_wait_s=slots["queue"]["oldest_wait_s"],
                    next_up=list(slots["queue"].get("requests", []))[:4],
                    preemptions=int(slots["engine"].get("preemptions", 0)))
        view.backend = _backend_text(props)
        view.usage_today = list(slots.get("usage_today", []))
        view.models = [(c["id"], c.get("status", {}).get("value", "?")) for c in slots.get("models", [])]
        prev = self._last
        dt = now - prev[0] if prev else 0.0
        if prev and dt > 0:
            view.tok_s = max(0.0, generated - prev[1]) / dt
            self.tok_s_history.append(view.tok_s)
            view.preempted_just_now = view.preemptions > prev[2]
        for s in slots["slots"]:
            rate = 0.0
            if prev and dt > 0 and s["request_id"] in prev[3]:
                rate = max(0, s["n_decoded"] - prev[3][s["request_id"]]) / dt
            view.slots.append(SlotRow(s["id"], s["state"], s["n_cached"], s["n_ctx"], s["n_decoded"],
                                      rate, s.get("age_s"), s.get("user"), s["request_id"],
                                      s.get("n_borrowed", 0)))
        cache = slots.get("cache", {})
        view.pool = (cache.get("used_tokens", 0), cache.get("pool_tokens", 0),
                     cache.get("borrowed_tokens", 0))
        self._history.append((now, ttft_buckets))
        while self._history and now - self._history[0][0] > WINDOW_S:
            self._history.popleft()
        view.ttft_p50, view.ttft_p95 = self._ttft_window(ttft_buckets)
        if view.ttft_p50 is not None:
            self.ttft_history.append(view.ttft_p50)
        view.tok_s_history = list(self.tok_s_history)
        view.ttft_p50_history = list(self.ttft_history)
        view.cpu_percent = m.get("localserve:process_cpu_percent", 0.0)
        view.cpu_count = int(m.get("localserve:system_cpu_count", 0))
        view.rss_bytes = m.get("localserve:process_resident_memory_bytes", 0.0)
        view.mem_total = m.get("localserve:system_memory_total_bytes", 0.0)
        view.mem_available = m.get("localserve:system_memory_available_bytes", 0.0)
        _less_work(view, m)
        self._last = (now, generated, view.preemptions, decoded)
        return view

    def _ttft_window(self, current: list) -> tuple[float | None, float | None]:
        """TTFT percentiles of requests that got their first token within the window."""
        oldest = dict(self._history[0][1]) if self._history else {}
        delta = [(le, count - oldest.get(le, 0.0)) for le, count in current]
        return histogram_quantile(0.5, delta), histogram_quantile(0.95, delta)


def _less_work(view: View, m: dict) -> None:
    """Hit rate of the prompt cache and the share of drafts kept, since the server started."""
    hits = m.get("localserve:prompt_cache_hits_total")
    if hits is not None:
        looked_up = hits + m.get("localserve:prompt_cache_misses_total", 0.0)
        view.cache_hit_rate = hits / looked_up if looked_up else 0.0
        view.cache_bytes = m.get("localserve:prompt_cache_bytes", 0.0)
    drafted = m.get("localserve:spec_decode_num_draft_tokens_total", 0.0)
    if drafted:
        view.drafts_kept = m.get("localserve:spec_decode_num_accepted_tokens_total", 0.0) / drafted


def _backend_text(props: dict | None) -> str:
    if not props:
        return ""
    backend = props.get("backend", {})
    text = backend.get("name", "?")
    if backend.get("gpu_offload"):
        n_layers = props.get("model", {}).get("n_layers", "?")
        text += f", {backend.get('n_gpu_layers', 0)}/{n_layers} layers on GPU"
    return text
