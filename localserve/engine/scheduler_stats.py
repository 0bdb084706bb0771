"""The scheduler's counters (read into every snapshot) and its plain-words preemption warning."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from localserve.engine.finish import FinishReason

log = logging.getLogger("localserve.scheduler")


@dataclass
class SchedulerStats:
    steps: int = 0
    tokens_batched: int = 0
    max_decode_rows_in_step: int = 0  # proof of sharing: >1 means streams decoded together
    requests_finished: int = 0
    requests_aborted: int = 0  # the client went away
    requests_failed: int = 0  # the server ended them: decode error, queue timeout, shutdown
    preemptions: int = 0  # the shared cache pool ran short
    share_preemptions: int = 0  # a user gave a slot back to a colleague who was waiting
    borrow_preemptions: int = 0  # a borrower gave cells back to a request within its guarantee
    task_preemptions: int = 0  # a background task gave its slot or borrowed cells to a chat
    interrupted_steps: int = 0  # steps of background tasks stopped for a chat that arrived
    prompt_tokens_computed: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of those, tokens found in a slot's cache
    draft_tokens: int = 0  # speculative drafts put into batches
    draft_tokens_accepted: int = 0  # of those, drafts the model agreed with (kept)

    def count_step(self, plan) -> None:
        self.steps += 1
        self.tokens_batched += plan.num_tokens
        self.max_decode_rows_in_step = max(self.max_decode_rows_in_step, plan.num_decode_rows)

    def count_end(self, reason: FinishReason) -> None:
        if reason is FinishReason.ABORT:
            self.requests_aborted += 1
        elif reason.completed:
            self.requests_finished += 1
        else:
            self.requests_failed += 1


def log_preemption(slot, why: str, pool_tokens: int, running: int,
                   waiting: int) -> None:  # pragma: no mutate block
    because = {"share": "to share slots with a waiting user",
               "task": "a background task, to give its slot to a waiting chat",
               "guarantee": "to give borrowed cells back to a request within its guarantee",
               }.get(why, f"cache pool of {pool_tokens} tokens short")
    log.info("preempted %s (slot %d, %d cached tokens saved to the prompt cache or dropped; "
             "%s): %d running, %d waiting", slot.request.request_id, slot.slot_id, slot.n_cached,
             because, running - 1, waiting)


class PreemptionWatch:
    """Says plainly, at most once a minute, when preemption is frequent."""

    def __init__(self, threshold: int = 3, window_s: float = 60.0):
        self.threshold, self.window_s = threshold, window_s
        self.recent: deque[float] = deque()
        self.last_warning = -window_s

    def record(self, now: float) -> None:
        self.recent.append(now)
        while self.recent and now - self.recent[0] > self.window_s:
            self.recent.popleft()
        if len(self.recent) >= self.threshold and now - self.last_warning >= self.window_s:
            self.last_warning = now
            log.warning("the cache is too small for this traffic: %d preemptions in the last "
                        "%.0f s, each one recomputes a prompt and stalls its stream. Fixes: a larger "
                        "-c, fewer --parallel slots, a lower --max-num-seqs, or shorter max_tokens.",
                        len(self.recent), self.window_s)
