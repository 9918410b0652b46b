"""``/metrics`` on the admin port: Prometheus text, and the values a scenario must leave."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable

import aiohttp
from yarl import URL

from policies.reasons import Reason
from proxy.metrics import EDGE_ONLY
from tests.conftest import raw_request, route, wait_until

CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}


async def chat_status(session: aiohttp.ClientSession, url: str) -> int:
    """The status of a chat completion posted to ``url``, its body read."""
    async with session.post(url, json=CHAT) as r:
        await r.read()
        return r.status


async def test_content_type_is_prometheus_text(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("openai", upstream.url, "openai")]})
    async with aiohttp.ClientSession() as session:
        async with session.get(sluice.admin_url + "/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await r.text()
        async with session.get(sluice.admin_url + "/metrics",
                               headers={"Accept": "application/openmetrics-text"}) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert (await r.text()).rstrip().endswith("# EOF")
    for family in ("sluice_requests_total", "sluice_rejections_total",
                   "sluice_inflight_requests", "sluice_queue_depth",
                   "sluice_queue_wait_seconds", "sluice_upstream_duration_seconds"):
        assert f"# TYPE {family.removesuffix('_total')}" in text, family


async def test_scenario_leaves_the_right_values(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        route("openai", upstream.url, "openai",
              concurrency={"limit": 1, "queue": 1, "max_wait": "60s"}),
        route("limited", upstream.url, "http", rate={"requests": "1/min"}),
    ]})
    url = sluice.url + "/openai/v1/chat/completions"
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        def call() -> Awaitable[int]:
            return chat_status(session, url)

        first = asyncio.create_task(call())
        await wait_until(lambda: upstream.inflight == 1, what="the slot taken")
        queued = asyncio.create_task(call())
        await sluice.wait_metric("sluice_queue_depth", 1, route="openai")
        queued_seen = time.monotonic()
        assert await sluice.metric("sluice_inflight_requests", route="openai") == 1
        assert await call() == 503  # queue full
        await asyncio.sleep(0.2)  # hold the queued request for a measurable wait
        released = time.monotonic()
        upstream.hold.set()
        assert await asyncio.gather(first, queued) == [200, 200]
        statuses = []
        for _ in range(2):
            async with session.get(sluice.url + "/limited/x") as r:
                statuses.append(r.status)
        assert statuses == [200, 429]
    held_s = released - queued_seen

    await sluice.wait_metric("sluice_inflight_requests", 0, route="openai")
    m = await sluice.metrics()

    def value(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    assert value("sluice_queue_depth", route="openai") == 0
    assert value("sluice_queue_wait_seconds_count", route="openai") == 1
    assert value("sluice_queue_wait_seconds_sum", route="openai") >= held_s
    assert value("sluice_upstream_duration_seconds_count", route="openai") == 2
    # The first request was held at the upstream at least as long as the second queued.
    assert value("sluice_upstream_duration_seconds_sum", route="openai") >= held_s
    assert value("sluice_upstream_duration_seconds_count", route="limited") == 1
    assert value("sluice_requests_total", route="openai", outcome="2xx") == 2
    assert value("sluice_requests_total", route="openai", outcome="rejected") == 1
    assert value("sluice_requests_total", route="limited", outcome="rejected") == 1
    rejections = {reason.code: value("sluice_rejections_total", route="openai",
                                     reason=reason.code)
                  for reason in Reason if reason not in EDGE_ONLY}
    assert rejections == {code: (1 if code == "queue_full" else 0) for code in rejections}
    assert not any(name == "sluice_rejections_total" and dict(labels)["reason"] in
                   {r.code for r in EDGE_ONLY} for name, labels in m)
    assert value("sluice_rejections_total", route="limited", reason="rate_limited") == 1


async def test_request_faults_are_counted_by_reason_on_their_route(upstream, start_sluice):
    sluice = await start_sluice({"server": {"max_request_bytes": 100},
                                 "routes": [route("svc", upstream.url, "http")]})
    async with aiohttp.ClientSession() as session:
        async with session.post(sluice.url + "/svc/x", data=b"x" * 1000) as r:
            assert r.status == 413
        async with session.get(URL(sluice.url + "/svc/../x", encoded=True)) as r:
            assert r.status == 400
    assert await sluice.metric("sluice_rejections_total", route="svc",
                               reason="request_too_large") == 1
    assert await sluice.metric("sluice_rejections_total", route="svc",
                               reason="bad_request") == 1
    assert await sluice.metric("sluice_requests_total", route="svc", outcome="rejected") == 2
    await wait_until(lambda: len(sluice.events()) == 2, what="two rejected events")
    assert sorted(e["reason"] for e in sluice.events()) == ["bad_request", "request_too_large"]
    assert upstream.requests == []


async def test_refusals_before_a_route_are_counted_at_the_edge(upstream, start_sluice):
    # Seen by a new user: a request naming no route or another host, a head that is not
    # HTTP/1.1, a refused Expect were answered but counted in no metric.
    sluice = await start_sluice({"routes": [route("svc", upstream.url, "http")]})
    async with aiohttp.ClientSession() as session:
        async with session.get(sluice.url + "/nowhere") as r:
            assert r.status == 404
        async with session.get(sluice.url + "/svc/x", headers={"Host": "elsewhere.example"}
                               ) as r:
            assert r.status == 421
        async with session.post(sluice.url + "/svc/x", data=b"{}",
                                headers={"Expect": "teapot"}) as r:
            assert r.status == 417
    answer = await raw_request(sluice.port, b"GET /svc/x HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               b"Content-Length: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400")
    edge = {reason: await sluice.metric("sluice_edge_rejections_total", reason=reason)
            for reason in ("no_route", "misdirected_request", "expectation_failed", "bad_request",
                           "too_many_connections", "request_timeout")}
    assert edge == {"no_route": 1, "misdirected_request": 1, "expectation_failed": 1,
                    "bad_request": 1, "too_many_connections": 0, "request_timeout": 0}
    # The admin port's refusals are there at 0 from the start too (an alert's rate() over a
    # series that appears with its first refusal misses that refusal).
    samples = await sluice.metrics()
    admin = {labels[0][1]: value for (name, labels), value in samples.items()
             if name == "sluice_admin_rejections_total"}
    assert admin == dict.fromkeys(("bad_request", "headers_too_large", "internal_error",
                                   "misdirected_request", "request_timeout",
                                   "too_many_connections"), 0)
    assert await sluice.metric("sluice_rejections_total", route="svc",
                               reason="bad_request") == 0


async def test_scrapes_at_once_share_one_render_and_a_later_one_sees_a_change(tmp_path):
    """A hostile trial: each of 500 concurrent scrapes rendered /metrics on the event loop
    (20-40 ms each at 300-500 KB), which held the readiness probe 2-5 s and proxied calls up
    to 1.3 s. Scrapes that arrive while a render runs share it; none is kept after."""
    import yaml
    from prometheus_client.registry import Collector

    from proxy.config import load_config
    from proxy.runtime import Runtime
    from proxy.server import build_admin_app
    from tests.conftest import serve_app

    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump({"routes": [route("llm", "http://127.0.0.1:9")]}))
    runtime = Runtime(load_config(path))
    await runtime.open()

    class Counted(Collector):
        renders = 0

        def collect(self):  # type: ignore[override]
            Counted.renders += 1
            return []

    runtime.metrics.registry.register(Counted())
    runner, port = await serve_app(build_admin_app(runtime))
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        async with aiohttp.ClientSession() as session:
            async def scrape() -> str:
                async with session.get(url) as answer:
                    assert answer.status == 200
                    return await answer.text()

            async def scrape_with(query: str) -> str:
                async with session.get(url + query) as answer:
                    assert answer.status == 200
                    return await answer.text()

            # A query that changes nothing shares too (a review: ?nocache=N dodged it).
            bodies = await asyncio.gather(*(scrape_with(f"?nocache={n}") for n in range(40)))
            assert all("sluice_config_reloads_total" in body for body in bodies)
            assert Counted.renders < 40
            shared = Counted.renders
            runtime.metrics.config_reloads.inc()
            after = await scrape()
            assert Counted.renders == shared + 1  # rendered anew: nothing kept
            assert "sluice_config_reloads_total 1.0" in after
    finally:
        await runner.cleanup()
        await runtime.close()


async def test_a_proxied_call_is_answered_while_a_scrape_is_rendered(upstream):
    """A hostile trial: at 1,000 routes /metrics is 6.6 MB, and its render on the event loop
    held every proxied call 0.6-1.5 s (5.7 s at 10,000 routes, past a 2 s liveness probe). A
    collector that blocks until the test lets it go stands for a slow render: a call sent
    meanwhile is answered while the render is still blocked."""
    from prometheus_client.registry import Collector

    from proxy.server import build_admin_app
    from tests.conftest import open_runtime, serve_app, serve_runtime

    runtime = await open_runtime(route("llm", upstream.url))
    entered, release = threading.Event(), threading.Event()
    blocked = [False]

    class Slow(Collector):
        def describe(self):  # registered without a collect() (auto_describe would call it)
            return []

        def collect(self):  # type: ignore[override]
            blocked[0] = True
            entered.set()
            release.wait(timeout=5)  # bounds the test where the render holds the loop
            blocked[0] = False
            return []

    runtime.metrics.registry.register(Slow())
    proxy, port = await serve_runtime(runtime)
    admin, admin_port = await serve_app(build_admin_app(runtime))
    try:
        async with aiohttp.ClientSession() as session:
            async def scrape() -> str:
                async with session.get(f"http://127.0.0.1:{admin_port}/metrics") as answer:
                    assert answer.status == 200
                    return await answer.text()

            scraping = asyncio.create_task(scrape())
            assert await asyncio.to_thread(entered.wait, 5)
            url = f"http://127.0.0.1:{port}/llm/v1/chat/completions"
            assert await chat_status(session, url) == 200
            answered_while_blocked = blocked[0]
            release.set()
            assert "sluice_requests_total" in await scraping
        assert answered_while_blocked
    finally:
        release.set()
        await admin.cleanup()
        await proxy.cleanup()
        await runtime.close()


async def test_a_render_reads_the_loops_objects_on_the_loop_and_says_the_same(tmp_path):
    """The render's thread formats what reads the loop's objects (gauges' functions, routes'
    calls) as read on the loop just before, and the text is the one rendered on the loop,
    whole or restricted to some series (``name[]``)."""
    from prometheus_client.exposition import generate_latest

    from tests.conftest import open_runtime

    runtime = await open_runtime(
        route("llm", "http://127.0.0.1:9", concurrency={"limit": 2, "queue": 3}),
        route("tools", "http://127.0.0.1:9", "mcp", retry={"attempts": 2},
              circuit_breaker={"fail_max": 3}, idempotency={"mode": "dedup"}),
        dead_letter={"path": str(tmp_path / "dlq.sqlite")})  # not in the checkout

    def steady(text: bytes) -> list[bytes]:
        """The lines but the process's own samples (its CPU time, memory: they move)."""
        return [line for line in text.splitlines()
                if not line.startswith((b"process_", b"python_gc_"))]

    try:
        metrics = runtime.metrics
        readers: list[int] = []
        metrics.buffered_bytes.set_function(
            lambda: readers.append(threading.get_ident()) or 7.0)
        metrics.requests.labels("llm", "2xx").inc(3)
        metrics.queue_wait.labels("llm").observe(0.2)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as thread:
            for names in ([], ["sluice_buffered_request_bytes", "sluice_requests_total"],
                          ["sluice_requests_total"]):
                readers.clear()
                read = metrics.read_on_loop(names)
                rendered = await asyncio.get_running_loop().run_in_executor(
                    thread, metrics.render, generate_latest, names, read)
                if names == ["sluice_requests_total"]:
                    # A gauge the scrape does not name is not read (a review: a scrape of
                    # one series read every route's gauges on the loop).
                    assert readers == [] and b"sluice_buffered_request_bytes" not in rendered
                    assert b'sluice_requests_total{outcome="2xx",route="llm"} 3.0' in rendered
                else:
                    assert readers == [threading.get_ident()]  # the loop's thread, once
                    assert b"sluice_buffered_request_bytes 7.0" in rendered
                on_loop = generate_latest(metrics.registry.restricted_registry(names)
                                          if names else metrics.registry)
                assert steady(rendered) == steady(on_loop)
    finally:
        await runtime.close()


async def test_a_wait_that_ends_in_a_queue_timeout_is_a_queue_wait(upstream, start_sluice):
    """A trial: only admitted calls' waits were observed, so the longest ones (those that
    reached max_wait and were refused queue_timeout) never moved the queue-wait quantile the
    SluiceQueueWaitNearMaxWait alert reads."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, concurrency={"limit": 1, "queue": 4, "max_wait": "0.3s"})]})
    url = sluice.url + "/openai/v1/chat/completions"
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(chat_status(session, url))
        await wait_until(lambda: upstream.inflight == 1, what="the slot taken")
        assert await chat_status(session, url) == 503  # queue_timeout after 0.3 s
        upstream.hold.set()
        assert await first == 200
    assert await sluice.metric("sluice_rejections_total", route="openai",
                               reason="queue_timeout") == 1
    assert await sluice.metric("sluice_queue_wait_seconds_count", route="openai") == 1
    # libuv runs timers on a millisecond clock: the expiry can come a fraction of a
    # millisecond before 0.3 s by time.monotonic (0.29978 seen under load).
    assert await sluice.metric("sluice_queue_wait_seconds_sum", route="openai") >= 0.29
    assert await sluice.metric("sluice_queue_wait_seconds_bucket", route="openai",
                               le="0.25") == 0
