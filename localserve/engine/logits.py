"""Numbers from a row of logits, in numpy (no llama.cpp here): the candidate array the
grammar path samples from, and log-probabilities for clients that ask for them."""

from __future__ import annotations

import numpy as np

# The memory layout of llama.cpp's llama_token_data, so a ctypes array can be filled at once.
CANDIDATE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def fill_candidates(view: np.ndarray, logits: np.ndarray) -> None:
    """Every token with its raw logit, in id order (samplers sort and trim it in place)."""
    view["id"] = np.arange(len(view), dtype=np.int32)
    view["logit"] = logits
    view["p"] = 0.0


def log_probs(logits: np.ndarray, token: int, top_n: int) -> tuple:
    """log-softmax of raw logits (the model's own distribution, before temperature or
    penalties): (token, its log-probability, ((token, logprob), ...) top N best first)."""
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
    top = np.argpartition(logits, -top_n)[-top_n:] if top_n else np.empty(0, dtype=np.int64)
    top = top[np.argsort(-logits[top], kind="stable")]
    return (token, float(logits[token]) - log_total,
            tuple((int(t), float(logits[t]) - log_total) for t in top))


# sample_softmax's block: the whole vocabulary is summed in blocks of this many entries, and only
# the chosen block is summed entry by entry (a running sum over every entry is one sequential
# pass, 0.31 ms on 128k entries; the block sums are vectorised).
SAMPLE_BLOCK = 1024
_BLOCK_ONES = np.ones(SAMPLE_BLOCK, dtype=np.float32)


def sample_softmax(logits: np.ndarray, temperature: float, rng: np.random.Generator,
                   scratch: np.ndarray) -> int:
    """A token drawn from softmax(logits / temperature) over the whole vocabulary: what
    llama.cpp's temp + dist chain computes, vectorised instead of its loop over every entry
    (0.9 ms a row on a 128k vocabulary). `scratch`: a float32 array of the vocabulary's
    size, reused row after row."""
    n = len(logits)
    np.subtract(logits, logits.max(), out=scratch)
    if temperature != 1.0:  # OpenAI's default: a pass over the vocabulary saved
        scratch *= np.float32(1.0 / temperature)
    np.exp(scratch, out=scratch)
    full = n - n % SAMPLE_BLOCK
    sums = scratch[:full].reshape(-1, SAMPLE_BLOCK) @ _BLOCK_ONES  # BLAS: 7 us against 50
    running = np.cumsum(np.append(sums, scratch[full:].sum()), dtype=np.float64)
    target = rng.random() * running[-1]
    block = min(int(np.searchsorted(running, target, side="right")), len(running) - 1)
    within = target - (running[block - 1] if block else 0.0)
    start = block * SAMPLE_BLOCK
    entries = np.cumsum(scratch[start:start + SAMPLE_BLOCK], dtype=np.float64)
    return start + min(int(np.searchsorted(entries, within, side="right")), len(entries) - 1)
