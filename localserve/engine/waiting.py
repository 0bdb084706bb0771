"""The waiting queue: first come first served within each user, turns taken between users.

Requests carry an identity (`user`: an API key's name or the request's `user` field; None is
one shared "anonymous" identity). The queue serves users round-robin, so one user's batch of
fifty requests does not starve a colleague's single question. Preempted requests go to a
priority lane served before everyone: they were admitted once and hold a client mid-answer.
A frontend's background tasks (Request.background: a chat's title, its tags) go to a lane
served after everyone: no colleague's chat waits behind one, their own included.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterator, Mapping

from localserve.engine.request import Request


class FairQueue:
    def __init__(self):
        self._resumed: deque[Request] = deque()  # preempted, served first, oldest first
        self._by_user: OrderedDict[str | None, deque[Request]] = OrderedDict()  # rotation order
        self._background: deque[Request] = deque()  # served last, oldest first

    def __len__(self) -> int:
        return (len(self._resumed) + sum(len(q) for q in self._by_user.values())
                + len(self._background))

    def __bool__(self) -> bool:
        return bool(self._resumed) or bool(self._by_user) or bool(self._background)

    def append(self, request: Request) -> None:
        if request.background:
            self._background.append(request)
        else:
            self._by_user.setdefault(request.user, deque()).append(request)

    def push_front(self, request: Request) -> None:
        """A preempted request: back at the head, before every other waiting one."""
        self._resumed.appendleft(request)

    def follow(self, request: Request) -> None:
        """A sibling choice (n > 1) of a request just admitted: behind the preempted ones, ahead
        of every user's queue, as part of the request it belongs to; a background task's at the
        head of the tasks' lane, behind its earlier siblings (ahead of the chats, it would stop
        tasks, itself included, and every chat behind it: hardening round 7)."""
        if not request.background:
            self._resumed.append(request)
            return
        lane = self._background
        behind = next((i for i, r in enumerate(lane) if r.prefix_of is not request.prefix_of),
                      len(lane))
        lane.insert(behind, request)

    def peek(self) -> Request:
        if self._resumed:
            return self._resumed[0]
        if self._by_user:
            return next(iter(self._by_user.values()))[0]
        return self._background[0]

    def pop(self) -> Request:
        """The head; its user then goes to the back of the rotation."""
        return self.take(self.peek())

    def take(self, request: Request) -> Request:
        """Remove a request about to be admitted; its user goes to the back of the rotation."""
        if self._resumed and self._resumed[0] is request:
            return self._resumed.popleft()
        if not self.remove(request):
            raise KeyError(request.request_id)
        queue = None if request.background else self._by_user.pop(request.user, None)
        if queue:
            self._by_user[request.user] = queue
        return request

    def requeue(self, request: Request, behind: Request | None = None) -> None:
        """Preempted to make room for another request (`behind`): first of its own user's
        requests but after `behind` when that is one of them, and that user behind everyone
        else in the rotation (so the request it made room for goes first). A background task
        goes back to the head of its lane."""
        if request.background:
            self._background.appendleft(request)
            return
        queue = self._by_user.pop(request.user, deque())
        if behind is not None and behind in queue:
            queue.insert(queue.index(behind) + 1, request)
        else:
            queue.appendleft(request)
        self._by_user[request.user] = queue

    def has_foreground(self) -> bool:
        """Anything waiting that is not a background task."""
        return bool(self._resumed) or bool(self._by_user)

    def first_foreground(self) -> Request | None:
        """The first waiting request that is not a background task."""
        return next((r for r in self if not r.background), None) if self.has_foreground() else None

    def users(self) -> set[str | None]:
        """Identities with a request waiting (a waiting background task makes nobody give way:
        it waits for every chat anyway)."""
        return {r.user for r in self._resumed} | set(self._by_user)

    def remove(self, request: Request) -> bool:
        for lane in (self._resumed, self._background):
            if request in lane:
                lane.remove(request)
                return True
        queue = self._by_user.get(request.user)
        if queue is None or request not in queue:
            return False
        queue.remove(request)
        if not queue:
            del self._by_user[request.user]
        return True

    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they will be served (if nothing else arrives)."""
        return self.in_turn()

    def in_turn(self, held: Mapping[str | None, int] | None = None) -> Iterator[Request]:
        """The order of service; with `held` (the slots each user holds now), users holding
        fewer come first, in rotation order among equals: a colleague's one chat before the
        fourth of ten that someone sent at once (that one came first in the rotation)."""
        yield from self._resumed
        users = list(self._by_user)
        if held is not None:
            users.sort(key=lambda user: held.get(user, 0))
        queues = [list(self._by_user[user]) for user in users]
        for depth in range(max((len(q) for q in queues), default=0)):
            for queue in queues:
                if depth < len(queue):
                    yield queue[depth]
        yield from self._background

    def overdue(self, max_wait_s: float, now: float) -> list[Request]:
        """Requests that waited longer than `max_wait_s` for their first slot (a preempted one,
        with output, already had one)."""
        return [r for r in self._all() if r.num_output_tokens == 0
                and now - r.arrival_time > max_wait_s]

    def oldest_arrival(self) -> float | None:
        return min((r.arrival_time for r in self._all()), default=None)

    def _all(self) -> Iterator[Request]:
        yield from self._resumed
        for queue in self._by_user.values():
            yield from queue
        yield from self._background
