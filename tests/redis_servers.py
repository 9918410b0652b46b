"""Redis for the state tests: the shared server, servers of their own, a 3-master cluster.

* ``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``) is the server most tests use, each
  under a random key prefix that it deletes afterwards. If it does not answer the tests
  are skipped with the reason, unless ``CI=true``, where that is a failure.
* :class:`RedisServer` runs a ``redis-server`` of a test's own on a free loopback port
  (no persistence), for tests that stop, freeze (SIGSTOP) or reconfigure it.
* ``redis_cluster`` (session scope, started once, only if a test asks) is three
  ``redis-server --cluster-enabled yes`` joined by ``redis-cli --cluster create``.
* ``backends`` runs a test against the memory implementations, the shared server and the
  cluster in turn, each a fresh :class:`policies.state.StateBackends`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from policies.state import StateBackends, memory_backends, redis_backends
from tests.ports import free_ports

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
#: The per-call bound the tests give Sluice's state (``state.timeout``): generous, as 2 busy
#: cores can stall a call.
TEST_TIMEOUT_S = 0.5
#: The per-call bound of the in-process clients of the ``backends`` fixture and
#: :func:`replica`: a test's burst of 30-60 calls opens ~20 connections per client, which
#: outlasted 0.5 s on a busy CI machine (twice). Those tests count admissions, not time.
CLIENT_TIMEOUT_S = 2.0
#: How often a backend marked down is probed in the tests, seconds.
TEST_PROBE_S = 0.1


def unavailable(reason: str) -> None:
    """Skip the test for lack of Redis, or fail it when CI promised Redis."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


def answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5) as r:
            return bool(r.ping())
    except redis.AuthenticationError:
        return True  # up, and wanting a password
    except (redis.RedisError, OSError):
        return False


def require_redis(url: str = REDIS_URL) -> str:
    if not answers(url):
        unavailable(f"no Redis answers at {url} (set REDIS_URL)")
    return url


def free_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too (:mod:`tests.ports`)."""
    return free_ports(1, bus=True)[0]


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix:`` on the server ``url`` names."""
    with redis.Redis.from_url(url, socket_timeout=2) as r:
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            for key in keys:  # one by one: a cluster node refuses multi-slot DEL
                r.delete(key)


class RedisServer:
    """A ``redis-server`` of one test's own on 127.0.0.1 (no RDB, no AOF)."""

    def __init__(self, directory: Path, port: int | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        if shutil.which("redis-server") is None:
            unavailable("redis-server is not installed")
        self.directory = directory
        #: A port the caller chose (a restart on the same address) is kept; a picked one is
        #: replaced if another process binds it first.
        self.pinned = port is not None
        self.port = port or free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Run the server and wait until it answers PING.

        Raises RuntimeError, with the server's own log, if it exits at once three times (a
        pinned port taken; an unpinned one is re-picked each time) or is not answering after
        15 s (two busy cores).
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        log = self.directory / "redis-server.log"
        for _ in range(3):
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                 "--protected-mode", "no", "--logfile", str(log), *self.extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 15
            while not self._answering():
                if self.proc.poll() is not None:
                    break  # exited: most likely its port was taken
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer "
                                       f"within 15 s; its log:\n{_tail(log)}")
                time.sleep(0.02)
            else:
                return self
            if not self.pinned:
                self.port = free_port()
                # a cluster node records its address at start: a node on a new port starts anew
                (self.directory / "nodes.conf").unlink(missing_ok=True)
        self.proc = None
        raise RuntimeError(f"redis-server on port {self.port} exited at start three times; "
                           f"its log:\n{_tail(log)}")

    def _answering(self) -> bool:
        """This server answers, not another one that took the port first."""
        try:
            # No retries: redis-py's default three, with back-off, made one look at a port
            # taken by a silent listener 9 s long (a pinned-port test took 27 s).
            with redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5,
                             retry=Retry(NoBackoff(), 0)) as r:
                return r.info("server")["process_id"] == self.proc.pid
        except redis.AuthenticationError:  # up, wanting a password: ours if still running
            return self.proc.poll() is None
        except (redis.RedisError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen server cannot exit
            self.proc.terminate()
            self.proc.wait(5)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log written)"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh ``redis-server`` for this test alone."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


class RedisCluster:
    """Three masters, no replicas, on free loopback ports."""

    def __init__(self, directory: Path) -> None:
        self.servers = [
            RedisServer(directory / f"node{i}", extra=(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000"))
            for i in range(3)
        ]

    @property
    def url(self) -> str:
        return self.servers[0].url

    def start(self) -> RedisCluster:
        for server in self.servers:
            server.start()
        if shutil.which("redis-cli") is None:
            unavailable("redis-cli is not installed")
        subprocess.run(
            ["redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{s.port}" for s in self.servers),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
        )
        deadline = time.monotonic() + 15
        for server in self.servers:
            with server.client() as r:
                while r.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError("the test cluster did not become ready")
                    time.sleep(0.05)
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def delete_prefix(self, prefix: str) -> None:
        for server in self.servers:
            delete_prefix(server.url, prefix)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A 3-master Redis Cluster, started once per test session."""
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.asynccontextmanager
async def replica_process(script: str, state: Any, lease_s: float, ready: bytes
                          ) -> AsyncIterator[subprocess.Popen[bytes]]:
    """A replica of its own process, to kill with SIGKILL: ``script`` (Python source that
    reads the Redis URL, the key prefix and the lease seconds from ``argv``) run against
    ``state`` (a :class:`policies.state.RedisState`), once it has printed ``ready``. Killed
    and reaped on the way out."""
    repo = Path(__file__).resolve().parent.parent
    child = subprocess.Popen(
        [sys.executable, "-c", script, state.url, state.prefix, str(lease_s)],
        cwd=repo, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        assert child.stdout is not None
        line = await asyncio.to_thread(child.stdout.readline)
        assert line.strip() == ready, line
        yield child
    finally:
        child.kill()
        child.wait()


#: Every key prefix this process's tests made, swept again at the session's end.
MADE_PREFIXES: list[str] = []


def new_prefix() -> str:
    prefix = f"sluice-test-{uuid.uuid4().hex[:12]}"
    MADE_PREFIXES.append(prefix)
    return prefix


@pytest.fixture(scope="session", autouse=True)
def _prefixes_swept_at_the_end() -> Iterator[None]:
    """Each test deletes its prefix, but a Sluice it started may still write under it until
    the test's own fixtures stop that Sluice, after the prefix was deleted (pytest tears
    fixtures down in reverse): an idempotency record was left on the shared Redis for a day
    after a clean-clone run. Every prefix this process made is deleted once more at the end
    (only those: other suites on the same Redis keep theirs)."""
    yield
    if not MADE_PREFIXES:
        return
    try:
        for prefix in MADE_PREFIXES:
            delete_prefix(REDIS_URL, prefix)
    except redis.RedisError:
        pass  # no Redis answering: nothing it could hold


@pytest.fixture(params=["memory", "redis", "cluster"])
async def backends(request: pytest.FixtureRequest) -> AsyncIterator[StateBackends]:
    """The same test against memory, one Redis server, and a Redis Cluster."""
    if request.param == "memory":
        yield memory_backends()
        return
    prefix = new_prefix()
    if request.param == "redis":
        url = require_redis()
        cleanup = lambda: delete_prefix(url, prefix)  # noqa: E731
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        url = cluster.url
        cleanup = lambda: cluster.delete_prefix(prefix)  # noqa: E731
    state = await redis_backends(url, prefix, CLIENT_TIMEOUT_S, probe_interval_s=TEST_PROBE_S)
    try:
        assert state.health.up, state.health.last_error
        yield state
    finally:
        await state.close()
        cleanup()


@contextlib.asynccontextmanager
async def replica(like: StateBackends) -> AsyncIterator[StateBackends]:
    """Another replica's view of the same state: a second client on the same Redis (and
    prefix), or the very same memory backends (one process has one memory)."""
    if like.redis is None:
        yield like
        return
    other = await redis_backends(like.redis.url, like.redis.prefix, CLIENT_TIMEOUT_S,
                                 probe_interval_s=TEST_PROBE_S)
    try:
        yield other
    finally:
        await other.close()


@pytest.fixture(params=["redis", "cluster"])
def shared_state(request: pytest.FixtureRequest) -> Iterator[dict[str, object]]:
    """A ``state`` config block for Sluice processes sharing one Redis (then a Redis Cluster)
    under a key prefix of their own, deleted afterwards. Pass it to several ``start_sluice``
    calls to get replicas of one deployment."""
    prefix = new_prefix()
    if request.param == "redis":
        url = require_redis()
        cleanup = lambda: delete_prefix(url, prefix)  # noqa: E731
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        url = cluster.url
        cleanup = lambda: cluster.delete_prefix(prefix)  # noqa: E731
    try:
        yield {"backend": "redis", "redis_url": url, "key_prefix": prefix,
               "timeout": f"{int(TEST_TIMEOUT_S * 1000)}ms", "replicas": 3}
    finally:
        cleanup()
