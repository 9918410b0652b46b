"""Gauges that lied after a fault or a reload (a hostile trial at 7e2c916): each test failed
before its fix. Real ``sluice serve`` processes; Redis under a key prefix of the test's own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from pathlib import Path

import aiohttp
import redis
import yaml

from proxy.config import StrictLoader
from tests.conftest import SluiceProcess, route, status_of, wait_until
from tests.redis_servers import delete_prefix, new_prefix, require_redis
from tests.test_review_redis_round35 import budgeted_replicas, eventually

CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


# -- 1. a killed replica's lapsed reservation stayed in the gauges of an idle route -------------


async def test_a_killed_replicas_lapsed_reservation_leaves_the_gauges_at_the_next_scrape(
        upstream, start_sluice):
    """B holds a reservation for a call at the upstream; A's call for the same tenant settles
    meanwhile, so A shows B's reservation in ``sluice_budget_reserved``. B is SIGKILLed. Once
    the reservation's hold has passed, A's next scrape shows nothing reserved (it showed it
    until the route's next call, however long after: 227 tokens at +180 s of a 120 s hold).

    The hold is 2 minutes at least (``policies.budget.HOLD_S``; no config shortens it), so
    the test moves the reservation's expiry into the past in Redis, as 2 minutes would."""
    url, prefix = require_redis(), new_prefix()
    a, b = await budgeted_replicas(start_sluice, upstream, url, prefix)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    labels = {"route": "openai", "tenant": tenant, "unit": "tokens"}
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        async with aiohttp.ClientSession() as session:
            chat = a.url + "/openai/v1/chat/completions"
            on_b = asyncio.create_task(status_of(
                session, b.url + "/openai/v1/chat/completions", CHAT,
                {"X-Tenant-ID": tenant, "x-fake-delay": "60"}))
            await wait_until(lambda: upstream.inflight == 1, what="B's call at the upstream")
            assert await status_of(session, chat, CHAT, {"X-Tenant-ID": tenant}) == 200
            held_by_b = await a.metric("sluice_budget_reserved", **labels)
            assert held_by_b > 0  # A's settle answered with B's reservation still held
            b.kill()
            with contextlib.suppress(aiohttp.ClientError):
                await on_b
        expiries = [key for key in client.scan_iter(match=f"{prefix}:*~resv-exp")]
        assert len(expiries) == 1
        assert client.zcard(expiries[0]) == 1  # B's; A's was settled
        client.zadd(expiries[0], {member: 0 for member in client.zrange(expiries[0], 0, -1)},
                    xx=True)
        await eventually(lambda: a.metric("sluice_budget_reserved", **labels), 0.0, 5.0,
                         "A's sluice_budget_reserved after B's reservation lapsed")
        # A's call spent 16 tokens (the fake's usage); B's is given back, spend unknown.
        assert await a.metric("sluice_budget_remaining", **labels) == 100000 - 16
    finally:
        client.close()
        delete_prefix(url, prefix)


# -- 2. a removed route's calls vanished from /metrics and /admin/routes ------------------------


def rewrite(path: Path, routes: list[dict]) -> None:
    """Replace the config's routes the way an editor saves: write aside, rename over."""
    data = yaml.load(path.read_text(), Loader=StrictLoader)
    data["routes"] = routes
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)


async def routes_view(sluice: SluiceProcess) -> dict:
    async with aiohttp.ClientSession() as s, s.get(sluice.admin_url + "/admin/routes") as r:
        return await r.json()


async def series(sluice: SluiceProcess, name: str) -> dict[str, float]:
    """``name``'s samples by route label."""
    return {dict(labels)["route"]: value for (sample, labels), value in
            (await sluice.metrics()).items() if sample == name}


async def test_a_removed_routes_calls_stay_in_its_gauges_until_they_end(upstream, start_sluice):
    """Route h, 2 calls at the upstream and 2 queued, is removed by a reload: its
    ``sluice_inflight_requests`` and ``sluice_queue_depth`` went, and ``/admin/routes`` had
    the queued calls nowhere. Added back while they run, its gauge counted only the new
    route's calls (2 where 4 were at the upstream)."""
    keep = route("keep", upstream.url, "http")
    h = route("h", upstream.url, "http", concurrency={"limit": 2, "queue": 6,
                                                       "max_wait": "30s"})
    sluice = await start_sluice({"routes": [keep, h]})
    url = sluice.url + "/h/slow"

    async def reloaded(count: int) -> None:
        await wait_until(lambda: sluice.stderr().count("config reloaded") >= count,
                         what=f"reload {count}")

    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        old = [asyncio.create_task(status_of(session, url, None)) for _ in range(4)]
        await wait_until(lambda: upstream.inflight == 2, what="2 calls at the upstream")
        await sluice.wait_metric("sluice_queue_depth", 2, route="h")
        rewrite(sluice.config_path, [keep])
        await reloaded(1)
        assert (await series(sluice, "sluice_inflight_requests")).get("h") == 2
        assert (await series(sluice, "sluice_queue_depth")).get("h") == 2
        view = await routes_view(sluice)
        assert [(r["name"], r["removed"]) for r in view["routes"]] == [
            ("keep", False), ("h", True)]
        assert view["routes"][1]["inflight"] == 2
        assert view["routes"][1]["concurrency"]["queued"] == 2
        async with session.get(sluice.admin_url + "/admin/") as r:
            assert "removed, draining" in await r.text()

        rewrite(sluice.config_path, [keep, h])  # added back: empty slots, the old calls run
        await reloaded(2)
        new = [asyncio.create_task(status_of(session, url, None)) for _ in range(2)]
        await wait_until(lambda: upstream.inflight == 4, what="4 calls at the upstream")
        assert await sluice.metric("sluice_inflight_requests", route="h") == 4
        assert await sluice.metric("sluice_queue_depth", route="h") == 2
        view = await routes_view(sluice)
        assert [(r["name"], r["removed"], r["inflight"]) for r in view["routes"]] == [
            ("keep", False, 0), ("h", False, 2), ("h", True, 2)]
        assert view["inflight"] == 4

        upstream.hold.set()
        assert [await call for call in (*old, *new)] == [200] * 6
        await sluice.wait_metric("sluice_inflight_requests", 0, route="h")
        assert await sluice.metric("sluice_queue_depth", route="h") == 0
        await listed(sluice, ["keep", "h"])

        # Removed again with one call running: its series stays until that call ends.
        upstream.hold = asyncio.Event()
        last = asyncio.create_task(status_of(session, url, None))
        await wait_until(lambda: upstream.inflight == 1, what="the call at the upstream")
        rewrite(sluice.config_path, [keep])
        await reloaded(3)
        assert (await series(sluice, "sluice_inflight_requests")).get("h") == 1
        upstream.hold.set()
        assert await last == 200
        for name in ("sluice_inflight_requests", "sluice_queue_depth"):
            await wait_until_absent(sluice, name, "h")
        await listed(sluice, ["keep"])


async def wait_until_absent(sluice: SluiceProcess, name: str, label: str,
                            timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while label in (found := await series(sluice, name)):
        assert time.monotonic() < deadline, f"{name}: {found}"
        await asyncio.sleep(0.05)


async def listed(sluice: SluiceProcess, names: list[str], timeout: float = 10.0) -> None:
    """Wait until ``/admin/routes`` lists the routes ``names``, in order (a call's answer
    reaches its caller a moment before the call has left its route)."""
    deadline = time.monotonic() + timeout
    while (found := [r["name"] for r in (await routes_view(sluice))["routes"]]) != names:
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.05)


async def test_calls_queued_at_an_endpoints_or_a_runs_limit_are_in_the_queue_depth(
        upstream, start_sluice):
    """``sluice_queue_depth`` counted the route's own limiter only: calls queued at an
    endpoint's ``concurrency`` or a run's ``fanout.width`` showed 0 while ``/admin/routes``
    said 3 queued (a hostile review)."""
    sluice = await start_sluice({"routes": [route(
        "h", upstream.url, "http",
        endpoints={"POST /slow": {"concurrency": {"limit": 1, "queue": 5, "max_wait": "30s"}}},
        fanout={"width": 1, "max_wait": "30s"})]})
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        calls = [asyncio.create_task(status_of(session, sluice.url + "/h/slow", None))
                 for _ in range(3)]  # one at the upstream, two at the endpoint's limit
        calls += [asyncio.create_task(status_of(session, sluice.url + "/h/other", None,
                                                {"X-Run-ID": "run-1"})) for _ in range(2)]
        await wait_until(lambda: upstream.inflight == 2, what="2 calls at the upstream")
        await sluice.wait_metric("sluice_queue_depth", 3, route="h")
        upstream.hold.set()
        assert await asyncio.gather(*calls) == [200] * 5
    await sluice.wait_metric("sluice_queue_depth", 0, route="h")
