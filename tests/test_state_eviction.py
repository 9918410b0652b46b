"""A hostile trial of Sluice's Redis faults (trial/redismem): under an evicting
``maxmemory-policy`` Redis evicted Sluice's leases, idempotency markers and budget counters
(a ``limit: 4`` route ran 14 calls at once, a 3,000-token budget spent 18,228) while
``sluice_state_backend_up`` stayed 1 and nothing was logged. The policy and the server's
``evicted_keys`` are now read (``INFO``) at connect and in the background, exported, and
logged once when evicting; a read that fails leaves them absent and the backend up. Each test
runs a ``redis-server`` of its own."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from prometheus_client import generate_latest

from policies.state import connection
from policies.state.connection import RedisState
from policies.state.errors import StateUnavailable
from policies.state.eviction import Eviction, NodeEviction
from proxy.metrics import Metrics
from tests.conftest import route
from tests.redis_servers import RedisCluster, RedisServer, new_prefix
from tests.test_shared_rate_budget import own_state, post

EVICTING = ("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
#: Reads this often in the tests that drive the state module, seconds.
CHECK_S = 0.1


@pytest.fixture
def evicting(tmp_path: Path) -> Iterator[RedisServer]:
    """A ``redis-server`` of this test's own with ``maxmemory 4mb`` and ``allkeys-lru``."""
    server = RedisServer(tmp_path / "redis", extra=EVICTING).start()
    try:
        yield server
    finally:
        server.stop()


def eviction_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "sluice.state" and "maxmemory-policy" in r.getMessage()]


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def exposition(state: RedisState) -> str:
    """``/metrics`` of a registry exporting ``state``'s eviction series alone."""
    metrics = Metrics()
    metrics.bind_state_eviction(lambda: state.eviction.last)
    return metrics.render(generate_latest, [], metrics.read_on_loop()).decode()


def rendered(state: RedisState) -> list[str]:
    """The eviction series' samples as ``/metrics`` shows them."""
    return [line for line in exposition(state).splitlines()
            if line.startswith(("sluice_state_evicting_policy", "sluice_state_redis_evicted"))]


def node(eviction: Eviction | None, address: str) -> NodeEviction:
    assert eviction is not None
    (found,) = [one for one in eviction.nodes if one.node == address]
    return found


async def test_an_evicting_redis_shows_in_the_gauges_and_one_warning(
        upstream, start_sluice, evicting: RedisServer) -> None:
    sluice = await start_sluice({"state": own_state(evicting, "local"), "routes": [
        route("openai", upstream.url, concurrency={"limit": 4})]})
    address = f"127.0.0.1:{evicting.port}"
    await sluice.wait_metric("sluice_state_evicting_policy", 1, node=address,
                             policy="allkeys-lru")
    samples = await sluice.metrics()
    assert samples[("sluice_state_redis_evicted_keys_total", (("node", address),))] == 0
    assert samples[("sluice_state_backend_up", (("backend", "redis"),))] == 1
    async with aiohttp.ClientSession() as session:
        for _ in range(5):
            status, _, _ = await post(session, sluice.url)
            assert status == 200
        async with session.get(sluice.admin_url + "/readyz") as ready:
            assert ready.status == 200  # the calls work: the limits are what is at risk
    (line,) = [line for line in sluice.stderr().splitlines() if "maxmemory-policy" in line]
    assert " WARNING " in line and "maxmemory-policy is allkeys-lru" in line
    assert "concurrency leases" in line and "Set maxmemory-policy noeviction" in line


async def test_evictions_and_policy_changes_are_read_in_the_background_and_told_once(
        evicting: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sluice.state")
    state = RedisState(evicting.url, new_prefix(), 0.5, eviction_check_s=CHECK_S)
    admin = evicting.client()
    try:
        await state.start()
        address = f"127.0.0.1:{evicting.port}"
        await until(lambda: state.eviction.last is not None, "the first read")
        assert state.eviction.last == Eviction((NodeEviction(address, "allkeys-lru", True, 0),))
        assert rendered(state) == [
            f'sluice_state_evicting_policy{{node="{address}",policy="allkeys-lru"}} 1.0',
            f'sluice_state_redis_evicted_keys_total{{node="{address}"}} 0.0']
        # Another program's data pushes Redis past its maxmemory: keys are evicted.
        with admin.pipeline(transaction=False) as pipe:
            for i in range(8000):
                pipe.set(f"other:{i}", "x" * 1000)
            pipe.execute()
        await until(lambda: (state.eviction.last or Eviction(())).evicted_keys > 0,
                    "evicted_keys read again")
        assert state.health.up
        assert len(eviction_lines(caplog)) == 1  # many reads, one line

        admin.config_set("maxmemory-policy", "noeviction")
        await until(lambda: state.eviction.last is not None and not state.eviction.last.evicting,
                    "noeviction read")
        assert rendered(state)[0] == (
            f'sluice_state_evicting_policy{{node="{address}",policy="noeviction"}} 0.0')
        admin.config_set("maxmemory-policy", "volatile-ttl")
        await until(lambda: state.eviction.last is not None and state.eviction.last.evicting,
                    "volatile-ttl read")
        await asyncio.sleep(5 * CHECK_S)
        lines = eviction_lines(caplog)
        assert len(lines) == 3, lines
        assert "no longer evicts" in lines[1] and "maxmemory-policy is volatile-ttl" in lines[2]
    finally:
        await state.close()
        admin.close()


async def test_an_evicting_policy_without_a_maxmemory_never_evicts(
        evicting: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """``maxmemory 0`` (no limit, the default of a server outside a container): Redis never
    reaches a maxmemory, so allkeys-lru evicts nothing. The gauge says 0 and nothing is
    logged; a maxmemory set then makes it 1, with the warning."""
    caplog.set_level(logging.INFO, "sluice.state")
    admin = evicting.client()
    admin.config_set("maxmemory", "0")
    state = RedisState(evicting.url, new_prefix(), 0.5, eviction_check_s=CHECK_S)
    address = f"127.0.0.1:{evicting.port}"
    try:
        await state.start()
        await until(lambda: state.eviction.last is not None, "the first read")
        assert state.eviction.last == Eviction((NodeEviction(address, "allkeys-lru", False, 0),))
        assert rendered(state)[0] == (
            f'sluice_state_evicting_policy{{node="{address}",policy="allkeys-lru"}} 0.0')
        assert eviction_lines(caplog) == []

        admin.config_set("maxmemory", "64mb")
        await until(lambda: state.eviction.last is not None and state.eviction.last.evicting,
                    "a maxmemory read")
        (line,) = eviction_lines(caplog)
        assert "maxmemory-policy is allkeys-lru" in line
    finally:
        await state.close()
        admin.close()


async def test_a_refused_or_unanswered_read_leaves_the_gauges_absent_and_the_backend_as_it_is(
        evicting: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """An ACL without INFO's memory and stats sections: one warning, the backend still up
    (its calls work). Redis frozen: down by the probe's say alone, and unknown meanwhile."""
    caplog.set_level(logging.INFO, "sluice.state")
    server = evicting
    admin = server.client()
    # INFO cluster stays allowed: Sluice asks it at connect (a cluster or not).
    admin.acl_setuser("sluice", enabled=True, passwords=["+pw"], keys=["~*"], channels=["&*"],
                      commands=["+@all", "-info", "+info|cluster"])
    url = f"redis://sluice:pw@127.0.0.1:{server.port}/0"
    state = RedisState(url, new_prefix(), 0.2, eviction_check_s=CHECK_S, probe_interval_s=0.1)
    try:
        await state.start()
        await asyncio.sleep(5 * CHECK_S)
        assert state.health.up and state.eviction.last is None
        assert rendered(state) == []
        (line,) = eviction_lines(caplog)
        assert "no permissions" in line and "absent until it can" in line

        caplog.clear()
        admin.acl_setuser("sluice", enabled=True, commands=["+info"])
        await until(lambda: state.eviction.last is not None, "a read allowed")
        server.freeze()
        try:
            await until(lambda: not state.health.up, "the probe to mark it down")
            assert state.eviction.last is None and rendered(state) == []
        finally:
            server.thaw()
        await until(lambda: state.eviction.last is not None, "read again once it answers")
        # The policy was told once; the outage and the refused reads say nothing more.
        assert len(eviction_lines(caplog)) == 1
    finally:
        await state.close()
        admin.close()


async def test_a_read_in_flight_never_holds_up_the_probe_nor_another_read(
        evicting: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis freezes as a read starts (SIGSTOP). The read ran in the probe's task and the
    probe waited it out, up to its bound, before its next PING (a review: an idle replica
    marked a frozen Redis down after 1.56 s against main's 1 s). Now the read is a task of
    its own: with a bound far longer than any probe, the probe's heartbeat marks the backend
    down while the read is still waiting, and no second read starts meanwhile."""
    reads: list[asyncio.Task[None] | None] = []
    read_eviction = connection.read_eviction

    async def freezing(client: Any) -> Eviction:
        reads.append(asyncio.current_task())  # type: ignore[arg-type]
        if len(reads) == 2:
            evicting.freeze()
        return await read_eviction(client)

    monkeypatch.setattr(connection, "read_eviction", freezing)
    monkeypatch.setattr(connection, "READ_TIMEOUT_S", 120.0)
    state = RedisState(evicting.url, new_prefix(), 0.2, eviction_check_s=CHECK_S)
    probes_while_reading: list[bool] = []
    probe = state.probe

    async def probing() -> bool:
        probes_while_reading.append(len(reads) == 2 and not reads[1].done())
        return await probe()

    monkeypatch.setattr(state, "probe", probing)
    try:
        await state.start()
        await until(lambda: len(reads) == 2, "a second read, frozen")
        await until(lambda: not state.health.up, "the probe to mark it down")
        assert not reads[1].done()  # the read still waits: the probe did not wait for it
        assert any(probes_while_reading)  # a PING sent with the read in flight
        await asyncio.sleep(5 * CHECK_S)
        assert len(reads) == 2  # one read at a time
    finally:
        evicting.thaw()
        await state.close()


async def test_a_read_answered_after_the_backend_was_marked_down_is_dropped(
        evicting: RedisServer) -> None:
    """Redis stalls with a read in flight; a call marks the backend down; Redis answers the
    read within its bound. The read filled the series the outage had emptied, and as no read
    is made while down, they stayed for the whole outage. Dropped now."""
    # No probe within the test: the backend stays marked down once a call marks it so.
    state = RedisState(evicting.url, new_prefix(), 0.05, probe_interval_s=60.0,
                       eviction_check_s=60.0)
    try:
        await state.start()
        await until(lambda: state.eviction.last is not None, "the first read")
        evicting.freeze()
        try:
            read = asyncio.create_task(state.check_eviction())
            await asyncio.sleep(0.01)  # the read's INFO sent
            with pytest.raises(StateUnavailable):
                await state.run(lambda client: client.get(state.key("x", "y")))
            assert not state.health.up and state.eviction.last is None
        finally:
            evicting.thaw()
        await read
        assert not state.health.up
        assert state.eviction.last is None and rendered(state) == []
    finally:
        await state.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A cluster of this test's own: it changes a node's policy."""
    nodes = RedisCluster(tmp_path / "cluster").start()
    try:
        yield nodes
    finally:
        nodes.stop()


async def test_a_cluster_is_read_on_every_primary_each_its_own_series(
        cluster: RedisCluster) -> None:
    """Per primary, not summed: a primary's count back to 0 (a failover to its replica, a
    restart, CONFIG RESETSTAT) resets its own counter, which increase() takes as a reset; a
    sum with one term dropped read as a reset and all the rest new evictions (a review: the
    critical SluiceStateRedisKeysEvicted for a failover, no key evicted)."""
    state = RedisState(cluster.url, new_prefix(), 1.0, eviction_check_s=CHECK_S)
    try:
        await state.start()
        assert state.cluster
        addresses = sorted(f"127.0.0.1:{server.port}" for server in cluster.servers)
        await until(lambda: state.eviction.last is not None, "the first read")
        assert state.eviction.last == Eviction(tuple(
            NodeEviction(address, "noeviction", False, 0) for address in addresses))
        one = cluster.servers[1]
        with redis.Redis(port=one.port, socket_timeout=2) as server:
            server.config_set("maxmemory", "64mb")
            server.config_set("maxmemory-policy", "allkeys-lfu")
        await until(lambda: state.eviction.last is not None and state.eviction.last.evicting,
                    "one primary's policy read")
        assert state.eviction.last.policy == "allkeys-lfu,noeviction"
        lines = rendered(state)
        for address in addresses:
            policy = "allkeys-lfu" if address == f"127.0.0.1:{one.port}" else "noeviction"
            evicting = float(policy != "noeviction")
            assert (f'sluice_state_evicting_policy{{node="{address}",policy="{policy}"}} '
                    f"{evicting}") in lines
            assert f'sluice_state_redis_evicted_keys_total{{node="{address}"}} 0.0' in lines
        assert len(lines) == 2 * len(addresses)
    finally:
        await state.close()


async def test_the_series_pass_promtools_metrics_lint(evicting: RedisServer) -> None:
    """The count is the server's cumulative evicted_keys: a counter, named ``_total``."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (.ci/run installs it)")
    state = RedisState(evicting.url, new_prefix(), 0.5, eviction_check_s=CHECK_S)
    try:
        await state.start()
        await until(lambda: state.eviction.last is not None, "the first read")
        text = exposition(state)
        assert "# TYPE sluice_state_redis_evicted_keys_total counter" in text
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                              text=True, timeout=60)
        assert (lint.returncode, lint.stdout, lint.stderr) == (0, "", "")
    finally:
        await state.close()
