"""Writes to stdout, stderr or a file that never hold up the event loop.

A reader that stops reading (``sluice serve | less`` left paused, a terminal stopped with
Ctrl-S, a container log driver that blocks) fills the pipe, and a plain ``write`` then blocks
the thread that makes it. Made on the event loop, that stopped every request, the probes and
the drain with it (seen: ~64 KiB of events in, request 199 and ``/healthz`` hung, and SIGTERM
left the process stuck in the write).

A :class:`BackgroundWriter` owns one destination and writes to it from a thread of its own;
the loop only hands it bytes. While the destination is stuck, what waits is bounded
(``max_pending_bytes``): what does not fit is dropped and counted, since a lost log or event
line costs less than a stopped proxy, and so are lines a write error loses (a full disk, a
reader gone); the first write that fits again is preceded by a line saying how many were
lost. Writes go to the descriptor with ``os.write`` (:class:`FdSink`), not through a buffered
file object, so a thread stuck in one holds no lock that the interpreter's own flush at exit
would wait on.

Events (stdout) and log lines (stderr) have a writer each, and both may end in one pipe
(``2>&1 |``, a container runtime's log pipe). A write to a pipe is atomic only up to
``PIPE_BUF`` bytes (POSIX): one waiting for room lets another in mid-way, and a log line was
seen spliced into an event's JSON. So the :class:`FdSink` s of one destination (the same
device and inode) share a lock, held for a whole batch: their lines never interleave.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import logging
import os
import select
import stat
import threading
from collections.abc import Callable, Iterator
from typing import IO

log = logging.getLogger("sluice")

#: Bytes waiting for a stuck destination before new writes are dropped (~8,000 events).
MAX_PENDING_BYTES = 4 * 1024 * 1024
#: Seconds a shutdown waits for the last lines to reach a destination that is stuck.
CLOSE_TIMEOUT_S = 1.0


class BackgroundWriter:
    """Writes byte strings to ``sink`` in order, from a daemon thread.

    Args:
        sink: writes all of one byte string, blocking as long as it must (:func:`fd_sink`).
        name: the thread's name.
        lost: builds the line written before the next accepted write after some were
            dropped, from how many items were dropped (``None``: no such line).
        max_pending_bytes: bytes accepted and not yet written beyond which a write is
            dropped.
        failed: told (in the writer's thread) the error of the first write that failed
            after one that did not (``None``: nobody; the log's own writer has nowhere
            else to say it).
    """

    def __init__(self, sink: Callable[[bytes], object], name: str,
                 lost: Callable[[int], bytes] | None = None,
                 max_pending_bytes: int = MAX_PENDING_BYTES,
                 failed: Callable[[Exception], object] | None = None) -> None:
        self._sink = sink
        self._failed = failed
        self._failing = False
        #: Items (events, log records) dropped so far because the destination was stuck.
        self.dropped = 0
        self._lost = lost
        self._max = max_pending_bytes
        self._unreported = 0
        #: byte strings waiting, each with the number of items (lines) it holds and, for a
        #: ``lost`` line, the number of dropped items it announces
        self._pending: collections.deque[tuple[bytes, int, int]] = collections.deque()
        self._pending_bytes = 0  # queued, or taken by the thread and not yet written
        self._closing = False
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def write(self, data: bytes, items: int = 1) -> bool:
        """Queue ``data`` (``items`` lines of it, each ending in a newline) to be written;
        never blocks on the destination. Returns ``False`` when it was dropped: the
        destination is too far behind, or the writer is closed."""
        with self._done:
            if self._closing or self._pending_bytes + len(data) > self._max:
                self.dropped += items
                self._unreported += items
                return False
            if self._unreported and self._lost is not None:
                note = self._lost(self._unreported)
                self._pending.append((note, 0, self._unreported))
                self._pending_bytes += len(note)
                self._unreported = 0
            self._pending.append((data, items, 0))
            self._pending_bytes += len(data)
            self._done.notify_all()
        return True

    def close(self, timeout_s: float) -> bool:
        """Accept no more writes, and wait up to ``timeout_s`` seconds for what is queued to
        be written. Returns whether all of it was (if not, the thread is left to finish, or
        to stay stuck, on its own: it is a daemon and holds no lock the exit waits on)."""
        with self._done:
            self._closing = True
            self._done.notify_all()
            self._done.wait_for(lambda: not self._pending_bytes, timeout_s)
            return not self._pending_bytes

    def _run(self) -> None:
        while True:
            with self._done:
                self._done.wait_for(lambda: self._pending or self._closing)
                if not self._pending:
                    return  # closing, and everything was written
                data = b"".join([chunk for chunk, _, _ in self._pending])
                items = sum([count for _, count, _ in self._pending])
                announced = sum([count for _, _, count in self._pending])
                self._pending.clear()
            try:
                self._sink(data)
                lost = unsaid = 0
                self._failing = False
            except Exception as exc:  # a broken destination must not stop the writer
                lost = items  # some may be out: counted as lost all the same
                unsaid = announced  # the announcement of earlier drops was lost with them
                if not self._failing and self._failed is not None:
                    # Once per run of failures: the destination itself cannot say it (an
                    # ops trial's events.path on /dev/full lost 40 events, said nowhere).
                    with contextlib.suppress(Exception):
                        self._failed(exc)
                self._failing = True
            with self._done:
                self._pending_bytes -= len(data)
                self.dropped += lost
                self._unreported += lost + unsaid
                self._done.notify_all()


class FdSink:
    """A sink writing to the file descriptor ``fd`` (not closed here) with ``os.write``,
    waiting for room if it was left non-blocking (e.g. by another process on the pipe).

    A batch is written whole under the lock of its destination, shared by every sink on the
    same file (see the module docstring). A write that failed mid-line (a full disk) leaves
    the destination's last line cut: the next write then starts on a new line, not onto that
    half.

    Raises:
        OSError: the write failed (the caller drops the lines).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        status = os.fstat(fd)
        with _DESTINATIONS_GUARD:
            self._to = _DESTINATIONS.setdefault((status.st_dev, status.st_ino), _Destination())

    def __call__(self, data: bytes) -> None:
        with self._to.lock:
            if self._to.cut:
                self._write(memoryview(b"\n"))
                self._to.cut = False
            self._write(memoryview(data))

    def _write(self, view: memoryview) -> None:
        written = 0
        try:
            while written < len(view):
                try:
                    written += os.write(self.fd, view[written:])
                except BlockingIOError:
                    select.select([], [self.fd], [])
        except OSError:
            self._to.cut = self._to.cut or (0 < written < len(view)
                                            and view[written - 1:written] != b"\n")
            raise


class _Destination:
    """What the sinks writing to one file share: the lock a batch is written under, and
    whether its last line was cut by a failed write."""

    __slots__ = ("cut", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cut = False


#: The destinations written to, by (device, inode).
_DESTINATIONS: dict[tuple[int, int], _Destination] = {}
_DESTINATIONS_GUARD = threading.Lock()


class FileSink:
    """A sink appending to the file at ``path``, reopened (created if need be) before a write
    when the file there is no longer the one open: moved away or deleted by log rotation
    (logrotate's ``create``), as ``logging.handlers.WatchedFileHandler`` and nginx do. Without
    it, lines went on into the renamed file, or into a deleted one that kept its disk space.

    The check is one ``os.stat`` a batch, on the writer's thread. A path that is not a regular
    file (a FIFO, ``/dev/stdout``) is never reopened. Opened for appending (``O_APPEND``), so
    after a ``copytruncate`` the next line lands at the new end of the file, not past a hole.
    A failed reopen keeps the open file and is logged once until one succeeds.

    A FIFO that no process reads yet (a log shipper that starts after Sluice) is opened by the
    first write, on the writer's thread, which waits there for its reader as it would for a
    reader that stopped reading: opened at construction, on the event loop, the wait held up
    the start (no ``/readyz``, SIGTERM unanswered) until a reader came.

    Raises:
        OSError: ``path`` cannot be opened for appending (at construction only).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1  # none open yet
        self._regular = False
        self._reopen_failed = False
        try:
            self._open(os.O_NONBLOCK)  # a FIFO without a reader: ENXIO, not a wait
        except OSError as exc:
            if exc.errno != errno.ENXIO or not stat.S_ISFIFO(os.stat(path).st_mode):
                raise

    def __call__(self, data: bytes) -> None:
        if self._fd < 0:  # a FIFO that had no reader: wait for one here, off the loop
            self._open(create=False)  # gone meanwhile: no regular file in its place
        elif self._regular and self._replaced():
            self._reopen()
        self._sink(data)

    def close(self) -> None:
        """Close the file; not to be called while a write may still come."""
        if self._fd >= 0:
            os.close(self._fd)

    def _open(self, flags: int = 0, *, create: bool = True) -> None:
        flags |= os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0)
        # Not readable by every user (a new user's trial found it 0644): events name tenants,
        # runs and keys. A log shipper in the same group (a pod's fsGroup) still reads it;
        # the umask applies, as to any file a daemon creates (077 makes it 0600).
        fd = os.open(self.path, flags, 0o640)
        try:
            os.set_blocking(fd, True)
            status = os.fstat(fd)
            self._sink = FdSink(fd)
        except OSError:
            os.close(fd)
            raise
        old, self._fd = self._fd, fd
        self._inode = (status.st_dev, status.st_ino)
        self._regular = stat.S_ISREG(status.st_mode)
        if old >= 0:
            os.close(old)

    def _replaced(self) -> bool:
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return True
        except OSError:  # cannot tell (a directory made unreadable): write where we are
            return False
        return (there.st_dev, there.st_ino) != self._inode

    def _reopen(self) -> None:
        try:
            self._open()
        except OSError as exc:
            if not self._reopen_failed:
                log.warning("%s was moved or deleted and cannot be reopened (%s): writing "
                            "on to the file that was there", self.path, exc.strerror or exc)
            self._reopen_failed = True
            return
        self._reopen_failed = False


def fd_sink(fd: int) -> Callable[[bytes], None]:
    """:class:`FdSink` for ``fd``; when ``fd`` is not open, a sink whose every write fails
    (its lines dropped and counted) rather than an error at startup."""
    try:
        return FdSink(fd)
    except OSError as closed:
        return _failing(closed)


def _failing(error: OSError) -> Callable[[bytes], None]:
    def fail(data: bytes) -> None:
        raise error

    return fail


def stream_sink(stream: IO[bytes] | IO[str] | None) -> Callable[[bytes], None]:
    """A sink for ``stream``: its file descriptor's (:func:`fd_sink`) when it has one, else
    its own ``write`` (e.g. a test's captured stdout), decoding for a text stream."""
    if stream is None:  # the process started with that descriptor closed (">&-")
        return _failing(OSError(errno.EBADF, "no such output: it was closed at startup"))
    try:
        return fd_sink(stream.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        pass

    def write(data: bytes) -> None:
        if isinstance(stream, io.TextIOBase):
            stream.write(data.decode("utf-8", "replace"))
        else:
            stream.write(data)  # type: ignore[arg-type]
        stream.flush()

    return write


class WriterHandler(logging.Handler):
    """A logging handler that formats on the logging thread and writes through a
    :class:`BackgroundWriter`, so a stuck stderr blocks no one."""

    def __init__(self, writer: BackgroundWriter) -> None:
        super().__init__()
        self.writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
            self.writer.write(line.encode("utf-8", "backslashreplace"))
        except Exception:  # as logging.StreamHandler does
            self.handleError(record)


def _lost_log_lines(formatter: logging.Formatter) -> Callable[[int], bytes]:
    """The warning, formatted as the log's other lines, that ``count`` of them were lost."""

    def line(count: int) -> bytes:
        record = logging.makeLogRecord({
            "name": "sluice", "levelno": logging.WARNING, "levelname": "WARNING",
            "msg": "%d log line(s) dropped: the log's destination was not taking them "
                   "(sluice_output_dropped_total)", "args": (count,)})
        return (formatter.format(record) + "\n").encode("utf-8", "backslashreplace")

    return line


@contextlib.contextmanager
def logging_in_background(stream: IO[str]) -> Iterator[BackgroundWriter]:
    """Within the block, the root logger's handlers that write to ``stream`` (the one
    ``logging.basicConfig`` added) write through one :class:`BackgroundWriter` instead, with
    the same formatter, level and filters, and Python's warnings go to the log too
    (``logging.captureWarnings``) rather than to ``stream`` directly. On the way out the
    writer gets ``CLOSE_TIMEOUT_S`` to finish; the handlers are put back if it did (if not,
    ``stream`` is stuck, and later lines are dropped rather than block the exit)."""
    root = logging.getLogger()
    found = [handler for handler in root.handlers
             if isinstance(handler, logging.StreamHandler) and handler.stream is stream]
    formatter = (found[0].formatter if found else None) or logging.Formatter()
    writer = BackgroundWriter(stream_sink(stream), "sluice-log-writer",
                              lost=_lost_log_lines(formatter))
    swapped: list[tuple[logging.Handler, logging.Handler]] = []
    for handler in found:
        instead = WriterHandler(writer)
        instead.setFormatter(handler.formatter)
        instead.setLevel(handler.level)
        for each in handler.filters:
            instead.addFilter(each)
        root.removeHandler(handler)
        root.addHandler(instead)
        swapped.append((handler, instead))
    logging.captureWarnings(True)
    try:
        yield writer
    finally:
        if writer.close(CLOSE_TIMEOUT_S):
            logging.captureWarnings(False)
            for handler, instead in swapped:
                root.removeHandler(instead)
                root.addHandler(handler)


def log_dropped() -> int:
    """Log lines dropped so far by the root logger's :class:`WriterHandler` s."""
    writers = {id(h.writer): h.writer for h in logging.getLogger().handlers
               if isinstance(h, WriterHandler)}
    return sum(writer.dropped for writer in writers.values())
