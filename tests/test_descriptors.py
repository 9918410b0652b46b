"""The open-files limit (proxy/descriptors.py): raised at start, and what it cannot hold
refused with 503 ``too_many_connections`` before descriptors run out, never with resets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.descriptors import (
    DESCRIPTORS_PER_CONNECTION,
    connection_limit,
    descriptor_reserve,
)
from proxy.edge import ADMIN_MAX_CONNECTIONS
from tests.conftest import REPO, STARTUP_TIMEOUT_S, free_ports
from tests.fakeupstream import FakeUpstream
from tests.sluice_child import coverage_env

#: Calls held at the upstream: without a bound, 2 descriptors each pass a limit of 256.
HELD_CALLS = 150
LOW_LIMIT = 256


class Served:
    """A ``sluice serve`` subprocess under an open-files limit of its own."""

    def __init__(self, proc: subprocess.Popen, port: int, admin_port: int,
                 stderr: Path) -> None:
        self.proc = proc
        self.port = port
        self.admin_url = f"http://127.0.0.1:{admin_port}"
        self.stderr = stderr

    async def metric(self, name: str, **labels: str) -> float | None:
        async with aiohttp.ClientSession() as s, s.get(self.admin_url + "/metrics") as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return None


@pytest.fixture
async def serve_limited(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Served]]]:
    started: list[subprocess.Popen] = []

    async def start(upstream: str, soft: int, hard: int) -> Served:
        port, admin_port = free_ports(2)
        path = tmp_path / "sluice.yaml"
        path.write_text(yaml.safe_dump({
            "server": {"listen": f"127.0.0.1:{port}", "admin_listen": f"127.0.0.1:{admin_port}",
                       "drain_timeout": "1s"},
            "events": {"path": str(tmp_path / "events.jsonl")},
            "dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
            "routes": [{"name": "r", "path_prefix": "/r/", "upstream": upstream}],
        }))
        stderr = tmp_path / "sluice.stderr"

        def limit() -> None:  # in the child, before it runs Sluice
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

        with stderr.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "serve", "--config", str(path)], cwd=str(REPO),
                env={**os.environ, **coverage_env()}, stdout=subprocess.DEVNULL, stderr=err,
                preexec_fn=limit)
        started.append(proc)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        async with aiohttp.ClientSession() as session:
            while True:
                assert proc.poll() is None, stderr.read_text()
                with contextlib.suppress(aiohttp.ClientError, ValueError):
                    async with session.get(f"http://127.0.0.1:{admin_port}/readyz") as r:
                        if r.status == 200 and (await r.json()).get("pid") == proc.pid:
                            return Served(proc, port, admin_port, stderr)
                assert time.monotonic() < deadline, stderr.read_text()
                await asyncio.sleep(0.05)

    yield start
    for proc in started:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _call(port: int, upstream: FakeUpstream,
                opened: list[asyncio.StreamWriter]) -> bytes | None:
    """Send a call over a new connection (kept open in ``opened``): ``None`` once it reached
    the upstream (which holds it), else its answer's status line (``b""``: closed unanswered).
    One at a time: a connection not yet sending is idle, and one over the bound closes it."""
    reached = len(upstream.requests)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opened.append(writer)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    writer.write(b"POST /r/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    await writer.drain()
    line = asyncio.ensure_future(reader.readline())
    async with asyncio.timeout(10):
        while not line.done():
            if len(upstream.requests) > reached:
                line.cancel()
                return None
            await asyncio.sleep(0.005)
    return line.result()


async def test_connections_past_the_open_files_limit_get_503_and_healthz_answers(
        serve_limited: Callable[..., Awaitable[Served]]) -> None:
    upstream = await FakeUpstream(hold=asyncio.Event()).start()
    opened: list[asyncio.StreamWriter] = []
    try:
        # Hard limit too: raising the soft one cannot help.
        sluice = await serve_limited(upstream.url, LOW_LIMIT, LOW_LIMIT)
        bound = connection_limit(1000, LOW_LIMIT, descriptor_reserve(ADMIN_MAX_CONNECTIONS,
                                                                     None))
        assert bound == (LOW_LIMIT - 64 - 2 * ADMIN_MAX_CONNECTIONS) // 3
        assert await sluice.metric("sluice_connections_limit", port="proxy") == bound
        assert await sluice.metric("sluice_connections_limit", port="admin") == 64
        lines = []
        for _ in range(HELD_CALLS):
            try:
                lines.append(await _call(sluice.port, upstream, opened))
            except ConnectionError as exc:
                lines.append(repr(exc).encode())
        assert lines == [None] * bound + [b"HTTP/1.1 503 Service Unavailable\r\n"] * (
            HELD_CALLS - bound)
        async with aiohttp.ClientSession() as s:
            async with s.get(sluice.admin_url + "/healthz") as r:
                assert r.status == 200
            # A new caller is told why, in Sluice's words, not reset.
            async with s.post(f"http://127.0.0.1:{sluice.port}/r/v1/chat/completions",
                              json={"model": "m", "messages": []}) as r:
                assert r.status == 503
                assert r.headers["X-Sluice-Reason"] == "too_many_connections"
                assert "open-files limit" in json.loads(await r.read())["error"]["message"]
        assert await sluice.metric("sluice_edge_rejections_total",
                                   reason="too_many_connections") == HELD_CALLS - bound + 1
        assert await sluice.metric("sluice_descriptors_exhausted_total") == 0
        warnings = [line for line in sluice.stderr.read_text().splitlines()
                    if "WARNING" in line and "RLIMIT_NOFILE" in line]
        assert len(warnings) == 1
        assert f"RLIMIT_NOFILE) {LOW_LIMIT} leaves room for {bound} connections" in warnings[0]
    finally:
        for writer in opened:
            writer.close()
        assert upstream.hold is not None
        upstream.hold.set()
        await upstream.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="reads the child's limit from /proc/PID/limits (Linux)")
async def test_a_soft_limit_below_the_hard_one_is_raised_at_start(
        serve_limited: Callable[..., Awaitable[Served]]) -> None:
    upstream = await FakeUpstream().start()
    try:
        sluice = await serve_limited(upstream.url, LOW_LIMIT, 4096)
        limits = Path(f"/proc/{sluice.proc.pid}/limits").read_text()
        assert [line.split()[3:5] for line in limits.splitlines()
                if line.startswith("Max open files")] == [["4096", "4096"]]
        assert "raised from 256 to the hard limit 4096" in sluice.stderr.read_text()
        # Room for the configured 1,000 (4,096 - 192 reserved, 3 each): no warning.
        assert await sluice.metric("sluice_connections_limit", port="proxy") == 1000
        assert "leaves room for" not in sluice.stderr.read_text()
    finally:
        await upstream.stop()


def test_the_bound_leaves_the_reserve_and_three_descriptors_a_connection() -> None:
    reserve = descriptor_reserve(64, None)
    assert reserve == 64 + 128
    assert descriptor_reserve(64, 64) == reserve + 64 + 4  # Redis's pool and pub/sub
    assert connection_limit(1000, 1024, reserve) == (1024 - reserve) // DESCRIPTORS_PER_CONNECTION
    assert connection_limit(1000, 20_000, reserve) == 1000
    assert connection_limit(1000, resource.RLIM_INFINITY, reserve) == 1000
    assert connection_limit(1000, 100, reserve) == 1  # never none at all


def test_descriptors_run_out_anyway_is_logged_and_counted_each_check() -> None:
    # A real exhaustion (EMFILE), in a child of its own: its limit is lowered and its
    # descriptors used up, as a leak would. The check must not list the process's
    # descriptors (/proc/self/fd: 13.5 ms on the loop at 10,000 of them, every second).
    script = textwrap.dedent("""
        import logging, os, resource, sys
        from proxy.descriptors import DescriptorWatch
        def listed(*args):
            raise AssertionError("descriptors listed")
        os.listdir = os.scandir = listed
        logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(message)s")
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        counted = []
        watch = DescriptorWatch(lambda: counted.append(1))
        print("before", watch.check())
        held = []
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        print("out", watch.check(), watch.check())
        for fd in held[:4]:
            os.close(fd)
        print("after", watch.check(), len(counted))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=str(REPO), capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "before False" in out
    assert "out True True" in out
    assert "after False 2" in out
    assert out.count("WARNING out of descriptors (open files at RLIMIT_NOFILE 64") == 2
