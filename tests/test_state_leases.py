"""Shared concurrency leases (policies.state.leases): memory, one Redis, a Redis Cluster; and
a replica killed with SIGKILL (a real process) whose slots free within one lease time."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import pytest
import redis.asyncio

from policies.idempotency import _renew
from policies.state import StateBackends, memory_backends, redis_backends
from policies.state.errors import StateUnavailable
from policies.state.idempotency import CLAIMED
from policies.state.leases import (
    LIMIT,
    TENANT,
    HeldLeases,
    Lease,
    LeaseResult,
    Leases,
    acquire_lease,
)
from tests.redis_servers import (
    CLIENT_TIMEOUT_S,
    TEST_PROBE_S,
    delete_prefix,
    new_prefix,
    replica,
    replica_process,
    require_redis,
)


async def test_slots_up_to_the_limit_and_the_tenant_cap_first(backends: StateBackends):
    leases = backends.leases
    assert (await leases.acquire("r", "a", "1", 3, 2, 60)).granted
    assert (await leases.acquire("r", "a", "2", 3, 2, 60)) == (True, None, 2, 2)
    assert await leases.acquire("r", "a", "3", 3, 2, 60) == (False, TENANT, 2, 2)
    assert await leases.acquire("r", "b", "4", 3, 2, 60) == (True, None, 3, 1)
    assert await leases.acquire("r", "c", "5", 3, None, 60) == (False, LIMIT, 3, 0)
    # Acquiring an id already held grants again without taking a second slot.
    assert await leases.acquire("r", "b", "4", 3, 2, 60) == (True, None, 3, 1)
    assert await leases.counts("r", "a") == (3, 2)
    assert await leases.release("r", "a", "1") is True
    assert await leases.release("r", "a", "1") is False
    assert await leases.counts("r", "a") == (2, 1)
    # Renewing a lease that is gone takes it again, past the limit: its call still runs.
    assert await leases.renew("r", "a", "1", 60) is False
    assert await leases.counts("r", "a") == (3, 2)
    assert await leases.renew("r", "a", "1", 60) is True


async def test_a_lapsed_lease_frees_its_slot(backends: StateBackends):
    leases = backends.leases
    assert (await leases.acquire("r", "a", "dead", 1, None, 0.3)).granted
    assert not (await leases.acquire("r", "a", "next", 1, None, 0.3)).granted
    await asyncio.sleep(0.35)
    assert (await leases.acquire("r", "a", "next", 1, None, 60)).granted
    assert await leases.counts("r", "a") == (1, 1)


async def test_a_held_lease_is_renewed_until_released(backends: StateBackends):
    # A 0.6 s lease (renewed every 0.2 s), not 0.2 s: a busy machine stalled this process
    # past a 0.2 s lease's renewal once, and it lapsed (retaken == 1).
    result, lease = await acquire_lease(backends.leases, "r", "a", 1, None, 0.6)
    assert result.granted and lease is not None
    await asyncio.sleep(0.9)  # longer than the lease: renewal keeps it
    assert await backends.leases.counts("r", "a") == (1, 1)
    assert lease.retaken == 0
    assert await lease.aclose() is True
    assert lease.release() is lease.release()  # releasing again is the same, finished task
    assert await backends.leases.counts("r", "a") == (0, 0)


async def test_a_lease_lost_while_its_call_runs_is_taken_again(backends: StateBackends):
    """A Redis restarted without its data (or an outage longer than the lease) loses the
    leases of calls still at the upstream; they used to stop counting, so the route admitted
    up to `limit` more until they ended."""
    _, lease = await acquire_lease(backends.leases, "r", "a", 1, None, 0.3)
    assert lease is not None
    await backends.leases.release("r", "a", lease.lease_id)  # as if Redis had lost it
    assert (await backends.leases.acquire("r", "b", "other", 1, None, 60)).granted
    # A renewal (every lease / 3) takes it back: waited for, as a busy machine may run the
    # first one later than a fixed 0.25 s (before the fix it never came).
    deadline = time.monotonic() + 5
    while lease.retaken == 0:
        assert time.monotonic() < deadline, "the lease was not taken again"
        await asyncio.sleep(0.02)
    assert lease.retaken == 1
    assert await backends.leases.counts("r", "a") == (2, 1)  # over the limit of 1: draining
    assert not (await backends.leases.acquire("r", "c", "third", 1, None, 60)).granted
    assert await lease.aclose() is True


async def wait_for_slot(leases: Leases, group: str, tenant: str, limit: int,
                        per_tenant: int | None, lease_s: float, timeout_s: float,
                        poll_s: float) -> tuple[LeaseResult, Lease | None]:
    """A lease, waited for up to ``timeout_s`` seconds as policies.shared_concurrency's
    dispatcher waits: woken by a release published on any replica, asking again every
    ``poll_s`` seconds (a lapsed lease publishes nothing), giving up at once on a tenant's
    refusal. Returns the last result and the lease, ``None`` when not granted in time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with leases.watch(group) as released:
        while True:
            result, lease = await acquire_lease(leases, group, tenant, limit, per_tenant,
                                                lease_s)
            left = deadline - loop.time()
            if lease is not None or result.refused_by == TENANT or left <= 0:
                return result, lease
            await released.wait(min(poll_s, left))


async def test_a_release_wakes_a_waiter_on_another_replica(backends: StateBackends):
    async with replica(backends) as other:
        _, held = await acquire_lease(backends.leases, "r", "a", 1, None, 60)
        assert held is not None
        # Asking again only every 600 s: only the release's message can wake it in time.
        waiter = asyncio.create_task(
            wait_for_slot(other.leases, "r", "b", 1, None, 60, timeout_s=600, poll_s=600))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        await held.aclose()
        result, lease = await asyncio.wait_for(waiter, 30)
        assert result.granted and lease is not None
        await lease.aclose()


async def test_waiting_ends_at_the_timeout_or_at_once_for_the_tenant(backends: StateBackends):
    _, held = await acquire_lease(backends.leases, "r", "a", 1, 1, 60)
    assert held is not None
    loop = asyncio.get_running_loop()
    started = loop.time()
    result, lease = await asyncio.wait_for(wait_for_slot(
        backends.leases, "r", "b", 1, 1, 60, timeout_s=0.3, poll_s=0.1), 30)
    assert (result.refused_by, lease) == (LIMIT, None)
    assert loop.time() - started >= 0.3
    # Refused for its tenant: at once, not after 600 s.
    result, lease = await asyncio.wait_for(wait_for_slot(
        backends.leases, "r", "a", 2, 1, 60, timeout_s=600, poll_s=600), 30)
    assert (result.refused_by, lease) == (TENANT, None)
    await held.aclose()


@pytest.mark.parametrize("backends", ["redis"], indirect=True)
async def test_a_replica_killed_with_sigkill_frees_its_slots_within_the_lease_time(
        backends: StateBackends):
    state = backends.redis
    assert state is not None
    lease_s = 0.3
    async with replica_process(_HOLDER, state, lease_s, b"held") as child:
        await asyncio.sleep(lease_s * 1.5)  # the child's renewals keep both slots
        assert await backends.leases.counts("r", "t") == (2, 2)
        child.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while True:
            # Timed from when each count is asked, not answered: a busy machine's slow reply
            # is not the slots outliving the lease.
            asked = time.monotonic()
            if not (await backends.leases.counts("r", "t"))[0]:
                break
            assert asked - killed < lease_s + 0.15
            await asyncio.sleep(0.02)


_HOLDER = """
import asyncio, sys
from policies.state import redis_backends
from policies.state.leases import acquire_lease

async def main(url, prefix, lease_s):
    backends = await redis_backends(url, prefix, 0.5)
    for _ in range(2):
        result, lease = await acquire_lease(backends.leases, "r", "t", 4, None, lease_s)
        assert lease is not None, result
    print("held", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


async def test_a_cancel_during_a_redis_call_is_never_lost(backends: StateBackends):
    """A call cancelled in its first loop turns is cancelled. redis-py wrote commands under
    ``asyncio.wait_for`` when given a socket timeout, and on Python 3.11 that swallowed a
    cancel landing as the write completed (CPython gh-86296): every cancel in turns 1-3 was
    lost, and a released lease's renewal went on taking it back for good."""
    leases = backends.leases
    lost = []
    for turns in range(8):
        for _ in range(5):
            task = asyncio.create_task(leases.renew("r", "a", "x", 60))
            for _ in range(turns):
                await asyncio.sleep(0)
            if task.done():
                continue
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                continue
            lost.append(turns)
    assert lost == []
    await leases.release("r", "a", "x")


async def test_a_release_during_a_renewal_waits_for_it_then_gives_the_lease_back(
        backends: StateBackends, monkeypatch):
    """A renewal in a backend call is not cancelled (it could not tell whether its call took
    effect): the release waits for it, then gives the lease back once, and the renewal ends
    by itself. Its cancel is made a no-op to show that nothing relies on it."""
    _, lease = await acquire_lease(backends.leases, "r", "a", 1, None, 0.15)
    assert lease is not None
    renewal = lease._renewal
    assert renewal is not None
    monkeypatch.setattr(renewal, "cancel", lambda *args: False)  # as if the cancel were lost
    renew = backends.leases.renew
    entered = asyncio.Event()

    async def slow_renew(*args):
        entered.set()
        await asyncio.sleep(0.05)  # the release runs meanwhile
        return await renew(*args)

    monkeypatch.setattr(backends.leases, "renew", slow_renew)
    await entered.wait()
    assert await lease.aclose() is True
    done, _ = await asyncio.wait({renewal}, timeout=1.0)
    monkeypatch.undo()
    if not done:
        renewal.cancel()
    assert done  # it ended by itself
    assert lease.retaken == 0
    assert await backends.leases.counts("r", "a") == (0, 0)  # taken back, then given back


async def test_a_lease_taken_from_memory_is_counted_in_redis_once_it_answers(
        backends: StateBackends):
    """A call admitted on a replica's local share while Redis did not answer counts in Redis
    from its lease's next renewal once Redis is back, past the limit if need be; before, it
    went uncounted and the route ran up to twice its limit until such calls ended."""
    local = memory_backends().leases
    # A 1 s lease, renewed every third of it: with 0.3 s, a CI run on a busy machine saw it
    # lapse (retaken) before its renewal moved it.
    assert (await local.acquire("r", "a", "m1", 1, None, 1.0)).granted
    lease = Lease(local, "r", "a", "m1", 1.0, shared=backends.leases)
    # Meanwhile another replica took the route's one slot in Redis.
    assert (await backends.leases.acquire("r", "b", "other", 1, None, 60)).granted
    # One renewal (every third of a second) moves it there, over the limit of 1 (draining):
    # waited for, not a fixed time, which left a busy machine 50 ms (before the fix: (1, 0)
    # for good).
    deadline = time.monotonic() + 5
    while (counted := await backends.leases.counts("r", "a")) != (2, 1):
        assert time.monotonic() < deadline, counted
        await asyncio.sleep(0.02)
    assert await local.counts("r", "a") == (0, 0)
    assert not (await backends.leases.acquire("r", "c", "third", 1, None, 60)).granted
    assert lease.retaken == 0  # moved on purpose, not lapsed
    assert await lease.aclose() is True
    assert await backends.leases.counts("r", "a") == (1, 0)


async def test_a_released_lease_stops_renewing_even_if_its_cancel_is_lost(
        backends: StateBackends, monkeypatch):
    """Released between renewals with the cancel lost (as in a library that swallows one):
    the renewal ends at its next turn without renewing, and the lease is given back."""
    _, lease = await acquire_lease(backends.leases, "r", "a", 1, None, 0.15)
    assert lease is not None
    renewal = lease._renewal
    assert renewal is not None
    await asyncio.sleep(0)  # the renewal is asleep until its first turn
    monkeypatch.setattr(renewal, "cancel", lambda *args: False)
    assert await lease.aclose() is True
    assert renewal.done()
    assert await backends.leases.counts("r", "a") == (0, 0)


async def test_a_lease_moved_to_redis_is_given_back_there_when_released_mid_move(
        backends: StateBackends):
    """Released while the renewal that moves a memory lease into the shared backend waits
    for the reply (the script has run: the lease counts there now). Before, the release
    cancelled that renewal and gave back only the memory lease, so the shared one stayed
    counted until it lapsed (found by a review: (1, 1) after the release)."""
    shared = backends.leases
    applied = asyncio.Event()

    class SlowReply:
        async def renew(self, *args: object) -> bool:
            held = await shared.renew(*args)  # type: ignore[arg-type]
            applied.set()
            await asyncio.sleep(0.2)  # the reply is on its way
            return held

        async def release(self, *args: object) -> bool:
            return await shared.release(*args)  # type: ignore[arg-type]

    local = memory_backends().leases
    assert (await local.acquire("r", "a", "m1", 1, None, 3.0)).granted
    lease = Lease(local, "r", "a", "m1", 0.3, shared=SlowReply())  # type: ignore[arg-type]
    await asyncio.wait_for(applied.wait(), 5)
    assert await shared.counts("r", "a") == (1, 1)  # counted there already
    assert await lease.aclose() is True
    assert await shared.counts("r", "a") == (0, 0)
    assert await local.counts("r", "a") == (0, 0)


async def test_a_lease_taken_from_memory_stays_there_while_redis_is_away():
    """Its moves into a frozen Redis time out: the memory lease is renewed meanwhile, and at
    the end given back in memory and, as a timed-out move may have run, in Redis too: once
    it answers again (kept in ``lost``), as Redis does not answer now."""
    class Away:
        releases = 0

        async def renew(self, *args: object) -> bool:
            raise StateUnavailable("frozen")

        async def release(self, *args: object) -> bool:
            Away.releases += 1
            raise StateUnavailable("frozen")

    local, held = memory_backends().leases, HeldLeases()
    assert (await local.acquire("r", "a", "m1", 1, None, 0.15)).granted
    lease = Lease(local, "r", "a", "m1", 0.15, shared=Away(),  # type: ignore[arg-type]
                  held=held)
    await asyncio.sleep(0.4)  # past the lease time: the memory lease was renewed
    assert await local.counts("r", "a") == (1, 1)
    assert await lease.aclose() is True
    assert await local.counts("r", "a") == (0, 0)
    assert Away.releases == 1 and held.lost == {("r", "a", "m1")}
    assert not held.live and not held.unmoved


async def test_a_renewal_that_fails_is_logged_when_it_fails(caplog):
    """A renewal ending with an unexpected error (not an unavailable backend) is logged at
    once, its lease lapsing from then on; before, it was seen only as 'Task exception was
    never retrieved', if at all."""
    class Broken:
        async def renew(self, *args: object) -> bool:
            raise RuntimeError("a fault in the backend's client")

        async def release(self, *args: object) -> bool:
            return True

    lease = Lease(Broken(), "r", "a", "x", 0.06)  # type: ignore[arg-type]
    await asyncio.sleep(0.1)  # past its first renewal
    assert "its renewal failed; the lease lapses" in caplog.text
    assert await lease.aclose() is True


async def test_a_pause_ends_when_redis_is_seen_back_or_at_its_timeout() -> None:
    """``seen_back``: the pause of a write retried on a schedule (an idempotency key's marker)
    ends as soon as a health listener hears Redis back, and says so; a pause that times
    out says so, and one cancelled leaves nothing behind."""
    prefix = new_prefix()
    url = require_redis()
    state = await redis_backends(url, prefix, CLIENT_TIMEOUT_S, probe_interval_s=TEST_PROBE_S)
    try:
        paused = asyncio.create_task(state.seen_back(3600))
        await asyncio.sleep(0)
        state.wake(False, "down")  # a change to down wakes nothing
        await asyncio.sleep(0)
        assert not paused.done()
        state.wake(True)
        assert await asyncio.wait_for(paused, 5) is True
        assert await state.seen_back(0.01) is False
        cancelled = asyncio.create_task(state.seen_back(3600))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert state._pauses == set()
    finally:
        await state.close()
        delete_prefix(url, prefix)


@pytest.mark.parametrize("outage", ["freeze", "restart"])
async def test_many_markers_renewed_on_recovery_do_not_mark_redis_down_again(
        redis_server, outage) -> None:
    """Every running keyed call's marker renewal woken at once by Redis coming back: on the
    pool's connections past ``state.timeout``, they marked Redis down again, and each
    recovery woke them all once more (a hostile review: the health down in 49 of 60 looks
    over 3 s with 150 calls, a keyed call run twice meanwhile). Now a recovery's writes go
    :data:`~policies.state.RENEW_BATCH` at a time: next to none time out, the health stays
    up, and every marker is there again (after a restart, taken again). At this timeout only
    the restart failed before (10,722 unanswered); the freeze failed at 50 ms (3,666), which
    CI's loaded machine could not hold even paced, and stays as a guard."""
    state = await redis_backends(redis_server.url, new_prefix(), 0.2,
                                 probe_interval_s=TEST_PROBE_S)
    records, lease_s = state.idempotency, 30.0
    keys = [(f"route\0acme\0k{i}", f"owner-{i}") for i in range(600)]
    changes: list[bool] = []
    state.health.on_change(lambda up, _error: changes.append(up))
    fingerprint = b"\x01" * 32
    renewers: list[asyncio.Task[None]] = []
    failed = [0]  # renewals (and takes) sent that Redis did not answer
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        for key, owner in keys:
            assert (await records.begin(key, owner, fingerprint, lease_s)).state == CLAIMED
        for name in ("renew", "begin"):
            write = getattr(records, name)

            async def counted(*args: object, write=write) -> object:
                tried = state.health.up  # marked down, a write fails at once, unsent
                try:
                    return await write(*args)
                except StateUnavailable:
                    failed[0] += tried
                    raise
            setattr(records, name, counted)
        renewers = [asyncio.create_task(_renew(records, key, owner, fingerprint, lease_s, state))
                    for key, owner in keys]
        await asyncio.sleep(0.05)
        if outage == "freeze":
            redis_server.freeze()
            try:
                with pytest.raises(StateUnavailable):
                    await records.get("a look that finds Redis frozen")
            finally:
                await asyncio.sleep(0.5)
                redis_server.thaw()
        else:
            redis_server.stop()
            redis_server.start()
            with contextlib.suppress(StateUnavailable):
                await records.get("a look that finds the connection broken")
        flights = [records._keys(key)[1] for key, _ in keys]

        async def markers() -> int:  # one round trip, on a client of the test's own
            return await client.exists(*flights)

        for _ in range(200):
            await asyncio.sleep(0.05)
            if state.health.up and await markers() == len(keys):
                break
        await asyncio.sleep(1.0)  # a herd's timeouts would mark it down again by now
        assert await markers() == len(keys)
        # Before: thousands unanswered (6,868 after the restart), the health down again and
        # again. A loaded machine (CI's, tracing coverage beside another worker) may still
        # time out a few batches: at state.timeout's 50 ms, 80 to 128 paced ones did there.
        print(f"{outage}: {failed[0]} renewals not answered; health {changes}")
        assert failed[0] <= len(keys) // 10, changes
        assert changes.count(False) <= 3, changes
        assert state.health.up
    finally:
        for renewer in renewers:
            renewer.cancel()
        await asyncio.gather(*renewers, return_exceptions=True)
        await client.aclose()
        await state.close()
