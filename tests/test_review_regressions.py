"""Regressions found by the adversarial review of the CPU-optimised request path
(57359db..80d76e3), each through the real proxy in this process (as
``tests/test_pipeline_regressions.py`` does) or on the policy objects themselves."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from policies import breaker as brk
from policies.config import CircuitBreakerConfig
from policies.reasons import Rejected
from policies.state import memory_backends
from policies.state.breaker import OPEN, MemoryBreakerStates
from policies.state.rate import Take
from proxy import attempts
from proxy.config import parse_config
from tests.conftest import raw_request
from tests.fakeupstream import FakeUpstream, RawUpstream
from tests.test_pipeline_regressions import post, proxy
from tests.test_resilience_units import Clock

# -- Content-Length with more digits than int() reads -------------------------------------------

#: A Content-Length of 1 written with 5,000 leading zeros: RFC 9110 §8.6 allows any number of
#: digits, llhttp reads it as 1, but Python's int() refuses a string of more than 4,300 digits
#: (``sys.int_max_str_digits``).
ZERO_PADDED_ONE = "0" * 5000 + "1"


async def test_a_zero_padded_content_length_is_read_not_a_500(upstream: FakeUpstream) -> None:
    # Seen: the edge read Content-Length with int() on the header's text (the request's
    # content_length property before, the header itself since the edge reads it) and a
    # 5,001-digit value raised ValueError outside the handler: 500 internal_error, and a
    # traceback logged for each such request.
    config = f"""
routes:
  - name: r
    path_prefix: /r/
    upstream: {upstream.url}
    protocol: http
"""
    async with proxy(config) as sluice:
        answer = await raw_request(
            sluice.port,
            (f"POST /r/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {ZERO_PADDED_ONE}"
             "\r\nConnection: close\r\n\r\nx").encode())
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert len(upstream.requests) == 1 and upstream.requests[0].body == b"x"


async def test_an_upstreams_zero_padded_content_length_is_relayed() -> None:
    # The relay read the upstream's Content-Length the same way: a 5,001-digit one raised
    # ValueError in the relay, logged as a "proxy error" with its traceback, and the caller
    # got 502 for a well-formed 2-byte answer.
    raw = RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                      + ZERO_PADDED_ONE.encode()[:-1] + b"2\r\nConnection: close\r\n\r\nok")
    await raw.start()
    config = f"""
routes:
  - name: r
    path_prefix: /r/
    upstream: {raw.url}
    protocol: http
"""
    try:
        async with proxy(config) as sluice, aiohttp.ClientSession() as session:
            async with session.get(sluice.url("/r/x")) as response:
                assert (response.status, await response.read()) == (200, b"ok")
    finally:
        await raw.stop()


# -- a half-open probe that outlives its lease ------------------------------------------------


async def test_a_probe_past_its_lease_no_longer_refuses_every_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen: on a memory route a probe whose upstream is slow to answer (timeouts.total is 600 s
    # by default) keeps the view "half-open, a probe in flight" until it ends, so the
    # pipeline's check() refuses every call 503 circuit_open for that long. The state itself
    # lets another call probe once the probe's lease (PROBE_LEASE_S) has lapsed, as a probing
    # replica that died would (the sibling of ef19128, a probe whose caller left).
    clock = Clock()
    monkeypatch.setattr(brk.time, "monotonic", clock)
    backends = memory_backends()
    backends.breakers = MemoryBreakerStates(clock)
    breaker = brk.Breaker(CircuitBreakerConfig(fail_max=1, reset_timeout="5s"), "r",
                          lambda *a, **k: None, backends)
    await breaker.record(await breaker.attempt(), brk.FAILURE)
    clock.now += 5
    breaker.check()
    await breaker.attempt()  # the probe: its upstream does not answer
    with pytest.raises(Rejected):
        breaker.check()  # while its lease holds, the others wait for its verdict
    clock.now += brk.PROBE_LEASE_S + 1
    breaker.check()  # the lease lapsed: the next caller may probe
    second = await breaker.attempt()
    assert second.ticket.probe is not None
    await breaker.record(second, brk.SUCCESS)
    assert breaker.current == "closed"


# -- a reload between a call's rate step and its accounting step --------------------------------


def _twin_route(upstream_url: str, budget: bool) -> str:
    return f"""
routes:
  - name: r
    path_prefix: /r/
    upstream: {upstream_url}
    protocol: openai
    rate: {{per_tenant: {{requests: 2/min}}}}
    idempotency: {{mode: dedup, derive_from: [X-Step]}}
""" + ("    budget: {tokens: 100000/day}\n" if budget else "")


@pytest.mark.parametrize("budget_before", [False, True])
async def test_a_reload_while_a_call_waits_for_its_twin_keeps_its_rate_limit(
        upstream: FakeUpstream, budget_before: bool) -> None:
    # Seen: which step takes a metered call's request units (the rate step, or the
    # accounting step with its tokens and budget holds) is a flag on the route's rate limiter,
    # which a reload keeps and sets from the *new* blocks, while a call already past the
    # reload's swap runs the *old* plan's accounting step. A call that waited for its twin
    # across a reload adding a budget skipped the rate step (the flag said "the accounting
    # takes them") and the old accounting step took nothing (no budget in its blocks): it
    # reached the upstream without spending its unit of the tenant's 2/min. A reload removing
    # the budget made the call pay its unit twice: refused 429 with one unit still free.
    upstream.hold = asyncio.Event()
    upstream.statuses = [500]  # the first call fails: its key goes to the waiting twin
    async with proxy(_twin_route(upstream.url, budget_before)) as sluice, \
            aiohttp.ClientSession() as session:
        url = sluice.url("/r/v1/chat/completions")
        first = asyncio.create_task(post(session, url, **{"X-Step": "1"}))
        while upstream.inflight < 1:
            await asyncio.sleep(0.01)
        twin = asyncio.create_task(post(session, url, **{"X-Step": "1"}))
        while sluice.route().idempotency.waiting < 1:
            await asyncio.sleep(0.01)
        sluice.runtime.configure(parse_config(_twin_route(upstream.url, not budget_before)))
        upstream.hold.set()
        assert (await first)[0] == 500  # it reached the upstream: its unit is spent
        status, headers, _ = await twin
        assert (status, headers.get("X-Sluice-Reason")) == (200, None)
        assert len(upstream.requests) == 2
        # Each call spent one unit of the tenant's two, no more, no less.
        buckets = sluice.runtime.state.rates
        (left,) = await buckets.available("r", [Take("tenant:default", 2, 60.0)])
        assert left == 0
        with_key = await post(session, url)
        assert (with_key[0], with_key[1].get("X-Sluice-Reason")) == (429, "rate_limited")


# -- a caller leaving while an attempt's outcome is recorded to its first breaker -------------


class _SlowRecordStates(MemoryBreakerStates):
    """Memory breaker states whose record suspends, as a Redis round trip does."""

    async def record(self, *args, **kwargs):
        await asyncio.sleep(0.05)
        return await super().record(*args, **kwargs)


async def test_a_caller_leaving_during_the_first_breakers_record_still_reports_to_the_rest():
    # Seen (review): the attempt recorded to each of its breakers (the route's, the tool's)
    # in turn; a cancellation surfacing at the first record (shielded: it runs to its end)
    # skipped the others, whose tickets were never recorded nor released; a half-open
    # probe's lease stayed held until PROBE_LEASE_S.
    def breaker(states) -> brk.Breaker:
        backends = memory_backends()
        backends.breakers = states
        return brk.Breaker(CircuitBreakerConfig(fail_max=1, reset_timeout="30s"), "r",
                           lambda *a, **k: None, backends)

    states = _SlowRecordStates(), MemoryBreakerStates()
    first, second = breaker(states[0]), breaker(states[1])
    tickets = [(first, await first.attempt()), (second, await second.attempt())]
    task = asyncio.create_task(attempts._record_each(tickets, brk.FAILURE))
    await asyncio.sleep(0.01)  # inside the first breaker's record
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)  # the handed-over record lands
    # (The first record itself is shielded on Redis, the only states that suspend; this
    # stand-in is not, so what it counted is not asserted.)
    assert (await states[1].view("r")).state == OPEN

