"""Warnings that recur once per call, held to one line per text every few seconds.

While Redis is down or refusing, every call can lose a write it made in the background (a
refund, a settle, a breaker outcome, an idempotency record): one warning each would be one log
line per request for the length of the outage. A site that logs such a warning marks it with
``extra=PER_CALL``; :class:`RepeatFilter`, installed on the log handlers by the proxy, lets the
first line of each text through, then at most one every ``every_s`` seconds, which says how
many it held back; the proxy also logs what is still held every ``every_s`` and at shutdown
(:meth:`RepeatFilter.held`), so no count waits for the next outage. Unmarked records pass
untouched, so a state change (Redis marked down, up again) is logged every time it happens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

#: ``extra=`` for a warning that can recur once per call.
PER_CALL = {"sluice_per_call": True}
#: Seconds between two lines of the same text.
EVERY_S = 10.0
#: Texts remembered at most; the least recently seen is forgotten first (and let through
#: when it comes again).
MAX_TEXTS = 256


class RepeatFilter(logging.Filter):
    """A handler filter: a ``PER_CALL`` record whose text was let through less than
    ``every_s`` seconds ago is dropped and counted; the next one let through ends with
    ``(N more like it held back over Xs)``.

    Args:
        every_s: seconds between two lines of the same text.
        clock: monotonic seconds (a test's clock).
    """

    def __init__(self, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        #: text -> when it was last let through, and the records held back since
        self._texts: dict[str, _Seen] = {}
        self._lock = threading.Lock()  # handlers run on whichever thread logs

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "sluice_per_call", False):
            return True
        text = record.getMessage()
        now = self.clock()
        with self._lock:
            seen = self._texts.pop(text, None)  # re-inserted: least recently seen first
            if seen is not None and now - seen.at < self.every_s:
                seen.held += 1
                self._texts[text] = seen
                return False
            if len(self._texts) >= MAX_TEXTS:
                del self._texts[next(iter(self._texts))]
            self._texts[text] = _Seen(now)
        if seen is not None and seen.held:
            record.msg = _held_line(text, seen.held, now - seen.at)
            record.args = None
        return True

    def held(self, final: bool = False) -> list[str]:
        """A line for each text with records held back and no line for ``every_s`` seconds
        (for each text with any, when ``final``: at shutdown), so a count is reported when
        its burst ends rather than with the next one; those counts start again."""
        now = self.clock()
        lines = []
        with self._lock:
            for text, seen in self._texts.items():
                if seen.held and (final or now - seen.at >= self.every_s):
                    lines.append(_held_line(text, seen.held, now - seen.at))
                    seen.at, seen.held = now, 0
        return lines


class _Seen:
    """One text's last line (monotonic seconds) and the records held back since."""

    __slots__ = ("at", "held")

    def __init__(self, at: float) -> None:
        self.at = at
        self.held = 0


def _held_line(text: str, held: int, over_s: float) -> str:
    return f"{text} ({held} more like it held back over {over_s:.0f}s)"


__all__ = ["EVERY_S", "PER_CALL", "RepeatFilter"]
