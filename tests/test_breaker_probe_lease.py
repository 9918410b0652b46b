"""The half-open probe's lease (a hostile trial, 3 replicas on one Redis): a replica killed
(SIGKILL) while its probe was in flight left every replica refusing the route 503
``circuit_open`` ("a probe is in flight") for the probe lease's fixed 30 s, whatever
``reset_timeout`` said (measured 30.2 s), though the upstream was healthy; and a probe that
outlasted those 30 s (a long LLM call, no response headers yet) let a second probe through.

The lease now lasts ``state.lease`` and the probing replica renews it while its probe runs:
these tests give ``state.lease`` one second so that "longer than a lease" takes
seconds, and wait on conditions with generous bounds (the old lease was 30 s).
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from policies.breaker import Breaker, Pass
from policies.config import CircuitBreakerConfig
from policies.reasons import Rejected
from policies.state import StateBackends
from policies.state.breaker import FAILURE, NEUTRAL, SUCCESS
from tests.conftest import route
from tests.redis_servers import replica, replica_process
from tests.test_shared_rate_budget import own_state, post, replicas

#: ``state.lease`` in these tests, seconds.
LEASE_S = 1.0
#: How long a test waits for what should happen within about one lease: far under the old
#: 30 s, far over one lease on a busy machine.
WITHIN_S = LEASE_S + 6.0
CONFIG = CircuitBreakerConfig(fail_max=1, reset_timeout="100ms")


def breaker(backends: StateBackends) -> Breaker:
    return Breaker(CONFIG, "r", lambda *_, **__: None, backends)


async def probe_of(b: Breaker, timeout: float = WITHIN_S) -> Pass:
    """The probe's pass, once ``b`` is let through as the half-open probe (refused meanwhile:
    still open, or another probe holds the lease)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ticket = await b.attempt()
        except Rejected:
            assert time.monotonic() < deadline, f"no probe let through within {timeout:g}s"
            await asyncio.sleep(0.02)
            continue
        assert ticket.ticket.probe is not None, "let through, but not as the probe"
        return ticket


async def half_open(b: Breaker) -> Pass:
    """Open the breaker with one failure; the probe's pass once ``reset_timeout`` passed."""
    await b.record(await b.attempt(), FAILURE, 500)
    assert b.current == "open"
    return await probe_of(b)


async def lease_left(backends: StateBackends) -> float:
    """Seconds until the probe lease lapses unless renewed (0 when none is held)."""
    if backends.redis is None:
        machine = backends.breakers._machines["r"]  # type: ignore[attr-defined]
        return 0.0 if machine.probe is None else machine.probe[1] / 1000 - time.monotonic()
    key = backends.redis.key("r", "breaker", "probe")
    return max(await backends.redis.run(lambda client: client.pttl(key)), 0) / 1000


def renewals() -> list[asyncio.Task]:
    """The probe-lease renewals running in this loop."""
    return [t for t in asyncio.all_tasks()
            if t.get_name().startswith("sluice-probe-lease") and not t.done()]


async def no_renewal_left() -> None:
    deadline = time.monotonic() + 5
    while renewals():
        assert time.monotonic() < deadline, renewals()
        await asyncio.sleep(0.01)


@pytest.fixture
def short_lease(backends: StateBackends) -> StateBackends:
    backends.lease_s = LEASE_S
    return backends


async def test_a_probe_longer_than_its_lease_is_renewed_and_never_doubled(
        short_lease: StateBackends):
    """A's probe runs three lease times: the lease is never longer than one (so a dead A
    would free it soon), yet it is still A's at the end, and B is refused all along."""
    async with replica(short_lease) as other:
        other.lease_s = LEASE_S
        a = breaker(short_lease)
        probe = await half_open(a)
        b = breaker(other)  # its view is not a closed one younger than VIEW_FRESH_S
        loop = asyncio.get_running_loop()
        until = loop.time() + 3 * LEASE_S
        while loop.time() < until:
            assert 0 < await lease_left(short_lease) <= LEASE_S
            with pytest.raises(Rejected) as refused:
                await b.attempt()
            assert "a probe is in flight" in refused.value.detail
            if short_lease.redis is None:
                with pytest.raises(Rejected):
                    a.check()  # this process's view keeps refusing before the queue too
            await asyncio.sleep(LEASE_S / 6)
        await a.record(probe, SUCCESS, 200)
        assert a.current == "closed"
        assert (await b.attempt()).ticket.probe is None  # closed for B too
        await no_renewal_left()


async def test_a_probe_whose_task_ended_without_an_outcome_frees_within_a_lease(
        short_lease: StateBackends):
    """The task that took the probe ends without recording it or giving it back (as a
    holder that died would): its lease is no longer renewed, and another caller probes
    within about one lease (memory had the same 30 s wedge)."""
    async with replica(short_lease) as other:
        other.lease_s = LEASE_S
        a = breaker(short_lease)
        await asyncio.create_task(half_open(a))  # that task is over; the outcome never comes
        b = breaker(other)
        await no_renewal_left()
        second = await probe_of(b)
        await b.record(second, SUCCESS, 200)
        assert b.current == "closed"


@pytest.mark.parametrize("backends", ["memory"], indirect=True)
@pytest.mark.parametrize("ending", ["success", "failure", "neutral", "release",
                                    "record_soon", "caller_left"])
async def test_every_ending_of_a_probe_stops_its_renewal(backends: StateBackends,
                                                         ending: str,
                                                         caplog: pytest.LogCaptureFixture):
    """Whatever ends the probe stops its renewal at once (none is left running, none is
    taken for a probe that ended without an outcome)."""
    backends.lease_s = LEASE_S
    b = breaker(backends)
    if ending == "caller_left":  # cancelled while its attempt is upstream, as _attempt is
        taken = asyncio.Event()

        async def call() -> None:
            probe = await half_open(b)
            try:
                taken.set()
                await asyncio.Event().wait()
            except BaseException:
                b.release(probe)
                raise

        task = asyncio.create_task(call())
        await taken.wait()
        assert len(renewals()) == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    else:
        probe = await half_open(b)
        assert len(renewals()) == 1
        if ending == "release":
            b.release(probe)
        elif ending == "record_soon":
            b.record_soon(probe, SUCCESS)
        else:
            outcome = {"success": SUCCESS, "failure": FAILURE, "neutral": NEUTRAL}[ending]
            await b.record(probe, outcome)
    await no_renewal_left()
    assert "without an outcome" not in caplog.text


@pytest.mark.parametrize("backends", ["memory"], indirect=True)
async def test_a_closed_breaker_starts_no_renewal(backends: StateBackends):
    b = breaker(backends)
    for _ in range(3):
        await b.record(await b.attempt(), SUCCESS, 200)
    assert renewals() == []


@pytest.mark.parametrize("backends", ["redis"], indirect=True)
async def test_a_replica_killed_mid_probe_lets_another_probe_within_a_lease(
        backends: StateBackends):
    """A real process takes the probe and is killed with SIGKILL: while it lives the lease
    is renewed past its lease time; once it is dead another replica probes within about one
    lease."""
    state = backends.redis
    assert state is not None
    backends.lease_s = LEASE_S
    async with replica_process(_PROBER, state, LEASE_S, b"probing") as child:
        b = breaker(backends)
        loop = asyncio.get_running_loop()
        until = loop.time() + 3 * LEASE_S
        while loop.time() < until:  # the child's renewals keep its probe alone
            with pytest.raises(Rejected):
                await b.attempt()
            await asyncio.sleep(LEASE_S / 6)
        child.send_signal(signal.SIGKILL)
        child.wait()
        second = await probe_of(b)
        await b.record(second, SUCCESS, 200)
        assert b.current == "closed"


_PROBER = """
import asyncio, sys, time
from policies.breaker import Breaker
from policies.config import CircuitBreakerConfig
from policies.reasons import Rejected
from policies.state import redis_backends
from policies.state.breaker import FAILURE

async def main(url, prefix, lease_s):
    backends = await redis_backends(url, prefix, 0.5)
    backends.lease_s = lease_s
    b = Breaker(CircuitBreakerConfig(fail_max=1, reset_timeout="100ms"), "r",
                lambda *_, **__: None, backends)
    await b.record(await b.attempt(), FAILURE, 500)
    while True:
        try:
            probe = await b.attempt()
            break
        except Rejected:
            await asyncio.sleep(0.02)
    assert probe.ticket.probe is not None
    print("probing", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


async def test_sluice_replicas_recover_from_a_replica_killed_mid_probe(
        upstream, start_sluice, redis_server):
    """The trial itself: two Sluice replicas on one Redis, ``state.lease: 1s``. A's probe
    waits on the upstream when A is killed; B's next calls are refused "a probe is in
    flight" for about one lease, not 30 s, and then B's probe closes the breaker."""
    state = {**own_state(redis_server, "local"), "lease": "1s"}
    a, b = await replicas(start_sluice, 2, state, route(
        "openai", upstream.url, circuit_breaker={"fail_max": 2, "reset_timeout": "1s"}))
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            assert (await post(session, a.url, **{"x-fake-status": "500"}))[0] == 500
        deadline = time.monotonic() + 10
        while True:  # the first call after reset_timeout is the probe; it waits upstream
            seen = len(upstream.requests)
            probe = asyncio.create_task(post(session, a.url, **{"x-fake-delay": "60"}))
            while len(upstream.requests) == seen and not probe.done():
                await asyncio.sleep(0.01)
            if not probe.done():
                break
            assert time.monotonic() < deadline, "no probe let through"
            await asyncio.sleep(0.1)
        a.kill()
        await asyncio.gather(probe, return_exceptions=True)
        killed = time.monotonic()
        while True:
            status, headers, _ = await post(session, b.url)
            if status == 200:
                break
            assert headers.get("X-Sluice-Reason") == "circuit_open", (status, headers)
            # A lease and a generous margin: under the 5 s default lease, far under 30 s.
            assert time.monotonic() - killed < 1.0 + 3.0, "still refused long after a lease"
            await asyncio.sleep(0.1)
        print(f"\nprobe of a SIGKILLed replica taken over after {time.monotonic() - killed:.2f}s"
              " (lease 1s)")
        await b.wait_metric("sluice_circuit_state", 0, route="openai")

