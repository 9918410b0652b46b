"""The admission timeline: one JSON object per line (SPEC, "Events").

Every line has ``ts`` (Unix seconds), ``event``, ``request_id``, ``route``, ``tenant``, ``run``
and ``idempotency_key``, then the event's own fields. Events are buffered in memory as dicts
and written, as JSON lines, every ``FLUSH_INTERVAL_S`` by a background task, as soon as
``FLUSH_BATCH`` are waiting (by a callback on the loop) and at shutdown; the request path pays
for no encoding call of its own: one flush encodes every buffered event in C (``map`` over
``orjson.dumps``). A flush hands the lines to a :class:`~proxy.output.BackgroundWriter`, so
nothing on the loop waits on a disk or a pipe: while the destination is stuck (a reader that
stopped reading stdout), lines beyond its bound are dropped and counted
(``sluice_output_dropped_total{output="events"}``), and an ``events_dropped`` line with their
number comes first once it moves again. Emitting never raises, and neither does writing: a
value JSON cannot carry as it is is escaped (see :func:`_encodable`). An event's dict must not
change once emitted (every caller builds a new one).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from proxy.output import CLOSE_TIMEOUT_S, BackgroundWriter, FileSink, stream_sink

log = logging.getLogger("sluice")

FLUSH_INTERVAL_S = 0.2
#: Events that make a flush due before its time. Small batches keep what a flush frees below
#: glibc's heap trim threshold (128 KiB and up): at 200 ms, a busy proxy's batch (~1,000
#: events, ~1 MiB of dicts and lines) was handed back to the kernel and faulted in again every
#: flush, ~3 page faults and ~6 us of CPU a request (docs/benchmarks.md, 2026-12-03).
FLUSH_BATCH = 128
_line = functools.partial(orjson.dumps, option=orjson.OPT_APPEND_NEWLINE)


def _encodable(value: Any) -> Any:
    """``value`` as orjson can write it: a string that is not valid UTF-8 (a caller's header
    bytes, decoded by aiohttp with surrogate escapes) keeps its bytes as escapes; anything
    else orjson refuses becomes its ``repr``. An event must never fail a request."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    try:
        orjson.dumps(value)
    except TypeError:
        return repr(value)
    return value


def _encode(records: list[dict[str, Any]]) -> bytes:
    """``records`` as JSON lines."""
    try:
        return b"".join(map(_line, records))
    except TypeError:  # orjson.JSONEncodeError: e.g. a header decoded to lone surrogates
        return b"".join(_line({k: _encodable(v) for k, v in record.items()})
                        for record in records)


def _dropped_line(count: int) -> bytes:
    return _line({"ts": round(time.time(), 6), "event": "events_dropped", "events": count})


class EventLog:
    """Buffered JSON-lines writer to a file path, or to stdout when ``path`` is ``None``."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._buffer: list[dict[str, Any]] = []
        self._writer: BackgroundWriter | None = None
        self._file: FileSink | None = None  # a file destination, closed in close()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set while started

    def emit(self, event: str, request_id: str, route: str, tenant: str, run: str | None,
             idempotency_key: str | None = None, **fields: Any) -> None:
        """Queue one event; never blocks, never raises."""
        self.emit_record(event, request_id, route, tenant, run, idempotency_key, fields)

    def emit_record(self, event: str, request_id: str, route: str, tenant: str,
                    run: str | None, idempotency_key: str | None,
                    fields: dict[str, Any]) -> None:
        """:meth:`emit` with the event's own fields in a dict (copied, not kept): for a
        caller that has them in one already, so none is built for keywords."""
        self._buffer.append({"ts": time.time(), "event": event, "request_id": request_id,
                             "route": route, "tenant": tenant, "run": run,
                             "idempotency_key": idempotency_key, **fields})
        if len(self._buffer) == FLUSH_BATCH and self._loop is not None:
            self._loop.call_soon(self.flush)

    def emit_system(self, event: str, **fields: Any) -> None:
        """Queue an event that belongs to no request (e.g. ``config_reloaded``)."""
        self._buffer.append({"ts": round(time.time(), 6), "event": event, **fields})

    def lines(self) -> bytes:
        """The events buffered and not yet handed to the writer, as JSON lines."""
        return _encode(self._buffer)

    @property
    def dropped(self) -> int:
        """Events dropped so far because the destination was stuck."""
        return self._writer.dropped if self._writer is not None else 0

    async def start(self) -> None:
        """Open the destination and start the flusher. A file is reopened when log rotation
        moves or deletes it (:class:`~proxy.output.FileSink`).

        Raises:
            OSError: the file ``path`` cannot be opened for appending.
        """
        sink: Callable[[bytes], object]
        if self.path is None:
            sink = stream_sink(getattr(sys.stdout, "buffer", sys.stdout))
        else:
            # Opened at startup, before any traffic; closed in close().
            sink = self._file = FileSink(self.path)
        self._writer = BackgroundWriter(sink, "sluice-events-writer", lost=_dropped_line,
                                        failed=self._write_failed)
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._flush_forever(), name="sluice-events")

    def _write_failed(self, error: Exception) -> None:
        """The destination refused a batch (a full disk...): said in the log, once until a
        write succeeds again; its events are counted dropped."""
        log.warning("events could not be written to %s (%s): they are dropped and counted "
                    "in sluice_output_dropped_total{output=\"events\"} until a write succeeds",
                    self.path or "stdout", error)

    def flush(self) -> None:
        """Hand what is buffered to the writer (encoding a few KiB: cheap on the loop)."""
        if not self._buffer or self._writer is None:
            return
        records = self._buffer
        self._buffer = []
        self._writer.write(_encode(records), len(records))

    async def close(self) -> None:
        """Stop the flusher, write what is left (waiting at most ``CLOSE_TIMEOUT_S`` for a
        stuck destination), and close a file destination."""
        self._loop = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.flush()
        writer, self._writer = self._writer, None
        if writer is None:
            return
        written = await asyncio.to_thread(writer.close, CLOSE_TIMEOUT_S)
        if self._file is not None and written:  # else the stuck thread still writes to it
            self._file.close()
        self._file = None

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self.flush()
