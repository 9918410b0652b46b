"""Idempotency keys end to end: real clients, Sluice as a subprocess, the fake upstream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import aiohttp
import openai
import pytest

from tests.conftest import route
from tests.redis_servers import TEST_TIMEOUT_S, delete_prefix, new_prefix, require_redis

CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}


async def post(session: aiohttp.ClientSession, url: str, payload: dict,
               headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    async with session.post(url, json=payload, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_concurrent_duplicates_execute_once_and_replay(upstream, start_sluice):
    upstream.hold = asyncio.Event()
    sluice = await start_sluice(
        {"routes": [route("tools", upstream.url, "http", idempotency={"mode": "dedup"})]})
    url = sluice.url + "/tools/v1/artifacts"
    payload = {"name": "report.pdf", "pages": 3}
    headers = {"Idempotency-Key": '"artifact-42"', "X-Tenant-ID": "acme"}
    async with aiohttp.ClientSession() as s:
        calls = [asyncio.create_task(post(s, url, payload, headers)) for _ in range(5)]
        # Four duplicates wait for the first while it is held at the upstream.
        await sluice.wait_metric("sluice_idempotency_waiting", 4, route="tools")
        assert len(upstream.requests) == 1
        upstream.hold.set()
        results = await asyncio.gather(*calls)

        assert [status for status, _, _ in results] == [200] * 5
        assert len({body for _, _, body in results}) == 1
        assert sorted(h.get("Idempotent-Replayed", "-") for _, h, _ in results) == [
            "-", "true", "true", "true", "true"]
        assert upstream.executed == 1
        assert upstream.requests[0].headers["Idempotency-Key"] == '"artifact-42"'

        # Later duplicates are replayed; the bare form names the same key.
        status, h, body = await post(s, url, payload, {**headers, "Idempotency-Key": "artifact-42"})
        assert (status, h["Idempotent-Replayed"], body) == (200, "true", results[0][2])
        assert h["Content-Type"].startswith("application/json")
        assert int(h["Content-Length"]) == len(body)

        # The same key with another payload is refused, and the upstream never sees it.
        status, h, body = await post(s, url, {**payload, "pages": 4}, headers)
        assert status == 422
        assert h["X-Sluice-Reason"] == "idempotency_mismatch"
        assert b'"reason":"idempotency_mismatch"' in body
        assert b"a new request with an Idempotency-Key of its own" in body

        # Another tenant with the same key runs its own request.
        status, h, _ = await post(s, url, payload, {**headers, "X-Tenant-ID": "other"})
        assert status == 200 and "Idempotent-Replayed" not in h

    assert upstream.executed == 2
    assert await sluice.metric("sluice_upstream_attempts_total", route="tools") == 2
    assert await sluice.metric("sluice_work_units_total", route="tools") == 2
    assert await sluice.metric("sluice_idempotent_replays_total", route="tools") == 5
    assert await sluice.metric("sluice_requests_total", route="tools", outcome="replayed") == 5
    assert await sluice.metric("sluice_rejections_total", route="tools",
                               reason="idempotency_mismatch") == 1
    await wait_for(lambda: len([e for e in sluice.events() if e["event"] == "replayed"]) == 5)
    replayed = [e for e in sluice.events() if e["event"] == "replayed"]
    assert {(e["idempotency_key"], e["tenant"], e["status"]) for e in replayed} == {
        ("artifact-42", "acme", 200)}
    assert sum(e["waited_s"] > 0 for e in replayed) == 4


async def test_invalid_keys_get_400(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("tools", upstream.url, "http",
                                                   idempotency={"mode": "dedup"})]})
    url = sluice.url + "/tools/v1/run"
    async with aiohttp.ClientSession() as s:
        for bad in ("k" * 256, "two words", '"unterminated', '""', '"bad\\q"'):
            status, h, body = await post(s, url, {}, {"Idempotency-Key": bad})
            assert status == 400, bad
            assert h["X-Sluice-Reason"] == "bad_request"
            assert b"Idempotency-Key" in body
        async with s.post(url, json={}, headers=[("Idempotency-Key", "a"),
                                                 ("Idempotency-Key", "b")]) as r:
            assert r.status == 400
        # 255 characters is the longest key; a quoted one may escape a quote.
        for good in ("k" * 255, '"say \\"hi\\""'):
            status, _, _ = await post(s, url, {}, {"Idempotency-Key": good})
            assert status == 200
        # Safe methods pass untouched: no key is injected.
        async with s.get(url) as r:
            assert r.status == 200
    assert "Idempotency-Key" not in upstream.requests[-1].headers
    assert len(upstream.requests) == 3


async def test_openai_sdk_retry_is_one_logical_call(upstream, start_sluice):
    """The SDK sends no Idempotency-Key; the agent names the call with run and step headers."""
    upstream.statuses = [500]
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, idempotency={"derive_from": ["X-Run-ID", "X-Step-ID"]})]})
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                max_retries=2, default_headers={"X-Run-ID": "run-7"})
    reply = await client.chat.completions.create(**CHAT, extra_headers={"X-Step-ID": "step-3"})
    assert reply.choices[0].message.content == "hello from fake"

    assert [r.headers["x-stainless-retry-count"] for r in upstream.requests] == ["0", "1"]
    keys = {r.headers["Idempotency-Key"] for r in upstream.requests}
    assert len(keys) == 1 and keys.pop().startswith('"sluice-d-')
    assert upstream.executed == 1

    # The agent runs step 3 again (say its worker restarted): a replay, not a second call.
    raw = await client.chat.completions.with_raw_response.create(
        **CHAT, extra_headers={"X-Step-ID": "step-3"})
    assert raw.headers["Idempotent-Replayed"] == "true"
    assert raw.parse().id == reply.id
    assert upstream.executed == 1 and len(upstream.requests) == 2

    assert await sluice.metric("sluice_upstream_attempts_total", route="openai") == 2
    assert await sluice.metric("sluice_work_units_total", route="openai") == 1
    assert await sluice.metric("sluice_idempotent_replays_total", route="openai") == 1
    await client.close()


async def test_sdk_retry_without_a_key_is_counted_not_deduplicated(upstream, start_sluice):
    """Without a key or derive headers each attempt gets a fresh key; the retry is still
    recognised by x-stainless-retry-count, so the amplification metrics stay true."""
    upstream.statuses = [503]
    sluice = await start_sluice({"routes": [
        route("openai", upstream.url, idempotency={"derive_from": ["X-Run-ID", "X-Step-ID"]}),
        route("plain", upstream.url),
    ]})
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                max_retries=2)
    await client.chat.completions.create(**CHAT)
    keys = [r.headers["Idempotency-Key"] for r in upstream.requests]
    assert len(keys) == 2 and keys[0] != keys[1]
    assert await sluice.metric("sluice_upstream_attempts_total", route="openai") == 2
    assert await sluice.metric("sluice_work_units_total", route="openai") == 1

    # A route with no idempotency block counts the same way, and injects no key.
    upstream.statuses = [503]
    plain = openai.AsyncOpenAI(base_url=sluice.url + "/plain/v1", api_key="sk-test",
                               max_retries=2)
    await plain.chat.completions.create(**CHAT)
    assert all("Idempotency-Key" not in r.headers for r in upstream.requests[2:])
    assert await sluice.metric("sluice_upstream_attempts_total", route="plain") == 2
    assert await sluice.metric("sluice_work_units_total", route="plain") == 1
    await client.close()
    await plain.close()


async def test_serialize_never_overlaps_at_the_upstream(upstream, start_sluice):
    upstream.hold = asyncio.Event()
    upstream.delay = 0.05
    sluice = await start_sluice({"routes": [route("tool", upstream.url, "http",
                                                   idempotency={"mode": "serialize"})]})
    url = sluice.url + "/tool/v1/deploy"
    async with aiohttp.ClientSession() as s:
        same = [asyncio.create_task(post(s, url, {"n": i}, {"Idempotency-Key": "deploy-9"}))
                for i in range(3)]
        await sluice.wait_metric("sluice_idempotency_waiting", 2, route="tool")
        await wait_for(lambda: len(upstream.requests) == 1)  # the holder's, on its way
        upstream.hold.set()
        results = await asyncio.gather(*same)
        assert [status for status, _, _ in results] == [200] * 3
        assert upstream.executed == 3 and upstream.peak_inflight == 1
        assert all("Idempotent-Replayed" not in h for _, h, _ in results)

        # The lock is per key: two different keys run side by side.
        upstream.hold = asyncio.Event()
        other = [asyncio.create_task(post(s, url, {}, {"Idempotency-Key": f"deploy-{i}"}))
                 for i in (1, 2)]
        await wait_for(lambda: upstream.inflight == 2)
        upstream.hold.set()
        await asyncio.gather(*other)
    assert upstream.peak_inflight == 2
    await sluice.wait_metric("sluice_idempotency_waiting", 0, route="tool")


async def test_streamed_answers_are_replayed_up_to_max_replay_bytes(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        route("openai", upstream.url, idempotency={"mode": "dedup"}),
        route("small", upstream.url, idempotency={"max_replay_bytes": 300}),
    ]})
    stream_req = {**CHAT, "stream": True}
    async with aiohttp.ClientSession() as s:
        url = sluice.url + "/openai/v1/chat/completions"
        first = await post(s, url, stream_req, {"Idempotency-Key": "stream-1"})
        second = await post(s, url, stream_req, {"Idempotency-Key": "stream-1"})
        assert first[0] == second[0] == 200
        assert second[1]["Idempotent-Replayed"] == "true"
        assert second[1]["Content-Type"] == "text/event-stream"
        assert second[2] == first[2] and first[2].endswith(b"data: [DONE]\n\n")

        # A stream longer than max_replay_bytes reaches its caller whole but is not kept;
        # the duplicate must not run again and is told not to retry.
        url = sluice.url + "/small/v1/chat/completions"
        first = await post(s, url, stream_req, {"Idempotency-Key": "stream-2"})
        assert first[0] == 200 and len(first[2]) > 300
        status, h, _ = await post(s, url, stream_req, {"Idempotency-Key": "stream-2"})
        assert status == 409
        assert h["X-Sluice-Reason"] == "idempotency_conflict"
        assert h["x-should-retry"] == "false"
    assert len(upstream.requests) == 2

    # The official SDK parses a replayed stream like a live one.
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                max_retries=0)
    texts = []
    for _ in range(2):
        stream = await client.chat.completions.create(
            **CHAT, stream=True, extra_headers={"Idempotency-Key": "stream-3"})
        texts.append("".join([c.choices[0].delta.content or "" async for c in stream
                              if c.choices]))
    assert texts == ["".join(f"tok{i} " for i in range(upstream.chunks))] * 2
    assert len(upstream.requests) == 3
    assert await sluice.metric("sluice_idempotent_replays_total", route="openai") == 2
    await client.close()


async def test_refusals_and_transient_failures_free_the_key(upstream, start_sluice):
    upstream.hold = asyncio.Event()
    sluice = await start_sluice({"routes": [route(
        "tools", upstream.url, "http", concurrency={"limit": 1, "queue": 0},
        idempotency={"mode": "dedup"})]})
    url = sluice.url + "/tools/v1/send"
    async with aiohttp.ClientSession() as s:
        holder = asyncio.create_task(post(s, url, {}, {"Idempotency-Key": "other"}))
        await wait_for(lambda: len(upstream.requests) == 1)
        status, h, _ = await post(s, url, {"to": "bob"}, {"Idempotency-Key": "mail-1"})
        assert (status, h["X-Sluice-Reason"]) == (503, "queue_full")
        upstream.hold.set()
        await holder

        # Sluice's own "not now" was not the outcome: the retry runs.
        status, h, _ = await post(s, url, {"to": "bob"}, {"Idempotency-Key": "mail-1"})
        assert status == 200 and "Idempotent-Replayed" not in h

        # Neither is an upstream 5xx or 429.
        upstream.statuses = [502, 429]
        for expected in (502, 429, 200):
            status, h, _ = await post(s, url, {"to": "eve"}, {"Idempotency-Key": "mail-2"})
            assert status == expected and "Idempotent-Replayed" not in h
        status, h, _ = await post(s, url, {"to": "eve"}, {"Idempotency-Key": "mail-2"})
        assert (status, h.get("Idempotent-Replayed")) == (200, "true")
    assert len(upstream.requests) == 5 and upstream.executed == 3
    # mail-1 and mail-2 are one unit each; their retries were recognised by key.
    assert await sluice.metric("sluice_work_units_total", route="tools") == 3
    assert await sluice.metric("sluice_upstream_attempts_total", route="tools") == 5


async def test_in_flight_duplicates_when_the_first_caller_leaves(upstream, start_sluice):
    upstream.hold = asyncio.Event()
    sluice = await start_sluice({"routes": [
        route("wait", upstream.url, "http", idempotency={"mode": "dedup"}),
        route("reject", upstream.url, "http", idempotency={"on_in_flight": "reject"}),
    ]})
    async with aiohttp.ClientSession() as s:
        url = sluice.url + "/wait/v1/charge"
        first = asyncio.create_task(post(s, url, {"usd": 5}, {"Idempotency-Key": "c-1"}))
        await wait_for(lambda: len(upstream.requests) == 1)
        second = asyncio.create_task(post(s, url, {"usd": 5}, {"Idempotency-Key": "c-1"}))
        await sluice.wait_metric("sluice_idempotency_waiting", 1, route="wait")
        first.cancel()  # the first caller disconnects: its upstream request is cancelled
        # The waiter does not hang: the key passes to it and its own request goes upstream.
        await wait_for(lambda: len(upstream.requests) == 2 and upstream.cancelled == 1)
        upstream.hold.set()
        status, h, _ = await second
        assert status == 200 and "Idempotent-Replayed" not in h
        assert upstream.requests[1].headers["Idempotency-Key"] == "c-1"

        upstream.hold = asyncio.Event()
        url = sluice.url + "/reject/v1/charge"
        running = asyncio.create_task(post(s, url, {"usd": 7}, {"Idempotency-Key": "c-2"}))
        await wait_for(lambda: len(upstream.requests) == 3)
        status, h, _ = await post(s, url, {"usd": 7}, {"Idempotency-Key": "c-2"})
        assert (status, h["X-Sluice-Reason"], h["Retry-After"]) == (
            409, "idempotency_conflict", "1")
        status, h, _ = await post(s, url, {"usd": 8}, {"Idempotency-Key": "c-2"})
        assert (status, h["X-Sluice-Reason"]) == (422, "idempotency_mismatch")
        upstream.hold.set()
        assert (await running)[0] == 200
        status, h, _ = await post(s, url, {"usd": 7}, {"Idempotency-Key": "c-2"})
        assert (status, h["Idempotent-Replayed"]) == (200, "true")
    assert len(upstream.requests) == 3


async def test_forward_mode_injects_keys_and_leaves_dedup_upstream(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route(
        "pay", upstream.url, "http",
        idempotency={"mode": "forward", "derive_from": ["X-Run-ID", "X-Step-ID"]})]})
    url = sluice.url + "/pay/v1/charges"
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            await post(s, url, {}, {"Idempotency-Key": "caller-key"})
        for _ in range(2):
            await post(s, url, {}, {"X-Run-ID": "r", "X-Step-ID": "1"})
        await post(s, url, {}, {"X-Run-ID": "r", "X-Step-ID": "1", "X-Tenant-ID": "t2"})
        await post(s, url, {}, {})
    keys = [r.headers["Idempotency-Key"] for r in upstream.requests]
    assert keys[:2] == ["caller-key", "caller-key"]
    assert keys[2] == keys[3] and keys[2].startswith('"sluice-d-')
    assert keys[4] != keys[2]  # derived keys are scoped by tenant
    assert keys[5].startswith('"sluice-') and keys[5] not in keys[:5]
    assert upstream.executed == 6
    # Four logical calls: caller-key, the derived key of each tenant, and the keyless one.
    assert await sluice.metric("sluice_work_units_total", route="pay") == 4
    assert await sluice.metric("sluice_upstream_attempts_total", route="pay") == 6


@pytest.fixture(params=["memory", "redis"])
def state_block(request: pytest.FixtureRequest) -> Iterator[dict[str, object]]:
    """The memory backend, or one Redis under a key prefix of the test's own."""
    if request.param == "memory":
        yield {"backend": "memory"}
        return
    url, prefix = require_redis(), new_prefix()
    try:
        yield {"backend": "redis", "redis_url": url, "key_prefix": prefix,
               "timeout": f"{int(TEST_TIMEOUT_S * 1000)}ms"}
    finally:
        delete_prefix(url, prefix)


async def test_waiting_duplicates_of_one_key_are_bounded_in_number(upstream, start_sluice,
                                                                   state_block):
    """Duplicates of an in-flight key were bounded in time (max_wait) but not in number: each
    held a connection and a waiter for as long as the first request ran."""
    upstream.hold = asyncio.Event()
    sluice = await start_sluice({"state": state_block, "routes": [route(
        "tools", upstream.url, "http", idempotency={"mode": "dedup", "max_waiters": 3})]})
    url = sluice.url + "/tools/v1/artifacts"
    payload = {"name": "report.pdf"}
    headers = {"Idempotency-Key": "artifact-7", "X-Tenant-ID": "acme"}
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, url, payload, headers))
        await wait_for(lambda: len(upstream.requests) == 1)
        waiting = [asyncio.create_task(post(s, url, payload, headers)) for _ in range(3)]
        await sluice.wait_metric("sluice_idempotency_waiting", 3, route="tools")
        started = time.monotonic()
        status, h, body = await post(s, url, payload, headers)
        assert time.monotonic() - started < 5  # at once, not after max_wait (60 s)
        assert (status, h["X-Sluice-Reason"], h["Retry-After"]) == (
            409, "idempotency_conflict", "1")
        assert h["x-should-retry"] == "true"  # the first may be done by then
        error = json.loads(body)["error"]
        assert error["reason"] == "idempotency_conflict"
        assert "3 duplicates already wait" in error["message"]
        assert "idempotency.max_waiters" in error["message"]
        # Another key is not affected by this one's waiters.
        other = asyncio.create_task(post(s, url, payload, {**headers,
                                                           "Idempotency-Key": "artifact-8"}))
        await wait_for(lambda: len(upstream.requests) == 2)
        upstream.hold.set()
        results = await asyncio.gather(first, *waiting, other)
    assert [status for status, _, _ in results] == [200] * 5
    assert [h.get("Idempotent-Replayed") for _, h, _ in results[1:4]] == ["true"] * 3
    assert upstream.executed == 2
    assert await sluice.metric("sluice_rejections_total", route="tools",
                               reason="idempotency_conflict") == 1


FAILING_ROUTE = {"retry": {"attempts": 3, "backoff": {"base": "10ms", "max": "50ms"}},
                 "idempotency": {"mode": "dedup"}}


async def test_waiting_duplicates_get_their_twins_failure(upstream, start_sluice, state_block):
    """20 agents of one step whose call failed after Sluice's retries ran it 20 times, one
    after another, each with its retries (60 attempts, 20 dead letters): those waiting for
    the key now get the first one's failure; one arriving after it runs again."""
    upstream.hold = asyncio.Event()
    upstream.status = 503
    sluice = await start_sluice({"state": state_block, "routes": [route(
        "tools", upstream.url, "http", **FAILING_ROUTE)]})
    url = sluice.url + "/tools/v1/charge"
    headers = {"Idempotency-Key": "charge-9", "X-Tenant-ID": "acme"}
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, url, {"usd": 5}, headers))
        await wait_for(lambda: len(upstream.requests) == 1)
        twins = [asyncio.create_task(post(s, url, {"usd": 5}, headers)) for _ in range(9)]
        await sluice.wait_metric("sluice_idempotency_waiting", 9, route="tools")
        upstream.hold.set()
        results = await asyncio.gather(first, *twins)
        assert len(upstream.requests) == 3  # one retry cycle, not ten
        assert [status for status, _, _ in results] == [503] * 10
        assert "Idempotent-Replayed" not in results[0][1]
        assert [h.get("Idempotent-Replayed") for _, h, _ in results[1:]] == ["true"] * 9
        # The same answer: body, Sluice's "do not retry" and the one dead letter's id.
        assert {body for _, _, body in results} == {results[0][2]}
        assert {h["x-should-retry"] for _, h, _ in results} == {"false"}
        assert {h["X-Sluice-Dead-Letter"] for _, h, _ in results} == {
            results[0][1]["X-Sluice-Dead-Letter"]}

        # The failure is not stored: a retry arriving now runs its own cycle.
        status, h, _ = await post(s, url, {"usd": 5}, headers)
        assert status == 503 and "Idempotent-Replayed" not in h
    assert len(upstream.requests) == 6
    assert await sluice.metric("sluice_upstream_attempts_total", route="tools") == 6
    assert await sluice.metric("sluice_dead_letters_total", route="tools") == 2
    assert await sluice.metric("sluice_idempotent_replays_total", route="tools") == 9
    assert await sluice.metric("sluice_idempotent_failure_replays_total", route="tools") == 9
    assert await sluice.metric("sluice_requests_total", route="tools", outcome="replayed") == 9
    assert await sluice.metric("sluice_work_units_total", route="tools") == 1
    await wait_for(lambda: len([e for e in sluice.events() if e["event"] == "replayed"]) == 9)
    replayed = [e for e in sluice.events() if e["event"] == "replayed"]
    assert {(e["status"], e["failure"]) for e in replayed} == {(503, True)}


async def test_a_failure_sluice_writes_is_given_to_waiting_twins(upstream, start_sluice,
                                                                  state_block):
    """No answer from the upstream in time: the 504 Sluice writes once its retries end is
    the failure the waiting duplicates get."""
    upstream.hold = asyncio.Event()  # never set: every attempt times out
    sluice = await start_sluice({"state": state_block, "routes": [route(
        "tools", upstream.url, "http", **{**FAILING_ROUTE, "retry": {
            "attempts": 2, "per_try_timeout": "400ms", "backoff": {"base": "10ms"}}})]})
    url = sluice.url + "/tools/v1/charge"
    headers = {"Idempotency-Key": "charge-10"}
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, url, {"usd": 5}, headers))
        await wait_for(lambda: len(upstream.requests) == 1)
        twins = [asyncio.create_task(post(s, url, {"usd": 5}, headers)) for _ in range(3)]
        await sluice.wait_metric("sluice_idempotency_waiting", 3, route="tools")
        results = await asyncio.gather(first, *twins)
    assert {(status, h["X-Sluice-Reason"]) for status, h, _ in results} == {
        (504, "upstream_timeout")}
    assert [h.get("Idempotent-Replayed") for _, h, _ in results] == [None] + ["true"] * 3
    assert {body for _, _, body in results} == {results[0][2]}
    assert len(upstream.requests) == 2
    assert await sluice.metric("sluice_upstream_attempts_total", route="tools") == 2


async def test_a_twin_whose_caller_left_or_was_refused_hands_the_key_on(upstream, start_sluice,
                                                                       state_block):
    """What is not a failure of the call is not given to its waiting twins: a caller that
    left (its request cancelled), and a refusal of Sluice's own before any attempt (here
    ``queue_timeout``): the waiter runs its own request, judged on its own."""
    upstream.hold = asyncio.Event()
    sluice = await start_sluice({"state": state_block, "routes": [route(
        "tools", upstream.url, "http", concurrency={"limit": 1, "queue": 5, "max_wait": "1s"},
        **FAILING_ROUTE)]})
    url = sluice.url + "/tools/v1/charge"
    async with aiohttp.ClientSession() as s:
        headers = {"Idempotency-Key": "left-1"}
        first = asyncio.create_task(post(s, url, {"usd": 1}, headers))
        await wait_for(lambda: len(upstream.requests) == 1)
        second = asyncio.create_task(post(s, url, {"usd": 1}, headers))
        await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
        first.cancel()
        await wait_for(lambda: len(upstream.requests) == 2 and upstream.cancelled == 1)
        upstream.hold.set()
        status, h, _ = await second
        assert status == 200 and "Idempotent-Replayed" not in h

        upstream.hold = asyncio.Event()
        blocker = asyncio.create_task(post(s, url, {}, {"Idempotency-Key": "blocker"}))
        await wait_for(lambda: len(upstream.requests) == 3)
        headers = {"Idempotency-Key": "queued-1"}
        queued = asyncio.create_task(post(s, url, {"usd": 2}, headers))
        await sluice.wait_metric("sluice_queue_depth", 1, route="tools")
        waiter = asyncio.create_task(post(s, url, {"usd": 2}, headers))
        await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
        status, h, _ = await queued
        assert (status, h["X-Sluice-Reason"]) == (503, "queue_timeout")
        upstream.hold.set()
        status, h, _ = await waiter
        assert status == 200 and "Idempotent-Replayed" not in h
        assert (await blocker)[0] == 200
    assert len(upstream.requests) == 4
    assert await sluice.metric("sluice_idempotent_failure_replays_total", route="tools") == 0


async def test_duplicates_waiting_on_another_replica_get_the_failure(upstream, start_sluice):
    """Two replicas on one Redis: the duplicates waiting on the replica that does not run the
    call get its failure too (woken by its write), and make no attempt of their own."""
    url, prefix = require_redis(), new_prefix()
    state = {"backend": "redis", "redis_url": url, "key_prefix": prefix,
             "timeout": f"{int(TEST_TIMEOUT_S * 1000)}ms"}
    upstream.hold = asyncio.Event()
    upstream.status = 503
    config = {"state": state, "routes": [route("tools", upstream.url, "http", **FAILING_ROUTE)]}
    try:
        runner, other = await start_sluice(config), await start_sluice(config)
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(post(s, runner.url + "/tools/v1/charge", {"usd": 5},
                                             {"Idempotency-Key": "charge-11"}))
            await wait_for(lambda: len(upstream.requests) == 1)
            twins = [asyncio.create_task(post(s, other.url + "/tools/v1/charge", {"usd": 5},
                                              {"Idempotency-Key": "charge-11"}))
                     for _ in range(5)]
            await other.wait_metric("sluice_idempotency_waiting", 5, route="tools")
            upstream.hold.set()
            results = await asyncio.gather(first, *twins)
            assert [status for status, _, _ in results] == [503] * 6
            assert [h.get("Idempotent-Replayed") for _, h, _ in results] == [None] + ["true"] * 5
            assert {body for _, _, body in results} == {results[0][2]}
            assert len(upstream.requests) == 3

            # Arriving after the failure, on either replica: the key is free, and runs.
            status, h, _ = await post(s, other.url + "/tools/v1/charge", {"usd": 5},
                                      {"Idempotency-Key": "charge-11"})
            assert status == 503 and "Idempotent-Replayed" not in h
        assert len(upstream.requests) == 6
        assert await runner.metric("sluice_upstream_attempts_total", route="tools") == 3
        assert await other.metric("sluice_upstream_attempts_total", route="tools") == 3
        assert await other.metric("sluice_idempotent_failure_replays_total", route="tools") == 5
    finally:
        delete_prefix(url, prefix)


async def holder_and_waiting_twin(s: aiohttp.ClientSession, sluice, upstream, url: str,
                                  headers: dict[str, str], deadline: str, reached: int = 1
                                  ) -> tuple[asyncio.Task, asyncio.Task]:
    """A keyed call of the ``tools`` route whose caller's deadline is ``deadline`` seconds,
    once the upstream has its ``reached``-th request, and its twin with no deadline, once it
    waits for the key: both tasks (``post``'s results)."""
    first = asyncio.create_task(post(s, url, {"usd": 5},
                                     {**headers, "X-Request-Timeout": deadline}))
    await wait_for(lambda: len(upstream.requests) == reached)
    twin = asyncio.create_task(post(s, url, {"usd": 5}, headers))
    await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
    return first, twin


async def test_a_twin_stopped_by_its_callers_deadline_hands_the_key_on(upstream, start_sluice):
    """A call whose retries its caller's deadline stopped (the upstream's Retry-After did not
    fit in it) failed for that caller, not for good: a duplicate with no deadline waiting for
    the key runs the call itself, rather than being given the short-deadline caller's 503."""
    upstream.hold = asyncio.Event()
    upstream.statuses = [503]  # then 200
    upstream.error_headers = {"Retry-After": "3"}
    sluice = await start_sluice({"state": {"backend": "memory"}, "routes": [route(
        "tools", upstream.url, "http", **{**FAILING_ROUTE, "retry": {"attempts": 3}})]})
    url = sluice.url + "/tools/v1/charge"
    headers = {"Idempotency-Key": "charge-11"}
    async with aiohttp.ClientSession() as s:
        first, twin = await holder_and_waiting_twin(s, sluice, upstream, url, headers, "2")
        upstream.hold.set()
        status, h, _ = await first
        assert status == 503 and "Idempotent-Replayed" not in h
        status, h, _ = await twin
    assert status == 200 and "Idempotent-Replayed" not in h
    assert len(upstream.requests) == 2
    assert await sluice.metric("sluice_idempotent_failure_replays_total", route="tools") == 0
