"""Output nobody reads must not stop the proxy (proxy/output.py).

Seen from outside: ``sluice serve | sleep 300`` (a pipe nobody reads) froze the whole proxy once
~64 KiB of events had filled it: request 199 and every later one, ``/healthz``, and the drain
on SIGTERM, stuck in a write on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import pytest
import yaml

from proxy import output
from proxy.output import BackgroundWriter
from tests.conftest import REPO, coverage_env, free_port
from tests.fakeupstream import FakeUpstream


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
    assert "log line(s) dropped: the log's reader fell behind" in text


def _read_all(fd: int, into: list[bytes]) -> None:
    while chunk := os.read(fd, 65536):
        into.append(chunk)
    os.close(fd)


@pytest.fixture
def serve_config(tmp_path: Path, upstream: FakeUpstream) -> tuple[Path, int, int]:
    port, admin_port = free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "admin_listen": f"127.0.0.1:{admin_port}",
                   "drain_timeout": "2s"},
        "routes": [{"name": "r", "path_prefix": "/r/", "upstream": upstream.url}],
    }  # events: the default, stdout
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port, admin_port


async def test_a_proxy_whose_stdout_and_stderr_nobody_reads_keeps_serving_and_stops(
        serve_config: tuple[Path, int, int]) -> None:
    path, port, admin_port = serve_config
    # Popen, not asyncio's subprocess: its pipes would be read into buffers by the loop.
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(path)], cwd=str(REPO),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # never read
        env={**os.environ, **coverage_env()})
    try:
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(30):
                while True:
                    try:
                        async with session.get(f"http://127.0.0.1:{admin_port}/readyz") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.05)
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
