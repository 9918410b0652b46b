"""A hostile trial of Sluice's Redis faults (trial/hostile): a key claimed from the local
fallback while Redis did not answer (``on_unavailable: local``) was forgotten once Redis
answered again. A duplicate of it sent afterwards, even to the very replica that still held
the key in flight in its memory, found nothing in Redis and ran the upstream a second time,
concurrently with the first (measured: 2 upstream executions of one key, 2 at once, after a
1.5 s freeze); and a retry of a call that replica had answered during the outage ran again
too, its answer kept only in that replica's memory. The replica now consults what it holds
itself: the duplicate waits for its twin and gets its answer replayed, and an answer kept
during the outage is replayed and shared through Redis."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import redis.asyncio
import yaml

from tests.conftest import route
from tests.test_shared_rate_budget import own_state, post, wait_for

KEY = {"Idempotency-Key": "job-42", "X-Tenant-ID": "acme"}


async def backend_up(sluice) -> None:
    """Wait until the replica has seen Redis answer again."""
    for _ in range(750):
        if await sluice.metric("sluice_state_backend_up", backend="redis") == 1:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the replica never saw Redis answer again")


async def first_call_while_frozen(session, upstream, redis_server, url: str) -> asyncio.Task:
    """Send the keyed call while Redis is frozen (claimed from memory), held at the upstream;
    Redis thawed once it got there. Returns its task."""
    redis_server.freeze()
    try:
        first = asyncio.create_task(post(session, url, **KEY))
        await wait_for(lambda: len(upstream.requests) == 1, what="the first call upstream")
    finally:
        redis_server.thaw()
    return first


async def two_replicas(start_sluice, upstream, redis_server, lease: str) -> tuple:
    """Two Sluices on the test's own Redis in ``local`` mode, one deduplicating route each."""
    state = {**own_state(redis_server, "local"), "lease": lease}
    routes = [route("openai", upstream.url, idempotency={"mode": "dedup", "max_wait": "30s"})]
    return (await start_sluice({"state": state, "routes": routes}),
            await start_sluice({"state": state, "routes": routes}))


async def ran_once(upstream, first: asyncio.Task, duplicate: asyncio.Task) -> None:
    """The held first call and its duplicate: one execution while both were out, then both
    answered, the duplicate with the first's answer."""
    executions = len(upstream.requests)
    upstream.hold.set()
    (status_1, _, _), (status_2, headers_2, _) = await first, await duplicate
    assert executions == 1, "the duplicate ran upstream while its twin was still in flight"
    assert (status_1, status_2) == (200, 200)
    assert headers_2.get("Idempotent-Replayed") == "true"
    assert len(upstream.requests) == 1


async def test_a_duplicate_waits_for_its_twin_claimed_while_redis_was_away(
        upstream, start_sluice, redis_server):
    state = {**own_state(redis_server, "local"), "lease": "1s"}
    sluice = await start_sluice({"state": state, "routes": [route(
        "openai", upstream.url, idempotency={"mode": "dedup", "max_wait": "30s"})]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = await first_call_while_frozen(session, upstream, redis_server, sluice.url)
        await backend_up(sluice)
        duplicate = asyncio.create_task(post(session, sluice.url, **KEY))
        # Past the lease: a marker the frozen Redis ran late for the first call has lapsed,
        # so the duplicate has had every chance to run.
        await asyncio.sleep(2.5)
        await ran_once(upstream, first, duplicate)


async def test_a_key_claimed_while_redis_was_away_takes_its_marker_once_it_answers(
        upstream, start_sluice, redis_server):
    """Another replica knew nothing of a key claimed from memory during the outage: its
    duplicate, sent once Redis answered again, ran the upstream while the first still ran."""
    a, b = await two_replicas(start_sluice, upstream, redis_server, "1s")
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = await first_call_while_frozen(session, upstream, redis_server, a.url)
        await backend_up(a)
        await backend_up(b)
        await asyncio.sleep(1.0)  # a third of the lease: the key has taken its marker
        duplicate = asyncio.create_task(post(session, b.url, **KEY))
        await asyncio.sleep(2.5)  # past the lease: the marker is kept, not left to lapse
        await ran_once(upstream, first, duplicate)


async def test_a_key_claimed_while_redis_was_away_takes_its_marker_as_soon_as_it_answers(
        upstream, start_sluice, redis_server):
    """The marker was taken at the registration's next try, a third of ``state.lease`` after
    the one the outage failed (20 s here): until then, a duplicate sent to another replica
    found the key free and ran the upstream a second time while the first still ran. The
    registration now tries again as soon as its replica sees Redis back."""
    a, b = await two_replicas(start_sluice, upstream, redis_server, "60s")
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = await first_call_while_frozen(session, upstream, redis_server, a.url)
        await backend_up(a)
        for _ in range(500):  # 10 s, half the registration's schedule
            if await flight_markers(redis_server, a):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the key took no marker once Redis answered again")
        await backend_up(b)
        duplicate = asyncio.create_task(post(session, b.url, **KEY))
        await asyncio.sleep(0.5)  # the duplicate has had time to run upstream, had it been let
        await ran_once(upstream, first, duplicate)


async def flight_markers(redis_server, sluice) -> list[bytes]:
    """The in-flight markers under ``sluice``'s key prefix in the test's own Redis."""
    prefix = yaml.safe_load(sluice.config_path.read_text())["state"]["key_prefix"]
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        return [k async for k in client.scan_iter(match=f"{prefix}:*flight*")]
    finally:
        await client.aclose()


def answers_kept(redis_server, sluice) -> bool:
    """An answer is kept in the test's own Redis under ``sluice``'s key prefix (a record
    with a status: :mod:`policies.state.idempotency`'s layout)."""
    prefix = yaml.safe_load(sluice.config_path.read_text())["state"]["key_prefix"]
    with redis_server.client() as client:
        return any(client.hget(k, "status") for k in client.scan_iter(match=f"{prefix}:*:idem"))


@pytest.mark.parametrize("outage", ["freeze", "restart"])
async def test_a_marker_lost_while_its_call_runs_is_taken_again(
        upstream, start_sluice, redis_server, outage):
    """Redis frozen for longer than ``state.lease``, or restarted empty, while a keyed call
    runs: its marker was gone, the renewal found it so and stopped, and a duplicate sent to
    another replica once Redis answered again ran the upstream a second time while the
    first still ran. The marker is now taken again when the key is free (a twin that took
    it meanwhile keeps it)."""
    a, b = await two_replicas(start_sluice, upstream, redis_server,
                              "1s" if outage == "freeze" else "30s")
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, a.url, **KEY))
        await wait_for(lambda: len(upstream.requests) == 1, what="the first call upstream")
        assert await flight_markers(redis_server, a)
        if outage == "freeze":
            redis_server.freeze()
            try:
                await asyncio.sleep(2.0)  # twice the lease: the marker lapses at the thaw
            finally:
                redis_server.thaw()
        else:
            redis_server.stop()
            redis_server.start()  # empty, on the same port
        await backend_up(a)
        await backend_up(b)
        for _ in range(250):
            if await flight_markers(redis_server, a):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the running call's marker was not taken again")
        duplicate = asyncio.create_task(post(session, b.url, **KEY))
        await asyncio.sleep(0.5)  # the duplicate has had time to run upstream, had it been let
        await ran_once(upstream, first, duplicate)


async def test_an_answer_kept_while_redis_was_away_is_replayed_on_every_replica(
        upstream, start_sluice, redis_server):
    a, b = await two_replicas(start_sluice, upstream, redis_server, "1s")
    async with aiohttp.ClientSession() as session:
        redis_server.freeze()
        try:
            status, _, _ = await post(session, a.url, **KEY)
        finally:
            redis_server.thaw()
        assert status == 200
        await backend_up(a)
        await backend_up(b)
        await asyncio.sleep(1.5)  # past the lease of a marker the frozen Redis ran late
        status_a, headers_a, _ = await post(session, a.url, **KEY)
        # The answer reaches Redis in the background: waited for, as a busy machine may
        # write it later than a fixed 0.5 s (B would then find no answer and run the call).
        await wait_for(lambda: answers_kept(redis_server, a), what="the answer in Redis")
        status_b, headers_b, _ = await post(session, b.url, **KEY)
    assert (status_a, headers_a.get("Idempotent-Replayed")) == (200, "true")
    assert (status_b, headers_b.get("Idempotent-Replayed")) == (200, "true")
    assert len(upstream.requests) == 1, "the keyed work ran again after Redis came back"


async def test_an_answer_whose_write_met_a_short_freeze_is_kept(
        upstream, start_sluice, redis_server):
    """The first call ends while Redis is frozen for less than the lease: its answer's write
    timed out and was dropped (logged), so a retry sent once Redis answered again ran the
    keyed work a second time (measured: 2 executions after a 1.5 s freeze, lease 3 s). The
    write is now tried again while the key's marker could still be its own."""
    a, b = await two_replicas(start_sluice, upstream, redis_server, "3s")
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, a.url, **KEY))
        await wait_for(lambda: len(upstream.requests) == 1, what="the first call upstream")
        redis_server.freeze()
        try:
            upstream.hold.set()
            status, _, _ = await first
            await asyncio.sleep(0.5)  # its answer's write meets the frozen Redis
        finally:
            redis_server.thaw()
        assert status == 200
        await backend_up(a)
        await backend_up(b)
        retry_status, retry_headers, _ = await post(session, b.url, **KEY)
    assert (retry_status, retry_headers.get("Idempotent-Replayed")) == (200, "true")
    assert len(upstream.requests) == 1, "the keyed work ran again after a short freeze"
