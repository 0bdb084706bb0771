"""Prometheus metrics, vLLM-style names under `localserve:`.

Two sources, neither of which ever waits for the engine:
- EngineMetrics observes the engine loop (histograms of latencies and batch fullness, token
  and finish counters), called from the loop thread after each step;
- SnapshotCollector turns the snapshot the engine published after its last step (queue,
  slots, cache, preemptions, prefix cache) and psutil's view of this machine into gauges and
  counters at scrape time.
"""

from __future__ import annotations

import os
import time

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

P = "localserve:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class EngineMetrics:
    """The engine loop's observer: it calls on_step() after each step and on_event() for
    every event it delivers."""

    def __init__(self, registry: CollectorRegistry):
        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(P + name, doc, buckets=buckets, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.")
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive tokens of a stream.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last token.")
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first admission into a slot.")
        self.step_time = hist("engine_step_seconds", "Wall time of one engine step, llama_decode included.")
        self.step_tokens = hist("iteration_tokens_total",
                                "Tokens carried by one engine step (batch fullness).", STEP_TOKEN_BUCKETS)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=registry)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", registry=registry)
        self.finished = Counter(P + "request_success", "Requests finished, by reason.",
                                ["finished_reason"], registry=registry)

    def on_step(self, plan, seconds: float) -> None:
        self.step_time.observe(seconds)
        self.step_tokens.observe(plan.num_tokens)
        for admission in plan.admitted:
            if admission.request.preemptions == 0:
                self.queue_time.observe(time.monotonic() - admission.request.arrival_time)

    def on_event(self, request, event) -> None:
        now = time.monotonic()
        if event.token_ids:
            self.generation_tokens.inc(len(event.token_ids))
            if request.last_token_time is None:
                self.ttft.observe(now - request.arrival_time)
            else:
                self.itl.observe(now - request.last_token_time)
            request.last_token_time = now
        if event.finished:
            self.finished.labels(event.finish_reason.value).inc()
            self.prompt_tokens.inc(event.prompt_tokens)
            if event.finish_reason.completed:
                self.e2e.observe(now - request.arrival_time)


class KeyUsageMetrics:
    """Per-key token counters (only with API keys: the key file bounds the label's values).
    In their own registry, so /metrics shows them to admin keys only. Colleagues named by a
    trusted frontend (`frontend:colleague`, any number of them) get series of their own up to
    MAX_COLLEAGUES; later ones are counted together as `frontend:other`, so a frontend sending
    ever new names cannot grow /metrics without bound (counters never move between series)."""

    MAX_COLLEAGUES = 100

    def __init__(self, registry: CollectorRegistry):
        self._colleagues: set[str] = set()
        self.prompt = Counter(P + "key_prompt_tokens", "Prompt tokens by API key.", ["key"],
                              registry=registry)
        self.generated = Counter(P + "key_generation_tokens", "Generated tokens by API key.",
                                 ["key"], registry=registry)
        self.requests = Counter(P + "key_requests", "Finished requests by API key.", ["key"],
                                registry=registry)

    def on_step(self, plan, seconds: float) -> None:
        pass

    def on_event(self, request, event) -> None:
        if event.finished and request.user:
            label = self._label(request.user)
            self.prompt.labels(label).inc(event.prompt_tokens)
            self.generated.labels(label).inc(event.completion_tokens)
            self.requests.labels(label).inc()

    def _label(self, user: str) -> str:
        frontend, colleague, _ = user.partition(":")
        if not colleague or user in self._colleagues:
            return user
        if len(self._colleagues) < self.MAX_COLLEAGUES:
            self._colleagues.add(user)
            return user
        return f"{frontend}:other"


class SnapshotCollector:
    """Gauges read at scrape time from the engine's last published snapshot and psutil."""

    def __init__(self, snapshot_source):
        self.snapshot_source = snapshot_source  # () -> EngineSnapshot | None
        self.process = psutil.Process(os.getpid())
        self.process.cpu_percent(None)  # prime: the first call always returns 0

    def describe(self):
        return []

    def collect(self):
        yield from self._system()
        snap = self.snapshot_source()
        if snap is None:
            return
        yield _gauge("num_requests_running", "Requests holding a slot.", snap.running)
        yield _gauge("num_requests_waiting", "Requests waiting for a slot.", snap.queue.waiting)
        yield _gauge("oldest_waiting_seconds", "How long the oldest waiting request has waited.",
                     snap.queue.oldest_wait_s)
        pool_used = snap.cache.used_tokens / max(snap.cache.pool_tokens, 1)
        yield _gauge("kv_cache_usage_perc", "Share of the whole cache holding tokens (0-1).", pool_used)
        per_slot = GaugeMetricFamily(P + "slot_cache_usage_perc",
                                     "Share of each slot's context in use (0-1).", labels=["slot"])
        busy = GaugeMetricFamily(P + "slot_busy", "1 if the slot serves a request.", labels=["slot"])
        for s in snap.slots:
            per_slot.add_metric([str(s.id)], s.n_cached / max(s.n_ctx, 1))
            busy.add_metric([str(s.id)], 0 if s.state == "idle" else 1)
        yield per_slot
        yield busy
        engine = snap.engine
        for name, value, doc in (
            ("num_preemptions", engine.preemptions, "Sequences evicted from the cache and requeued."),
            ("num_share_preemptions", engine.share_preemptions,
             "Sequences requeued so that another API key waiting could have a slot."),
            ("num_borrow_preemptions", engine.borrow_preemptions,
             "Borrowers requeued to give cells back to a request within its guarantee."),
            ("num_task_preemptions", engine.task_preemptions,
             "Background tasks requeued to give a slot or borrowed cells to a chat."),
            ("prefix_cache_queries", engine.prefix_cache_queries, "Prompt tokens looked up in slot caches."),
            ("prefix_cache_hits", engine.prefix_cache_hits, "Prompt tokens found in slot caches."),
            ("spec_decode_num_draft_tokens", engine.draft_tokens,
             "Speculative drafts put into batches (--spec ngram)."),
            ("spec_decode_num_accepted_tokens", engine.draft_tokens_accepted,
             "Speculative drafts the model agreed with, kept without a step of their own."),
            ("engine_steps", engine.steps, "Engine steps (one batch each)."),
            ("requests_aborted", engine.requests_aborted, "Requests aborted (client gone)."),
            ("requests_failed", engine.requests_failed,
             "Requests the server ended (decode error, queue timeout, shutdown)."),
        ):
            yield CounterMetricFamily(P + name, doc, value=value)
        yield _gauge("engine_alive", "1 while the engine loop runs.", 1 if engine.alive else 0)
        yield from self._prompt_cache(snap.cache.ram)

    @staticmethod
    def _prompt_cache(ram):
        """The prompt cache beyond the slots (--cache-ram), when it is on."""
        if ram is None:
            return
        yield _gauge("prompt_cache_bytes", "Bytes of prompt states kept in RAM.", ram.bytes)
        yield _gauge("prompt_cache_max_bytes", "The RAM prompt cache's bound.", ram.max_bytes)
        yield _gauge("prompt_cache_entries", "Prompts kept in RAM.", ram.entries)
        yield _gauge("prompt_cache_disk_bytes", "Bytes of prompt cache files (--cache-disk).",
                     ram.disk_bytes)
        yield _gauge("prompt_cache_disk_entries", "Prompts kept in files.", ram.disk_entries)
        for name, value, doc in (
            ("prompt_cache_hits", ram.hits, "Admissions that restored a prefix from RAM."),
            ("prompt_cache_misses", ram.misses, "Admissions that found no longer prefix in RAM."),
            ("prompt_cache_saves", ram.saves, "Slot sequences saved to RAM before being overwritten."),
            ("prompt_cache_evictions", ram.evictions, "Prompts dropped from RAM to stay in bounds."),
            ("prompt_cache_tokens_restored", ram.tokens_restored,
             "Prompt tokens restored from the cache instead of computed."),
            ("prompt_cache_disk_writes", ram.disk_writes, "Prompts written to files."),
            ("prompt_cache_disk_reads", ram.disk_reads, "Prompts read back from files."),
        ):
            yield CounterMetricFamily(P + name, doc, value=value)

    def _system(self):
        mem = psutil.virtual_memory()
        yield _gauge("process_cpu_percent", "Server process CPU use (100 = one core).",
                     self.process.cpu_percent(None))
        yield _gauge("process_resident_memory_bytes", "Server process resident memory.",
                     self.process.memory_info().rss)
        yield _gauge("system_memory_total_bytes", "Machine memory.", mem.total)
        yield _gauge("system_memory_available_bytes", "Machine memory available.", mem.available)
        yield _gauge("system_cpu_count", "Logical CPUs of the server machine.", psutil.cpu_count() or 0)
        yield _gauge("system_cpu_percent", "Machine CPU use since the last scrape (0-100).",
                     psutil.cpu_percent(None))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, value=value)


def build_registry(snapshot_source) -> tuple[CollectorRegistry, EngineMetrics]:
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(snapshot_source))
    return registry, EngineMetrics(registry)


class ModelLabels:
    """Several models: every model's figures in one exposition, each sample labelled with its
    model (families merged by name, as Prometheus requires). With one model /metrics stays
    label-free, as before."""

    def __init__(self, registries):
        self.registries = registries  # () -> [(model name, CollectorRegistry)]

    def collect(self):
        merged: dict[str, Metric] = {}
        for model, registry in self.registries():
            for family in registry.collect():
                target = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                               family.type, family.unit))
                target.samples += [sample._replace(labels={**sample.labels, "model": model})
                                   for sample in family.samples]
        return list(merged.values())


def labelled_registry(registries) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ModelLabels(registries))
    return registry
