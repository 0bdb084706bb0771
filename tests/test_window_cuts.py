"""A sliding-window model's cache cut back (Gemma 3 270M, the real runner): taken where the
window layers still hold every position the next one sees, refused where they do not. llama.cpp
writes a batch's rows over cells of the sequence that none of its rows sees any more, so a cut
a few positions back is whole; one far back would decode from a window with a hole in it,
fluently and wrongly, so the runner clears the sequence instead and says so
(LlamaRunner._window_whole). A drafted step's rejected rows (--spec ngram) are such a cut."""

from __future__ import annotations

import re

import httpx
import llama_cpp as C
import pytest

from conftest import ROOT, running
from localserve.engine.errors import RowsRefused
from localserve.engine.plan import Admission, SeqChunk, StepPlan
from localserve.engine.request import Request, SamplingParams

GEMMA = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"


def test_a_cut_within_the_window_is_taken_and_one_past_it_refused():
    if not GEMMA.is_file():
        pytest.skip("no Gemma 3 270M: scripts/setup-second-model")
    from localserve.engine.runner import LlamaRunner, RunnerConfig

    runner = LlamaRunner(RunnerConfig(str(GEMMA), ctx_size=4096, n_slots=2, n_batch=1024,
                                      n_threads=2))
    try:
        assert runner.memory_kind == "sliding-window" and runner.n_swa == 512
        prompt = [2, *range(1000, 2700)]  # past the window layers' cells: older ones written over
        request = Request(prompt, SamplingParams(temperature=0), request_id="doc")
        runner.decode(StepPlan([SeqChunk(0, request, prompt[:1000], 0, False)],
                               [Admission(0, request, 0)]))
        runner.decode(StepPlan([SeqChunk(0, request, prompt[1000:], 1000, True)]))
        oldest = C.llama_memory_seq_pos_min(runner.memory, 0)
        assert 0 < oldest <= 1000 - 512  # what the second call's rows no longer see, at most
        assert runner._cut(0, len(prompt) - 5)  # a failed draft's, an answer's tail
        assert C.llama_memory_seq_pos_max(runner.memory, 0) == len(prompt) - 6
        with pytest.raises(RowsRefused) as refused:  # back to before the window's oldest cell
            runner.decode(StepPlan([], trims=[(0, oldest + 100)]))
        assert 0 in refused.value.refused
        assert C.llama_memory_seq_pos_max(runner.memory, 0) == -1  # cleared, never decoded on
    finally:
        runner.close()


def test_a_drafted_steps_rejected_rows_leave_the_window_whole():
    """Past its window, a sequence's drafted step (one physical batch) is cut back to the rows
    that held: taken (the cells its first row sees were spared), and the answer goes on as a
    token a step gives it (--spec ngram on a window model)."""
    if not GEMMA.is_file():
        pytest.skip("no Gemma 3 270M: scripts/setup-second-model")
    from localserve.engine.runner import LlamaRunner, RunnerConfig

    runner = LlamaRunner(RunnerConfig(str(GEMMA), ctx_size=4096, n_slots=2, n_batch=1024,
                                      n_threads=2, draft_rollback=8))
    try:
        assert runner.draft_rollback == 64  # a window model: as many as attention gets
        prompt = [2, *range(1000, 1700)]  # past the window (512)
        expected, drafted = [], []
        for slot, out in ((0, expected), (1, drafted)):
            request = Request(prompt, SamplingParams(temperature=0), request_id=f"r{slot}")
            first = runner.decode(StepPlan([SeqChunk(slot, request, prompt, 0, True)],
                                           [Admission(slot, request, 0)]))
            out += first.sampled[slot]
            pos, trims = len(prompt), []
            while len(out) < 12:
                drafts = (expected[len(out):len(out) + 2] + [7] * 6) if slot else []
                chunk = SeqChunk(slot, request, [out[-1], *drafts], pos, True, drafts=len(drafts))
                sampled = runner.decode(StepPlan([chunk], trims=trims)).sampled[slot]
                out += sampled
                pos += len(sampled)
                trims = [(slot, pos)] if drafts else []
            assert runner._window_whole(slot, pos)
        assert drafted[:12] == expected[:12]
    finally:
        runner.close()


def test_spec_ngram_drafts_on_a_window_model_through_the_real_server():
    """Asked for, Gemma 3 drafts a copied list, every answer whole; by default it does not
    (tests/test_memory_kinds.py). (Rejected rows taken out: the runner test above.)"""
    if not GEMMA.is_file():
        pytest.skip("no Gemma 3 270M: scripts/setup-second-model")
    items = ", ".join(f"item {i} costs {i * 3} crowns" for i in range(30))
    with running("-m", str(GEMMA), "-c", "4096", "-np", "2", "-t", "2", "--spec", "ngram",
                 log_name="window-drafts") as srv:
        assert "drafts of up to 64 tokens a step (a step's rows are one physical batch" in \
            srv.log()
        for _ in range(10):  # drafts follow measured step costs: a busy machine may say wait
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": f"Copy this list exactly: {items}"}],
                "max_tokens": 150, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 50
            metrics = httpx.get(srv.url + "/metrics").text
            counts = {name: float(re.search(rf"^localserve:spec_decode_num_{name}_tokens_total "
                                            r"(\S+)", metrics, re.M).group(1))
                      for name in ("draft", "accepted")}
            if counts["accepted"] > 20:
                break
        assert counts["draft"] >= counts["accepted"] > 20, counts
        assert "Traceback" not in srv.log()
