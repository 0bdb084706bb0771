"""A sliding-window model's cache cut back (Gemma 3 270M, the real runner): taken where the
window layers still hold every position the next one sees, refused where they do not. llama.cpp
writes a batch's rows over cells of the sequence that none of its rows sees any more, so a cut
a few positions back is whole; one far back would decode from a window with a hole in it,
fluently and wrongly, so the runner clears the sequence instead and says so
(LlamaRunner._window_whole)."""

from __future__ import annotations

import llama_cpp as C
import pytest

from conftest import ROOT
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
