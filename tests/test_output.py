"""Output nobody reads must not stop the proxy (proxy/output.py).

Seen from outside: ``sluice serve | sleep 300`` (a pipe nobody reads) froze the whole proxy once
~64 KiB of events had filled it: request 199 and every later one, ``/healthz``, and the drain
on SIGTERM, stuck in a write on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import yaml

from proxy import output
from proxy.events import EventLog
from proxy.output import BackgroundWriter
from tests.conftest import REPO, STARTUP_TIMEOUT_S, free_ports
from tests.fakeupstream import FakeUpstream
from tests.sluice_child import coverage_env


class Stuck:
    """A sink that takes nothing until ``release``d, then keeps what it is given."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.taken: list[bytes] = []

    def __call__(self, data: bytes) -> None:
        self.open.wait()
        self.taken.append(data)

    def release(self) -> None:
        self.open.set()


def test_a_stuck_destination_drops_beyond_its_bound_and_says_so_once_it_moves() -> None:
    sink = Stuck()
    writer = BackgroundWriter(sink, "test-writer", lost=lambda n: b"lost %d\n" % n,
                              max_pending_bytes=100)
    assert writer.write(b"a" * 60, items=3)  # taken by the thread, which is now stuck
    assert writer.write(b"b" * 40, items=2)  # fits: 100 bytes wait in all
    assert not writer.write(b"c", items=1)  # would be 101: dropped, and nothing blocked
    assert not writer.write(b"d" * 50, items=5)
    assert writer.dropped == 6
    assert not writer.close(0.05)  # still stuck: close gives up at its timeout
    sink.release()
    assert writer.close(10)
    assert b"".join(sink.taken) == b"a" * 60 + b"b" * 40


def test_the_next_write_that_fits_is_preceded_by_the_count_of_lost_ones() -> None:
    sink = Stuck()
    writer = BackgroundWriter(sink, "test-writer", lost=lambda n: b"lost %d\n" % n,
                              max_pending_bytes=10)
    writer.write(b"1234567890")
    assert not writer.write(b"x", items=4)
    sink.release()
    while sink.taken == [] or writer.write(b"next\n") is False:
        pass  # until the first write is out and there is room again
    assert writer.close(10)
    assert b"".join(sink.taken) == b"1234567890lost 4\nnext\n"
    assert writer.dropped == 4


def test_a_sink_that_fails_loses_its_lines_and_nothing_else() -> None:
    def broken(data: bytes) -> None:
        raise BrokenPipeError(32, "the reader left")

    writer = BackgroundWriter(broken, "test-writer")
    assert writer.write(b"one\n")
    assert writer.close(10)  # written off, not retried forever


def test_two_writers_on_one_pipe_never_splice_their_lines() -> None:
    # Seen: with "2>&1 |", a log line landed in the middle of an event's JSON: each writer's
    # batch went in one write, which a pipe makes atomic only up to PIPE_BUF bytes.
    read_end, write_end = os.pipe()
    got: list[bytes] = []

    def read_slowly() -> None:
        while chunk := os.read(read_end, 4096):
            got.append(chunk)
            time.sleep(0.0005)  # a reader behind: the writers wait for room, mid-batch

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    events = BackgroundWriter(output.FdSink(write_end), "events")
    logs = BackgroundWriter(output.FdSink(write_end), "log")
    for _ in range(200):  # ~1.2 MiB: the events' writer is stuck in its writes a while
        events.write(b"".join(b'{"event":"%d","x":"%s"}\n' % (i, b"e" * 90)
                              for i in range(50)), 50)
    for n in range(200):  # meanwhile, log lines come one by one, some longer than PIPE_BUF
        logs.write(b"WARNING %d %s\n" % (n, b"l" * (9000 if n % 10 == 0 else 300)))
        time.sleep(0.001)
    assert events.close(60) and logs.close(60)
    os.close(write_end)
    reader.join(60)
    lines = b"".join(got).splitlines()
    assert len(lines) == 200 * 50 + 200
    spliced = [line for line in lines
               if not ((line.startswith(b'{"event"') and line.endswith(b'"}'))
                       or (line.startswith(b"WARNING") and line.endswith(b"l")))]
    assert spliced == []


def test_lines_a_write_error_loses_are_counted_and_a_cut_line_is_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen: to /dev/full, or a disk that filled up, every line was lost uncounted, and the
    # next line written after space came back was appended to the half line left.
    full = BackgroundWriter(output.FdSink(os.open("/dev/full", os.O_WRONLY)), "full")
    assert full.write(b"a\nb\nc\n", items=3)
    assert full.close(10) and full.dropped == 3

    path = tmp_path / "events.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    real_write = os.write
    space = [17]  # bytes the disk takes before it is full: "first line\nsecond"

    def filling_write(to: int, data: memoryview | bytes) -> int:
        if to != fd or space[0] is None:
            return real_write(to, data)
        if space[0] == 0:
            raise OSError(28, "No space left on device")
        taken = real_write(to, bytes(data[:space[0]]))
        space[0] -= taken
        return taken

    monkeypatch.setattr(os, "write", filling_write)
    sink = output.FdSink(fd)
    writer = BackgroundWriter(sink, "disk", lost=lambda n: b"lost %d\n" % n)
    writer.write(b"first line\nsecond line\n", items=2)
    while writer.dropped < 2:
        time.sleep(0.01)
    space[0] = None  # room again
    writer.write(b"third line\n")
    assert writer.close(10)
    os.close(fd)
    assert path.read_bytes() == b"first line\nsecond\nlost 2\nthird line\n"


def test_drops_whose_announcement_was_lost_too_are_announced_again() -> None:
    # Seen in review: each failed batch dropped the count its "lost" line carried, so after
    # ten failed batches of 3 lines the announcement said 3, not 30.
    failures = [10]
    taken: list[bytes] = []

    def disk(data: bytes) -> None:
        if failures[0]:
            failures[0] -= 1
            raise OSError(28, "No space left on device")
        taken.append(data)

    writer = BackgroundWriter(disk, "test-writer", lost=lambda n: b"lost %d\n" % n)
    for batch in range(1, 11):
        writer.write(b"a\nb\nc\n", items=3)
        while writer.dropped < 3 * batch:  # one batch at a time
            time.sleep(0.001)
    writer.write(b"ok\n")
    assert writer.close(10)
    assert b"".join(taken) == b"lost 30\nok\n" and writer.dropped == 30


def test_a_run_of_failed_writes_is_told_once_and_again_after_a_success() -> None:
    # An ops trial: events.path on /dev/full lost 40 events, counted, and said nowhere.
    failures = [3]
    told: list[str] = []
    written: list[bytes] = []

    def disk(data: bytes) -> None:
        if failures[0]:
            failures[0] -= 1
            raise OSError(28, "No space left on device")
        written.append(data)

    writer = BackgroundWriter(disk, "test-writer", failed=lambda exc: told.append(str(exc)))
    for batch in range(1, 4):
        writer.write(b"a\n")
        while writer.dropped < batch:  # one batch at a time: three failures in a row
            time.sleep(0.001)
    writer.write(b"ok\n")  # a success ends the run
    while written != [b"ok\n"]:
        time.sleep(0.001)
    failures[0] = 1
    writer.write(b"b\n")
    assert writer.close(10)
    assert told == ["[Errno 28] No space left on device"] * 2 and writer.dropped == 4


async def test_events_that_cannot_be_written_are_said_in_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    events = EventLog("/dev/full")
    await events.start()
    with caplog.at_level(logging.WARNING, logger="sluice"):
        events.emit_system("config_reloaded", trigger="test")
        events.flush()
        deadline = time.monotonic() + 10
        while events.dropped < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert events.dropped >= 1
        await events.close()
    assert [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()
            ] == ["events could not be written to /dev/full ([Errno 28] No space left on "
                  "device): they are dropped and counted in "
                  'sluice_output_dropped_total{output="events"} until a write succeeds']


def test_log_lines_to_a_stderr_nobody_reads_never_block_the_logger() -> None:
    read_end, write_end = os.pipe()
    stream = open(write_end, "w", closefd=True)  # closed below
    root = logging.getLogger()
    plain = logging.StreamHandler(stream)
    plain.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root.addHandler(plain)
    level = root.level
    root.setLevel(logging.INFO)
    logged = threading.Event()
    try:
        with output.logging_in_background(stream):
            assert plain not in root.handlers

            def log_a_lot() -> None:  # ~6 MiB: beyond the pipe (64 KiB) and the bound
                for n in range(6000):
                    logging.getLogger("sluice").warning("line %d %s", n, "x" * 1000)
                logged.set()

            thread = threading.Thread(target=log_a_lot, daemon=True)
            thread.start()
            # A plain handler would block in its first write beyond 64 KiB, for good.
            assert logged.wait(30), "logging blocked on a pipe nobody reads"
            assert output.log_dropped() > 0
            reader = threading.Thread(target=lambda: _read_all(read_end, got), daemon=True)
            got: list[bytes] = []
            reader.start()
            logging.getLogger("sluice").warning("after")
        assert plain in root.handlers  # put back on the way out
    finally:
        root.removeHandler(plain)
        root.setLevel(level)
        stream.close()
    reader.join(10)
    text = b"".join(got).decode()
    assert "WARNING line 0 " in text and text.rstrip().endswith("WARNING after")
    assert re.search(r"^WARNING \d+ log line\(s\) dropped: the log's destination was not "
                     r"taking them", text, re.MULTILINE)


def _read_all(fd: int, into: list[bytes]) -> None:
    while chunk := os.read(fd, 65536):
        into.append(chunk)
    os.close(fd)


@pytest.fixture
def start_serve(tmp_path: Path, upstream: FakeUpstream
                ) -> Callable[..., Awaitable[tuple[subprocess.Popen, int, int]]]:
    """``start(**popen_kwargs)``: ``sluice serve`` (events to its stdout, the default) as a
    plain ``Popen`` with the given descriptors, once it answers ``/readyz``; returns
    ``(proc, port, admin_port)``. Its stderr must be a pipe: read when it exits at startup.
    Ports taken by another process before Sluice binds them are picked again, twice at most
    (as ``start_sluice`` does)."""
    path = tmp_path / "sluice.yaml"

    async def start(**popen_kwargs: object) -> tuple[subprocess.Popen, int, int]:
        for attempt in range(3):
            port, admin_port = free_ports(2)
            path.write_text(yaml.safe_dump({
                "server": {"listen": f"127.0.0.1:{port}",
                           "admin_listen": f"127.0.0.1:{admin_port}", "drain_timeout": "2s"},
                "routes": [{"name": "r", "path_prefix": "/r/", "upstream": upstream.url}],
            }))
            proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "serve", "--config", str(path)], cwd=str(REPO),
                env={**os.environ, **coverage_env()}, **popen_kwargs)
            if await _ready(proc, admin_port):
                return proc, port, admin_port
            stderr = proc.stderr.read().decode(errors="replace")
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            if not (attempt < 2 and "address already in use" in stderr):
                raise AssertionError(f"sluice exited at startup:\n{stderr}")
        raise AssertionError("unreachable")

    return start


async def test_a_proxy_whose_stdout_and_stderr_nobody_reads_keeps_serving_and_stops(
        start_serve: Callable[..., Awaitable[tuple[subprocess.Popen, int, int]]]) -> None:
    # Popen, not asyncio's subprocess: its pipes would be read into buffers by the loop.
    proc, port, admin_port = await start_serve(stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE)  # never read
    try:
        async with aiohttp.ClientSession() as session:
            # ~600 bytes of events a request: 600 requests are ~5 pipes' worth.
            async with asyncio.timeout(60):
                for n in range(600):
                    async with session.post(f"http://127.0.0.1:{port}/r/x",
                                            json={"n": n}) as r:
                        assert r.status == 200
                async with session.get(f"http://127.0.0.1:{admin_port}/healthz") as r:
                    assert r.status == 200
                async with session.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
                    assert 'sluice_output_dropped_total{output="events"}' in await r.text()
        proc.send_signal(signal.SIGTERM)
        # The last events cannot be written: the shutdown gives them a second, not forever.
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


async def test_a_proxy_started_with_stdout_closed_serves_counts_its_events_and_stops(
        start_serve: Callable[..., Awaitable[tuple[subprocess.Popen, int, int]]]) -> None:
    # Seen: with ">&-", the events' writer thread died on the first flush (sys.stdout is
    # None), and libuv aborted at exit on a descriptor that took number 1 (rc 134).
    proc, port, admin_port = await start_serve(
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(1))  # before exec: the child starts without it
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/r/x", json={}) as r:
                assert r.status == 200
            async with asyncio.timeout(30):
                while True:  # the flush runs every 200 ms
                    async with session.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
                        text = await r.text()
                    if 'sluice_output_dropped_total{output="events"} 2.0' in text:
                        break
                    await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


async def _ready(proc: subprocess.Popen, admin_port: int) -> bool:
    """Wait for ``proc`` to answer ``/readyz`` on ``admin_port``; False if it exited first.

    Raises:
        AssertionError: not ready within ``STARTUP_TIMEOUT_S``.
    """
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while proc.poll() is None:
            with contextlib.suppress(aiohttp.ClientError, ValueError):
                async with session.get(f"http://127.0.0.1:{admin_port}/readyz") as r:
                    # Ours, not another process on a reused port.
                    if r.status == 200 and (await r.json()).get("pid") == proc.pid:
                        return True
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise AssertionError(f"sluice not ready in {STARTUP_TIMEOUT_S} s:\n"
                                     f"{proc.stderr.read().decode(errors='replace')}")
            await asyncio.sleep(0.05)
    return False


def test_the_event_log_and_the_dead_letter_file_are_not_readable_by_every_user(tmp_path):
    """A new user's trial: both were made 0644 in the working directory, the dead letters
    holding whole request bodies (prompts, tool arguments) and the events naming tenants,
    runs and keys. The letters are their owner's alone; a log shipper of the same group (a
    pod's fsGroup) still reads the events. A file that is there keeps its mode."""
    import stat

    from policies.deadletter import DeadLetterFile
    from proxy.output import FileSink

    old = os.umask(0o022)
    try:
        FileSink(str(tmp_path / "events.jsonl")).close()
        DeadLetterFile(str(tmp_path / "dlq.sqlite")).close()
        kept = tmp_path / "kept.sqlite"
        kept.touch(mode=0o644)
        DeadLetterFile(str(kept)).close()
    finally:
        os.umask(old)
    modes = {name: stat.S_IMODE(os.stat(tmp_path / name).st_mode)
             for name in ("events.jsonl", "dlq.sqlite", "kept.sqlite")}
    assert modes == {"events.jsonl": 0o640, "dlq.sqlite": 0o600, "kept.sqlite": 0o644}
