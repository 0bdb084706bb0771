"""Greedy decoding without bias or penalties reads the logits' argmax in place
(runner/sampling.py) instead of running llama.cpp's sampler chain: on the real model, every
row it samples, alone or behind drafts, gets the token a greedy chain picks from that row."""

import llama_cpp as C
import pytest

from counting_prompts import counting
from localserve.engine.plan import Admission, SeqChunk, StepPlan
from localserve.engine.request import Request, SamplingParams

PROMPTS = ("The capital of France is", "Write a short poem about the sea.\n", counting(10, 30))


def chain_pick(runner, row: int) -> int:
    chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
    C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
    try:
        return C.llama_sampler_sample(chain, runner.ctx, row)
    finally:
        C.llama_sampler_free(chain)


def prompt_step(runner, request) -> list[int]:
    return runner.decode(StepPlan([SeqChunk(0, request, request.prompt_tokens, 0, True)],
                                  [Admission(0, request, 0)])).sampled[0]


@pytest.mark.parametrize("text", PROMPTS)
def test_every_sampled_row_gets_what_a_greedy_sampler_chain_picks(runner, text):
    request = Request(runner.tokenize(text), SamplingParams(temperature=0), request_id="g")
    out = prompt_step(runner, request)
    assert 0 in runner.sampling.argmax_slots and out == [chain_pick(runner, -1)]
    while len(out) < 10:  # one row a step
        row = SeqChunk(0, request, out[-1:], len(request.prompt_tokens) + len(out) - 1, True)
        out += runner.decode(StepPlan([row])).sampled[0]
        assert out[-1] == chain_pick(runner, 0)
    # Again behind drafts: the first answer's tokens checked in one step, row after row.
    C.llama_memory_seq_rm(runner.memory, 0, -1, -1)
    first = prompt_step(runner, request)
    drafted = SeqChunk(0, request, first + out[1:6], len(request.prompt_tokens), True, drafts=5)
    kept = runner.decode(StepPlan([drafted])).sampled[0]
    assert kept == [chain_pick(runner, k) for k in range(len(kept))]
    assert len(kept) > 1  # some drafts held, so rows past the first were compared too
    C.llama_memory_seq_rm(runner.memory, 0, -1, -1)


def test_bias_or_penalties_keep_the_sampler_chain(runner):
    for params in ({"logit_bias": ((0, 0.0),)}, {"repeat_penalty": 1.1}, {"temperature": 0.7}):
        request = Request(runner.tokenize("Hello"), SamplingParams(**{"temperature": 0, **params}),
                          request_id="b")
        prompt_step(runner, request)
        assert 0 not in runner.sampling.argmax_slots, params
        C.llama_memory_seq_rm(runner.memory, 0, -1, -1)
