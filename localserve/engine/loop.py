"""The engine loop (one plain thread) and the asyncio façade the HTTP side talks to.

Where a request's tokens are made: EngineLoop.run() -> step():
    drain the inbox (adds, aborts) -> plan = scheduler.schedule() -> runner.decode(plan)
    -> scheduler.update(plan, output) -> hand events to their requests -> publish a snapshot.
The HTTP side never waits for a step: it reads the last published snapshot (an immutable
EngineSnapshot swapped in by reference) and receives tokens through per-request asyncio queues.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterable

from localserve.engine.finish import FinishReason
from localserve.engine.grammar_shares import GrammarRefused
from localserve.engine.request import Request, TokenEvent
from localserve.engine.errors import (CacheFull, DecodeError, EngineFailed, Interrupted,
                                      RestoreFailed, RowsRefused)
from localserve.engine.inbox import Abort, Add, DropScope, Stop
from localserve.engine.interfaces import EngineObserver, Runner, StepScheduler
from localserve.engine.plan import NEVER, StepPlan
from localserve.engine.snapshot import EngineSnapshot, build_snapshot
from localserve.engine.streams import ChoiceStreams, RequestStream, hold_wake_ups, wake_held

log = logging.getLogger("localserve.engine")

# Woken from idle, the loop waits at most this long for requests already accepted over HTTP
# (still in tokenization) to join the first one's prefill step; polled this often.
ARRIVAL_WINDOW_S = 0.02
ARRIVAL_POLL_S = 0.0005
# A step that only added tokens to running requests publishes its snapshot at most this often
# (for /slots, /metrics and the dashboard, which poll at most a few times a second); a step that
# admits or ends a request always does. Building one reads every slot: 11 % of the engine
# thread at one stream on a fast model (bench/host.py), for a view nobody read.
SNAPSHOT_EVERY_S = 0.05
# How long the HTTP thread may hold the GIL while the engine thread waits for it (Python's
# default is 5 ms). The engine thread gives it up for every llama_decode and wake-up, and on a
# fast model a whole step takes about a millisecond: at 5 ms the streams' own chunk writing
# held each step back by up to five steps' time.
GIL_SWITCH_S = 0.0005


class EngineUnavailable(RuntimeError):
    """The engine thread is not running (stopped, or died): requests must fail fast."""


class QueueFull(RuntimeError):
    """--max-queue requests are already waiting: refuse at once rather than queue forever."""


class UserQueueFull(QueueFull):
    """This user already holds their share of the queue (--max-queue-per-key): the rest of the
    queue stays free for everyone else."""


class EngineLoop(threading.Thread):
    def __init__(self, scheduler: StepScheduler, runner: Runner, max_queue: int | None = None,
                 queue_timeout_s: float | None = None, observers: Iterable[EngineObserver] = (),
                 max_queue_per_user: int | None = None, arriving: Callable[[], int] = lambda: 0):
        super().__init__(name="localserve-engine", daemon=True)
        self.scheduler, self.runner = scheduler, runner
        self.max_queue = max_queue
        self.max_queue_per_user = max_queue_per_user
        self.queue_timeout_s = queue_timeout_s
        self.arriving = arriving  # requests on their way to submit (see _gather_arrivals)
        self.arrival_window_s = ARRIVAL_WINDOW_S
        self.observers = tuple(observers)  # EngineObserver: the metrics, the ledger
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.failure: str | None = None  # set if the loop itself died
        self.decoding = False  # inside runner.decode (llama_decode): no request is touched
        self.stop_rule = NEVER  # which arriving chat stops the step in flight (plan.StopRule)
        self.chats_on_their_way = 0  # accepted over HTTP, not yet submitted (chat_on_its_way)
        self._chat_submitted = threading.Event()  # set as each chat on its way leaves it
        self.stopping = False
        self.last_step_s = 0.0
        self.busy_seconds = 0.0  # wall time of all steps: schedule, decode, update, deliver
        self.llama_decode_s = 0.0  # of which inside llama_decode (the overhead share in /slots)
        self.sampling_s = 0.0  # and inside the samplers
        self.queued = 0  # submitted and not yet admitted (or ended): what --max-queue bounds
        self.in_flight = 0  # submitted and not yet finished: what a drain waits for
        self._queued_by_user: Counter = Counter()  # what --max-queue-per-key bounds
        self._queued_lock = threading.Lock()
        self.snapshot: EngineSnapshot = self._build_snapshot()

    # ---- called from any thread ---------------------------------------------------------
    def submit(self, request: Request) -> None:
        if not self.is_alive() or self.stopping:
            raise EngineUnavailable(self.failure or "the engine is not running")
        with self._queued_lock:
            if self.max_queue is not None and self.queued >= self.max_queue:
                raise QueueFull(f"{self.queued} requests are already waiting (--max-queue "
                                f"{self.max_queue})")
            mine = self._queued_by_user[request.user]
            if self.max_queue_per_user is not None and mine >= self.max_queue_per_user:
                raise UserQueueFull(f"you already have {mine} requests waiting, your share of the "
                                    f"queue (--max-queue-per-key {self.max_queue_per_user})")
            self._queued_by_user[request.user] += 1
            self.queued += 1
            self.in_flight += 1
        request.holds_queue_place = True
        self.inbox.put(Add(request))
        if self.stop_rule.stops(request):
            self.runner.interrupt()  # a chat never waits for a step of tasks or a long prompt

    @contextmanager
    def chat_on_its_way(self):
        """A colleague's chat, accepted over HTTP, is being tokenized (on the event loop's
        thread). A step of background tasks in flight stops, and none starts until it is
        submitted (_wait_for_chats): on a CPU its tokenizing would otherwise share the cores
        with that step's threads, and its first token wait for the step."""
        self.chats_on_their_way += 1
        if self.stop_rule.tasks_only:
            self.runner.interrupt()
        try:
            yield
        finally:
            self.chats_on_their_way -= 1
            self._chat_submitted.set()

    def abort(self, request_id: str) -> None:
        self.inbox.put(Abort(request_id))

    def stop(self) -> None:
        self.stopping = True
        self.inbox.put(Stop())

    def drop_scope(self, scope: str) -> None:
        """Forget what a removed key cached, applied between steps: the loop thread is the
        only one that touches the slots and the prompt cache."""
        self.inbox.put(DropScope(scope))

    # ---- the loop thread ----------------------------------------------------------------
    def run(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_S)
        hold_wake_ups()  # woken before each llama_decode and before waiting (streams.py)
        try:
            while self._drain_inbox(block=not self.scheduler.has_work()):
                if self.scheduler.has_work():
                    self.step()
                else:  # e.g. the last request was just aborted: show the idle slots
                    self.snapshot = self._build_snapshot()
        except BaseException as exc:  # the loop must never vanish silently
            self.failure = self.failure or f"engine loop died: {exc!r}"
            log.exception("engine loop died; failing all requests")
            self._fail_everything(self.failure)
        finally:
            wake_held()
            self.snapshot = self._build_snapshot()

    def fatal(self, message: str) -> None:
        """llama.cpp hit a fatal error (runner/aborts.py); the thread that hit it parks for
        good and the context is never used again. The loop is marked failed (/health says so,
        new requests get 503), and, when the error came from this loop's decode, every request
        fails with the message."""
        self.failure = f"llama.cpp stopped with a fatal error: {message}"
        # Inside llama_decode the loop thread touches no request: another thread (e.g. the
        # RPC backend's, while the loop waits for it forever) may end them all.
        if threading.current_thread() is self or self.decoding:
            self._fail_everything(self.failure)
            self.snapshot = self._build_snapshot()

    def step(self) -> None:
        step_started = time.perf_counter()
        try:
            self._step()
        finally:
            self.busy_seconds += time.perf_counter() - step_started

    def _step(self) -> None:
        if self.queue_timeout_s is not None:
            self._deliver(self.scheduler.expire_waiting(self.queue_timeout_s, time.monotonic()))
        plan = self.scheduler.schedule()
        for admission in plan.admitted:
            self._release_queue_place(admission.request)
        if plan.encodes:  # their requests wait for them; colleagues' steps go on meanwhile
            self.runner.encode_ahead(plan.encodes)
        if not plan:
            wake_held()
            time.sleep(0.001)
            return
        started = time.perf_counter()
        try:
            # A chat that came as the last step ended asked it to stop, too late: that must
            # not stop this one (the chat's own, maybe). Arrivals from here on are this step's.
            self.runner.forget_interrupt()
            self.decoding, self.stop_rule = True, plan.stop_rule
            if self.stop_rule.tasks_only and (self.chats_on_their_way or not self.inbox.empty()):
                self.runner.interrupt()  # planned just as a chat came: it stops at once
            wake_held()  # the HTTP side writes the last step's tokens while this one computes
            try:
                out = self.runner.decode(plan)
            finally:
                self.decoding, self.stop_rule = False, NEVER
            if self.failure is not None:  # llama.cpp failed fatally meanwhile (see fatal())
                raise EngineFailed(self.failure)
            self.llama_decode_s += out.decode_s
            self.sampling_s += out.sample_s
            events = self.scheduler.update(plan, out)
            self._attach_logprobs(plan, events, out.logprobs)
        except DecodeError as exc:
            if isinstance(exc, Interrupted):
                self.scheduler.interrupted(plan, exc.saved)
                events = []
                self._wait_for_chats()
            elif isinstance(exc, RowsRefused):
                log.warning("%s; ending those %d requests only", exc, len(exc.refused))
                events = self.scheduler.refused(plan, exc.refused, exc.saved)
            elif isinstance(exc, RestoreFailed):
                log.warning("%s; its requests are placed again without it", exc)
                self.scheduler.restore_failed(plan, exc.entry)
                events = []
            elif isinstance(exc, CacheFull) and self.scheduler.cache_full():
                events = []  # the evicted request is requeued; this batch is planned again
            else:
                log.error("%s; ending the %d requests in that batch", exc, len(plan.chunks))
                events = self.scheduler.fail(plan, str(exc))
        except Exception as exc:  # a bug in one request's handling must not stop the others
            log.exception("step failed; ending the requests in that batch")
            events = self.scheduler.fail(plan, f"internal error: {exc!r}")
        self.last_step_s = time.perf_counter() - started
        for observer in self.observers:
            observer.on_step(plan, self.last_step_s)
        self._deliver(events)
        now = time.monotonic()
        if (plan.admitted or any(event.finished for _, event in events)
                or now - self._snapshot_at >= SNAPSHOT_EVERY_S):
            self.snapshot = self._build_snapshot(plan)

    def _attach_logprobs(self, plan: StepPlan, events, computed: dict[int, tuple]) -> None:
        """The runner computed log-probabilities for the rows that asked; hand each to the
        event that carries its token."""
        if not computed:
            return
        slot_of = {id(c.request): c.slot_id for c in plan.chunks}
        for request, event in events:
            found = computed.get(slot_of.get(id(request)))
            if found is not None and event.token_ids and event.token_ids[0] == found[0]:
                event.logprobs = found

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every pending add/abort; wait for one if idle. False when asked to stop."""
        if block:
            wake_held()
        try:
            item = self.inbox.get() if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._apply(item):
                return False
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return self._gather_arrivals() if block else True

    def _wait_for_chats(self) -> None:
        """A step of tasks stopped for a chat: let the chat reach the inbox before the next
        plan (bounded, like _gather_arrivals). It sleeps on an event that each chat sets as it
        leaves chat_on_its_way, leaving the cores to the chat and waking as soon as it is
        submitted: polling woke 1-2 ms late on 2 cores (measured, the bench_tasks chat)."""
        deadline = time.monotonic() + self.arrival_window_s
        self._chat_submitted.clear()
        while self.chats_on_their_way > 0 and time.monotonic() < deadline:
            self._chat_submitted.wait(max(0.0, deadline - time.monotonic()))
            self._chat_submitted.clear()

    def _gather_arrivals(self) -> bool:
        """Woken from idle by a request: the ones the HTTP side accepted with it (a colleague's
        four tabs, an agent's parallel calls) are still being tokenized. Wait for them, while
        any is on its way and for at most arrival_window_s, so that one prefill step takes
        them all instead of the first alone (llama-server's loop takes every queued task
        before it plans a batch). What is waited for is a count of requests, never a guess."""
        deadline = time.monotonic() + self.arrival_window_s
        while self.arriving() > 0 and time.monotonic() < deadline:
            try:
                item = self.inbox.get(timeout=ARRIVAL_POLL_S)
            except queue.Empty:
                continue
            if not self._apply(item):
                return False
        return self._drain_inbox(block=False)  # the last one's lease ends after its submit

    def _apply(self, item) -> bool:
        """One inbox item applied; False for Stop."""
        if isinstance(item, Stop):
            self._fail_everything("the server is shutting down")
            return False
        if isinstance(item, Add):
            self._add(item.request)
        elif isinstance(item, DropScope):
            self.scheduler.drop_scope(item.scope)
        else:
            found = self.scheduler.abort(item.request_id)
            if found:
                self._deliver([found])
        return True

    def _add(self, request: Request) -> None:
        try:
            self.scheduler.add(request)
        except ValueError as exc:
            reason = FinishReason.GRAMMAR_COST if isinstance(exc, GrammarRefused) else FinishReason.ERROR
            self._deliver([(request, TokenEvent("", finish_reason=reason, error=str(exc)))])

    def _release_queue_place(self, request: Request) -> None:
        if request.holds_queue_place:
            request.holds_queue_place = False
            with self._queued_lock:
                self.queued -= 1
                self._queued_by_user[request.user] -= 1
                if self._queued_by_user[request.user] <= 0:
                    del self._queued_by_user[request.user]

    def _deliver(self, events) -> None:
        for request, event in events:
            if event.finished:  # every submitted request gets exactly one finished event
                self._release_queue_place(request)
                with self._queued_lock:
                    self.in_flight -= 1
            try:
                for observer in self.observers:
                    observer.on_event(request, event)
                request.emit(event)
            except Exception:  # a vanished client must not take the loop down
                log.debug("could not deliver an event to %s", request.request_id, exc_info=True)

    def _fail_everything(self, message: str) -> None:
        for request in self.scheduler.pending():
            found = self.scheduler.abort(request.request_id, FinishReason.ERROR, message)
            if found:
                self._deliver([found])
        while True:  # requests submitted but never drained
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Add):
                self._deliver([(item.request, TokenEvent("", finish_reason=FinishReason.ERROR,
                                                         error=message))])

    def _build_snapshot(self, plan: StepPlan | None = None) -> EngineSnapshot:
        self._snapshot_at = time.monotonic()
        return build_snapshot(self, plan)


class AsyncEngine:
    """What the HTTP handlers use: submit() a request, then iterate its RequestStream."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    @property
    def snapshot(self) -> EngineSnapshot:
        return self.loop.snapshot

    @property
    def healthy(self) -> bool:
        return self.loop.is_alive() and self.loop.failure is None and not self.loop.stopping

    def submit(self, request: Request) -> RequestStream:
        """Queue a request; raises EngineUnavailable at once if the engine cannot take it."""
        stream = RequestStream(self.loop, request)
        self.loop.submit(request)
        return stream

    def submit_choices(self, requests: list[Request]) -> ChoiceStreams:
        """Queue a request's choices together: if one cannot be queued, none stays queued."""
        streams = ChoiceStreams(self.loop, requests)
        submitted = []
        try:
            for request in requests:
                self.loop.submit(request)
                submitted.append(request)
        except BaseException:
            for request in submitted:
                self.loop.abort(request.request_id)
            raise
        return streams
