"""logits.sample_softmax: the whole vocabulary's softmax drawn in numpy, for slots whose chain
is temperature alone. It must draw what llama.cpp's temp + dist chain draws."""

import numpy as np
import pytest

from localserve.engine.logits import SAMPLE_BLOCK, sample_softmax


def frequencies(logits, temperature, draws=20000, seed=0):
    rng, scratch = np.random.default_rng(seed), np.empty(len(logits), dtype=np.float32)
    tokens = [sample_softmax(logits, temperature, rng, scratch) for _ in range(draws)]
    return np.bincount(tokens, minlength=len(logits)) / draws


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_softmax_at_the_temperature_across_blocks(temperature):
    """Mass in several blocks, the last one partial: each token drawn as often as its
    probability says, and never a token without mass."""
    n = 2 * SAMPLE_BLOCK + 300
    logits = np.full(n, -1e9, dtype=np.float32)
    chosen = [3, SAMPLE_BLOCK + 7, n - 1]
    logits[chosen] = np.log([0.2, 0.3, 0.5])
    expected = np.array([0.2, 0.3, 0.5]) ** (1 / temperature)
    expected /= expected.sum()
    seen = frequencies(logits, temperature)
    assert seen[chosen].sum() == 1.0
    assert np.allclose(seen[chosen], expected, atol=0.015)


def test_a_seed_draws_the_same_tokens_and_another_seed_others():
    logits = np.random.default_rng(1).normal(0, 2, 5000).astype(np.float32)
    draw = lambda seed: frequencies(logits, 1.0, draws=50, seed=seed)  # noqa: E731
    assert np.array_equal(draw(7), draw(7)) and not np.array_equal(draw(7), draw(8))


def test_a_peaked_row_at_a_tiny_temperature_is_its_argmax():
    logits = np.random.default_rng(2).normal(0, 1, 3000).astype(np.float32)
    assert frequencies(logits, 1e-6, draws=200)[int(np.argmax(logits))] == 1.0
