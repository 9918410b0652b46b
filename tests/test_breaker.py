"""The shared circuit breaker, end to end: Sluice as a subprocess, aiohttp callers."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.conftest import route
from tests.fakeupstream import RawUpstream
from tests.test_reload import rewrite

CHAT = "/openai/v1/chat/completions"
BODY = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}


async def post(session: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, dict]:
    async with session.post(url + CHAT, json=BODY, headers=headers) as r:
        await r.read()
        return r.status, dict(r.headers)


async def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_upstream_down_opens_fails_fast_then_one_probe_closes(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, circuit_breaker={"fail_max": 3, "reset_timeout": "2s"})]})
    upstream.status = 503
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            assert (await post(s, sluice.url))[0] == 503
        assert len(upstream.requests) == 3
        await sluice.wait_metric("sluice_circuit_state", 2, route="openai")
        half_open_at = time.monotonic() + 2.0  # at the latest

        # Open: answered at once by Sluice, no upstream call, Retry-After = time to half-open
        # plus a spread of up to one reset_timeout.
        for _ in range(5):
            status, headers = await post(s, sluice.url)
            assert status == 503 and headers["X-Sluice-Reason"] == "circuit_open"
            assert headers["Retry-After"] in ("1", "2", "3", "4")
            assert 0 < int(headers["retry-after-ms"]) <= 4000
            assert headers["x-should-retry"] == "true"
        assert len(upstream.requests) == 3
        assert await sluice.metric("sluice_rejections_total", route="openai",
                                   reason="circuit_open") == 5

        # After reset_timeout: exactly one probe.
        await asyncio.sleep(half_open_at + 0.05 - time.monotonic())
        upstream.status = None
        upstream.hold = asyncio.Event()
        calls = [asyncio.create_task(post(s, sluice.url)) for _ in range(10)]
        await wait_for(lambda: sum(c.done() for c in calls) == 9 and upstream.inflight == 1)
        assert len(upstream.requests) == 4
        refused = [c.result() for c in calls if c.done()]
        assert {(st, h["X-Sluice-Reason"]) for st, h in refused} == {(503, "circuit_open")}
        await sluice.wait_metric("sluice_circuit_state", 1, route="openai")

        upstream.hold.set()  # the probe succeeds: the breaker closes
        assert sorted(st for st, _ in await asyncio.gather(*calls)) == [200] + [503] * 9
        await sluice.wait_metric("sluice_circuit_state", 0, route="openai")
        assert (await post(s, sluice.url))[0] == 200
    # The event log is flushed every 0.2 s, in order: wait for the last transition, not for a
    # fixed time (a busy machine's Sluice may flush later than 0.3 s).
    await wait_for(lambda: any(e["event"] == "circuit_closed" for e in sluice.events()))
    transitions = [e for e in sluice.events() if e["event"].startswith("circuit_")]
    assert [e["event"] for e in transitions] == [
        "circuit_opened", "circuit_half_open", "circuit_closed"]
    assert transitions[0]["route"] == "openai" and transitions[0]["cause"] == "fail_max"


async def test_client_deadlines_and_bad_requests_never_trip_it(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, circuit_breaker={"fail_max": 2, "reset_timeout": "30s"})]})
    async with aiohttp.ClientSession() as s:
        # One tenant's bad requests: the upstream answered, the request was at fault.
        for status in (400, 401, 404, 413, 422, 400, 400):
            got, _ = await post(s, sluice.url, **{"X-Tenant-ID": "careless",
                                                  "x-fake-status": str(status)})
            assert got == status
        # Callers that give up: their own timeout, and their declared deadline.
        for _ in range(3):
            try:
                async with s.post(sluice.url + CHAT, json=BODY,
                                  headers={"x-fake-delay": "5"},
                                  timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                    await r.read()
            except TimeoutError:
                pass
        await sluice.wait_metric("sluice_requests_total", 3, route="openai",
                                 outcome="client_disconnected")
        for _ in range(3):
            got, headers = await post(s, sluice.url, **{"x-fake-delay": "5",
                                                        "x-stainless-timeout": "0.3"})
            assert got == 504  # Sluice stopped at the caller's deadline
        assert await sluice.metric("sluice_circuit_state", route="openai") == 0

        # Another tenant is served as usual.
        assert (await post(s, sluice.url, **{"X-Tenant-ID": "careful"}))[0] == 200

        # The breaker is live: two real upstream failures do open it.
        for _ in range(2):
            assert (await post(s, sluice.url, **{"x-fake-status": "500"}))[0] == 500
        status, headers = await post(s, sluice.url, **{"X-Tenant-ID": "careful"})
        assert status == 503 and headers["X-Sluice-Reason"] == "circuit_open"


async def test_upstream_retry_after_extends_the_open_time(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        route("short", upstream.url, circuit_breaker={"fail_max": 1, "reset_timeout": "1s"}),
        route("long", upstream.url, circuit_breaker={"fail_max": 1, "reset_timeout": "20s"}),
    ]})
    upstream.status = 503
    upstream.error_headers = {"Retry-After": "8"}
    async with aiohttp.ClientSession() as s:
        # Open for max(reset_timeout, upstream Retry-After), plus up to one reset_timeout spread.
        for name, low, high in (("short", 7, 9), ("long", 19, 40)):
            async with s.post(f"{sluice.url}/{name}/v1/chat/completions", json=BODY) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "8"  # relayed as sent
            async with s.post(f"{sluice.url}/{name}/v1/chat/completions", json=BODY) as r:
                assert r.headers["X-Sluice-Reason"] == "circuit_open"
                assert low <= int(r.headers["Retry-After"]) <= high
    assert len(upstream.requests) == 2


async def test_a_reload_changing_the_breaker_block_keeps_an_open_breaker_open(
        upstream, start_sluice):
    """The breaker's state lives in the state backend under the route's name, so a reload
    that changed the block kept it; but the route got a fresh breaker object whose view said
    closed, so the gauge and the admin page showed a closed breaker that was refusing calls."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, circuit_breaker={"fail_max": 2, "reset_timeout": "60s"})]})
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            assert (await post(s, sluice.url, **{"x-fake-status": "500"}))[0] == 500
        await sluice.wait_metric("sluice_circuit_state", 2, route="openai")
        rewrite(sluice.config_path,
                lambda data: data["routes"][0]["circuit_breaker"].update(fail_max=5))
        await sluice.wait_metric("sluice_config_reloads_total", 1)
        assert await sluice.metric("sluice_circuit_state", route="openai") == 2
        async with s.get(sluice.admin_url + "/admin/routes") as r:
            (view,) = (await r.json())["routes"]
        assert view["breaker"]["state"] == "open"
        status, headers = await post(s, sluice.url)
        assert (status, headers["X-Sluice-Reason"]) == (503, "circuit_open")
    assert len(upstream.requests) == 2


async def test_a_breaker_block_removed_and_added_back_shows_the_open_state(
        upstream, start_sluice):
    # Seen in a hostile trial: the state outlived the block in the backend, so calls were
    # refused circuit_open, but the re-added breaker's view said closed until a call asked:
    # sluice_circuit_state read 0 and SluiceCircuitOpen could miss a quiet outage.
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, circuit_breaker={"fail_max": 2, "reset_timeout": "60s"})]})
    block = {}
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            assert (await post(s, sluice.url, **{"x-fake-status": "500"}))[0] == 500
        await sluice.wait_metric("sluice_circuit_state", 2, route="openai")
        rewrite(sluice.config_path,
                lambda data: block.update(data["routes"][0].pop("circuit_breaker")))
        await sluice.wait_metric("sluice_config_reloads_total", 1)
        rewrite(sluice.config_path,
                lambda data: data["routes"][0].update(circuit_breaker=block))
        # Watched on /admin/routes, not /metrics: a scrape asks too, and the new breaker must
        # have asked by itself.
        deadline = time.monotonic() + 10
        while True:
            async with s.get(sluice.admin_url + "/admin/routes") as r:
                (view,) = (await r.json())["routes"]
            if (view.get("breaker") or {}).get("state") == "open":
                break
            assert time.monotonic() < deadline, view.get("breaker")
            await asyncio.sleep(0.05)
        assert await sluice.metric("sluice_circuit_state", route="openai") == 2
    assert len(upstream.requests) == 2


async def test_an_open_breaker_idle_past_its_open_time_reads_half_open(upstream, start_sluice):
    """sluice_circuit_state stayed 2 until the next call after reset_timeout, so with no
    traffic SluiceCircuitOpen fired all night though the next call would be let through as
    the probe (a hostile trial). It reads 1 then; the probe still decides."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, circuit_breaker={"fail_max": 1, "reset_timeout": "1s"})]})
    async with aiohttp.ClientSession() as s:
        assert (await post(s, sluice.url, **{"x-fake-status": "500"}))[0] == 500
        await sluice.wait_metric("sluice_circuit_state", 1, route="openai")  # no call since
        assert len(upstream.requests) == 1
        assert (await post(s, sluice.url))[0] == 200  # the probe
        await sluice.wait_metric("sluice_circuit_state", 0, route="openai")
    assert len(upstream.requests) == 2


@pytest.mark.parametrize("protocol", ["http", "openai"])
async def test_an_answer_cut_after_its_status_line_counts_as_a_failure(start_sluice, protocol):
    """A hostile trial: a 200 whose body the upstream cut (Content-Length 100, then close)
    was judged a success at its status line; every caller got 502 and the breaker never
    opened. It is judged once read now, as a stream is: a failure."""
    raw = await RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{\"id\": 1").start()
    try:
        sluice = await start_sluice({"routes": [route(
            "openai", raw.url, protocol,
            circuit_breaker={"fail_max": 3, "reset_timeout": "30s"})]})
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                status, headers = await post(s, sluice.url)
                assert (status, headers["X-Sluice-Reason"]) == (502, "upstream_unreachable")
            status, headers = await post(s, sluice.url)
            assert (status, headers["X-Sluice-Reason"]) == (503, "circuit_open")
        assert len(raw.requests) == 3
    finally:
        await raw.stop()
