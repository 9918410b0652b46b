"""The rate policy end to end: 429 at once, with a Retry-After that tells the truth.

A rate ``N/period`` admits a burst of ``N`` and then one request every ``period / N`` seconds,
so right after a burst the next request can pass in ``period / N`` seconds: that is the wait
Sluice must advertise (less the little that leaked while the burst was sent).
"""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp

from tests.conftest import route


async def get(session: aiohttp.ClientSession, url: str, tenant: str | None = None):
    headers = {"X-Tenant-ID": tenant} if tenant else {}
    started = time.monotonic()
    async with session.get(url, headers=headers) as r:
        return r.status, r.headers, await r.json(), time.monotonic() - started


def _assert_retry_after(headers, period_s: float, count: int, burst_started: float) -> float:
    """Retry-After matches the configured rate; returns the advertised wait in seconds.

    The bucket leaks from the burst's first request on, so the honest wait is ``period/count``
    less the time since then, never more.
    """
    refill_s = period_s / count
    leaked_s = time.monotonic() - burst_started
    wait_ms = int(headers["retry-after-ms"])
    assert (refill_s - leaked_s) * 1000 <= wait_ms <= refill_s * 1000
    assert headers["Retry-After"] == str(max(1, math.ceil(wait_ms / 1000)))
    return wait_ms / 1000


async def test_route_rate_answers_429_at_once_with_a_truthful_retry_after(upstream,
                                                                          start_sluice):
    sluice = await start_sluice({"routes": [
        route("svc", upstream.url, "openai", rate={"requests": "3/min"})]})
    url = sluice.url + "/svc/v1/models"
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        for _ in range(3):
            assert (await get(session, url))[0] == 200
        status, headers, body, _ = await get(session, url)
        assert status == 429
        assert headers["X-Sluice-Reason"] == "rate_limited"
        assert headers["x-should-retry"] == "true"
        assert _assert_retry_after(headers, 60, 3, started) > 10  # one request per 20 s
        assert headers["RateLimit-Policy"] == '"requests";q=3;w=60'
        assert headers["RateLimit"] == f'"requests";r=0;t={headers["Retry-After"]}'
        assert body["error"]["code"] == "rate_limited"
        assert body["error"]["type"] == "rate_limit_error"
        assert "3/min" in body["error"]["message"]
        # The route's rate binds every tenant.
        assert (await get(session, url, tenant="other"))[0] == 429
    assert len(upstream.requests) == 3
    assert await sluice.metric("sluice_rejections_total", route="svc",
                               reason="rate_limited") == 2


async def test_per_tenant_rate_leaves_other_tenants_alone(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route(
        "svc", upstream.url, "http",
        rate={"requests": "100/min", "per_tenant": {"requests": "2/min"}})]})
    url = sluice.url + "/svc/x"
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        assert [(await get(session, url, "a"))[0] for _ in range(2)] == [200, 200]
        status, headers, body, _ = await get(session, url, "a")
        assert status == 429
        assert headers["X-Sluice-Reason"] == "rate_limited"
        _assert_retry_after(headers, 60, 2, started)
        assert headers["RateLimit-Policy"] == '"requests-per-tenant";q=2;w=60'
        assert body["error"]["reason"] == "rate_limited"
        assert [(await get(session, url, "b"))[0] for _ in range(2)] == [200, 200]
        assert (await get(session, url, "b"))[0] == 429
        # No tenant header: the default tenant has its own bucket.
        assert (await get(session, url))[0] == 200
    assert len(upstream.requests) == 5


async def test_waiting_the_advertised_time_is_enough(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        route("svc", upstream.url, "http", rate={"requests": "1/s"})]})
    url = sluice.url + "/svc/x"
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        assert (await get(session, url))[0] == 200
        status, headers, _, _ = await get(session, url)
        assert status == 429
        wait_s = _assert_retry_after(headers, 1, 1, started)
        assert headers["Retry-After"] == "1"  # whole seconds, rounded up (RFC 9110)
        await asyncio.sleep(wait_s)  # exactly what Sluice advertised
        assert (await get(session, url))[0] == 200


async def test_a_wait_beyond_what_sdks_honour_says_do_not_retry(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        route("svc", upstream.url, "anthropic", rate={"requests": "1/h"})]})
    url = sluice.url + "/svc/x"
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        assert (await get(session, url))[0] == 200
        status, headers, body, _ = await get(session, url)
    assert status == 429
    _assert_retry_after(headers, 3600, 1, started)
    assert headers["x-should-retry"] == "false"
    assert body == {"type": "error", "error": {"type": "rate_limit_error",
                                               "message": body["error"]["message"]}}
