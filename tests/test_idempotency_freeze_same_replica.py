"""A hostile trial of Sluice's Redis faults (trial/hostile, one replica): Redis frozen for
less than ``state.lease`` while a keyed call ran.

* The call ended during the freeze, its answer's write to Redis still being tried again; its
  retry on the same replica, Redis still frozen, fell back to this replica's memory, which
  held neither the call nor its answer, and ran the upstream a second time (200 with another
  answer), while the retry after the thaw was replayed the first one.
* Two duplicates already waiting for their twin in flight on the same replica were refused
  409 ``idempotency_conflict`` ~0.6 s into the freeze, though the replica knew that twin and
  answered it at 4 s: docs/idempotency.md says such a duplicate waits for its twin.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tests.conftest import route
from tests.test_idempotency_fallback_flight import backend_up
from tests.test_shared_rate_budget import own_state, post, wait_for

KEY = {"Idempotency-Key": "pay-42", "X-Tenant-ID": "acme"}


async def one_replica(start_sluice, upstream, redis_server, lease: str):
    state = {**own_state(redis_server, "local"), "lease": lease}
    return await start_sluice({"state": state, "routes": [route(
        "openai", upstream.url, idempotency={"mode": "dedup", "max_wait": "30s"})]})


async def test_a_retry_during_a_short_freeze_is_replayed_the_answer_its_replica_gave(
        upstream, start_sluice, redis_server):
    sluice = await one_replica(start_sluice, upstream, redis_server, "4s")
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, sluice.url, **KEY))
        await wait_for(lambda: len(upstream.requests) == 1, what="the first call upstream")
        redis_server.freeze()
        try:
            upstream.hold.set()
            status, headers, _ = await first  # its answer's write meets the frozen Redis
            during = await post(session, sluice.url, **KEY)
        finally:
            redis_server.thaw()
        await backend_up(sluice)
        after = await post(session, sluice.url, **KEY)
    assert (status, headers.get("Idempotent-Replayed")) == (200, None)
    assert len(upstream.requests) == 1, "the retry during the freeze ran the keyed work again"
    assert (during[0], during[1].get("Idempotent-Replayed")) == (200, "true")
    assert (after[0], after[1].get("Idempotent-Replayed")) == (200, "true")


async def test_duplicates_waiting_for_a_twin_on_their_replica_wait_through_a_freeze(
        upstream, start_sluice, redis_server):
    sluice = await one_replica(start_sluice, upstream, redis_server, "5s")
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, sluice.url, **KEY))
        await wait_for(lambda: len(upstream.requests) == 1, what="the first call upstream")
        duplicates = [asyncio.create_task(post(session, sluice.url, **KEY)) for _ in range(2)]
        await asyncio.sleep(0.5)  # they wait for their twin, in Redis
        redis_server.freeze()
        try:
            await asyncio.sleep(1.5)  # past the look-ups the frozen Redis leaves unanswered
            upstream.hold.set()
            (status, _, _), *waited = [await first, *[await d for d in duplicates]]
        finally:
            redis_server.thaw()
    assert status == 200
    assert [(s, h.get("Idempotent-Replayed")) for s, h, _ in waited] == [(200, "true")] * 2
    assert len(upstream.requests) == 1


async def test_a_duplicate_waiting_through_a_freeze_runs_when_its_twin_leaves_no_answer(
        upstream, start_sluice, redis_server):
    """The twin on the same replica ends with no outcome during the freeze (its caller
    leaves; a failure would be given to the duplicate instead): the key is handed to the
    duplicate, which runs its own request, and its answer is the key's."""
    sluice = await one_replica(start_sluice, upstream, redis_server, "5s")
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, sluice.url, **KEY))
        await wait_for(lambda: len(upstream.requests) == 1, what="the first call upstream")
        duplicate = asyncio.create_task(post(session, sluice.url, **KEY))
        await asyncio.sleep(0.5)  # it waits for its twin, in Redis
        redis_server.freeze()
        try:
            await asyncio.sleep(1.5)  # past the look-ups the frozen Redis leaves unanswered
            first.cancel()
            await wait_for(lambda: upstream.cancelled == 1, what="the first call cancelled")
            upstream.hold.set()
            dup_status, dup_headers, _ = await duplicate
        finally:
            redis_server.thaw()
        await backend_up(sluice)
        retry_status, retry_headers, _ = await post(session, sluice.url, **KEY)
    assert (dup_status, dup_headers.get("Idempotent-Replayed")) == (200, None)
    assert (retry_status, retry_headers.get("Idempotent-Replayed")) == (200, "true")
    assert len(upstream.requests) == 2
