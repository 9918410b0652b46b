"""Sluice's retry layer and dead letters, end to end, through the official openai SDK."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import aiohttp
import openai
import pytest
from multidict import CIMultiDict

from tests.conftest import free_port, route, wait_until
from tests.fakeupstream import RawUpstream
from tests.sluice_child import sluice_cli

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
FAST_BACKOFF = {"base": "10ms", "max": "50ms"}


def header(seen, name: str) -> str | None:
    """A header of a request the fake upstream saw, by case-insensitive name."""
    return CIMultiDict(seen.headers).get(name)


async def dlq_list(sluice) -> str:
    code, out, err = await sluice_cli("dlq", "list", "--config", str(sluice.config_path))
    assert code == 0, err
    return out


async def retry_sluice(start_sluice, tmp_path, *routes: dict):
    return await start_sluice({"dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
                               "routes": list(routes)})


async def post(session: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, dict]:
    async with session.post(url, json=BODY, headers=headers) as r:
        await r.read()
        return r.status, dict(r.headers)


async def test_retry_storm_is_one_layer_and_dead_letter_replays(upstream, start_sluice,
                                                                 tmp_path):
    sluice = await retry_sluice(start_sluice, tmp_path, route(
        "openai", upstream.url, retry={"attempts": 3, "backoff": FAST_BACKOFF}))
    upstream.status = 503
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test-secret",
                                max_retries=2)
    with pytest.raises(openai.InternalServerError) as info:
        await client.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"Idempotency-Key": "key-storm-1", "X-Tenant-ID": "acme",
                           "X-Run-ID": "run-7"})
    await client.close()
    response = info.value.response
    assert response.status_code == 503 and response.headers["x-should-retry"] == "false"
    letter_id = response.headers["x-sluice-dead-letter"]

    # One logical call: Sluice's 3 attempts, none from the SDK on top (not 9).
    assert len(upstream.requests) == 3
    assert {header(r, "Idempotency-Key") for r in upstream.requests} == {"key-storm-1"}
    assert await sluice.metric("sluice_upstream_attempts_total", route="openai") == 3
    assert await sluice.metric("sluice_work_units_total", route="openai") == 1
    assert await sluice.metric("sluice_retries_total", route="openai") == 2
    assert await sluice.metric("sluice_dead_letters_total", route="openai") == 1
    assert await sluice.metric("sluice_dead_letter_depth", route="openai") == 1

    config = str(sluice.config_path)
    code, out, _ = await sluice_cli("dlq", "list", "--config", config)
    assert code == 0
    rows = out.splitlines()[1:]
    assert len(rows) == 1 and rows[0].split()[0] == letter_id
    assert "attempts_exhausted" in rows[0] and "POST /v1/chat/completions" in rows[0]
    code, out, _ = await sluice_cli("dlq", "show", letter_id, "--config", config)
    record = json.loads(out)
    assert (record["route"], record["tenant"], record["run"], record["idempotency_key"]) == (
        "openai", "acme", "run-7", "key-storm-1")
    assert [a["status"] for a in record["attempts"]] == [503, 503, 503]
    assert record["reason"] == "attempts_exhausted"
    assert record["body"]["text"].encode() == upstream.requests[0].body
    assert "Authorization" in record["redacted_headers"]
    assert b"sk-test-secret" not in (tmp_path / "dlq.sqlite").read_bytes()

    # The upstream is back: the operator replays the work with the same idempotency key.
    upstream.status = None
    code, out, err = await sluice_cli(
        "dlq", "replay", letter_id, "--config", config,
        "-H", "Authorization: Bearer sk-test-secret")
    assert code == 0, err
    assert "HTTP 200" in out
    replayed = upstream.requests[-1]
    assert len(upstream.requests) == 4
    assert header(replayed, "Idempotency-Key") == "key-storm-1"
    assert header(replayed, "Authorization") == "Bearer sk-test-secret"
    assert replayed.body == upstream.requests[0].body and replayed.path_qs == CHAT
    code, out, _ = await sluice_cli("dlq", "show", letter_id, "--config", config)
    assert [r["status"] for r in json.loads(out)["replays"]] == [200]
    # Done once: a second replay could do the work twice, so it needs --again.
    code, _, err = await sluice_cli("dlq", "replay", letter_id, "--config", config)
    assert code == 1 and "already replayed" in err and "--again" in err
    assert len(upstream.requests) == 4
    code, out, _ = await sluice_cli("dlq", "replay", letter_id, "--config", config, "--again",
                                    "-H", "Authorization: Bearer sk-test-secret")
    assert code == 0 and len(upstream.requests) == 5
    code, out, _ = await sluice_cli("dlq", "purge", "--config", config)
    assert (code, out.split()[1]) == (0, "1")

    await asyncio.sleep(0.3)  # the event log is flushed every 0.2 s
    request_id = record["request_id"]
    events = [e for e in sluice.events() if e.get("request_id") == request_id]
    assert [e["event"] for e in events] == [
        "admitted", "retried", "retried", "dead_lettered", "completed"]
    assert events[3]["dead_letter_id"] == int(letter_id) and events[4]["status"] == 503


async def test_a_full_dead_letter_store_keeps_the_newest_letters(upstream, start_sluice,
                                                                   tmp_path):
    """dead_letter.max_records: an outage cannot fill the disk; the drops are counted."""
    sluice = await start_sluice({
        "dead_letter": {"path": str(tmp_path / "dlq.sqlite"), "max_records": 2},
        "routes": [route("openai", upstream.url,
                         retry={"attempts": 2, "backoff": FAST_BACKOFF})]})
    upstream.status = 503
    ids = []
    async with aiohttp.ClientSession() as s:
        for n in range(3):
            status, headers = await post(s, sluice.url + "/openai" + CHAT,
                                         **{"Idempotency-Key": f"full-{n}"})
            assert status == 503
            ids.append(headers["X-Sluice-Dead-Letter"])
    assert await sluice.metric("sluice_dead_letters_total", route="openai") == 3
    assert await sluice.metric("sluice_dead_letters_dropped_total", route="openai",
                               reason="max_records") == 1
    assert await sluice.metric("sluice_dead_letter_depth", route="openai") == 2
    assert [line.split()[0] for line in (await dlq_list(sluice)).splitlines()[1:]] == ids[1:]


async def test_one_tenants_failures_cannot_push_out_another_tenants_letter(
        upstream, start_sluice, tmp_path):
    """dead_letter.max_records_per_tenant: a caller flooding the store drops its own oldest
    letters, not another tenant's (a hostile trial: 60 calls of one caller left 50 of its
    letters in a store of 50, the victim's gone)."""
    sluice = await start_sluice({
        "dead_letter": {"path": str(tmp_path / "dlq.sqlite"), "max_records": 8,
                        "max_records_per_tenant": 2},
        "routes": [route("openai", upstream.url,
                         retry={"attempts": 2, "backoff": FAST_BACKOFF})]})
    upstream.status = 503
    async with aiohttp.ClientSession() as s:
        _, headers = await post(s, sluice.url + "/openai" + CHAT, **{
            "Idempotency-Key": "victim-0", "X-Tenant-ID": "victim"})
        victim = headers["X-Sluice-Dead-Letter"]
        ids = []
        for n in range(6):
            status, headers = await post(s, sluice.url + "/openai" + CHAT, **{
                "Idempotency-Key": f"flood-{n}", "X-Tenant-ID": "attacker"})
            assert status == 503
            ids.append(headers["X-Sluice-Dead-Letter"])
    assert await sluice.metric("sluice_dead_letters_dropped_total", route="openai",
                               reason="max_records_per_tenant") == 4
    assert await sluice.metric("sluice_dead_letters_dropped_total", route="openai",
                               reason="max_records") == 0
    listed = [line.split()[0] for line in (await dlq_list(sluice)).splitlines()[1:]]
    assert listed == [victim, *ids[-2:]]


async def test_a_locked_dead_letter_file_holds_no_slot_past_a_second(upstream, start_sluice,
                                                                     tmp_path):
    """Seen in a hostile trial: another process holding a write transaction on the file (an
    operator's sqlite3 shell) kept each failing call in its slot for SQLite's 5 s busy
    timeout, one write after another, and healthy calls queued behind it got 503
    queue_timeout. The answer now goes without its id, and the letter is written once the
    lock is gone."""
    path = tmp_path / "dlq.sqlite"
    sluice = await start_sluice({
        "dead_letter": {"path": str(path)},
        "routes": [route("openai", upstream.url, retry={"attempts": 1},
                         concurrency={"limit": 1, "queue": 1, "max_wait": "3s"})]})
    url = sluice.url + "/openai" + CHAT
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        async with aiohttp.ClientSession() as s:
            failing = asyncio.create_task(post(s, url, **{"x-fake-status": "502"}))
            await sluice.wait_metric("sluice_inflight_requests", 1, route="openai")
            healthy = await post(s, url)
            status, headers = await failing
    finally:
        locker.rollback()
        locker.close()
    assert healthy[0] == 200
    assert status == 502 and "X-Sluice-Dead-Letter" not in headers
    await wait_until(lambda: any(e["event"] == "dead_lettered" for e in sluice.events()),
                     what="the letter written once the lock is gone")
    [lettered] = [e for e in sluice.events() if e["event"] == "dead_lettered"]
    assert lettered["dead_letter_id"] == 1
    assert (await dlq_list(sluice)).splitlines()[1].split()[0] == "1"
    await sluice.wait_metric("sluice_buffered_request_bytes", 0)


async def test_a_letter_the_store_cannot_write_is_counted_as_lost(upstream, start_sluice,
                                                                   tmp_path):
    """Seen in a hostile trial: on a full disk each lost letter was a log line only, so
    nothing a dashboard or an alert reads said that dead letters were being lost."""
    where = tmp_path / "letters"
    where.mkdir()
    sluice = await start_sluice({
        "dead_letter": {"path": str(where / "dlq.sqlite")},
        "routes": [route("openai", upstream.url, retry={"attempts": 1})]})
    url = sluice.url + "/openai" + CHAT
    async with aiohttp.ClientSession() as s:
        status, headers = await post(s, url, **{"x-fake-status": "502"})
        assert (status, headers["X-Sluice-Dead-Letter"]) == (502, "1")
        for name in ("dlq.sqlite", "dlq.sqlite-wal", "dlq.sqlite-shm"):
            (where / name).unlink(missing_ok=True)
        where.rmdir()  # no file can be made there again
        status, headers = await post(s, url, **{"x-fake-status": "502"})
    assert status == 502 and "X-Sluice-Dead-Letter" not in headers
    await sluice.wait_metric("sluice_dead_letter_write_failures_total", 1, route="openai")
    assert await sluice.metric("sluice_dead_letters_total", route="openai") == 1
    assert "dead-letter write failed on route openai" in sluice.stderr()


async def test_letters_lost_to_an_unanswering_redis_are_one_line_a_route_not_a_traceback_each(
        caplog) -> None:
    """A hostile trial froze Redis under load: each dead letter it could not take was an
    ERROR with a full traceback (six in 5 s on one replica), where every other write lost to
    an outage is held to a line every few seconds. Now so is this one, with no traceback; a
    failure of any other kind keeps its traceback."""
    from types import SimpleNamespace

    from policies.logs import PER_CALL
    from policies.state import StateUnavailable
    from proxy.attempts import _dead_lettered

    lost: list[int] = []
    route_ = SimpleNamespace(name="openai", metrics=SimpleNamespace(
        dead_letter_failures=SimpleNamespace(inc=lambda: lost.append(1))))
    call = SimpleNamespace(request_id="req-1", tenant="acme", run=None, idempotency_key=None,
                           event_names=dict)
    emitted: list[tuple] = []
    rt = SimpleNamespace(events=SimpleNamespace(emit=lambda *a, **f: emitted.append((a, f))))
    loop = asyncio.get_running_loop()
    for error in (StateUnavailable("timed out after 50ms"), OSError("disk full")):
        write = loop.create_future()
        write.set_exception(error)
        with caplog.at_level("ERROR", logger="sluice"):
            _dead_lettered(rt, route_, call, "retries_exhausted", 3, write)
    frozen, full = caplog.records[-2:]
    assert frozen.getMessage() == ("dead-letter write failed on route openai: the state backend "
                                   "did not answer (timed out after 50ms)")
    assert frozen.exc_info is None and frozen.sluice_per_call is PER_CALL["sluice_per_call"]
    assert full.exc_info is not None and not getattr(full, "sluice_per_call", False)
    assert len(lost) == 2  # both counted in sluice_dead_letter_write_failures_total
    assert [a[0] for a, _ in emitted] == ["dead_letter_lost"] * 2  # and on the event log


async def test_first_attempt_fails_every_caller_gets_200_amplification_2(upstream, start_sluice,
                                                                         tmp_path):
    # ratio 1.0: this test is about amplification, not about the budget (tested below).
    sluice = await retry_sluice(start_sluice, tmp_path, route(
        "openai", upstream.url,
        retry={"attempts": 3, "backoff": FAST_BACKOFF, "budget": {"ratio": 1.0}}))
    upstream.fail_first = 503
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test")

    async def call(i: int) -> str:
        reply = await client.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"Idempotency-Key": f"key-{i}"})
        return reply.choices[0].message.content

    assert await asyncio.gather(*(call(i) for i in range(8))) == ["hello from fake"] * 8
    await client.close()
    attempts = await sluice.metric("sluice_upstream_attempts_total", route="openai")
    work = await sluice.metric("sluice_work_units_total", route="openai")
    assert (attempts, work, attempts / work) == (16, 8, 2.0)
    assert await sluice.metric("sluice_retries_total", route="openai") == 8
    assert await sluice.metric("sluice_dead_letters_total", route="openai") == 0


async def test_retry_budget_stops_a_storm(upstream, start_sluice, tmp_path):
    sluice = await retry_sluice(start_sluice, tmp_path, route(
        "openai", upstream.url, retry={"attempts": 3, "backoff": FAST_BACKOFF}))
    upstream.fail_first = 503  # first attempts fail at once ...
    upstream.hold = asyncio.Event()  # ... and the retries stay in flight until released
    async with aiohttp.ClientSession() as s:
        calls = [asyncio.create_task(post(s, sluice.url + "/openai" + CHAT,
                                          **{"Idempotency-Key": f"k{i}"}))
                 for i in range(10)]
        deadline = time.monotonic() + 10
        while not (sum(c.done() for c in calls) == 7 and upstream.inflight == 3):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        refused = [c.result() for c in calls if c.done()]
        assert {st for st, _ in refused} == {503}
        assert {h["x-should-retry"] for _, h in refused} == {"false"}
        upstream.hold.set()
        results = await asyncio.gather(*calls)
    assert sorted(st for st, _ in results) == [200] * 3 + [503] * 7
    assert len(upstream.requests) == 13
    assert await sluice.metric("sluice_retry_overflow_total", route="openai") == 7
    out = await dlq_list(sluice)
    assert [line.split()[5] for line in out.splitlines()[1:]] == ["retry_budget"] * 7


async def test_only_safe_requests_are_retried(upstream, start_sluice, tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    retry = {"attempts": 3, "backoff": FAST_BACKOFF}
    sluice = await retry_sluice(start_sluice, tmp_path, route("openai", upstream.url, retry=retry),
                                route("down", closed, retry=retry))
    async with aiohttp.ClientSession() as s:
        # POST without an idempotency key that reached the upstream: not repeated, and the
        # caller's own retry rules stand (no x-should-retry: Sluice did not retry it).
        upstream.status = 503
        status, headers = await post(s, sluice.url + "/openai" + CHAT)
        assert status == 503 and "x-should-retry" not in headers
        assert len(upstream.requests) == 1
        # An idempotent method is.
        upstream.status = None
        upstream.statuses = [503, 502]
        async with s.get(sluice.url + "/openai/v1/models") as r:
            assert r.status == 200
        assert len(upstream.requests) == 4
        # A POST that never left (connection refused) is safe to repeat.
        status, headers = await post(s, sluice.url + "/down" + CHAT)
        assert status == 502 and headers["X-Sluice-Reason"] == "upstream_unreachable"
        assert headers["x-should-retry"] == "false" and "X-Sluice-Dead-Letter" in headers
        assert await sluice.metric("sluice_upstream_attempts_total", route="down") == 3
        # An SDK's own retry is not retried again by Sluice.
        upstream.status = 503
        status, headers = await post(s, sluice.url + "/openai" + CHAT,
                                     **{"Idempotency-Key": "k", "x-stainless-retry-count": "1"})
        assert (status, headers["x-should-retry"]) == (503, "false")
        assert len(upstream.requests) == 5
    assert await sluice.metric("sluice_work_units_total", route="openai") == 2
    out = await dlq_list(sluice)
    reasons = [(line.split()[2], line.split()[5]) for line in out.splitlines()[1:]]
    # The SDK's own retry: sent once, and its letter says why it was not retried (it read
    # "attempts_exhausted" with 1 attempt on a route of 3, as if the config were ignored).
    assert reasons == [("openai", "unsafe_to_retry"), ("down", "attempts_exhausted"),
                       ("openai", "sdk_retry")]


@pytest.mark.parametrize("dropped_by", ["connection", "route"])
async def test_a_callers_key_the_upstream_never_sees_makes_no_post_safe_to_repeat(
        upstream, start_sluice, tmp_path, dropped_by):
    """A hostile trial: ``Connection: Idempotency-Key`` (its field is hop-by-hop then, RFC
    9110 §7.6.1) kept the key from the upstream, yet Sluice repeated the POST as one the
    upstream could deduplicate: the upstream ran it twice, with no key on either attempt. So
    did a route's ``request_headers_to_remove``."""
    retry = {"attempts": 3, "backoff": FAST_BACKOFF}
    keyed = route("openai", upstream.url, retry=retry)
    if dropped_by == "route":
        keyed["request_headers_to_remove"] = ["Idempotency-Key"]
    sluice = await retry_sluice(start_sluice, tmp_path, keyed)
    headers = {"Idempotency-Key": "k-hop"}
    if dropped_by == "connection":
        headers["Connection"] = "Idempotency-Key"
    upstream.status = 503
    async with aiohttp.ClientSession() as s:
        status, answer = await post(s, sluice.url + "/openai" + CHAT, **headers)
    assert status == 503 and "x-should-retry" not in answer
    [seen] = upstream.requests  # sent once
    assert header(seen, "Idempotency-Key") is None
    assert (await dlq_list(sluice)).splitlines()[1].split()[5] == "unsafe_to_retry"


@pytest.mark.parametrize("key", ["", " ", "a\tb"])
async def test_an_invalid_callers_key_makes_no_post_safe_to_repeat(upstream, start_sluice,
                                                                   tmp_path, key):
    """A hostile trial: an empty ``Idempotency-Key`` (or a blank or malformed one), which no
    upstream can deduplicate by, made a non-idempotent POST retried three times."""
    retry = {"attempts": 3, "backoff": FAST_BACKOFF}
    sluice = await retry_sluice(start_sluice, tmp_path, route("openai", upstream.url,
                                                               retry=retry))
    upstream.status = 503
    async with aiohttp.ClientSession() as s:
        status, answer = await post(s, sluice.url + "/openai" + CHAT,
                                    **{"Idempotency-Key": key})
    assert status == 503 and "x-should-retry" not in answer
    assert len(upstream.requests) == 1  # sent once


async def test_an_attempt_that_may_have_reached_the_upstream_is_not_logged_as_a_connect_error(
        start_sluice, tmp_path):
    """An upstream that read the whole POST, then closed without answering: the dead letter
    said the attempt failed with ``connect_error``, which an operator deciding on a replay
    reads as "never left" (a new user's trial). It is ``connection_lost``; a refused
    connection stays ``connect_error``; ``retry.on: [connect_error]`` covers both."""
    received = []

    async def read_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        received.append(await reader.readexactly(length))
        writer.close()

    server = await asyncio.start_server(read_then_close, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    retry = {"attempts": 3, "backoff": FAST_BACKOFF}
    try:
        sluice = await retry_sluice(
            start_sluice, tmp_path, route("closes", f"http://127.0.0.1:{port}", retry=retry),
            route("down", f"http://127.0.0.1:{free_port()}", retry=retry))
        async with aiohttp.ClientSession() as s:
            for name in ("closes", "down"):
                status, headers = await post(s, sluice.url + f"/{name}" + CHAT)
                assert status == 502 and "X-Sluice-Dead-Letter" in headers
        assert len(received) == 1  # reached the upstream: not repeated (no key)
        errors = {}
        for line in (await dlq_list(sluice)).splitlines()[1:]:
            letter = line.split()[0]
            code, out, err = await sluice_cli("dlq", "show", letter, "--config",
                                              str(sluice.config_path))
            assert code == 0, err
            shown = json.loads(out)
            errors[shown["route"]] = (shown["reason"], [a["error"] for a in shown["attempts"]])
        assert errors == {"closes": ("unsafe_to_retry", ["connection_lost"]),
                          "down": ("attempts_exhausted", ["connect_error"] * 3)}
    finally:
        server.close()
        await server.wait_closed()


async def test_a_retry_count_that_is_no_number_is_no_retry(upstream, start_sluice, tmp_path):
    """Seen: x-stainless-retry-count "\u00b2" (a digit to str.isdigit(), not to int()) raised
    in the handler, a 500; it is no count, so not an SDK's retry: Sluice retries the call."""
    sluice = await retry_sluice(start_sluice, tmp_path, route(
        "openai", upstream.url, retry={"attempts": 2, "backoff": FAST_BACKOFF}))
    upstream.statuses = [503]
    async with aiohttp.ClientSession() as s:
        async with s.get(sluice.url + "/openai/v1/models",
                         headers={"x-stainless-retry-count": "\u00b2"}) as r:
            assert r.status == 200
    assert [header(seen, "x-stainless-retry-count") for seen in upstream.requests] == [
        "\u00b2", "\u00b2"]


async def test_retry_after_and_deadline(upstream, start_sluice, tmp_path):
    sluice = await retry_sluice(
        start_sluice, tmp_path,
        route("openai", upstream.url, retry={"attempts": 3, "backoff": FAST_BACKOFF,
                                             "max_retry_after": "2s", "deadline": "1s"}),
        route("slow", upstream.url, retry={"attempts": 5, "backoff": FAST_BACKOFF,
                                           "per_try_timeout": "300ms", "deadline": "500ms"}),
    )
    async with aiohttp.ClientSession() as s:
        # The upstream's wait is honoured (never shorter than asked).
        upstream.statuses = [503]
        upstream.error_headers = {"retry-after-ms": "400"}
        async with s.get(sluice.url + "/openai/v1/models") as r:
            assert r.status == 200
        assert upstream.requests[1].at - upstream.requests[0].at >= 0.4
        # A wait longer than max_retry_after, or past the deadline, ends the retries.
        for wait in ("5", "1.5"):  # ended by: retry_after_too_long, deadline
            upstream.statuses = [503]
            upstream.error_headers = {"Retry-After": wait}
            async with s.get(sluice.url + "/openai/v1/models") as r:
                assert (r.status, r.headers["Retry-After"]) == (503, wait)  # the upstream's own
                assert r.headers["x-should-retry"] == "false"
        assert len(upstream.requests) == 4
        # No answer within the deadline: 503 deadline_unreachable.
        upstream.error_headers = {}
        async with s.get(sluice.url + "/slow/v1/models", headers={"x-fake-delay": "3"}) as r:
            assert r.status == 503
            assert r.headers["X-Sluice-Reason"] == "deadline_unreachable"
            assert r.headers["x-should-retry"] == "false"
    out = await dlq_list(sluice)
    assert [line.split()[5] for line in out.splitlines()[1:]] == [
        "retry_after_too_long", "deadline", "deadline"]


async def test_each_attempt_tells_the_upstream_the_time_left_and_a_letter_keeps_none(
        upstream, start_sluice, tmp_path):
    """A hostile trial: every retry sent the deadline header as it was before the first
    attempt, so an upstream (or a Sluice behind this one) worked for 2.4 s more than the
    caller would wait. Each attempt now says what is left; a dead letter keeps none (its
    replay has no caller)."""
    sluice = await retry_sluice(
        start_sluice, tmp_path,
        route("tool", upstream.url, "http",
              retry={"attempts": 3, "backoff": {"base": "300ms", "max": "300ms"}}))
    upstream.statuses = [503, 503, 503]
    async with aiohttp.ClientSession() as s:
        status, _ = await post(s, sluice.url + "/tool/v1/deploy",
                               **{"X-Request-Timeout": "5", "Idempotency-Key": "deploy-1"})
    assert status == 503 and len(upstream.requests) == 3
    first = upstream.requests[0]
    told = [float(header(seen, "X-Request-Timeout")) for seen in upstream.requests]
    assert 4 < told[0] <= 5 and told[0] > told[1] > told[2]
    for seen, left in zip(upstream.requests[1:], told[1:], strict=True):
        # What was told first, less the time since: within the time a request takes here.
        assert left == pytest.approx(told[0] - (seen.at - first.at), abs=0.25)
    with sqlite3.connect(tmp_path / "dlq.sqlite") as db:
        (stored,) = db.execute("SELECT headers FROM dead_letters").fetchone()
    headers = stored.decode() if isinstance(stored, bytes) else stored
    assert "deploy-1" in headers and "x-request-timeout" not in headers.lower()


async def test_an_answer_cut_before_it_was_sent_keeps_the_callers_retry_rules(start_sluice,
                                                                              tmp_path):
    """One layer retries a failure: a small answer cut short before any of it was sent (a 502
    ``upstream_unreachable`` Sluice writes itself) is retried by no layer of Sluice's, yet it
    still carried ``x-should-retry: false`` on a route with ``retry``, so the caller's SDK
    dropped its own retry too. Only a failure Sluice did retry says so."""
    cut = b"{\"id\": \"chatcmpl-1\", \"obj"
    ok = await RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 1000\r\n\r\n" + cut).start()
    failing = await RawUpstream(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                                b"application/json\r\nContent-Length: 1000\r\n\r\n" + cut).start()
    retry = {"attempts": 2, "backoff": FAST_BACKOFF, "on": [503]}
    try:
        sluice = await retry_sluice(start_sluice, tmp_path,
                                    route("ok", ok.url, retry=retry),
                                    route("failing", failing.url, retry=retry))
        async with aiohttp.ClientSession() as s:
            status, headers = await post(s, sluice.url + "/ok" + CHAT,
                                         **{"Idempotency-Key": "k1"})
            assert (status, headers["X-Sluice-Reason"]) == (502, "upstream_unreachable")
            assert "x-should-retry" not in headers
            assert len(ok.requests) == 1
            # Retried as far as it went, its last answer then cut: the SDK must not add more.
            status, headers = await post(s, sluice.url + "/failing" + CHAT,
                                         **{"Idempotency-Key": "k2"})
            assert (status, headers["x-should-retry"]) == (502, "false")
            assert len(failing.requests) == 2
    finally:
        await ok.stop()
        await failing.stop()
