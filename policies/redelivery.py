"""Writes the shared state did not answer, kept and sent again, in order, once it answers.

One mechanism behind budget spend still to reconcile (:class:`policies.budget.Reconciler`)
and run-count give-backs (:class:`policies.runs.GiveBacks`). An entry must be safe to send
again (each names an id the shared state applies once): Redis may have run a write whose
answer was lost. The round that sends them is a task on the owner's
:class:`~policies.rate.Background`, started by :meth:`Redeliveries.kick` (when the health
sees Redis up again, and whenever the owner hears Redis answer); one that fails stops the
round until the next kick, and the entry stays first in line. At most ``limit`` entries are
kept: beyond that the oldest is dropped (the subclass logs it), so an outage with heavy
traffic cannot grow memory without bound.

A *key fault* (:attr:`~policies.state.StateUnavailable.key_fault`: a key the write touches
holds what Sluice does not write there) is never kept nor sent again: the scripts check
every value they write over before their first write, so the write did nothing, and sending
it again would do nothing until someone repairs the key, while it stood first in line ahead
of every other entry. Sent again on each kick, a settle that failed midway once charged its
first counter at every try (a hostile review: 28 for a true 7 after four tries). The entry
is dropped and logged (:meth:`Redeliveries._refused`); the fault itself is counted and
logged by the state layer.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from typing import TYPE_CHECKING, Generic, TypeVar

from policies.state import StateUnavailable

if TYPE_CHECKING:
    from policies.rate import Background
    from policies.state.connection import Health

E = TypeVar("E")

log = logging.getLogger("sluice.state")


class Redeliveries(Generic[E]):
    """Entries kept until the shared state takes them (see the module docstring).

    Subclasses say how one entry is sent (:meth:`_send`), what a round is called
    (:meth:`_round_name`), and what to log when entries are dropped or a round has sent
    some (:meth:`_dropped`, :meth:`_sent`).
    """

    __slots__ = ("__weakref__", "_background", "_limit", "_pending", "_task")

    def __init__(self, background: Background, limit: int) -> None:
        self._background = background
        self._limit = limit
        self._pending: deque[E] = deque()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def resend_when_up(self, health: Health) -> None:
        """Kick a round whenever ``health`` sees the shared state up again. Held weakly:
        the health outlives the owner (a reload replaces it; tests make many)."""
        me = weakref.ref(self)

        def kick_when_up(up: bool, _error: str | None) -> None:
            live = me()
            if up and live is not None:
                live.kick()

        health.on_change(kick_when_up)

    def adopt(self, old: Redeliveries[E]) -> None:
        """Take ``old``'s entries (a reload replaced its owner) by sharing its queue from
        now on, with every generation before it that shares it: what a call admitted under
        any of them keeps, and an entry a round has in flight whose send fails, comes back
        to the one queue the newest owner kicks. (Each owner once took its predecessor's
        entries into a queue of its own and re-pointed only that predecessor: a call
        admitted two reloads earlier kept its spend in a queue nobody read, lost.)"""
        old._pending.extend(self._pending)
        self._pending = old._pending
        self.kick()

    async def send(self, entry: E) -> None:
        """Send ``entry`` now; if the shared state does not answer, keep it for a round.

        Raises:
            StateUnavailable: not answered now (kept), or a key fault (dropped: see the
                module docstring).
        """
        try:
            await self._send(entry)
        except StateUnavailable as exc:
            if exc.key_fault:
                self._refused(entry, exc)
            else:
                self.keep(entry)
            raise

    def keep(self, entry: E) -> None:
        """Keep ``entry`` for the next round, dropping the oldest beyond the limit."""
        pending = self._pending
        if len(pending) >= self._limit:
            self._dropped(pending.popleft())
        pending.append(entry)

    def kick(self) -> None:
        """Start a round, unless nothing is kept or one already runs."""
        if self._pending and (self._task is None or self._task.done()):
            self._task = self._background.start(self._round(), self._round_name())

    async def _round(self) -> None:
        pending = self._pending  # shared by every generation (adopt): never replaced
        sent = 0
        while pending:
            # Taken off first: ``keep`` may drop the oldest while this send waits.
            entry = pending.popleft()
            try:
                await self._send(entry)
            except StateUnavailable as exc:
                if not exc.key_fault:
                    pending.appendleft(entry)
                    raise
                self._refused(entry, exc)
                continue
            except BaseException:
                pending.appendleft(entry)
                raise
            sent += 1
        self._sent(sent)

    async def _send(self, entry: E) -> None:
        raise NotImplementedError

    def _round_name(self) -> str:
        raise NotImplementedError

    def _dropped(self, entry: E) -> None:
        raise NotImplementedError

    def _sent(self, count: int) -> None:
        raise NotImplementedError

    def _refused(self, entry: E, exc: StateUnavailable) -> None:
        """``entry`` met a key fault (``exc``): dropped, not sent again."""
        log.warning("%s: one entry dropped, not sent again (%s): %r", self._round_name(),
                    exc.cause, entry)
