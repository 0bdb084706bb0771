"""Sampling, the runner's half of a step after llama_decode: each row with its slot's own
sampler chain, grammars checked outside the chain (llama.cpp aborts the process when a grammar
accepts a token it forbids), and drafted rows accepted while they hold (drafts.py).
SlotSamplers owns every slot's chain and grammar and what this step's grammars cost; the runner
(core.py) starts a slot's when it admits a request and asks it for each sampled row."""

from __future__ import annotations

import ctypes
import logging
import math
import time
from collections import deque

import llama_cpp as C
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from localserve.engine.errors import DecodeError
from localserve.engine.logits import CANDIDATE, fill_candidates, log_probs, sample_softmax
from localserve.engine.plan import SeqChunk
from localserve.engine.request import Request, SamplingParams

log = logging.getLogger("localserve.llama")

# The most one whole-vocabulary grammar pass may take, in this thread's CPU time (not the
# wall clock: a busy machine must not turn a sound grammar into a refusal): checked from the
# grammar's start before admission (grammar_error), and for every token it constrains after
# (sample: a grammar cheap at its start can turn costly one literal later). A pass costs in
# proportion to the vocabulary: 1 us per entry, at least 50 ms (SmolLM's 49,152 tokens: 50 ms;
# Gemma 3's 262,144: 262 ms). A JSON schema's grammar takes a few milliseconds on SmolLM,
# 1,500 alternatives of `[0-9]* "#I"` over 400.
MIN_GRAMMAR_PASS_S = 0.05
GRAMMAR_PASS_S_PER_TOKEN = 1e-6
# Measured on the tool grammars of the test suite: 0.5 ms per token at the median, 8 ms at
# p90, 49 ms at worst; 1,500 alternatives one literal after the start: 1,200 ms per token.
# A request is ended when one token costs more than GRAMMAR_SPIKE passes' worth, or the
# last GRAMMAR_WINDOW tokens more than one pass each on average.
GRAMMAR_SPIKE = 5
GRAMMAR_WINDOW = 8
SAMPLE_TOKENS = 2048  # about how many tokens, spread over the vocabulary, the first pass takes


class SlotSamplers:
    """Per slot: its sampler chain, its grammar (outside the chain) and its top-N
    log-probabilities; per step: which slots' grammars cost too much (costly_grammars) and the
    CPU seconds each slot's grammar took (grammar_seconds, billed to its user)."""

    def __init__(self, ctx, vocab):
        self.ctx, self.vocab = ctx, vocab
        self.n_vocab = C.llama_vocab_n_tokens(vocab)
        self.chains: dict[int, C.llama_sampler_p] = {}
        self.argmax_slots: set[int] = set()  # greedy alone: the logits' argmax
        self.softmax_slots: dict = {}  # temperature alone: (temperature, rng)
        self._softmax_scratch = np.empty(self.n_vocab, dtype=np.float32)
        self.grammars: dict[int, C.llama_sampler_p] = {}
        self.costly_grammars: set[int] = set()  # this step's slots over the grammar bound
        self.grammar_seconds: dict[int, float] = {}  # this step's grammar CPU s per slot
        self.grammar_costs: dict[int, deque] = {}  # per slot: its last tokens' grammar CPU s
        self._candidates = (C.llama_token_data * self.n_vocab)()  # reused for grammar rows
        self._candidate_view = np.frombuffer(self._candidates, dtype=CANDIDATE)
        self._one = (C.llama_token_data * 1)()
        self.logprob_n: dict[int, int | None] = {}  # top-N log-probabilities wanted

    def start(self, slot_id: int, request: Request) -> None:
        """The slot's sampling for the request it was given: a new chain that has seen the
        request's tokens (its penalties), its grammar advanced over the output so far."""
        self._new_sampler(slot_id, request.params, request.all_tokens)
        self._new_grammar(slot_id, request.params.grammar, request.output_tokens)
        self.logprob_n[slot_id] = request.params.logprobs

    def new_step(self) -> None:
        self.costly_grammars, self.grammar_seconds = set(), {}

    def logprobs(self, rows: list[tuple[SeqChunk, int]], sampled: dict[int, list[int]]) -> dict:
        """The top-N log-probabilities of each row whose slot asked for them (the first token
        sampled from it)."""
        return {c.slot_id: log_probs(self._row_logits(row), sampled[c.slot_id][0],
                                     self.logprob_n[c.slot_id])
                for c, row in rows if self.logprob_n.get(c.slot_id) is not None}

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        for chain in (*self.chains.values(), *self.grammars.values()):
            C.llama_sampler_free(chain)
        self.chains.clear()
        self.grammars.clear()

    def _new_sampler(self, slot_id: int, p: SamplingParams, history: list[int]) -> None:
        """A sampler chain in llama.cpp's usual order: penalties, top-k, typical-p, top-p, min-p,
        temp, dist (or temp, Mirostat).
        Penalties see the history (prompt, plus output so far for a preempted request)."""
        old = self.chains.pop(slot_id, None)
        if old is not None:
            C.llama_sampler_free(old)
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        add = lambda s: C.llama_sampler_chain_add(chain, s)  # noqa: E731
        if p.logit_bias:  # llama.cpp copies the array; -100 (OpenAI's "ban") becomes -inf
            biases = (C.llama_logit_bias * len(p.logit_bias))(*(
                C.llama_logit_bias(token, -math.inf if bias <= -100 else bias)
                for token, bias in p.logit_bias))
            add(C.llama_sampler_init_logit_bias(self.n_vocab, len(p.logit_bias), biases))
        if p.penalized:
            add(C.llama_sampler_init_penalties(self.n_vocab, p.penalty_last_n, p.repeat_penalty,
                                               p.frequency_penalty, p.presence_penalty))
        seed = C.LLAMA_DEFAULT_SEED if p.seed is None else p.seed & 0xFFFFFFFF
        if p.greedy:
            add(C.llama_sampler_init_greedy())
        elif p.mirostat:  # llama.cpp's common_sampler: temperature, then Mirostat alone
            add(C.llama_sampler_init_temp(p.temperature))
            add(C.llama_sampler_init_mirostat(self.n_vocab, seed, p.mirostat_tau, p.mirostat_eta, 100)
                if p.mirostat == 1 else
                C.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta))
        else:
            if p.top_k > 0:
                add(C.llama_sampler_init_top_k(p.top_k))
            if p.typical_p < 1.0:
                add(C.llama_sampler_init_typical(p.typical_p, 1))
            if p.top_p < 1.0:
                add(C.llama_sampler_init_top_p(p.top_p, 1))
            if p.min_p > 0.0:
                add(C.llama_sampler_init_min_p(p.min_p, 1))
            add(C.llama_sampler_init_temp(p.temperature))
            add(C.llama_sampler_init_dist(seed))
        if p.penalized:
            for token in history[-p.penalty_last_n:] if p.penalty_last_n > 0 else history:
                if token >= 0:  # an image's rows are no token (images.py)
                    C.llama_sampler_accept(chain, token)
        self.chains[slot_id] = chain
        # Greedy alone (no bias, no penalties) picks the first largest logit, which numpy
        # reads in place; llama_sampler_sample first copies the whole vocabulary into a
        # candidate array for every row, drafted rows included: 0.51 ms against 0.04 ms a row
        # on Gemma 3's 262,144 tokens, 0.11 against 0.03 on SmolLM2's 49,152. Temperature
        # alone (OpenAI's defaults: no top-k, top-p 1) draws from the whole vocabulary's
        # softmax in numpy (logits.sample_softmax): 0.10 ms against 0.9 ms a row on 128k.
        plain = not (p.logit_bias or p.penalized or p.mirostat)
        self.argmax_slots.discard(slot_id)
        self.softmax_slots.pop(slot_id, None)
        if plain and p.greedy:
            self.argmax_slots.add(slot_id)
        elif plain and p.top_k == 0 and p.top_p >= 1.0 and p.min_p <= 0.0 and p.typical_p >= 1.0:
            self.softmax_slots[slot_id] = (p.temperature, np.random.default_rng(
                None if p.seed is None else p.seed & 0xFFFFFFFF))

    # ---- grammar-constrained sampling (never inside the chain) -------------------------
    # llama.cpp aborts the whole process if a grammar accepts a token it forbids, or accepts
    # end-of-generation before it is complete. So a token reaches llama_sampler_accept(grammar)
    # only after _allows() said yes, and end-of-generation never reaches it at all.

    def grammar_error(self, gbnf: str) -> str | None:
        """None if llama.cpp can parse this GBNF (root rule 'root') and constraining a token
        with it is cheap enough, else why not. A grammar's cost is paid on the engine loop for
        every refused token, while everyone else's stream waits: one that costs more than
        grammar_budget() over the whole vocabulary (timed from its start, best of two) is
        refused. A first pass over a sample of the vocabulary (best of two too: one timing on a
        busy machine can read several times too high) refuses a very costly one without
        paying a whole pass for it. Runs on an HTTP worker thread, so it uses its own
        candidate array."""
        grammar = C.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root")
        if not grammar:
            return "llama.cpp could not parse the grammar"
        try:
            step = max(1, self.n_vocab // SAMPLE_TOKENS)
            cost = min(self._grammar_pass_seconds(grammar, step) for _ in range(2)) * step
            if cost <= 4 * self.grammar_budget():
                cost = min(self._grammar_pass_seconds(grammar, 1) for _ in range(2))
        finally:
            C.llama_sampler_free(grammar)
        if cost > self.grammar_budget():
            return (f"constraining one token with this grammar takes {cost * 1000:.0f} ms; the "
                    f"limit is {self.grammar_budget() * 1000:.0f} ms (simplify its alternatives)")
        return None

    def grammar_budget(self) -> float:
        """Seconds one whole-vocabulary grammar pass may take on this model."""
        return max(MIN_GRAMMAR_PASS_S, self.n_vocab * GRAMMAR_PASS_S_PER_TOKEN)

    def _grammar_pass_seconds(self, grammar, step: int) -> float:
        """The time to constrain every `step`-th token of the vocabulary from the grammar's
        start (step 1: all of it)."""
        ids = np.arange(0, self.n_vocab, step)
        candidates = (C.llama_token_data * len(ids))()
        np.frombuffer(candidates, dtype=CANDIDATE)["id"] = ids
        arr = C.llama_token_data_array(candidates, len(ids), -1, False)
        started = time.thread_time()
        C.llama_sampler_apply(grammar, ctypes.byref(arr))
        return time.thread_time() - started

    @staticmethod
    def json_schema_grammar(schema_json: str) -> str:
        """GBNF for a JSON schema (llama-cpp-python's converter; raises on what it rejects).
        Strings may not hold raw control characters: JSON forbids them."""
        gbnf = json_schema_to_gbnf(schema_json)
        return gbnf.replace(r'char ::= [^"\\]', r'char ::= [^"\\\x00-\x1F\x7F]')

    def _new_grammar(self, slot_id: int, gbnf: str | None, generated: list[int]) -> None:
        """A fresh grammar state, advanced over the tokens generated so far (after a
        preemption): never the prompt, which the grammar does not describe."""
        old = self.grammars.pop(slot_id, None)
        if old is not None:
            C.llama_sampler_free(old)
        self.grammar_costs.pop(slot_id, None)
        if gbnf is None:
            return
        grammar = C.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root")
        if not grammar:
            raise DecodeError("the request's grammar no longer parses")
        self.grammars[slot_id] = grammar
        for token in generated:
            if not self.is_eog(token) and self._allows(grammar, token):
                C.llama_sampler_accept(grammar, token)

    def _allows(self, grammar, token: int) -> bool:
        one = self._one
        one[0].id, one[0].logit, one[0].p = token, 0.0, 0.0
        arr = C.llama_token_data_array(one, 1, -1, False)
        C.llama_sampler_apply(grammar, ctypes.byref(arr))
        return math.isfinite(one[0].logit)

    def sample(self, slot_id: int, row: int) -> int:
        """Sample this row's token. With a grammar, as llama.cpp's common_sampler_sample does:
        sample freely, check only that token against the grammar, and only when it is
        refused apply the grammar to the whole vocabulary and sample again. A token that took
        more than grammar_budget() of CPU to constrain puts its slot in costly_grammars."""
        chain, grammar = self.chains[slot_id], self.grammars.get(slot_id)
        if grammar is None:
            return self._free_sample(chain, slot_id, row)
        started = time.thread_time()
        token = self._constrained(chain, grammar, slot_id, row)
        self._count_grammar_cost(slot_id, time.thread_time() - started)
        return token

    def _count_grammar_cost(self, slot_id: int, seconds: float) -> None:
        """This step's grammar time per slot (charged to its user: grammar_shares.py), and
        the request's own bound: a spike, or a costly window of tokens, ends it."""
        self.grammar_seconds[slot_id] = self.grammar_seconds.get(slot_id, 0.0) + seconds
        window = self.grammar_costs.setdefault(slot_id, deque(maxlen=GRAMMAR_WINDOW))
        window.append(seconds)
        budget = self.grammar_budget()
        if (seconds > GRAMMAR_SPIKE * budget or len(window) == GRAMMAR_WINDOW
                and sum(window) > GRAMMAR_WINDOW * budget):
            self.costly_grammars.add(slot_id)

    def _constrained(self, chain, grammar, slot_id: int, row: int) -> int:
        token = self._free_sample(chain, slot_id, row, in_place=False)
        if not self._allows(grammar, token):
            token = self._apply_chain(chain, row, grammar=grammar)
            if not self._allows(grammar, token):  # the grammar allows nothing: end the answer
                log.warning("slot %d: the grammar allows no next token; ending the answer", slot_id)
                return C.llama_vocab_eos(self.vocab)
        C.llama_sampler_accept(chain, token)
        if not self.is_eog(token):
            C.llama_sampler_accept(grammar, token)
        return token

    def _free_sample(self, chain, slot_id: int, row: int, in_place: bool = True) -> int:
        """The row's token as the slot's chain would draw it, by the cheapest path that draws
        the same: the argmax, the whole vocabulary's softmax in numpy, or the chain itself
        (`in_place`: llama_sampler_sample, which also accepts the token into the chain;
        otherwise on a copy of the row, the caller accepting)."""
        if slot_id in self.argmax_slots:
            return self._argmax(row)
        softmax = self.softmax_slots.get(slot_id)
        if softmax is not None:
            temperature, rng = softmax
            return sample_softmax(self._row_logits(row), temperature, rng, self._softmax_scratch)
        if in_place:
            return C.llama_sampler_sample(chain, self.ctx, row)
        return self._apply_chain(chain, row, grammar=None)

    def _apply_chain(self, chain, row: int, grammar) -> int:
        fill_candidates(self._candidate_view, self._row_logits(row))
        arr = C.llama_token_data_array(self._candidates, self.n_vocab, -1, False)
        if grammar is not None:
            C.llama_sampler_apply(grammar, ctypes.byref(arr))
        C.llama_sampler_apply(chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise DecodeError(f"the sampler chose no token for slot row {row}")
        return arr.data[arr.selected].id

    def _argmax(self, row: int) -> int:
        return int(np.argmax(self._row_logits(row)))

    def _row_logits(self, row: int) -> np.ndarray:
        return np.ctypeslib.as_array(C.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))

    def sample_drafted(self, chunk: SeqChunk, first_row: int) -> list[int]:
        """Sample row after row while each token equals the draft it checks (the scheduler
        plans the failed drafts' rows out of the cache: StepPlan.trims)."""
        drafts = chunk.tokens[-chunk.drafts:]
        out: list[int] = []
        for k in range(chunk.drafts + 1):
            token = self.sample(chunk.slot_id, first_row + k)
            out.append(token)
            if k == chunk.drafts or token != drafts[k] or self.is_eog(token):
                break
        return out

