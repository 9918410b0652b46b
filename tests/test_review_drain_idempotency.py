"""The drain's end and idempotency keys (from a hostile review): a queued call holding a key
and its twin waiting for that call's answer are both answered 503 ``draining`` (neither
reached the upstream), and the key is free afterwards on the shared state, so the retry the
answer invites runs on another replica instead of being refused or replayed."""

from __future__ import annotations

import asyncio
import signal

import aiohttp

from tests.conftest import route, status_of, wait_until
from tests.redis_servers import delete_prefix, new_prefix, require_redis
from tests.test_drain import CHAT, _answer, _by_request

PATH = "/openai/v1/chat/completions"


def _shared(upstream_url: str, **policies: object) -> tuple[dict, dict]:
    """A Redis state under a prefix of its own, and an ``openai`` route to ``upstream_url``
    with one slot, a queue of 4 and ``policies``."""
    state = {"backend": "redis", "redis_url": require_redis(), "key_prefix": new_prefix()}
    return state, route("openai", upstream_url, "openai", **policies,
                        concurrency={"limit": 1, "queue": 4, "max_wait": "60s"})


def _draining_soon(state: dict, openai: dict) -> dict:
    """A config serving ``openai`` on ``state`` whose drain ends 500 ms after SIGTERM."""
    return {"server": {"drain_timeout": "500ms"}, "state": state, "routes": [openai]}


async def _hold_the_slot(session: aiohttp.ClientSession, sluice, upstream) -> asyncio.Task:
    """A call holding the route's one slot at the upstream, until ``upstream.hold`` is set."""
    upstream.hold = asyncio.Event()
    held = asyncio.create_task(status_of(session, sluice.url + PATH, CHAT))
    await wait_until(lambda: upstream.inflight == 1, what="the call holding the slot")
    return held


async def test_a_key_held_by_a_queued_call_is_freed_and_its_twin_answered_at_the_drain_end(
        upstream, start_sluice):
    state, openai = _shared(upstream.url, idempotency={"mode": "dedup"})
    try:
        draining = await start_sluice(_draining_soon(state, openai))
        async with aiohttp.ClientSession() as session:
            held = await _hold_the_slot(session, draining, upstream)
            keyed = asyncio.create_task(_answer(
                session, draining.url + PATH, CHAT,
                {"X-Request-ID": "first", "Idempotency-Key": "k-1"}))
            await draining.wait_metric("sluice_queue_depth", 1, route="openai")
            twin = asyncio.create_task(_answer(
                session, draining.url + PATH, CHAT,
                {"X-Request-ID": "twin", "Idempotency-Key": "k-1"}))
            await asyncio.sleep(0.5)  # the twin is waiting for the first's answer
            assert not twin.done()
            draining.signal(signal.SIGTERM)
            first_answer, twin_answer = await keyed, await twin
            assert await draining.wait_exit(timeout=30) == 0
            upstream.hold.set()
            await asyncio.gather(held, return_exceptions=True)
            other = await start_sluice({"state": state, "routes": [openai]})
            # The retry Retry-After: 1 invites, on another replica: it runs.
            status, headers, _ = await _answer(session, other.url + PATH, CHAT,
                                               {"Idempotency-Key": "k-1"})
            await other.stop()
    finally:
        delete_prefix(str(state["redis_url"]), state["key_prefix"])
    for answer in (first_answer, twin_answer):
        assert (answer[0], answer[1]["X-Sluice-Reason"]) == (503, "draining"), answer
    assert status == 200, (status, headers.get("X-Sluice-Reason"))
    by_request = _by_request(draining.events())
    assert [e["event"] for e in by_request["first"]][-1] == "rejected"
    assert [e["event"] for e in by_request["twin"]].count("rejected") == 1
    assert not any(e["event"] == "completed" for e in by_request["twin"])
    assert len(upstream.requests) == 2  # the held call and the retry; neither keyed one ran


async def test_a_drain_answers_a_thousand_queued_calls_each_once(upstream, start_sluice):
    """Many calls queued at the drain's end: every one is answered 503 draining, each
    counted once as a refusal, none reaches the upstream, and the process exits 0."""
    n = 1500
    sluice = await start_sluice({
        "server": {"drain_timeout": "500ms", "max_connections": n + 50},
        "routes": [route("openai", upstream.url, "openai",
                         concurrency={"limit": 1, "queue": n, "max_wait": "120s"})]})
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        held = await _hold_the_slot(session, sluice, upstream)
        queued = [asyncio.create_task(_answer(session, sluice.url + PATH, CHAT,
                                              {"X-Request-ID": f"q{i}"})) for i in range(n)]
        await sluice.wait_metric("sluice_queue_depth", n, route="openai", timeout=120)
        sluice.signal(signal.SIGTERM)
        answers = await asyncio.gather(*queued, return_exceptions=True)
        assert await sluice.wait_exit(timeout=60) == 0
        upstream.hold.set()
        await asyncio.gather(held, return_exceptions=True)
    statuses = [a if isinstance(a, BaseException) else (a[0], a[1].get("X-Sluice-Reason"))
                for a in answers]
    assert statuses == [(503, "draining")] * n, [s for s in statuses
                                                  if s != (503, "draining")][:5]
    rejected = [e for e in sluice.events() if e["event"] == "rejected"]
    assert len(rejected) == n and len({e["request_id"] for e in rejected}) == n
    assert not any(e["event"] == "completed" and e["request_id"].startswith("q")
                   for e in sluice.events())
    assert len(upstream.requests) == 1
    assert "Traceback" not in sluice.stderr()


async def test_the_rate_unit_of_a_call_the_drain_answers_goes_back_to_the_shared_bucket(
        upstream, start_sluice):
    """A queued call took a request unit before it queued; answered 503 draining, it never
    reached the upstream, so the unit is refunded on Redis before the process exits: another
    replica has the rate less only the call that was cut at the upstream."""
    state, openai = _shared(upstream.url, rate={"requests": "3/h"})
    try:
        draining = await start_sluice(_draining_soon(state, openai))
        async with aiohttp.ClientSession() as session:
            held = await _hold_the_slot(session, draining, upstream)
            queued = asyncio.create_task(_answer(session, draining.url + PATH, CHAT, {}))
            await draining.wait_metric("sluice_queue_depth", 1, route="openai")
            draining.signal(signal.SIGTERM)
            assert (await queued)[0] == 503
            assert await draining.wait_exit(timeout=30) == 0
            upstream.hold.set()
            await asyncio.gather(held, return_exceptions=True)
            other = await start_sluice({"state": state, "routes": [openai]})
            statuses = [await status_of(session, other.url + PATH, CHAT) for _ in range(3)]
            await other.stop()
    finally:
        delete_prefix(str(state["redis_url"]), state["key_prefix"])
    assert statuses == [200, 200, 429]
