"""Refusals while replicas' rates differ (a reload reaching them one at a time): every shared
bucket is checked by the lowest rate a live replica records on it (``policies/state/rate.py``),
and the refusal must say so truthfully.

Two real Sluice processes (tests/sluice_child.py) on one Redis with different ``rate`` blocks,
and an aiohttp client reading statuses, headers and bodies:

* a token reservation that fits this replica's own token rate but not the lower one another
  replica still records is 429 ``token_rate_limited`` with a ``Retry-After`` until that
  record lapses (the other replica's ``state.lease``), and passes once retried after it:
  it was 400 ``exceeds_limit``, which tells a client never to retry a valid call;
* a refusal's ``RateLimit-Policy`` and message name the rate that refused it (the lowest
  live one), not this replica's own: they named this replica's configured rate.
"""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp
import pytest

from policies.state import StateBackends
from policies.state.rate import Holder, Take
from tests.conftest import route
from tests.redis_servers import replica

CHAT = "/openai/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


async def chat(session: aiohttp.ClientSession, url: str, max_tokens: int = 10,
               tenant: str = "acme") -> tuple[int, dict[str, str], str]:
    """Status, headers and error message (``''`` on a success) of one chat completion."""
    async with session.post(url + CHAT, json={"model": "gpt-test", "messages": MSG,
                                              "max_tokens": max_tokens},
                            headers={"X-Tenant-ID": tenant}) as r:
        answer = await r.json()
        message = answer["error"]["message"] if r.status != 200 else ""
        return r.status, dict(r.headers), message


def token_route(upstream_url: str, tokens: str) -> dict:
    return route("openai", upstream_url, rate={"tokens": tokens},
                 usage={"write_max_tokens": False})


@pytest.mark.parametrize("shared_state", ["redis"], indirect=True)
async def test_a_reservation_over_only_another_replicas_lower_token_rate_is_retryable(
        upstream, start_sluice, shared_state):
    """A is at ``1000/min`` tokens, B (reloaded first) at ``100/min``. A reservation of ~500
    at A fits A's own rate but not B's while B's record lives: 429 with ``Retry-After`` no
    later than B's record lapses (``state.lease: 2s`` after B's one take), and the same call
    retried after that wait passes. Only a reservation over A's own 1000 is 400."""
    state = {**shared_state, "lease": "2s"}  # the shortest the fixture's timeout allows
    a = await start_sluice({"state": state, "routes": [token_route(upstream.url, "1000/min")]})
    b = await start_sluice({"state": state, "routes": [token_route(upstream.url, "100/min")]})
    async with aiohttp.ClientSession() as session:
        assert (await chat(session, b.url))[0] == 200  # B's 100/min is recorded for 2 s
        status, headers, message = await chat(session, a.url, max_tokens=500)
        assert (status, headers["X-Sluice-Reason"]) == (429, "token_rate_limited"), message
        wait_ms = int(headers["retry-after-ms"])
        assert 0 < wait_ms <= 2000  # at most B's lease: its record lapses by then
        assert int(headers["Retry-After"]) <= 2
        assert headers["x-should-retry"] == "true"
        assert headers["RateLimit-Policy"] == '"tokens";q=100;w=60'  # B's, which refused
        assert "100/min" in message and "1000/min" in message, message
        await asyncio.sleep(wait_ms / 1000)
        assert (await chat(session, a.url, max_tokens=500))[0] == 200  # as promised
        status, headers, message = await chat(session, a.url, max_tokens=2000)
        assert (status, headers["X-Sluice-Reason"]) == (400, "exceeds_limit"), message
        assert headers["x-should-retry"] == "false"
    assert len(upstream.requests) == 2


@pytest.mark.parametrize("backends", ["redis"], indirect=True)
async def test_the_wait_over_a_lower_record_covers_its_lapse_and_the_level_then(
        backends: StateBackends):
    """The script's wait for an amount over only another holder's limit: until that record
    lapses, and longer if the level must still drain (at the rate it was stored with) to the
    limit that applies then. An amount over the holder's own limit never fits. The answer
    names the rate the bucket was checked by (for the refusal's ``RateLimit-Policy``)."""
    a, b = Holder("replica-a", 5.0), Holder("replica-b", 0.5)
    async with replica(backends) as other:
        assert (await other.rates.admit("r", [Take("tokens", 4, 120.0, 1)], b)).admitted
        soon = await backends.rates.admit("r", [Take("tokens", 10, 60.0, 8)], a)
        assert (soon.admitted, soon.denied) == (False, 0)
        assert 0 < soon.retry_after_s <= 0.5  # B's record lapses; then 1 + 8 <= 10
        assert soon.applied == pytest.approx((4, 120.0))  # the rate that refused: B's
        assert (await other.rates.admit("r", [Take("tokens", 4, 120.0, 3)], b)).admitted
        later = await backends.rates.admit("r", [Take("tokens", 10, 60.0, 8)], a)
        # 4 held, draining at B's 30 s a unit: 2 must drain for 4 + 8 to fit A's 10
        assert 59.0 < later.retry_after_s <= 60.0
        never = await backends.rates.admit("r", [Take("tokens", 10, 60.0, 11)], a)
        assert never.retry_after_s == math.inf


#: (A's rate block, B's, the bucket's RateLimit-Policy name, and the rate that refuses: the
#: smallest limit of the two and the longest interval, as q and w, and as the message says it)
CASES = {
    "requests": ({"requests": "600/min"}, {"requests": "2/min"}, "requests", 2, 60, "2/min"),
    # 10/min: 6 s a unit; 5/s: a burst of 5. The bucket: 5 at one per 6 s, i.e. 5 per 30 s.
    "requests-mixed": ({"requests": "10/min"}, {"requests": "5/s"}, "requests", 5, 30,
                       "5 per 30s"),
    "per-tenant": ({"per_tenant": {"requests": "600/min"}}, {"per_tenant": {"requests": "2/min"}},
                   "requests-per-tenant", 2, 60, "2/min"),
    "tokens": ({"tokens": "1000/min"}, {"tokens": "100/min"}, "tokens", 100, 60, "100/min"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shared_state", ["redis"], indirect=True)
async def test_a_refusal_names_the_lowest_live_rate_that_refused_it(
        upstream, start_sluice, shared_state, case):
    """B (reloaded first) takes once, recording its lower rate; A's calls are then refused
    by it. The refusal's ``RateLimit-Policy`` gives the q and w the bucket applied, and its
    message names that rate beside A's own."""
    mine, theirs, name, q, w, applied = CASES[case]
    state = {**shared_state, "lease": "30s"}  # B's record outlives the test
    usage = {"write_max_tokens": False}
    a = await start_sluice({"state": state, "routes": [
        route("openai", upstream.url, rate=mine, usage=usage)]})
    b = await start_sluice({"state": state, "routes": [
        route("openai", upstream.url, rate=theirs, usage=usage)]})
    async with aiohttp.ClientSession() as session:
        assert (await chat(session, b.url))[0] == 200
        for _ in range(20):
            status, headers, message = await chat(session, a.url, max_tokens=40)
            if status != 200:
                break
        assert status == 429, message
        assert headers["RateLimit-Policy"] == f'"{name}";q={q};w={w}'
        assert headers["RateLimit"].startswith(f'"{name}";r=')
        assert applied in message, message
        own = next(iter(mine.values()))
        assert str(own if isinstance(own, str) else own["requests"]) in message, message


@pytest.mark.parametrize("backends", ["redis"], indirect=True)
async def test_a_request_bucket_never_waits_forever_on_a_record_under_one(
        backends: StateBackends):
    """A request takes one unit, and Sluice records whole limits, so a request bucket meets
    a record it cannot fit only from another version (a record reads as any positive finite
    number). Such a record made the wait infinite: a 429 whose ``Retry-After`` cannot be
    written. It is a lower record like any other: the wait is until it lapses."""
    state = backends.redis
    assert state is not None
    key = state.key("r", "rate", "lim", "requests")
    expiry = int(time.time() * 1000) + 3_000
    await state.run(lambda client: client.hset(key, "other", f"0.5 120000000 {expiry}"))
    refused = await backends.rates.admit("r", [Take("requests", 10, 60.0)],
                                         Holder("replica-a", 5.0))
    assert (refused.admitted, refused.denied) == (False, 0)
    assert 0 < refused.retry_after_s <= 3.0
