"""Policies reconfigured in place, state carried across reloads, and what a reload holds back."""

from __future__ import annotations

import asyncio

import pytest

from policies.concurrency import ConcurrencyLimiter
from policies.config import RateConfig
from policies.pipeline import Admission, Call
from policies.rate import RateLimiter
from policies.reasons import Reason, Rejected
from policies.state import memory_backends
from proxy.config import parse_config
from proxy.events import EventLog
from proxy.reload import keep_restart_only
from proxy.routes import Route, carry_over


async def _queue(limiter: ConcurrencyLimiter, tenant: str = "t") -> asyncio.Task[None]:
    queued = limiter.queued
    task = asyncio.create_task(limiter.acquire(tenant))
    await asyncio.sleep(0)
    assert limiter.queued == queued + 1
    return task


def _call(tenant: str) -> Call:
    return Call(request_id="r", route="r", method="POST", path="/r/", headers={}, body=b"",
                tenant=tenant)


async def test_raised_limit_admits_waiters_at_once():
    limiter = ConcurrencyLimiter(limit=1, queue=10, max_wait=30.0, per_tenant=None)
    await limiter.acquire("t")
    waiters = [await _queue(limiter) for _ in range(3)]
    limiter.reconfigure(limit=3, queue=10, max_wait=30.0, per_tenant=None)
    await asyncio.sleep(0)
    assert [w.done() for w in waiters] == [True, True, False]
    assert (limiter.inflight, limiter.queued) == (3, 1)
    limiter.release("t", 0.1)  # the freed slot passes to the last waiter
    await asyncio.sleep(0)
    assert waiters[2].done() and (limiter.inflight, limiter.queued) == (3, 0)


async def test_lowered_limit_retires_slots_before_handing_any_over():
    limiter = ConcurrencyLimiter(limit=3, queue=10, max_wait=30.0, per_tenant=None)
    for _ in range(3):
        await limiter.acquire("t")
    waiter = await _queue(limiter)
    limiter.reconfigure(limit=1, queue=10, max_wait=30.0, per_tenant=None)
    limiter.release("t", None)
    limiter.release("t", None)
    await asyncio.sleep(0)
    assert not waiter.done() and limiter.inflight == 1  # nothing dropped, nothing handed over
    limiter.release("t", None)
    await asyncio.sleep(0)
    assert waiter.done() and limiter.inflight == 1
    limiter.release("t", None)
    assert limiter.inflight == 0


async def test_per_tenant_cap_switched_on_counts_requests_already_in_flight():
    limiter = ConcurrencyLimiter(limit=10, queue=0, max_wait=1.0, per_tenant=None)
    await limiter.acquire("a")
    await limiter.acquire("a")
    limiter.reconfigure(limit=10, queue=0, max_wait=1.0, per_tenant=2)
    with pytest.raises(Rejected) as refused:
        await limiter.acquire("a")
    assert refused.value.reason is Reason.TENANT_CONCURRENCY
    await limiter.acquire("b")
    limiter.release("a", None)
    await limiter.acquire("a")
    assert limiter.state()["tenants"] == {"a": 2, "b": 1}


async def test_smaller_queue_refuses_newcomers_but_keeps_the_queued():
    limiter = ConcurrencyLimiter(limit=1, queue=3, max_wait=30.0, per_tenant=None)
    await limiter.acquire("t")
    waiters = [await _queue(limiter) for _ in range(2)]
    limiter.reconfigure(limit=1, queue=1, max_wait=30.0, per_tenant=None)
    with pytest.raises(Rejected) as refused:
        await limiter.acquire("t")
    assert refused.value.reason is Reason.QUEUE_FULL
    limiter.release("t", None)
    limiter.release("t", None)
    await asyncio.sleep(0)
    assert all(w.done() and w.exception() is None for w in waiters)


async def test_changed_rate_keeps_the_bucket_level():
    limiter = RateLimiter(RateConfig.model_validate({"requests": "5/min"}), memory_backends(),
                          "r")
    for _ in range(5):
        await limiter.admit(_call("t"))
    assert limiter.state()["requests"] == {"rate": "5/min", "available": 0}
    limiter.reconfigure(RateConfig.model_validate({"requests": "6/min"}))
    await limiter.admit(_call("t"))  # one more fits the bigger bucket...
    with pytest.raises(Rejected):
        await limiter.admit(_call("t"))  # ...and no fresh burst was granted


async def test_tenant_buckets_follow_the_new_per_tenant_rate():
    limiter = RateLimiter(RateConfig.model_validate({"per_tenant": {"requests": "1/min"}}),
                          memory_backends(), "r")
    await limiter.admit(_call("a"))
    with pytest.raises(Rejected):
        await limiter.admit(_call("a"))
    limiter.reconfigure(RateConfig.model_validate({"per_tenant": {"requests": "2/min"}}))
    await limiter.admit(_call("a"))
    with pytest.raises(Rejected):
        await limiter.admit(_call("a"))
    # The per-tenant rate dropped, a route-wide one kept (an empty rate block is an error).
    limiter.reconfigure(RateConfig.model_validate({"requests": "1000/min"}))
    for _ in range(5):
        await limiter.admit(_call("a"))
    state = limiter.state()
    assert (state["tokens"], state["per_tenant"]) == (None, None)


def _routes(yaml_text: str) -> list[Route]:
    config = parse_config(yaml_text)
    return [Route(rc, EventLog(None)) for rc in config.routes]


ROUTE = """
routes:
  - name: r
    path_prefix: /r/
    upstream: http://127.0.0.1:1
    concurrency: {{limit: {limit}, queue: 4}}
    rate: {{requests: {rate}}}
"""


def test_take_over_keeps_unchanged_policies_and_reconfigures_changed_ones():
    (old,) = _routes(ROUTE.format(limit=2, rate="10/s"))
    old.present = old.inflight = 1  # an admitted call, present on its route object
    (new,) = _routes(ROUTE.format(limit=5, rate="10/s"))
    new.take_over(old)
    assert new.concurrency is old.concurrency and new.concurrency.limit == 5
    assert new.rate is old.rate
    assert new.inflight_total == 1 and new.retired == (old,)
    (newer,) = _routes(ROUTE.format(limit=5, rate="10/s"))
    old.inflight = 0  # admitted no more, but still present (answering): kept
    newer.take_over(new)
    assert newer.retired == (old,)
    (newest,) = _routes(ROUTE.format(limit=5, rate="10/s"))
    old.present = 0
    newest.take_over(newer)
    assert newest.retired == () and newest.concurrency is old.concurrency


@pytest.mark.parametrize(("before", "after"), [("openai", "anthropic"), ("anthropic", "openai")])
async def test_a_reload_that_changes_the_protocol_keeps_limiting_every_call(before, after):
    """A review: a reload changing a route's protocol kept its rate (the block unchanged) with
    the old protocol, which left the request units of calls only that protocol meters
    (``/v1/embeddings`` on openai) to the new accounting step, which does not meter them:
    they took no unit at all, and ``rate.requests: 1/min`` let every one through."""
    text = """
routes:
  - name: a
    path_prefix: /a/
    upstream: http://127.0.0.1:1
    protocol: {protocol}
    rate: {{requests: 1/min}}
    budget: {{tokens: 100000/day, per: tenant}}
"""
    for path in ("/a/v1/embeddings", "/a/v1/messages", "/a/v1/chat/completions"):
        backends = memory_backends()
        old, new = (Route(parse_config(text.format(protocol=p)).routes[0], EventLog(None),
                          state=backends) for p in (before, after))
        new.take_over(old)
        assert new.rate is old.rate
        admitted = Admission()
        await admitted.admit(new.base_plan.policies, _call_to(path))
        refused = Admission()
        with pytest.raises(Rejected) as caught:
            await refused.admit(new.base_plan.policies, _call_to(path))
        assert caught.value.reason is Reason.RATE_LIMITED, path


def _call_to(path: str) -> Call:
    return Call(request_id="r", route="a", method="POST", path=path, headers={},
                body=b'{"model": "m", "input": "hi", "max_tokens": 5}', tenant="t")


def test_carry_over_without_reconfigure_takes_the_fresh_object():
    old, new = object(), object()
    assert carry_over(old, new, {"a": 1}, {"a": 1}) is old
    assert carry_over(old, new, {"a": 1}, {"a": 2}) is new
    assert carry_over(None, new, None, {"a": 2}) is new
    assert carry_over(old, None, {"a": 1}, None) is None


def test_restart_only_keys_are_held_back():
    running = parse_config("server: {listen: 127.0.0.1:1000}\n" + ROUTE.format(limit=1, rate="1/s"))
    new = parse_config(
        "server: {listen: 127.0.0.1:2000, drain_timeout: 9s}\nevents: {path: /tmp/x}\n"
        "state: {backend: memory}\n" + ROUTE.format(limit=3, rate="1/s"))
    applied, held = keep_restart_only(running, new)
    assert held == ["server.listen", "events.path"]
    assert applied.server.listen == "127.0.0.1:1000" and applied.events.path is None
    assert applied.server.drain_timeout == 9.0
    assert applied.routes[0].concurrency.limit == 3
    # A whole section held back is named by the keys of it that changed.
    moved = parse_config("state: {backend: redis, redis_url: 'redis://127.0.0.1:1/0'}\n"
                         + ROUTE.format(limit=1, rate="1/s"))
    assert keep_restart_only(running, moved)[1] == [
        "server.listen", "state.backend", "state.redis_url"]


def test_a_reload_cannot_bound_held_bodies_below_the_largest_body_in_force(caplog):
    # A new user lowered both max_request_bytes (restart-only: still 2 MiB) and
    # max_buffered_bytes to 1 MiB: the reload applied the second, and every body over 1 MiB
    # was refused buffers_full "retry" for good. The file alone was valid.
    route = ROUTE.format(limit=1, rate="1/s")
    running = parse_config("server: {max_request_bytes: 2097152, max_buffered_bytes: 8388608}\n"
                           + route)
    new = parse_config("server: {max_request_bytes: 1048576, max_buffered_bytes: 1048576}\n"
                       + route)
    applied, held = keep_restart_only(running, new)
    assert held == ["server.max_request_bytes"]
    assert applied.server.max_request_bytes == 2097152
    assert applied.server.max_buffered_bytes == 8388608  # held at the running value
    assert "max_buffered_bytes (1048576) is less than the max_request_bytes in force" in \
        caplog.text
    lower = parse_config("server: {max_request_bytes: 2097152, max_buffered_bytes: 4194304}\n"
                         + route)
    assert keep_restart_only(running, lower)[0].server.max_buffered_bytes == 4194304
