"""Counting prompts, for tests that compare greedy text across batch layouts: in one cache pool
the logits differ in their last bits with the neighbours' layout (README, One pool), so a
greedy token flips wherever its two best candidates are nearly tied. Counting is certain
almost everywhere, but not everywhere ("100, 101, ..." ties "113" with "114" within 0.004 of
log-probability; CI saw it flip). So a test's reference run asks for log-probabilities and
asserts its own premise with `assert_certain`, rather than assuming it."""

CERTAIN = 0.25  # log-probability between a greedy token and the runner-up: far above the noise


def counting(first: int, n: int) -> str:
    return ", ".join(str(i) for i in range(first, first + n)) + ","


def is_counting(prompt: str, text: str) -> bool:
    numbers = [int(n) for n in (prompt + text).replace(",", " ").split()[:-1]]
    return numbers == list(range(numbers[0], numbers[0] + len(numbers)))


def assert_certain(prompt: str, top_logprobs: list[dict[str, float]]) -> None:
    """Every greedy token of the reference run beat its runner-up by CERTAIN (ask with
    logprobs >= 2); else the prompt cannot tell a batching bug from float noise."""
    for i, top in enumerate(top_logprobs):
        best, second = sorted(top.values(), reverse=True)[:2]
        assert best - second >= CERTAIN, (
            f"{prompt!r}: token {i} wins by only {best - second:.3f}; pick another prompt")
