"""MCP tasks (2025-11-25, experimental): a ``tools/call`` that runs on as a task.

A client may send ``tools/call`` with ``params.task`` (``{ttl}``); its server answers at once
with a ``CreateTaskResult`` (``result.task``: ``taskId``, ``status: working``, ``ttl`` in
milliseconds) and runs the tool in the background, and the client follows it with
``tasks/get``, ``tasks/result`` (which blocks until the task ends) and ``tasks/cancel``. Those
follow-ups are control traffic (``policies.mcp.CONTROL_METHODS``), so the call's holdings
stood for the server's work only until the quick ``CreateTaskResult``: under a tool's
``concurrency: {limit: 1}`` three staggered tasks ran at the server at once (a hostile trial).

So a call that holds a concurrency slot (the tool's, the route's, a run's width) and is
answered with a ``CreateTaskResult`` is held (``proxy.handler._hold_task``, as a call closed
early for polling is) until its task is seen over, keeping everything it took and its place
in flight; its end is settled in the one place (``proxy.handler._settle``). This module keeps
the tasks held (:class:`Tasks`, on :attr:`proxy.runtime.Runtime.tasks`), each by route,
``Mcp-Session-Id``, tenant and ``taskId`` (:data:`TaskKey`): a task's id is its session's,
and another tenant's or session's follow-up naming the same id ends nothing.

A held task is over (:meth:`HeldTask.end`) when, through this replica:

- a ``tasks/get`` (or ``tasks/cancel``) answer gives it a terminal status
  (``policies.mcp.TASK_TERMINAL``);
- a ``tasks/result`` is answered with a result (the server answers it only once the task has
  ended). An error ends nothing: the spec has the same codes for the request's own faults
  (``-32602``, a task unknown or a bad param, with the task maybe running on) and for a
  task whose underlying request failed, so they cannot be told apart; such a task's
  ``failed`` status is seen by ``tasks/get``, which the SDKs poll before ``tasks/result``;
- a ``notifications/tasks/status`` with a terminal status passes on one of its session's
  streams (the GET stream, or an answer of the session's); one that passed just before the
  ``CreateTaskResult`` was read counts too (:data:`EARLY_END_WINDOW_S`);
- or its bound passes: the call's ``timeouts.total`` (the tool's or route's) from its
  sending, 600 s without one. The task's ``ttl`` is how long its server keeps its result,
  chosen by the client, not how long it runs: it bounds nothing here (a ``ttl`` of 1 ms
  freed the slot while the tool ran on, a hostile review). At the bound Sluice sends the
  server a ``tasks/cancel`` for it (``proxy.attempts.send_cancel``), as it sends a call it
  ends a ``notifications/cancelled``.

A session's DELETE does not end its tasks' holds: the TypeScript SDK 1.x server keeps
running a deleted session's tasks (its task store outlives the session), and ending the hold
there let a client escape a tool's limit by deleting and opening sessions (a hostile review).
Sluice sends each held task of the session its ``tasks/cancel`` before the DELETE goes on
(:meth:`Tasks.session_calls`), and holds the calls to their bounds.

At most :data:`MAX_HELD_TASKS` task calls are held or in flight at once, and at most
:data:`MAX_HELD_TASKS_PER_TENANT` of one tenant's (:meth:`Tasks.reserve`, taken before the
call is admitted): past either, the task-augmented call of a tool with a slot is refused
(429 ``tenant_concurrency`` past the tenant's share, 503 ``queue_full`` past the whole),
not forwarded and left unheld as it was (one tenant filling the table let every other
tenant's task calls escape their limits).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from aiohttp import web

from policies.mcp import TASK_TERMINAL
from policies.reasons import Reason, Rejected

log = logging.getLogger("sluice")

#: (route name, ``Mcp-Session-Id`` or ``""``, tenant, ``taskId``).
TaskKey = tuple[str, str, str, str]

#: On a ``tasks/get``, ``tasks/result`` or ``tasks/cancel`` naming a task held here (set by
#: ``proxy.handler``): ``(its TaskKey, the method)``, by which ``proxy.attempts`` reads the
#: answer for the task's end (:func:`seen_answer`).
TASK_POLL = web.RequestKey("sluice_task_poll", tuple)

#: How many task calls are held or in flight at once, at most (each a call in flight and a
#: small entry here); past it, a new one is refused.
MAX_HELD_TASKS = 4096
#: How many of :data:`MAX_HELD_TASKS` one tenant may take (as the MRTR continuation notes
#: share theirs: ``policies.idempotency.Continuations``); past it, its new one is refused.
MAX_HELD_TASKS_PER_TENANT = 512
#: Seconds a terminal ``notifications/tasks/status`` of a task not held is remembered, when
#: its session has a task call in flight: a fast task's status can pass on the session's
#: GET stream before its ``CreateTaskResult`` is read (then held to its bound, a review).
EARLY_END_WINDOW_S = 30.0
#: How many such statuses are remembered at most (the oldest go first).
MAX_EARLY_ENDS = 1024
#: Seconds between two warnings of a task not held (the rest are counted in the next).
WARN_EVERY_S = 60.0
#: Seconds Sluice waits for a session's tasks' ``tasks/cancel`` before its DELETE goes on.
CANCEL_BEFORE_DELETE_S = 2.0


class HeldTask:
    """A task whose ``tools/call`` is held until the task is over.

    Attributes:
        key: its :data:`TaskKey`.
        deadline: monotonic seconds at which the hold ends if nothing ended it before (the
            call's ``timeouts.total`` from its sending).
        ended: how it was seen over (``tasks/get``, ``tasks/result``, ``tasks/cancel``,
            ``notification``), ``None`` while it runs.
        status: the terminal status seen, if any.
        call: the call held (``proxy.handler._hold_task``), ``None`` until it is.
        cancel_sent: Sluice has sent its server the task's ``tasks/cancel`` (its session's
            DELETE): not sent again at its bound.
        waiter: resolved by :meth:`end`, while ``proxy.handler`` holds the call.
    """

    __slots__ = ("call", "cancel_sent", "deadline", "ended", "key", "status", "waiter")

    def __init__(self, key: TaskKey, deadline: float) -> None:
        self.key = key
        self.deadline = deadline
        self.ended: str | None = None
        self.status: str | None = None
        self.cancel_sent = False
        self.call: Any = None
        self.waiter: asyncio.Future[None] | None = None

    @property
    def task_id(self) -> str:
        return self.key[3]

    def end(self, how: str, status: str | None = None) -> None:
        """The task is over (seen ``how``, with ``status``); once."""
        if self.ended is not None:
            return
        self.ended, self.status = how, status
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Tasks:
    """The tasks whose calls are held, by :data:`TaskKey`, the task calls in flight that may
    become held (their places taken by :meth:`reserve`), and the holds' own tasks (what the
    drain waits for, and cancels when it cuts)."""

    def __init__(self) -> None:
        self.held: dict[TaskKey, HeldTask] = {}
        #: Each hold's task with its call (``proxy.handler._hold_task``).
        self.holding: dict[asyncio.Task[Any], Any] = {}
        #: Each tenant's places taken: its task calls in flight and its tasks held.
        self._tenants: dict[str, int] = {}
        #: How many task calls each (route, session) has in flight, not answered yet.
        self._asked: dict[tuple[str, str], int] = {}
        #: How many tasks each (route, session) has held.
        self._sessions: dict[tuple[str, str], int] = {}
        #: Terminal statuses seen for tasks not held (yet): key -> (status, expiry).
        self._early: OrderedDict[TaskKey, tuple[str, float]] = OrderedDict()
        self._warned_at = -WARN_EVERY_S
        self._unwarned = 0

    def counts(self) -> dict[str, int]:
        """The entries of each table (``sluice_task_table_entries{table}``): ``held``,
        ``tenants``, ``sessions``, ``asked``, ``early_ends`` (unexpired). All but
        ``early_ends`` are 0 once no task call is in flight or held."""
        now = time.monotonic()
        return {"held": len(self.held), "tenants": len(self._tenants),
                "sessions": len(self._sessions), "asked": len(self._asked),
                "early_ends": sum(1 for _, until in self._early.values() if until > now)}

    def reserve(self, route: str, session: str, tenant: str) -> None:
        """Take a place for a task call about to be admitted (given back by
        :meth:`unreserve`, or kept by its held task, :meth:`note`).

        Raises:
            Rejected: ``tenant_concurrency`` (429) when ``tenant`` has
                :data:`MAX_HELD_TASKS_PER_TENANT` places, ``queue_full`` (503) when all
                :data:`MAX_HELD_TASKS` are taken.
        """
        own = self._tenants.get(tenant, 0)
        if own >= MAX_HELD_TASKS_PER_TENANT:
            raise Rejected(Reason.TENANT_CONCURRENCY, None,
                           f"limit {MAX_HELD_TASKS_PER_TENANT} tasks running per tenant")
        if sum(self._tenants.values()) >= MAX_HELD_TASKS:
            raise Rejected(Reason.QUEUE_FULL, None,
                           f"Sluice follows {MAX_HELD_TASKS} tasks at most")
        self._tenants[tenant] = own + 1
        _count_up(self._asked, (route, session))

    def unreserve(self, route: str, session: str, tenant: str) -> None:
        """A task call with a place (:meth:`reserve`) ended without a task held."""
        _count_down(self._asked, (route, session))
        _count_down(self._tenants, tenant)

    def answered(self, key: TaskKey, deadline: float) -> HeldTask | None:
        """A task call with a place (:meth:`reserve`) was answered with a
        ``CreateTaskResult`` (``key``; ``deadline``: the call's bound, monotonic seconds):
        its task is held and keeps the place; ``None`` for a key held already (a server that
        repeats a task id: the place is given back)."""
        route, session, tenant, _ = key
        _count_down(self._asked, (route, session))
        if key in self.held:
            _count_down(self._tenants, tenant)
            self._warn(key)
            return None
        task = self.held[key] = HeldTask(key, deadline)
        _count_up(self._sessions, (route, session))
        early = self._early.pop(key, None)
        if early is not None and early[1] > time.monotonic():
            task.end("notification", early[0])
        return task

    def _warn(self, key: TaskKey) -> None:
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_S:
            self._unwarned += 1
            return
        log.warning("route %s: task %r is held already: its second call ends with its "
                    "CreateTaskResult (%d more since the last warning)", key[0],
                    key[3][:64], self._unwarned)
        self._warned_at, self._unwarned = now, 0

    def forget(self, task: HeldTask) -> None:
        """The hold of ``task`` is over (whatever ended it): its place is given back."""
        if self.held.get(task.key) is task:
            del self.held[task.key]
            _count_down(self._tenants, task.key[2])
            _count_down(self._sessions, (task.key[0], task.key[1]))

    def watches(self, route: str, session: str | None) -> bool:
        """Whether ``session`` of ``route`` has tasks held or task calls in flight (its
        streams are then read for their ends)."""
        pair = route, session or ""
        return pair in self._sessions or pair in self._asked

    def seen(self, key: TaskKey, how: str, status: str | None = None) -> None:
        """A follow-up through this replica saw the task ``key`` over."""
        task = self.held.get(key)
        if task is not None:
            task.end(how, status)

    def watcher(self, route: str, session: str | None, tenant: str) -> Any:
        """What a stream of ``session`` calls with a task's id and status when it carries a
        terminal ``notifications/tasks/status``: ends its hold, or, while a task call of
        the session is in flight, is remembered for it (:data:`EARLY_END_WINDOW_S`)."""
        def ended(task_id: str, status: str) -> None:
            key = route, session or "", tenant, task_id
            task = self.held.get(key)
            if task is not None:
                task.end("notification", status)
            elif (route, session or "") in self._asked:
                self._remember(key, status)
        return ended

    def _remember(self, key: TaskKey, status: str) -> None:
        early = self._early
        now = time.monotonic()
        early.pop(key, None)
        while early and (len(early) >= MAX_EARLY_ENDS or next(iter(early.values()))[1] <= now):
            early.popitem(last=False)
        early[key] = status, now + EARLY_END_WINDOW_S

    def session_calls(self, route: str, session: str) -> list[tuple[Any, HeldTask]]:
        """The held calls of ``session`` on ``route`` (any tenant's: its DELETE ends the
        server's session whoever sends it) and their tasks still running."""
        if (route, session) not in self._sessions:
            return []
        return [(task.call, task) for key, task in self.held.items()
                if key[0] == route and key[1] == session and task.call is not None
                and task.ended is None]


def _count_up(counts: dict[Any, int], key: Any) -> None:
    counts[key] = counts.get(key, 0) + 1


def _count_down(counts: dict[Any, int], key: Any) -> None:
    """One fewer of ``key``; its entry goes at 0, so that an empty table is an empty dict
    (:meth:`Tasks.counts`, :meth:`Tasks.watches` tell by presence)."""
    left = counts.get(key, 1) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def seen_answer(tasks: Tasks, key: TaskKey, method: str, found: Any) -> None:
    """A follow-up's answer passed through (``found``: its
    :class:`policies.mcp.Outcome`, ``None`` if it held no response): end the held task
    ``key`` if it says the task is over: a ``tasks/result``'s result (not an error, module
    docstring), a Task with a terminal status."""
    if found is None:
        return
    if method == "tasks/result":
        if found.error_code is None and not found.cancelled and not found.input_required:
            tasks.seen(key, method, found.task_status)
        return
    if found.task_id == key[3] and found.task_status in TASK_TERMINAL:
        tasks.seen(key, method, found.task_status)
