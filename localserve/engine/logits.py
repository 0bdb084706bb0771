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
