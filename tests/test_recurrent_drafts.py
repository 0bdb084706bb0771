"""Drafts on a hybrid model, the real runner: llama.cpp keeps a few earlier recurrent states per
sequence (n_rs_seq) for the families that write them (LFM2 here; Qwen3.5, Nemotron-H...), so a
step's rejected draft rows are taken out again and the answer is the one decoding a token a step
gives. Granite 4's family keeps none: the runner says so, and the scheduler drafts nothing
there (reuse.DraftBook)."""

from __future__ import annotations

import re
import subprocess

import httpx
import llama_cpp as C
import pytest

from conftest import ROOT, running
from localserve.engine.errors import RowsRefused
from localserve.engine.plan import Admission, SeqChunk, StepPlan
from localserve.engine.request import Request, SamplingParams


def runner_for(kind: str, rollback: int):
    from localserve.engine.runner import LlamaRunner, RunnerConfig

    path = subprocess.run([str(ROOT / "scripts/make-memory-model"), kind], check=True,
                          text=True, capture_output=True).stdout.strip()
    return LlamaRunner(RunnerConfig(path, ctx_size=2048, n_slots=2, n_batch=512, n_threads=2,
                                    draft_rollback=rollback))


def start(runner, slot: int, prompt: list[int]) -> int:
    request = Request(prompt, SamplingParams(temperature=0), request_id=f"r{slot}")
    out = runner.decode(StepPlan([SeqChunk(slot, request, prompt, 0, True)],
                                 [Admission(slot, request, 0)]))
    return out.sampled[slot][0], request


def test_rejected_draft_rows_leave_a_recurrent_state_and_the_answer_is_unchanged():
    runner = runner_for("hybrid", 4)
    try:
        assert runner.memory_kind == "hybrid" and runner.draft_rollback == 4
        prompt = [1, *range(3000, 3100)]
        token, plain = start(runner, 0, prompt)  # slot 0: a token a step, the reference
        expected, pos = [token], len(prompt)
        while len(expected) < 16:
            out = runner.decode(StepPlan([SeqChunk(0, plain, [expected[-1]], pos, True)]))
            expected.append(out.sampled[0][0])
            pos += 1
        token, drafted = start(runner, 1, prompt)  # slot 1: two right drafts, then wrong ones
        got, pos, trims = [token], len(prompt), []
        while len(got) < 16:
            ahead = expected[len(got):len(got) + 2]
            drafts = ahead + [7, 7][:4 - len(ahead)]
            chunk = SeqChunk(1, drafted, [got[-1], *drafts], pos, True, drafts=len(drafts))
            sampled = runner.decode(StepPlan([chunk], trims=trims)).sampled[1]
            kept = len(sampled)  # the row sampled and the drafts that held
            got += sampled
            pos += kept
            trims = [(1, pos)]  # the rejected rows, out before the next step (the scheduler's)
            assert 1 + len(drafts) - kept <= 4
        assert got[:16] == expected
        runner.decode(StepPlan([SeqChunk(1, drafted, [got[-1]], pos, True)], trims=trims))
        assert C.llama_memory_seq_pos_max(runner.memory, 1) == pos  # the kept rows and this one
        with pytest.raises(RowsRefused):  # further back than the states kept: refused
            runner.decode(StepPlan([], trims=[(1, pos - 5)]))
    finally:
        runner.close()


def test_a_family_that_keeps_no_earlier_state_gets_none():
    runner = runner_for("hybrid-mamba", 8)
    try:
        assert runner.memory_kind == "hybrid" and runner.draft_rollback == 0
    finally:
        runner.close()


class FakeRunner:
    def __init__(self, memory_kind: str, draft_rollback: int):
        self.memory_kind, self.draft_rollback = memory_kind, draft_rollback


def test_the_start_up_line_says_whether_a_recurrent_state_gets_drafts_and_why():
    from localserve.common.config import Settings
    from localserve.models.assembly import memory_line

    said = {(kind, spec, rollback): memory_line(Settings(spec=spec), FakeRunner(kind, rollback))
            for kind, spec, rollback in (("attention", "auto", 0), ("hybrid", "auto", 0),
                                         ("hybrid", "ngram", 8), ("hybrid", "ngram", 0),
                                         ("hybrid", "off", 0))}
    assert "draft" not in said["attention", "auto", 0]
    assert "no drafting (greedy answers kept as llama-server's; --spec ngram" in \
        said["hybrid", "auto", 0]
    assert said["hybrid", "ngram", 8].endswith(
        "drafts of up to 8 tokens a step (llama.cpp keeps 8 earlier states per slot to take "
        "them out)")
    assert "no drafting (llama.cpp keeps no earlier state for this family" in \
        said["hybrid", "ngram", 0]
    assert "draft" not in said["hybrid", "off", 0]


def test_spec_ngram_drafts_on_a_hybrid_through_the_real_server():
    """Asked for, a hybrid of a family llama.cpp keeps earlier states for drafts (an answer
    that repeats itself: the random model's), and /props says so; by default it does not."""
    path = subprocess.run([str(ROOT / "scripts/make-memory-model"), "hybrid"], check=True,
                          text=True, capture_output=True).stdout.strip()
    text = " ".join(f"item{i} costs {i * 3} crowns" for i in range(40))
    for spec, drafts in (("ngram", True), ("auto", False)):
        with running("-m", path, "-c", "4096", "-np", "2", "-t", "2", "--spec", spec,
                     log_name=f"recurrent-drafts-{spec}") as srv:
            props = httpx.get(srv.url + "/props").json()
            assert props["default_generation_settings"]["params"]["speculative"] is drafts
            r = httpx.post(srv.url + "/v1/completions", timeout=300,
                           json={"prompt": text, "max_tokens": 120, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 120
            metrics = httpx.get(srv.url + "/metrics").text
            drafted = float(re.search(r"^localserve:spec_decode_num_draft_tokens_total (\S+)",
                                      metrics, re.M).group(1))
            assert (drafted > 0) is drafts, drafted
            assert "Traceback" not in srv.log()
