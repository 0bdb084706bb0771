"""A step's rows in one llama_decode call or two (runner/calls.py): when each, and, on the real
model, that two calls sample what each sequence samples alone."""

import llama_cpp as C
import pytest

from counting_prompts import counting
from localserve.engine.plan import Admission, SeqChunk, StepPlan
from localserve.engine.request import Request, SamplingParams
from localserve.engine.runner.calls import QUERY_TILE_ROWS, compacts, decode_calls, stream_call


def chunk(slot, n, start=0, sample=True, drafts=0):
    request = Request(list(range(1, start + n + 1)), SamplingParams(), request_id=f"r{slot}")
    return SeqChunk(slot, request, list(range(100, 100 + n)), start, sample, drafts)


def shape(plan):
    return [[(c.slot_id, start, end) for c, start, end in call] for call in decode_calls(plan)]


def test_a_prompt_chunk_beside_other_streams_decode_rows_goes_in_a_call_of_its_own():
    plan = StepPlan([chunk(1, 1, start=300), chunk(2, 3, start=400, drafts=2), chunk(0, 200)])
    assert shape(plan) == [[(0, 0, 199)], [(1, 0, 1), (2, 0, 3), (0, 199, 200)]]


def test_with_a_stream_per_slot_one_call_carries_the_rows_in_slot_order():
    """llama.cpp splits a call over streams into ubatches of consecutive sequence ids: 0, 2, 3
    in that order makes two ({0}, then {2, 3}), where 3, 0, 2 would make three."""
    plan = StepPlan([chunk(3, 1, start=300), chunk(0, 200), chunk(2, 1, start=50)])
    assert [[(c.slot_id, a, b) for c, a, b in call] for call in stream_call(plan)] == [
        [(0, 0, 200), (2, 0, 1), (3, 0, 1)]]


def test_a_prompt_chunk_that_samples_nothing_goes_whole_in_the_first_call():
    plan = StepPlan([chunk(1, 1, start=300), chunk(0, 200, sample=False)])
    assert shape(plan) == [[(0, 0, 200)], [(1, 0, 1)]]


@pytest.mark.parametrize("chunks", [
    [chunk(0, 200)],  # a prompt alone: its last row sees its own sequence only
    [chunk(1, 1, start=300), chunk(0, 63)],  # under a query tile: attention is per row
    [chunk(1, 1, start=300), chunk(2, 1, start=400)],  # decoding only
    [chunk(0, 130, sample=False), chunk(1, 130, sample=False)],  # no logits wanted at all
])
def test_one_call_when_two_would_save_nothing(chunks):
    plan = StepPlan(chunks)
    assert shape(plan) == [[(c.slot_id, 0, len(c.tokens)) for c in chunks]]


def greedy(runner, slot, text):
    return Request(runner.tokenize(text), SamplingParams(temperature=0), request_id=f"s{slot}")


def generate(runner, requests, together, n=6):
    """Greedy tokens per slot: each request's prompt, then n decode steps. `together`: the
    second prompt is computed in the step where the first request decodes its first token."""
    out = {slot: [] for slot in requests}

    def step(chunks, admitted=()):
        sampled = runner.decode(StepPlan(chunks, list(admitted))).sampled
        for slot, tokens in sampled.items():
            out[slot] += tokens

    def decode_row(slot):
        request = requests[slot]
        position = len(request.prompt_tokens) + len(out[slot]) - 1
        return SeqChunk(slot, request, out[slot][-1:], position, True)

    def prompt(slot):
        request = requests[slot]
        return SeqChunk(slot, request, request.prompt_tokens, 0, True), Admission(slot, request, 0)

    first, second = requests
    if together:
        step(*zip(prompt(first)))
        (chunk_, admission) = prompt(second)
        step([decode_row(first), chunk_], [admission])
        for _ in range(n - 1):
            step([decode_row(first), decode_row(second)])
    else:
        for slot in requests:
            step(*zip(prompt(slot)))
            for _ in range(n):
                step([decode_row(slot)])
    for slot in requests:
        C.llama_memory_seq_rm(runner.memory, slot, -1, -1)
    return {slot: tokens[:n] for slot, tokens in out.items()}


def watch(monkeypatch):
    """The sizes of llama_decode's calls and llama_memory_clear's (compactions), as they come."""
    calls, clears = [], []
    real_decode, real_clear = C.llama_decode, C.llama_memory_clear
    monkeypatch.setattr(C, "llama_decode", lambda ctx, batch: calls.append(batch.n_tokens)
                        or real_decode(ctx, batch))
    monkeypatch.setattr(C, "llama_memory_clear", lambda mem, data: clears.append(data)
                        or real_clear(mem, data))
    return calls, clears


def test_two_calls_and_compacting_sample_what_each_sequence_samples_alone(runner, monkeypatch):
    requests = {1: greedy(runner, 1, counting(500, 12)), 0: greedy(runner, 0, counting(100, 90))}
    assert len(requests[0].prompt_tokens) > 64  # a whole query tile: split and compaction apply
    alone = generate(runner, requests, together=False)
    calls, clears = watch(monkeypatch)
    runner.interleaved_rows = QUERY_TILE_ROWS  # as if streams had decoded side by side
    together = generate(runner, requests, together=True)
    n_prompt = len(requests[0].prompt_tokens)
    assert calls[:3] == [len(requests[1].prompt_tokens), n_prompt - 1, 2]  # the step in two
    assert len(calls) == 3 + 5  # and then one call a step
    assert clears == [False]  # the second prompt's step compacted the first's sequence
    assert together == alone
    assert runner.interleaved_rows == 2 + 5 * 2  # since then: the two-sequence calls' rows
    assert generate(runner, requests, together=True) == alone
    assert clears == [False]  # under a tile interleaved since: not compacted again


def test_with_layers_offloaded_a_step_is_one_call_and_the_pool_is_left_as_it_is(runner,
                                                                                 monkeypatch):
    requests = {1: greedy(runner, 1, counting(500, 12)), 0: greedy(runner, 0, counting(100, 90))}
    monkeypatch.setattr(runner, "cpu_tiles", False)
    runner.interleaved_rows = QUERY_TILE_ROWS
    calls, clears = watch(monkeypatch)
    generate(runner, requests, together=True)
    assert calls == [len(requests[1].prompt_tokens), len(requests[0].prompt_tokens) + 1] + [2] * 5
    assert clears == []


def test_the_pool_is_compacted_before_a_new_prompt_of_a_query_tile_or_more():
    def admitted(*chunks):
        return StepPlan(list(chunks), [Admission(c.slot_id, c.request, 0) for c in chunks[-1:]])

    assert compacts(admitted(chunk(1, 1, start=300), chunk(0, 64)), QUERY_TILE_ROWS)
    assert not compacts(admitted(chunk(1, 1, start=300), chunk(0, 63)), 500)  # a short turn
    assert not compacts(StepPlan([chunk(1, 1, start=300), chunk(0, 200, start=256)]), 500)  # its
    # prompt's later chunks: the first one's cells already follow the compacted sequences
    assert not compacts(admitted(chunk(0, 200)), QUERY_TILE_ROWS - 1)  # the pool is in order

