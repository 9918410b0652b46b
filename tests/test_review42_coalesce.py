"""A review of "duplicates waiting for a key get its call's failure": a failure that came of
its caller (its deadline, its SDK's retry, its replica's drain) is not the call's, and a
twin runs the call itself; one that came of the call (the route's own retry deadline) is
shared; the waiters get the answer its caller got, headers included."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.conftest import route
from tests.redis_servers import TEST_TIMEOUT_S, delete_prefix, new_prefix, require_redis
from tests.test_idempotency import holder_and_waiting_twin, post, wait_for


async def test_an_attempt_cut_by_its_callers_deadline_is_not_shared(upstream, start_sluice):
    """A route with no retry policy: the holder's single attempt is cut by its caller's
    deadline (X-Request-Timeout: 1), a 504 "what was left of the caller's own timeout". The
    twin that sent no deadline runs the call itself (it was given that 504)."""
    upstream.hold = asyncio.Event()
    sluice = await start_sluice({"state": {"backend": "memory"}, "routes": [route(
        "tools", upstream.url, "http", idempotency={"mode": "dedup"})]})
    url = sluice.url + "/tools/v1/charge"
    headers = {"Idempotency-Key": "deadline-1"}
    async with aiohttp.ClientSession() as s:
        first, twin = await holder_and_waiting_twin(s, sluice, upstream, url, headers, "1")
        status, h, body = await first
        assert status == 504, (status, body)
        upstream.hold.set()
        status, h, body = await twin
    # Should: the twin (no deadline) runs its own call and gets 200.
    assert (status, h.get("Idempotent-Replayed")) == (200, None), (status, h, body)


async def test_a_last_attempt_cut_by_its_callers_deadline_is_not_shared(upstream,
                                                                          start_sluice):
    """With retries: the first attempt is a 503, the second (the last, attempts: 2) is cut
    by the caller's deadline: retries end ``attempts_exhausted``, yet the failure is the
    caller's, and the twin that sent no deadline runs the call itself."""
    upstream.fail_first = 503  # at once; the second attempt hangs until the deadline
    upstream.hold = asyncio.Event()
    sluice = await start_sluice({"state": {"backend": "memory"}, "routes": [route(
        "tools", upstream.url, "http", idempotency={"mode": "dedup"},
        retry={"attempts": 2, "backoff": {"base": "10ms", "max": "10ms"}})]})
    url = sluice.url + "/tools/v1/charge"
    headers = {"Idempotency-Key": "deadline-2"}
    async with aiohttp.ClientSession() as s:
        first, twin = await holder_and_waiting_twin(s, sluice, upstream, url, headers, "1.5",
                                                    reached=2)
        status, h, body = await first
        assert status == 504, (status, h, body)
        upstream.hold.set()
        status, h, body = await twin
    assert (status, h.get("Idempotent-Replayed")) == (200, None), (status, h, body)


async def test_a_draining_replicas_failure_is_not_given_to_waiters_on_another(
        upstream, start_sluice):
    """Replica A holds the key, its attempt gets a 503 (Retry-After: 2) and backs off; A is
    told to stop (SIGTERM, drain_timeout 1s), so its retries stop ``draining`` and its
    caller gets the 503 with x-should-retry: false. Only A's shutdown stopped the retries:
    the twin waiting on replica B runs the call itself."""
    import signal
    url, prefix = require_redis(), new_prefix()
    state = {"backend": "redis", "redis_url": url, "key_prefix": prefix,
             "timeout": f"{int(TEST_TIMEOUT_S * 1000)}ms"}
    upstream.statuses = [503]
    upstream.error_headers = {"Retry-After": "2"}
    rt = {"retry": {"attempts": 3, "on": [503], "backoff": {"base": "10ms", "max": "50ms"}},
          "idempotency": {"mode": "dedup"}}
    try:
        a = await start_sluice({"server": {"drain_timeout": "1s"}, "state": state,
                                "routes": [route("tools", upstream.url, "http", **rt)]})
        b = await start_sluice({"state": state,
                                "routes": [route("tools", upstream.url, "http", **rt)]})
        headers = {"Idempotency-Key": "drain-1"}
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(post(s, a.url + "/tools/v1/charge", {"usd": 5},
                                             headers))
            await wait_for(lambda: any(e["event"] == "retried" for e in a.events()))
            twin = asyncio.create_task(post(s, b.url + "/tools/v1/charge", {"usd": 5},
                                            headers))
            await b.wait_metric("sluice_idempotency_waiting", 1, route="tools")
            a.signal(signal.SIGTERM)
            status, h, _ = await asyncio.wait_for(first, 10)
            assert (status, h.get("x-should-retry")) == (503, "false")
            status, h, body = await asyncio.wait_for(twin, 10)
        assert (status, h.get("Idempotent-Replayed")) == (200, None), (status, h, body)
    finally:
        delete_prefix(url, prefix)


async def test_an_sdk_retrys_one_attempt_is_not_given_to_a_first_attempt_twin(
        upstream, start_sluice):
    """The holder is an SDK's own retry (x-stainless-retry-count: 1): Sluice makes one
    attempt (stop ``sdk_retry``: the SDK owns its retries). A twin that is a first attempt,
    which Sluice gives its full retry cycle (attempts: 3), runs the call itself (here: 200)
    rather than being given that one attempt's 503."""
    upstream.hold = asyncio.Event()
    upstream.statuses = [503]  # then 200
    sluice = await start_sluice({"state": {"backend": "memory"}, "routes": [route(
        "tools", upstream.url, "http", idempotency={"mode": "dedup"},
        retry={"attempts": 3, "on": [503], "backoff": {"base": "10ms", "max": "10ms"}})]})
    url = sluice.url + "/tools/v1/charge"
    headers = {"Idempotency-Key": "sdk-1"}
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, url, {"usd": 5},
                                         {**headers, "x-stainless-retry-count": "1"}))
        await wait_for(lambda: len(upstream.requests) == 1)
        twin = asyncio.create_task(post(s, url, {"usd": 5},
                                        {**headers, "x-stainless-retry-count": "0"}))
        await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
        upstream.hold.set()
        status, h, _ = await first
        assert status == 503
        status, h, body = await twin
    assert (status, h.get("Idempotent-Replayed")) == (200, None), (status, h, body)


async def test_waiters_get_the_headers_their_twins_caller_got_when_its_relay_is_cut(
        start_sluice, tmp_path):
    """The last attempt's 503 is cut short while read (Content-Length 100, 7 bytes sent):
    the holder's caller gets Sluice's 502, without ``X-Sluice-Dead-Letter``; so do the
    waiters (they were given the dead letter's id of the relayed answer's additions)."""
    from tests.fakeupstream import RawUpstream

    class Held(RawUpstream):
        hold = asyncio.Event()

        async def _serve(self, reader, writer):
            await self.hold.wait()
            await super()._serve(reader, writer)

    raw = await Held(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"e\":1}").start()
    try:
        sluice = await start_sluice({
            "dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
            "state": {"backend": "memory"}, "routes": [route(
                "tools", raw.url, "http", idempotency={"mode": "dedup"},
                retry={"attempts": 2, "on": [503], "backoff": {"base": "10ms", "max": "10ms"}})]})
        url = sluice.url + "/tools/v1/charge"
        headers = {"Idempotency-Key": "cut-1"}
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(post(s, url, {"usd": 5}, headers))
            await asyncio.sleep(0.5)
            twin = asyncio.create_task(post(s, url, {"usd": 5}, headers))
            await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
            Held.hold.set()
            s1, h1, b1 = await first
            s2, h2, b2 = await twin
        assert s1 == 502 and s2 == 502 and h2.get("Idempotent-Replayed") == "true", (s1, s2)
        assert b1 == b2
        assert h2.get("X-Sluice-Dead-Letter") == h1.get("X-Sluice-Dead-Letter"), (h1, h2)
    finally:
        await raw.stop()


async def test_the_routes_own_retry_deadline_is_the_calls_and_shared(upstream, start_sluice):
    """The route's retry.deadline (1s) stops the retries (Retry-After 2 does not fit); the
    holder's caller sent a generous X-Request-Timeout (30). The twin, which the same route
    deadline would stop the same way, is given the failure (a first cut took any deadline
    stop of a caller that sent a deadline for the caller's, and the twin ran again)."""
    upstream.hold = asyncio.Event()
    upstream.status = 503
    upstream.error_headers = {"Retry-After": "2"}
    sluice = await start_sluice({"state": {"backend": "memory"}, "routes": [route(
        "tools", upstream.url, "http", idempotency={"mode": "dedup"},
        retry={"attempts": 3, "on": [503], "deadline": "1s",
               "backoff": {"base": "10ms", "max": "10ms"}})]})
    url = sluice.url + "/tools/v1/charge"
    headers = {"Idempotency-Key": "route-deadline-1", "X-Request-Timeout": "30"}
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, url, {"usd": 5}, headers))
        await wait_for(lambda: len(upstream.requests) == 1)
        twin = asyncio.create_task(post(s, url, {"usd": 5}, headers))
        await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
        upstream.hold.set()
        status, h, _ = await first
        assert status == 503
        status, h, _ = await twin
    assert (status, h.get("Idempotent-Replayed")) == (503, "true"), (status, h)
    assert len(upstream.requests) == 1
