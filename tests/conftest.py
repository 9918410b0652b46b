"""Shared fixtures: a fake upstream in the test's loop and Sluice as a real subprocess.

``start_sluice(config)`` writes ``config`` (a dict or YAML text) to a temporary file, runs
``sluice serve --config FILE`` in its own process (forked warm, see ``tests/sluice_child.py``)
on free loopback ports, waits for ``/readyz`` and returns a :class:`SluiceProcess`. Its event
log goes to a file the test can read. With
``config_path=`` the config is written there (through a symlink, if it is one) and Sluice is
started on that path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import StrictLoader, parse_config
from proxy.runtime import Runtime
from proxy.server import build_proxy_server
from tests.fakeupstream import FakeUpstream
from tests.ports import free_ports
from tests.redis_servers import (  # noqa: F401  (fixtures)
    _prefixes_swept_at_the_end,
    backends,
    redis_cluster,
    redis_server,
    shared_state,
)
from tests.sluice_child import ForkedSluice

REPO = Path(__file__).resolve().parent.parent
#: How long a Sluice child may take to be ready, seconds: on success it
#: costs nothing, and a child that exits is seen at once; 20 s was too short at load 11.
STARTUP_TIMEOUT_S = 60.0
#: How long a server stopped at a test's end may drain before it is killed, seconds.
STOP_GRACE_S = 3.0


class _FailuresAsTheyCome:
    """Names a failure the moment it is known, not only in the summary at the end: a run
    that CI or a user's ``timeout`` kills on a busy machine said only "F" (a new user's
    trial)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if report.failed and reporter is not None:
            # On a line of its own: the progress dots leave the cursor mid-line.
            reporter.write(f"\nFAILED {report.nodeid} ({report.when})\n", red=True)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller: xdist's workers print nothing
        config.pluginmanager.register(_FailuresAsTheyCome(config), "failures-as-they-come")


def free_port() -> int:
    """A free loopback port (:mod:`tests.ports`: not one an outgoing connection can take)."""
    return free_ports(1)[0]


class SluiceProcess:
    """A running ``sluice serve`` and the addresses it listens on."""

    def __init__(self, proc: ForkedSluice, port: int, admin_port: int, events: Path,
                 stderr: Path, config_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.admin_port = admin_port
        self.events_path = events
        self.stderr_path = stderr
        self.config_path = config_path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def events(self) -> list[dict]:
        """Event lines written so far (the log is flushed every 0.2 s): whole lines only, as
        a batch may be half written when it is read (a test failed on a cut last line)."""
        if not self.events_path.exists():
            return []
        *whole, _partial = self.events_path.read_text().split("\n")
        return [json.loads(line) for line in whole if line]

    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """``{(sample name, sorted labels): value}`` from ``/metrics``."""
        async with aiohttp.ClientSession() as s, s.get(self.admin_url + "/metrics") as r:
            text = await r.text()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    async def metric(self, name: str, **labels: str) -> float:
        return (await self.metrics()).get((name, tuple(sorted(labels.items()))), 0.0)

    async def wait_metric(self, name: str, value: float, timeout: float = 10.0,
                          **labels: str) -> None:
        """Wait until a sample equals ``value`` (tests wait on gauges, never on sleeps)."""
        deadline = time.monotonic() + timeout
        while True:
            current = await self.metric(name, **labels)
            if current == value:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}{labels} is {current}, expected {value}")
            await asyncio.sleep(0.05)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def wait_exit(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError("sluice did not exit in time")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def kill(self) -> None:
        """End it at once (SIGKILL): nothing it holds is given back, no data saved."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """End it as Kubernetes would: SIGTERM (a drain, which lets a measured server save its
        coverage), then SIGKILL if it is still running after ``grace_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        self.kill()


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0,
                     what: str = "condition") -> None:
    """Poll ``predicate`` until it is true (tests wait on conditions, never on fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def completed_events(sluice: SluiceProcess, count: int = 1,
                           timeout: float = 20.0) -> list[dict]:
    """``sluice``'s ``completed`` events, once ``count`` of them are in its log (flushed
    every 0.2 s)."""
    await wait_until(lambda: sum(e["event"] == "completed" for e in sluice.events()) >= count,
                     timeout, f"{count} completed event(s)")
    return [e for e in sluice.events() if e["event"] == "completed"]


async def status_of(session: aiohttp.ClientSession, url: str, body: object,
                    headers: dict[str, str] | None = None) -> int:
    """POST ``body`` as JSON and read the whole answer; its status."""
    async with session.post(url, json=body, headers=headers) as r:
        await r.read()
        return r.status


async def raw_request(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` over a fresh TCP connection and return every byte until the peer closes.

    For requests an HTTP client would refuse to send (absolute-form targets, dot-segments,
    hop-by-hop headers of the test's choosing). Send ``Connection: close`` to get the answer
    back promptly.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            return await reader.read(-1)
    finally:
        writer.close()


RunnerT = TypeVar("RunnerT", bound=web.BaseRunner)


async def serve_app(app: web.Application, **options: Any) -> tuple[web.AppRunner, int]:
    """Serve ``app`` (a test's own upstream) on a free loopback port in this process, with
    ``options`` for its runner (e.g. ``handler_cancellation=True``): its runner, to clean up,
    and its port."""
    return await _on_a_free_port(web.AppRunner(app, access_log=None, **options))


async def serve_runtime(runtime: Any, **settings: Any) -> tuple[web.ServerRunner, int]:
    """Serve ``runtime``'s proxy port in this process: its runner (``web.ServerRunner``
    with the keywords ``settings``, e.g. ``serve``'s ``shutdown_timeout``) and port."""
    return await _on_a_free_port(web.ServerRunner(build_proxy_server(runtime), **settings))


async def _on_a_free_port(runner: RunnerT) -> tuple[RunnerT, int]:
    """Set ``runner`` up on a free loopback port: it, and the port."""
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def leave_the_queue(sluice: Any, call: Coroutine[Any, Any, object], route: str) -> None:
    """Be a caller that leaves while queued: send ``call`` (a request to ``sluice``), wait
    until it is in ``route``'s queue, cancel it, and wait until that queue is empty again."""
    task = asyncio.create_task(call)
    await sluice.wait_metric("sluice_queue_depth", 1, route=route)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await sluice.wait_metric("sluice_queue_depth", 0, route=route)


async def leave_mid_body(sluice: Any, path: str, headers: bytes = b"") -> None:
    """Be a caller that leaves mid-upload: send a head declaring a 1,000-byte body to
    ``sluice`` (with ``headers``, CRLF-terminated lines), then a piece of the body, wait until
    Sluice holds the body's bytes, and close."""
    _, writer = await asyncio.open_connection("127.0.0.1", sluice.port)
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers
                 + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                 b"{\"model\": ")
    await writer.drain()
    await sluice.wait_metric("sluice_buffered_request_bytes", 1000)
    writer.close()


def route(name: str, upstream: str, protocol: str = "openai", **policies: object) -> dict:
    """A route config dict with prefix ``/<name>/``."""
    return {"name": name, "path_prefix": f"/{name}/", "upstream": upstream,
            "protocol": protocol, **policies}


async def open_runtime(*routes: dict, **top: object) -> Runtime:
    """A :class:`proxy.runtime.Runtime` of ``routes`` (:func:`route` dicts) and top-level
    config blocks ``top`` (e.g. ``events``), opened, for a test that serves it in process
    (:func:`serve_runtime`); the test closes it."""
    runtime = Runtime(parse_config(yaml.safe_dump({**top, "routes": list(routes)},
                                                  sort_keys=False)))
    await runtime.open()
    return runtime


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    fake = await FakeUpstream().start()
    yield fake
    if fake.hold is not None:
        fake.hold.set()
    await fake.stop()


@pytest.fixture(scope="session", autouse=True)
def _nothing_written_beside_the_readme() -> Iterator[None]:
    """The suite keeps its files in temporary directories: a dead-letter file left in the
    checkout (the default config's ``sluice-dlq.sqlite``) is the user's own, and tests once
    wrote their letters into it."""
    path = REPO / "sluice-dlq.sqlite"

    def seen() -> tuple[int, int] | None:
        with contextlib.suppress(OSError):
            st = path.stat()
            return st.st_size, st.st_mtime_ns
        return None

    before = seen()
    yield
    if seen() != before:
        pytest.fail(f"a test wrote {path}: give its Sluice a dead_letter.path in tmp_path")


@pytest.fixture
async def start_sluice(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[SluiceProcess]]]:
    started: list[SluiceProcess] = []

    async def start(config: dict | str, *, env: dict[str, str] | None = None,
                    config_path: Path | None = None) -> SluiceProcess:
        data = yaml.load(config, Loader=StrictLoader) if isinstance(config, str) else json.loads(
            json.dumps(config))
        index = len(started)
        events = tmp_path / f"events-{index}.jsonl"
        server = data.setdefault("server", {})
        # Ports picked here can be taken by another process before Sluice binds them (other
        # suites share the machine): then they are picked again, twice at most.
        picked = "listen" not in server and "admin_listen" not in server
        server.setdefault("drain_timeout", "5s")
        data.setdefault("events", {"path": str(events)})
        # Never the default ./sluice-dlq.sqlite: the suite wrote its letters into the
        # user's own file beside the README (a new user's trial).
        letters = data.setdefault("dead_letter", {})
        if isinstance(letters, dict):
            letters.setdefault("path", str(tmp_path / f"dlq-{index}.sqlite"))
        config_path = config_path or tmp_path / f"sluice-{index}.yaml"
        stderr = tmp_path / f"sluice-{index}.stderr"
        for attempt in range(3):
            if picked:
                port, admin_port = free_ports(2)
                server["listen"] = f"127.0.0.1:{port}"
                server["admin_listen"] = f"127.0.0.1:{admin_port}"
            else:
                server.setdefault("listen", f"127.0.0.1:{free_ports(1)[0]}")
                port = int(server["listen"].rpartition(":")[2])
                server.setdefault("admin_listen", f"127.0.0.1:{free_ports(1)[0]}")
                admin_port = int(server["admin_listen"].rpartition(":")[2])
            config_path.write_text(yaml.safe_dump(data, sort_keys=False))
            proc = ForkedSluice(str(config_path), str(stderr), str(REPO), env or {})
            sluice = SluiceProcess(proc, port, admin_port, events, stderr, config_path)
            if await _ready(sluice):
                started.append(sluice)
                return sluice
            if not (picked and attempt < 2 and "address already in use" in sluice.stderr()):
                raise AssertionError(f"sluice exited at startup:\n{sluice.stderr()}")
        raise AssertionError("unreachable")

    async def _ready(sluice: SluiceProcess) -> bool:
        """Wait for ``sluice`` to answer ``/readyz``; False if it exited first.

        Raises:
            AssertionError: not ready within ``STARTUP_TIMEOUT_S``.
        """
        proc = sluice.proc
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        async with aiohttp.ClientSession() as session:
            while True:
                if proc.poll() is not None:
                    return False
                with contextlib.suppress(aiohttp.ClientError, ValueError):
                    async with session.get(sluice.admin_url + "/readyz") as r:
                        # Ours, not another process on a reused port.
                        if r.status == 200 and (await r.json()).get("pid") == proc.pid:
                            return True
                if time.monotonic() > deadline:
                    started.append(sluice)  # stopped at the end like the others
                    raise AssertionError(f"sluice not ready in time:\n{sluice.stderr()}")
                await asyncio.sleep(0.05)

    yield start
    await asyncio.gather(*(sluice.stop() for sluice in started))
