"""The dashboard's pure part: metrics parsing, histogram percentiles, rates between polls."""

import pytest

from tui.model import Tracker, histogram_quantile

METRICS = """# TYPE localserve:generation_tokens counter
localserve:generation_tokens_total {gen}
# TYPE localserve:time_to_first_token_seconds histogram
localserve:time_to_first_token_seconds_bucket{{le="0.5"}} {b1}
localserve:time_to_first_token_seconds_bucket{{le="1.0"}} {b2}
localserve:time_to_first_token_seconds_bucket{{le="+Inf"}} {b2}
localserve:time_to_first_token_seconds_count {b2}
localserve:time_to_first_token_seconds_sum 1.0
"""


def slots(n_decoded, preemptions=0, state="decode"):
    return {"model": "m", "split": "2 slots × 512 tokens = -c 1024 (x)",
            "slots": [{"id": 0, "state": state, "n_ctx": 512, "n_cached": 100, "request_id": "r1",
                       "user": "ann", "n_decoded": n_decoded, "age_s": 3.0},
                      {"id": 1, "state": "idle", "n_ctx": 512, "n_cached": 0, "request_id": None,
                       "user": None, "n_decoded": 0, "age_s": None}],
            "queue": {"waiting": 2, "oldest_wait_s": 1.5, "requests": [
                {"request_id": "r7", "user": "bob", "position": 0, "wait_s": 1.5, "preempted": True},
                {"request_id": "r8", "user": None, "position": 1, "wait_s": 0.2, "preempted": False}]},
            "engine": {"preemptions": preemptions}}


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 0), (0.2, 50), (0.4, 100), (float("inf"), 100)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.5, [(1.0, 0), (float("inf"), 0)]) is None


def test_rates_come_from_differences_between_polls():
    tracker = Tracker()
    first = tracker.update(slots(10), METRICS.format(gen=100, b1=0, b2=0), now=10.0)
    assert first.tok_s == 0.0 and first.slots[0].tok_s == 0.0
    second = tracker.update(slots(30, preemptions=1), METRICS.format(gen=160, b1=3, b2=4), now=12.0)
    assert second.tok_s == pytest.approx(30.0)
    assert second.slots[0].tok_s == pytest.approx(10.0)
    assert second.preempted_just_now and second.preemptions == 1
    assert second.ttft_p50 == pytest.approx(1 / 3 * 0.5 * 2, rel=0.01)  # 2nd of 4 in the 0-0.5 bucket
    assert second.waiting == 2 and second.slots[0].user == "ann"
    assert [r["request_id"] for r in second.next_up] == ["r7", "r8"] and second.next_up[0]["preempted"]
    third = tracker.update(slots(30, preemptions=1), METRICS.format(gen=160, b1=3, b2=4), now=13.0)
    assert not third.preempted_just_now and third.tok_s == 0.0


def test_every_model_and_its_state_is_kept_for_the_header():
    body = {**slots(1), "models": [{"id": "chat", "status": {"value": "loaded"}},
                                   {"id": "coder", "status": {"value": "unloaded"}}]}
    view = Tracker().update(body, METRICS.format(gen=0, b1=0, b2=0), now=1.0)
    assert view.models == [("chat", "loaded"), ("coder", "unloaded")]


def test_prompt_cache_hit_rate_and_drafts_kept_come_from_the_metrics():
    extra = ("# TYPE localserve:prompt_cache_hits counter\nlocalserve:prompt_cache_hits_total 3\n"
             "# TYPE localserve:prompt_cache_misses counter\nlocalserve:prompt_cache_misses_total 1\n"
             "# TYPE localserve:prompt_cache_bytes gauge\nlocalserve:prompt_cache_bytes 2048\n"
             "# TYPE localserve:spec_decode_num_draft_tokens counter\n"
             "localserve:spec_decode_num_draft_tokens_total 10\n"
             "# TYPE localserve:spec_decode_num_accepted_tokens counter\n"
             "localserve:spec_decode_num_accepted_tokens_total 7\n")
    view = Tracker().update(slots(1), METRICS.format(gen=0, b1=0, b2=0) + extra, now=1.0)
    assert view.cache_hit_rate == pytest.approx(0.75) and view.cache_bytes == 2048
    assert view.drafts_kept == pytest.approx(0.7)
    plain = Tracker().update(slots(1), METRICS.format(gen=0, b1=0, b2=0), now=1.0)
    assert plain.cache_hit_rate is None and plain.drafts_kept is None


def test_a_server_with_several_models_is_read_for_the_model_shown():
    """Every sample is labelled with its model there: the shown model's are read, not none."""
    from tui.model import parse_metrics

    text = ('# TYPE localserve:generation_tokens counter\n'
            'localserve:generation_tokens_total{model="a"} 5\n'
            'localserve:generation_tokens_total{model="b"} 70\n'
            '# TYPE localserve:process_cpu_percent gauge\n'
            'localserve:process_cpu_percent{model="b"} 130\n')
    assert parse_metrics(text, "b") == {"localserve:generation_tokens_total": 70.0,
                                        "localserve:process_cpu_percent": 130.0}
    assert parse_metrics(text, "a")["localserve:generation_tokens_total"] == 5.0


def test_borrowed_cells_per_slot_and_the_pools_use_are_read():
    body = slots(5)
    body["slots"][0]["n_borrowed"] = 300
    body["cache"] = {"used_tokens": 812, "pool_tokens": 1024, "borrowed_tokens": 300}
    view = Tracker().update(body, METRICS.format(gen=0, b1=0, b2=0), now=1.0)
    assert [s.n_borrowed for s in view.slots] == [300, 0] and view.pool == (812, 1024, 300)


def test_top_reads_the_servers_own_key_file_and_picks_an_admin_key(tmp_path):
    """`localserve top --api-key-file keys.txt` takes the file `up` takes (name:key[:role]
    lines): its first admin key, which sees every slot, else its first key."""
    import argparse

    from tui.app import api_key

    keys = tmp_path / "keys.txt"
    keys.write_text("# the office\nalice:alice-key-0123456789\nroot:root-key-0123456789:admin\n")
    keys.chmod(0o600)
    args = argparse.Namespace(api_key=None, api_key_file=str(keys))
    assert api_key(args, environ={}) == "root-key-0123456789"
    keys.write_text("alice:alice-key-0123456789\nbob:bob-key-0123456789:user\n")
    assert api_key(args, environ={}) == "alice-key-0123456789"


def test_top_with_a_key_file_that_is_not_there_says_so_in_one_line(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "localserve", "top", "--api-key-file",
                          str(tmp_path / "nope.txt")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"localserve top: --api-key-file {tmp_path / 'nope.txt'}: no such file"]
