"""A reload that removes a ``concurrency`` or ``fanout`` block, or removes and re-adds it.

Found in a hostile trial: calls queued behind a block that a reload removed stayed in its
limiter and were refused ``queue_timeout`` (``fanout_limited``) at its ``max_wait``, on a
route with no limit any more, while newcomers went straight through; and a block added back
while calls admitted under it still ran started empty beside them (2 calls at the upstream on
``limit: 1``). Removing a limit is raising it without bound: the queued calls go at once; a
block added back counts the calls still in flight under it. Route, endpoint and fan-out
blocks, on memory and on Redis (where the leases are).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import yaml

from policies.pipeline import Call, Holding, Outcome
from policies.state import StateBackends, memory_backends
from proxy.config import parse_config
from proxy.events import EventLog
from proxy.routes import Route
from tests.conftest import open_runtime, route

DONE = Outcome("2xx", reached=True, status=200, service_s=0.01)
MEMORY_AND_REDIS = pytest.mark.parametrize("backends", ["memory", "redis"], indirect=True)

LIMIT = "{limit: 1, queue: 5, max_wait: 30s}"
ROUTE = """
routes:
  - name: h
    path_prefix: /h/
    upstream: http://127.0.0.1:1
    protocol: http
"""


def build(backends: StateBackends, **blocks: str) -> Route:
    """Route ``h`` with ``blocks`` (YAML flow text by key), on ``backends``."""
    text = ROUTE + "".join(f"    {key}: {value}\n" for key, value in blocks.items())
    (config,) = parse_config(text).routes
    return Route(config, EventLog(None), state=backends)


def reload(old: Route, backends: StateBackends, **blocks: str) -> Route:
    """The route ``old`` becomes on a reload to ``blocks``."""
    new = build(backends, **blocks)
    new.take_over(old)
    return new


def call(run: str | None = None) -> Call:
    return Call(request_id="r", route="h", method="GET", path="/h/slow", headers={}, body=b"",
                tenant="t", run=run)


async def queue(admit: Any, n: int, depth: Any) -> list[asyncio.Task[Holding]]:
    """``n`` calls of ``admit()`` that wait in a queue (``depth()`` counts them)."""
    tasks = [asyncio.create_task(admit()) for _ in range(n)]
    for _ in range(200):
        if depth() == n:
            return tasks
        await asyncio.sleep(0.01)
    raise AssertionError(f"{depth()} queued, not {n}")


async def served(tasks: list[asyncio.Task[Holding]]) -> list[Holding]:
    """The holdings ``tasks`` got; fails if one was refused or is still waiting."""
    done, pending = await asyncio.wait(tasks, timeout=2.0)
    assert not pending, f"{len(pending)} still queued"
    errors = [t.exception() for t in done if t.exception() is not None]
    assert not errors, errors
    return [t.result() for t in tasks]


async def no_leases(backends: StateBackends) -> None:
    """With Redis, wait for every lease of route ``h`` to be given back (in the background)."""
    if backends.redis is None:
        return
    for _ in range(100):
        if (await backends.leases.counts("h", "t"))[0] == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{(await backends.leases.counts('h', 't'))[0]} leases left")


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


# -- a route's concurrency block ----------------------------------------------------------------

@MEMORY_AND_REDIS
async def test_a_removed_concurrency_block_admits_its_queued_calls_at_once(
        backends: StateBackends):
    old = build(backends, concurrency=LIMIT)
    limiter = old.concurrency
    holder = await limiter.admit(call())
    waiters = await queue(lambda: limiter.admit(call()), 2, lambda: limiter.queued)
    new = reload(old, backends)
    assert new.concurrency is None
    slots = await served(waiters)  # at once: the test waits 2 s of a 30 s max_wait
    # A call that found its route before the reload and reaches the limiter only now (it was
    # in an earlier step) is admitted too, not queued behind a limit that is gone.
    late = await asyncio.wait_for(limiter.admit(call()), 2.0)
    for slot in (holder, *slots, late):
        slot.release(DONE)
    await settle()
    assert (limiter.inflight, limiter.queued, limiter._by_tenant) == (0, 0, {})
    await no_leases(backends)


@MEMORY_AND_REDIS
async def test_a_block_added_back_counts_the_calls_still_in_flight_under_it(
        backends: StateBackends):
    old = build(backends, concurrency=LIMIT)
    holder = await old.concurrency.admit(call())
    unlimited = reload(old, backends)
    again = reload(unlimited, backends, concurrency=LIMIT)
    limiter = again.concurrency
    # The old call still holds the only slot: a newcomer waits for it.
    (newcomer,) = await queue(lambda: limiter.admit(call()), 1, lambda: limiter.queued)
    await settle()
    assert not newcomer.done()
    holder.release(DONE)
    (slot,) = await served([newcomer])
    slot.release(DONE)
    await settle()
    assert (limiter.inflight, limiter.queued) == (0, 0)


@MEMORY_AND_REDIS
async def test_calls_admitted_while_a_block_was_removed_count_once_it_is_back(
        backends: StateBackends):
    old = build(backends, concurrency="{limit: 2, queue: 5, max_wait: 30s}")
    limiter = old.concurrency
    first = await limiter.admit(call())
    unlimited = reload(old, backends)
    # Admitted by the old object after the removal (a call past route matching then).
    second = await limiter.admit(call())
    third = await limiter.admit(call())
    again = reload(unlimited, backends, concurrency="{limit: 2, queue: 5, max_wait: 30s}")
    (newcomer,) = await queue(lambda: again.concurrency.admit(call()), 1,
                              lambda: again.concurrency.queued)
    first.release(DONE)
    await asyncio.sleep(0.6)  # the shared limiter's dispatcher asks Redis twice meanwhile
    assert not newcomer.done()  # 2 still in flight on a limit of 2: the lowered limit drains
    second.release(DONE)
    (slot,) = await served([newcomer])
    for held in (third, slot):
        held.release(DONE)
    assert (again.concurrency.inflight, again.concurrency.queued) == (0, 0)
    await no_leases(backends)


async def test_a_removed_block_is_forgotten_once_its_calls_are_done():
    backends = memory_backends()
    old = build(backends, concurrency=LIMIT)
    holder = await old.concurrency.admit(call())
    unlimited = reload(old, backends)
    holder.release(DONE)
    again = reload(unlimited, backends, concurrency=LIMIT)
    assert again.concurrency is not old.concurrency  # nothing held: a fresh one
    assert again.concurrency.inflight == 0


# -- an endpoint's concurrency block ------------------------------------------------------------

ENDPOINT = '{"GET /slow": {concurrency: ' + LIMIT + '}}'


def endpoint_limiter(route: Route) -> Any:
    return route.operations.by_name["GET /slow"].concurrency


@MEMORY_AND_REDIS
async def test_a_removed_endpoint_block_admits_its_queued_calls_at_once(
        backends: StateBackends):
    old = build(backends, endpoints=ENDPOINT)
    limiter = endpoint_limiter(old)
    holder = await limiter.admit(call())
    waiters = await queue(lambda: limiter.admit(call()), 2, lambda: limiter.queued)
    new = reload(old, backends)
    assert new.operations is None
    for slot in (holder, *await served(waiters)):
        slot.release(DONE)
    await settle()
    assert (limiter.inflight, limiter.queued) == (0, 0)


async def test_an_endpoint_block_added_back_counts_the_calls_still_in_flight_under_it():
    backends = memory_backends()
    old = build(backends, endpoints=ENDPOINT)
    holder = await endpoint_limiter(old).admit(call())
    # Removed in two ways: the whole ``endpoints`` key, then only the block's concurrency.
    unlimited = reload(old, backends)
    again = reload(unlimited, backends, endpoints=ENDPOINT)
    bare = reload(again, backends, endpoints='{"GET /slow": {timeouts: {total: 30s}}}')
    last = reload(bare, backends, endpoints=ENDPOINT)
    for each in (again, last):
        limiter = endpoint_limiter(each)
        (newcomer,) = await queue(lambda lim=limiter: lim.admit(call()), 1,
                                  lambda lim=limiter: lim.queued)
        await settle()
        assert not newcomer.done()
        newcomer.cancel()
        await settle()
    holder.release(DONE)
    assert endpoint_limiter(last).inflight == 0


# -- fan-out width ------------------------------------------------------------------------------

FANOUT = "{width: 1, max_wait: 30s}"


@MEMORY_AND_REDIS
async def test_a_removed_fanout_block_admits_the_runs_queued_calls_at_once(
        backends: StateBackends):
    old = build(backends, fanout=FANOUT)
    width = old.fanout
    holder = await width.admit(call("run1"))
    waiters = await queue(lambda: width.admit(call("run1")), 2,
                          lambda: sum(e.limiter.queued for e in width.runs.values()))
    new = reload(old, backends)
    assert new.fanout is None
    late = await asyncio.wait_for(width.admit(call("run1")), 2.0)
    other_run = await asyncio.wait_for(width.admit(call("run2")), 2.0)
    other_run2 = await asyncio.wait_for(width.admit(call("run2")), 2.0)
    for slot in (holder, *await served(waiters), late, other_run, other_run2):
        slot.release(DONE)
    await settle()
    assert width.runs == {}


async def test_a_fanout_block_added_back_counts_the_runs_calls_still_in_flight():
    backends = memory_backends()
    old = build(backends, fanout=FANOUT)
    holder = await old.fanout.admit(call("run1"))
    unlimited = reload(old, backends)
    again = reload(unlimited, backends, fanout=FANOUT)
    width = again.fanout
    (newcomer,) = await queue(lambda: width.admit(call("run1")), 1,
                              lambda: sum(e.limiter.queued for e in width.runs.values()))
    await settle()
    assert not newcomer.done()
    holder.release(DONE)
    (slot,) = await served([newcomer])
    slot.release(DONE)
    assert width.runs == {}


async def test_the_top_level_fanout_removed_and_added_back():
    """The same for the top-level ``fanout`` (every route's): its runs' queued calls go at
    once; added back while the old calls run, it counts them."""
    h = route("h", "http://127.0.0.1:1", "http")
    runtime = await open_runtime(h, fanout={"width": 1, "max_wait": "30s"})
    try:
        width = runtime.global_fanout
        holder = await width.admit(call("run1"))
        waiters = await queue(lambda: width.admit(call("run1")), 1,
                              lambda: sum(e.limiter.queued for e in width.runs.values()))
        runtime.configure(parse_config(yaml.safe_dump({"routes": [h]})))
        assert runtime.global_fanout is None
        (admitted,) = await served(waiters)
        runtime.configure(parse_config(yaml.safe_dump(
            {"fanout": {"width": 1, "max_wait": "30s"}, "routes": [h]})))
        again = runtime.global_fanout
        (newcomer,) = await queue(lambda: again.admit(call("run1")), 1,
                                  lambda: sum(e.limiter.queued for e in again.runs.values()))
        holder.release(DONE)
        await settle()
        assert not newcomer.done()  # one more still runs: the width drains to 1 first
        admitted.release(DONE)
        (slot,) = await served([newcomer])
        slot.release(DONE)
        assert again.runs == {}
    finally:
        await runtime.close()
