"""MCP tasks (2025-11-25, experimental): a ``tools/call`` that runs on as a task.

A client may send ``tools/call`` with ``params.task`` (``{ttl}``); its server answers at once
with a ``CreateTaskResult`` (``result.task``: ``taskId``, ``status: working``, ``ttl`` in
milliseconds) and runs the tool in the background, and the client follows it with
``tasks/get``, ``tasks/result`` (which blocks until the task ends) and ``tasks/cancel``. Those
follow-ups are control traffic (``policies.mcp.CONTROL_METHODS``), so the call's holdings
stood for the server's work only until the quick ``CreateTaskResult``: under a tool's
``concurrency: {limit: 1}`` three staggered tasks ran at the server at once (a hostile trial).

So a call answered with a ``CreateTaskResult`` is held (``proxy.handler._hold_task``, as a
call closed early for polling is) until its task is seen over, keeping everything it took
and its place in flight; its end is settled in the one place (``proxy.handler._settle``).
This module keeps the tasks held (:class:`Tasks`, on :attr:`proxy.runtime.Runtime.tasks`),
each by route, ``Mcp-Session-Id``, tenant and ``taskId`` (:data:`TaskKey`): a task's id is
its session's, and another tenant's or session's follow-up naming the same id ends nothing.

A held task is over (:meth:`HeldTask.end`) when, through this replica:

- a ``tasks/get`` (or ``tasks/cancel``) answer gives it a terminal status
  (``policies.mcp.TASK_TERMINAL``);
- a ``tasks/result`` is answered (with anything but the cancellation error of that request
  itself): the server answers it only once the task has ended;
- a ``notifications/tasks/status`` with a terminal status passes on one of its session's
  streams (the GET stream, or an answer of the session's);
- its session's DELETE goes through (the server ends the session's tasks);
- or its bound passes: the earlier of its ``ttl`` (from the ``CreateTaskResult``) and the
  call's ``timeouts.total`` from its sending (600 s without one). Sluice then sends the
  server a ``tasks/cancel`` for it (``proxy.attempts.send_cancel``), as it sends a call it
  ends a ``notifications/cancelled``.

At most :data:`MAX_HELD_TASKS` are held at once; past that a task's call ends with its
``CreateTaskResult``, as before (a warning is logged; its ``completed`` event names no
task).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from policies.mcp import TASK_TERMINAL

log = logging.getLogger("sluice")

#: (route name, ``Mcp-Session-Id`` or ``""``, tenant, ``taskId``).
TaskKey = tuple[str, str, str, str]

#: On a ``tasks/get``, ``tasks/result`` or ``tasks/cancel`` naming a task held here (set by
#: ``proxy.handler``): ``(its TaskKey, the method)``, by which ``proxy.attempts`` reads the
#: answer for the task's end (:func:`seen_answer`).
TASK_POLL = web.RequestKey("sluice_task_poll", tuple)

#: How many tasks' calls are held at once, at most (each a call in flight and a small
#: entry here); past it, a new task's call is not held.
MAX_HELD_TASKS = 4096


class HeldTask:
    """A task whose ``tools/call`` is held until the task is over.

    Attributes:
        key: its :data:`TaskKey`.
        deadline: monotonic seconds at which the hold ends if nothing ended it before.
        bound: what set ``deadline``: ``"ttl"`` (the task's own) or ``"timeout"`` (the
            call's ``timeouts.total``).
        ended: how it was seen over (``tasks/get``, ``tasks/result``, ``tasks/cancel``,
            ``notification``, ``session_ended``), ``None`` while it runs.
        status: the terminal status seen, if any.
        waiter: resolved by :meth:`end`, while ``proxy.handler`` holds the call.
    """

    __slots__ = ("bound", "deadline", "ended", "key", "status", "waiter")

    def __init__(self, key: TaskKey, deadline: float, bound: str) -> None:
        self.key = key
        self.deadline = deadline
        self.bound = bound
        self.ended: str | None = None
        self.status: str | None = None
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
    """The tasks whose calls are held, by :data:`TaskKey`, and the holds' own tasks (what the
    drain waits for, and cancels when it cuts)."""

    def __init__(self) -> None:
        self.held: dict[TaskKey, HeldTask] = {}
        #: Each hold's task with its call (``proxy.handler._hold_task``).
        self.holding: dict[asyncio.Task[Any], Any] = {}
        #: How many tasks each (route, session) has held: its streams are read for
        #: ``notifications/tasks/status`` only then.
        self._sessions: dict[tuple[str, str], int] = {}

    def note(self, key: TaskKey, deadline: float, bound: str) -> HeldTask | None:
        """A ``CreateTaskResult`` came for a call: hold its task (``None`` past
        :data:`MAX_HELD_TASKS`, or when the same key is held already: a server that
        repeats a task id)."""
        if key in self.held or len(self.held) >= MAX_HELD_TASKS:
            log.warning("route %s: task %r is not held (%d held): its call ends with its "
                        "CreateTaskResult", key[0], key[3][:64], len(self.held))
            return None
        task = self.held[key] = HeldTask(key, deadline, bound)
        session = key[0], key[1]
        self._sessions[session] = self._sessions.get(session, 0) + 1
        return task

    def forget(self, task: HeldTask) -> None:
        """The hold of ``task`` is over (whatever ended it)."""
        if self.held.get(task.key) is task:
            del self.held[task.key]
            session = task.key[0], task.key[1]
            left = self._sessions.get(session, 1) - 1
            if left:
                self._sessions[session] = left
            else:
                self._sessions.pop(session, None)

    def watches(self, route: str, session: str | None) -> bool:
        """Whether ``session`` of ``route`` has tasks held (its streams are then read for
        their ends)."""
        return bool(self._sessions) and (route, session or "") in self._sessions

    def seen(self, key: TaskKey, how: str, status: str | None = None) -> None:
        """A follow-up through this replica saw the task ``key`` over."""
        task = self.held.get(key)
        if task is not None:
            task.end(how, status)

    def watcher(self, route: str, session: str | None, tenant: str) -> Any:
        """What a stream of ``session`` calls with a task's id and status when it carries a
        terminal ``notifications/tasks/status``
        (:attr:`policies.mcp.AnswerTracker.on_task_end`)."""
        def ended(task_id: str, status: str) -> None:
            self.seen((route, session or "", tenant, task_id), "notification", status)
        return ended

    def session_ended(self, route: str, session: str) -> None:
        """``session``'s DELETE went through: its server has ended its tasks."""
        if (route, session) not in self._sessions:
            return
        for key, task in list(self.held.items()):
            if key[0] == route and key[1] == session:
                task.end("session_ended")


def seen_answer(tasks: Tasks, key: TaskKey, method: str, found: Any) -> None:
    """A follow-up's answer passed through (``found``: its
    :class:`policies.mcp.Outcome`, ``None`` if it held no response): end the held task
    ``key`` if it says the task is over."""
    if found is None:
        return
    if method == "tasks/result":
        if not found.cancelled:  # that request's own cancel says nothing of the task
            tasks.seen(key, method, found.task_status)
        return
    if found.task_id == key[3] and found.task_status in TASK_TERMINAL:
        tasks.seen(key, method, found.task_status)
