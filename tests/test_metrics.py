"""/metrics on the real server, parsed with prometheus_client's own parser."""

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

FAMILIES = {
    "localserve:num_requests_running", "localserve:num_requests_waiting",
    "localserve:kv_cache_usage_perc", "localserve:slot_cache_usage_perc",
    "localserve:num_preemptions", "localserve:prompt_tokens", "localserve:generation_tokens",
    "localserve:prefix_cache_queries", "localserve:prefix_cache_hits",
    "localserve:request_success", "localserve:time_to_first_token_seconds",
    "localserve:inter_token_latency_seconds", "localserve:e2e_request_latency_seconds",
    "localserve:request_queue_time_seconds", "localserve:iteration_tokens_total",
    "localserve:process_cpu_percent", "localserve:process_resident_memory_bytes",
    "localserve:system_memory_total_bytes", "localserve:system_memory_available_bytes",
}


def scrape(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    values = {}
    for family in text_string_to_metric_families(text):
        values.setdefault("families", set()).add(family.name)
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def test_metrics_families_exist_and_move_with_traffic(server, client):
    before = scrape(server)
    assert FAMILIES <= before["families"], FAMILIES - before["families"]
    client.completions.create(model="default", prompt="Once upon a time", max_tokens=10,
                              extra_body={"ignore_eos": True})
    after = scrape(server)
    assert after["localserve:generation_tokens_total"] - before["localserve:generation_tokens_total"] == 10
    assert after["localserve:prompt_tokens_total"] > before["localserve:prompt_tokens_total"]
    length = "localserve:request_success_total{finished_reason=length}"
    assert after[length] == before.get(length, 0) + 1
    assert (after["localserve:time_to_first_token_seconds_count"]
            == before["localserve:time_to_first_token_seconds_count"] + 1)
    assert (after["localserve:inter_token_latency_seconds_count"]
            - before["localserve:inter_token_latency_seconds_count"]) == 9
    assert after["localserve:engine_steps_total"] > before["localserve:engine_steps_total"]
    assert after["localserve:process_resident_memory_bytes"] > 50e6


def test_metrics_answer_while_a_long_prefill_runs(server, client):
    prompt = "Metrics under load: a slow purple turtle crosses the busy road. " * 70  # not cached
    worker = threading.Thread(target=lambda: client.completions.create(
        model="default", prompt=prompt, max_tokens=2))
    worker.start()
    running_seen, slowest = 0.0, 0.0
    while worker.is_alive():
        t0 = time.monotonic()
        values = scrape(server)
        slowest = max(slowest, time.monotonic() - t0)
        running_seen = max(running_seen, values["localserve:num_requests_running"])
    worker.join()
    assert running_seen == 1
    assert slowest < 1.0
