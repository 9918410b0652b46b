"""Redis faults, injected for real on a redis-server of the test's own: frozen (SIGSTOP),
stopped and restarted, absent at start, refusing (BUSY, READONLY, OOM, a wrong password).
Every call answers StateUnavailable within the timeout (plus slack for a busy machine), and the
same client recovers by itself once Redis answers again. Also: what the URL names (server or
cluster), and that passwords never show."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from policies.breaker import Breaker
from policies.config import CircuitBreakerConfig, RateConfig
from policies.deadletter import DeadLetter
from policies.rate import RateLimiter, unavailable
from policies.reasons import Reason, Rejected
from policies.state import (
    Fallback,
    StateBackends,
    StateUnavailable,
    redact_url,
    redis_backends,
)
from policies.state.breaker import FAILURE, SUCCESS, BreakerParams, Ticket
from policies.state.connection import RedisState, Script
from policies.state.idempotency import SEEN, Answer
from policies.state.ledger import Claim
from policies.state.rate import Take
from proxy.rejections import rejection_headers
from tests.conftest import route
from tests.redis_servers import RedisCluster, RedisServer, free_port, new_prefix, require_redis

TIMEOUT_S = 0.2
#: Slack for a busy machine (0.1 s failed a suite sharing 2 cores: 0.55 s): a call bounded
#: by ``state.timeout`` is told apart from one that waits for the frozen server, which never
#: answers before the test thaws it.
MARGIN_S = 1.0
PROBE_S = 0.05


def every_call(b: StateBackends) -> dict[str, Callable[[], Awaitable[Any]]]:
    """One request-path call of each kind of state."""
    now = time.time()
    letter = DeadLetter("r", "t", None, None, "req", "POST", "/", [], [], b"", 0, [], "x")
    return {
        "rate.admit": lambda: b.rates.admit("r", [Take("requests", 10, 60.0)]),
        "rate.refund": lambda: b.rates.refund("r", [Take("requests", 10, 60.0)]),
        "ledger.reserve": lambda: b.ledger.reserve(
            "r", "id", [Claim("day", 1, 10, now + 60)], now, 60),
        "ledger.settle": lambda: b.ledger.settle("r", "id", [1]),
        "admissions.admit": lambda: b.admissions.admit(
            "r", [Take("requests", 10, 60.0)], "id2", [Claim("day", 1, 10, now + 60)], now, 60),
        "admissions.release": lambda: b.admissions.release(
            "r", [Take("requests", 10, 60.0)], "id2"),
        "leases.acquire": lambda: b.leases.acquire("r", "t", "l", 4, None, 5),
        "leases.release": lambda: b.leases.release("r", "t", "l"),
        "idempotency.begin": lambda: b.idempotency.begin("k", "o", b"", 5),
        "idempotency.finish": lambda: b.idempotency.finish("k", "o", Answer(SEEN, b""), 5),
        "breaker.admit": lambda: b.breakers.admit("r", BreakerParams(5, 1.0)),
        "breaker.record": lambda: b.breakers.record("r", Ticket(0), 0, BreakerParams(5, 1.0)),
        "breaker.flush": lambda: flush_a_success(b),
        "dead_letters.add": lambda: b.dead_letters.add(letter),
    }


async def flush_a_success(b: StateBackends) -> object:
    """A success deferred, then flushed (the flush of nothing pending asks nothing)."""
    assert b.breakers.defer("r", Ticket(0), SUCCESS, BreakerParams(5, 1.0))
    return await b.breakers.flush("r", BreakerParams(5, 1.0))


async def each_is_unavailable_in_time(b: StateBackends) -> None:
    for name, call in every_call(b).items():
        started = time.monotonic()
        with pytest.raises(StateUnavailable):
            await call()
        took = time.monotonic() - started
        assert took <= TIMEOUT_S + MARGIN_S, f"{name} took {took:.3f}s"


async def each_answers(b: StateBackends) -> None:
    for call in every_call(b).values():
        await call()


async def recovered(b: StateBackends, within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while not b.health.up:
        assert time.monotonic() < deadline, f"not back up: {b.health.last_error}"
        await asyncio.sleep(0.02)


@pytest.fixture
async def own(redis_server: RedisServer) -> Any:
    backends = await redis_backends(redis_server.url, new_prefix(), TIMEOUT_S,
                                    probe_interval_s=PROBE_S)
    try:
        assert backends.health.up
        await each_answers(backends)  # scripts loaded, connections open
        yield backends
    finally:
        await backends.close()


async def test_a_frozen_redis_answers_unavailable_in_time_and_recovers(
        own: StateBackends, redis_server: RedisServer):
    redis_server.freeze()
    try:
        # Every kind of call at once, as a busy proxy would make them: all are on the wire
        # before anyone notices, so each is bounded by its own timeout.
        started = time.monotonic()
        results = await asyncio.gather(*(call() for call in every_call(own).values()),
                                       return_exceptions=True)
        took = time.monotonic() - started
        assert all(isinstance(r, StateUnavailable) for r in results), results
        assert took <= TIMEOUT_S + MARGIN_S, f"{took:.3f}s"
        assert not own.health.up and own.health.last_error
        await each_is_unavailable_in_time(own)
        await asyncio.sleep(3 * PROBE_S)  # the probes meet the frozen server too
        await each_is_unavailable_in_time(own)
    finally:
        redis_server.thaw()
    await recovered(own)
    await each_answers(own)


async def test_a_stopped_redis_answers_unavailable_and_a_restarted_one_serves_again(
        own: StateBackends, redis_server: RedisServer):
    redis_server.stop()
    await each_is_unavailable_in_time(own)
    redis_server.start()  # empty, with no scripts loaded: NOSCRIPT is handled
    await recovered(own)
    await each_answers(own)
    assert (await own.rates.admit("r", [Take("fresh", 1, 60.0)])).admitted


async def test_a_redis_absent_at_start_is_found_when_it_comes(tmp_path: Path):
    require_redis()  # only to skip or fail as the rest do when Redis is not installed
    server = RedisServer(tmp_path / "late", port=free_port())
    backends = await redis_backends(server.url, new_prefix(), TIMEOUT_S,
                                    probe_interval_s=PROBE_S)
    try:
        assert not backends.health.up and backends.redis is not None
        assert backends.redis.cluster is None
        await each_is_unavailable_in_time(backends)
        server.start()
        await recovered(backends)
        assert backends.redis.cluster is False
        # A server just started loads each script on its first call: on a busy machine one
        # outlasted the 0.2 s timeout (a CI run). Found, it answers every call within 3 s.
        deadline = time.monotonic() + 3.0
        while True:
            try:
                await each_answers(backends)
                break
            except StateUnavailable:
                assert time.monotonic() < deadline, backends.health.last_error
                await asyncio.sleep(PROBE_S)
    finally:
        await backends.close()
        server.stop()


async def refused_then_recovered(own: StateBackends, admin: redis.Redis,
                                 refuse: Callable[[], Any], allow: Callable[[], Any],
                                 code: str) -> None:
    refuse()
    with pytest.raises(StateUnavailable, match=code):
        await own.ledger.reserve("r", "x", [Claim("day", 1, 10, time.time() + 60)],
                                 time.time(), 60)
    assert not own.health.up
    allow()
    await recovered(own)
    await each_answers(own)


async def test_oom_readonly_and_busy_count_as_unavailable(
        own: StateBackends, redis_server: RedisServer):
    admin = redis_server.client()
    await refused_then_recovered(
        own, admin, lambda: admin.config_set("maxmemory", "1"),
        lambda: admin.config_set("maxmemory", "0"), "OutOfMemory")
    await refused_then_recovered(
        own, admin, lambda: admin.replicaof("127.0.0.1", str(free_port())),
        lambda: admin.replicaof("NO", "ONE"), "ReadOnly")

    admin.config_set("busy-reply-threshold", "50")

    def loop_forever() -> None:
        with redis_server.client() as blocked:
            try:
                blocked.eval("while true do end", 0)
            except redis.ResponseError:
                pass  # killed

    looping = threading.Thread(target=loop_forever)
    looping.start()
    try:
        await asyncio.sleep(0.1)
        await refused_then_recovered(own, admin, lambda: None,
                                     lambda: admin.script_kill(), "BUSY")
    finally:
        looping.join(5)
        admin.close()


async def test_a_key_of_another_type_under_the_prefix_fails_its_calls_only(
        own: StateBackends, redis_server: RedisServer):
    # Another program writing under Sluice's prefix turned every call on that key into a 502
    # "upstream_unreachable" with a traceback, the upstream never asked (a hostile trial): it
    # is unavailable, so state.on_unavailable applies. But only that key: marking the whole
    # backend down refused every route's calls while one key was foreign (a review).
    admin = redis_server.client()
    try:
        for key in admin.scan_iter("*"):  # this server is the test's own
            if admin.type(key) == b"hash":  # the ledger's counters
                admin.delete(key)
                admin.set(key, "x")
        with pytest.raises(StateUnavailable, match="WRONGTYPE"):
            await own.ledger.reserve("r", "x", [Claim("day", 1, 10, time.time() + 60)],
                                     time.time(), 60)
        assert own.health.up
        await own.rates.admit("r", [Take("requests", 10, 60.0)])  # other keys still serve
        admin.flushall()
        await each_answers(own)
    finally:
        admin.close()


async def test_a_key_of_the_right_type_holding_garbage_is_a_key_fault_too(
        own: StateBackends, redis_server: RedisServer):
    # Text where Sluice writes numbers (a budget counter's "s", the breaker's hash, an
    # idempotency answer's kind and status) raised ValueError, or a Lua "arithmetic on a nil
    # value", and every call on the key was a 502 "upstream_unreachable" for the key's whole
    # life (a hostile trial). It is a key fault, as WRONGTYPE: StateUnavailable, so
    # state.on_unavailable applies, the backend up for the other keys, the value never shown.
    admin = redis_server.client()
    try:
        for key in admin.scan_iter("*"):  # this server is the test's own
            kind = admin.type(key)
            if kind == b"hash":
                admin.hset(key, mapping={field: "garbage" for field in admin.hkeys(key)})
            elif kind == b"string":
                admin.set(key, "garbage", keepttl=True)
        for name, call in every_call(own).items():
            try:
                await call()
            except StateUnavailable as exc:
                assert "cannot be used" in str(exc) and "garbage" not in str(exc), (name, exc)
        for refused in (
                lambda: own.ledger.reserve("r", "x", [Claim("day", 1, 10, time.time() + 60)],
                                           time.time(), 60),
                lambda: own.breakers.admit("r", BreakerParams(5, 1.0)),
                lambda: own.idempotency.begin("k", "o2", b"", 5)):
            with pytest.raises(StateUnavailable, match="cannot be used"):
                await refused()
        assert own.health.up
        await own.rates.admit("r2", [Take("requests", 10, 60.0)])  # other keys still serve
        admin.flushall()
        await each_answers(own)
    finally:
        admin.close()


async def test_a_wrong_password_is_unavailable_and_never_shown(tmp_path: Path):
    require_redis()
    server = RedisServer(tmp_path / "auth", extra=("--requirepass", "right")).start()
    url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
    try:
        backends = await redis_backends(url, new_prefix(), TIMEOUT_S, probe_interval_s=PROBE_S)
        try:
            with pytest.raises(StateUnavailable) as refused:
                await backends.rates.admit("r", [Take("requests", 1, 1.0)])
            for shown in (str(refused.value), str(backends.health.last_error),
                          repr(backends.redis)):
                assert "s3cret-pw" not in shown
        finally:
            await backends.close()
    finally:
        server.stop()


def test_redact_url_hides_passwords_and_tokens():
    assert redact_url("redis://:pw@h:6379/0") == "redis://:<redacted>@h:6379/0"
    assert redact_url("rediss://user:pw@h/0") == "rediss://user:<redacted>@h/0"
    assert redact_url("redis://token@h") == "redis://<redacted>@h"
    assert redact_url("redis://h:1/0?password=pw&db=2") == (
        "redis://h:1/0?password=<redacted>&db=2")
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    # A credential by its value, whatever the field's name (policies.secrets).
    assert redact_url("https://api.example.com/v1?k=sk-abc&region=eu") == (
        "https://api.example.com/v1?k=<redacted>&region=eu")


def test_keys_share_the_group_hash_tag():
    state = RedisState("redis://h", "sluice", 0.05)
    assert state.key("openai", "rate", "tokens") == "sluice:{openai}:rate:tokens"
    weird = state.key("a}b", "x")
    assert weird.startswith("sluice:{") and "a}b" not in weird.split("}")[0]
    with pytest.raises(ValueError):
        RedisState("redis://h", "sl{uice", 0.05)


async def test_the_url_says_server_or_cluster(redis_cluster: RedisCluster):
    single = RedisState(require_redis(), new_prefix(), TIMEOUT_S)
    cluster = RedisState(redis_cluster.servers[1].url, new_prefix(), TIMEOUT_S)
    try:
        await single.start()
        await cluster.start()
        assert (single.cluster, cluster.cluster) == (False, True)
    finally:
        await single.close()
        await cluster.close()


async def test_connections_from_before_a_restart_cost_no_refusal_once_it_is_back(
        redis_server: RedisServer):
    """After a restart each pooled connection failed once ("Connection closed by server") and
    marked the backend down again, so calls were refused (503 in reject mode) although Redis
    was answering."""
    # A timeout generous for a loaded machine: what is checked is that no call fails on a
    # connection from before the restart, not how fast a fresh one is opened.
    own = await redis_backends(redis_server.url, new_prefix(), 2.0, probe_interval_s=PROBE_S)
    try:
        async def burst() -> None:
            await asyncio.gather(*(own.rates.admit("r", [Take("requests", 10_000, 60.0)])
                                   for _ in range(32)))

        await burst()  # several pooled connections, all to the server about to go
        redis_server.stop()
        redis_server.start()
        await recovered(own)
        changes: list[bool] = []
        own.health.on_change(lambda up, _: changes.append(up))
        for _ in range(5):
            await burst()
            await each_answers(own)
        assert changes == [] and own.health.up
    finally:
        await own.close()


async def test_no_503_in_reject_mode_once_a_restarted_redis_is_back(
        redis_server: RedisServer, upstream, start_sluice):
    sluice = await start_sluice({
        "state": {"backend": "redis", "redis_url": redis_server.url, "key_prefix": new_prefix(),
                  "timeout": "2s", "on_unavailable": "reject"},
        "routes": [route("svc", upstream.url, "http", rate={"requests": "100000/min"})]})

    async def burst(session: aiohttp.ClientSession) -> list[int]:
        async def one() -> int:
            async with session.get(sluice.url + "/svc/x") as r:
                return r.status
        return await asyncio.gather(*(one() for _ in range(32)))

    async def backend_up(session: aiohttp.ClientSession) -> bool:
        async with session.get(sluice.admin_url + "/readyz") as r:
            return (await r.json())["state"]["up"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        assert set(await burst(session)) == {200}  # opens several pooled Redis connections
        redis_server.stop()
        redis_server.start()
        deadline = time.monotonic() + 10
        while not await backend_up(session):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        statuses = [status for _ in range(5) for status in await burst(session)]
    assert statuses == [200] * len(statuses)


# A script that keeps Redis busy for 20 ms before it answers (TIME in a loop).
_TWENTY_MS = Script("""
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
while true do
  local u = redis.call('TIME')
  if u[1] * 1000000 + u[2] - start > 20000 then return 1 end
end
""")


async def test_a_busy_sluice_does_not_mark_a_healthy_redis_down(redis_server):
    """Sluice's own loop blocked past a call's deadline (a busy CPU) while Redis answered in
    time: the reply is taken when the loop comes back, not thrown away with Redis marked
    down (asyncio.timeout alone lost most of them: the deadline and the reply come due in
    the same loop turn, and the cancellation wins)."""
    state = RedisState(redis_server.url, new_prefix(), TIMEOUT_S, probe_interval_s=PROBE_S)
    await state.start()
    try:
        loop = asyncio.get_running_loop()
        busy = [state.key("g", "busy")]
        await state.eval(_TWENTY_MS, busy, [])  # loaded, and a connection open: one send each
        for _ in range(8):
            # 5 ms after the script is sent, the loop stalls past the deadline; Redis answers
            # at 20 ms.
            loop.call_later(0.005, time.sleep, TIMEOUT_S + 0.1)
            assert await state.eval(_TWENTY_MS, busy, []) == 1
        assert state.health.up and state.health.failures == 0
        redis_server.freeze()
        started = time.monotonic()
        with pytest.raises(StateUnavailable):  # a Redis that does not answer still times out
            await state.eval(_TWENTY_MS, busy, [])
        assert time.monotonic() - started <= TIMEOUT_S + MARGIN_S
    finally:
        redis_server.thaw()
        await state.close()


async def test_breaker_successes_pending_while_redis_refuses_are_dropped(
        own: StateBackends, redis_server: RedisServer, caplog):
    """Their flush meets a Redis that refuses writes (out of memory): they are dropped (a
    debug line), not sent again later, and nothing is raised to anyone; the breaker works on
    once Redis answers."""
    events: list[str] = []
    breaker = Breaker(CircuitBreakerConfig(fail_max=2, reset_timeout="30s"), "r",
                      lambda event, **_: events.append(event), own)
    await breaker.record(await breaker.attempt(), FAILURE, 500)  # 1 of 2
    await breaker.record(await breaker.attempt(), SUCCESS, 200)  # deferred
    with redis_server.client() as admin:
        admin.config_set("maxmemory", "1")
        try:
            with caplog.at_level(logging.DEBUG, logger="sluice"):
                await asyncio.sleep(0.25 + TIMEOUT_S + MARGIN_S)  # the flush is refused
            assert "circuit-breaker successes were dropped" in caplog.text
        finally:
            admin.config_set("maxmemory", "0")
    await recovered(own)
    await asyncio.sleep(0.5)  # the breaker's cached view has aged: it asks Redis again
    await breaker.record(await breaker.attempt(), FAILURE, 500)
    assert events == ["circuit_opened"]  # the dropped success did not reset the run


async def test_writes_lost_in_an_outage_are_logged_once_per_kind_not_once_per_call(
        redis_server: RedisServer, upstream, start_sluice):
    """30 calls admitted on Redis finish after it stopped: each one's background write
    (settling its budget, giving back its lease) fails. The log says so once per kind of
    write, not 30 times (a busy proxy would write a line per request for the whole outage),
    and every call is still answered."""
    # A timeout no busy machine reaches while the 30 are admitted: once, at 200 ms, Redis was
    # marked down for 20 ms meanwhile, a few calls were admitted from memory and fewer than 30
    # writes were lost. Once the server is gone its writes fail at once whatever the timeout.
    sluice = await start_sluice({
        "state": {"backend": "redis", "redis_url": redis_server.url, "key_prefix": new_prefix(),
                  "timeout": "2s"},
        "routes": [route("openai", upstream.url, concurrency={"limit": 64, "queue": 0},
                         budget=[{"tokens": "1000000/day", "per": "tenant"}])]})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> int:
            async with session.post(sluice.url + "/openai/v1/chat/completions", json=body,
                                    headers={"x-fake-delay": "1.0"}) as r:
                await r.read()
                return r.status
        calls = asyncio.gather(*(one() for _ in range(30)))
        deadline = time.monotonic() + 20
        while upstream.inflight < 30:
            assert time.monotonic() < deadline, upstream.inflight
            await asyncio.sleep(0.02)
        redis_server.stop()
        assert await calls == [200] * 30
    # The background writes fail: wait for the first line (a busy machine's Sluice may take
    # a while over 30 answers), then as long again for any repeat of it to show.
    deadline = time.monotonic() + 10
    while "not applied" not in sluice.stderr():
        assert time.monotonic() < deadline, "the outage's lost writes are not logged at all"
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    lost = [line for line in sluice.stderr().splitlines() if "not applied" in line]
    texts = {line.split(" WARNING ", 1)[1] for line in lost}
    assert len(lost) == len(texts), "\n".join(lost)  # each text once (its cause may vary)
    await sluice.stop()  # and what was held back is counted at shutdown, not lost
    held = re.findall(r"not applied: .*\((\d+) more like it held back", sluice.stderr())
    assert held and sum(map(int, held)) + len(lost) >= 30, sluice.stderr()


async def test_the_state_unavailable_hint_grows_with_the_outage():
    """A closed port: the refusal's wait is the time Redis has been down so far, at least the
    probe interval and at most 10 s. Always the probe interval, it made an SDK with 5 retries
    give up after 2.6 s of a 4 s outage. Sluice's own retries keep the probe interval."""
    require_redis()
    url = f"redis://127.0.0.1:{free_port()}/0"
    backends = await redis_backends(url, new_prefix(), TIMEOUT_S, probe_interval_s=PROBE_S)
    rates = backends.rates
    take = [Take("requests", 10, 60.0)]
    try:
        assert not backends.health.up
        with pytest.raises(StateUnavailable) as fresh:
            await rates.admit("r", take)
        assert unavailable(fresh.value).retry_after >= PROBE_S
        await asyncio.sleep(1.0)  # the outage goes on (a lower bound: a slow machine adds)
        with pytest.raises(StateUnavailable) as longer:
            await rates.admit("r", take)
        refused = unavailable(longer.value)
        assert refused.reason is Reason.STATE_UNAVAILABLE
        headers = rejection_headers(refused)
        assert int(headers["retry-after-ms"]) >= 1000
        assert headers["x-should-retry"] == "true"
        assert longer.value.retry_after == pytest.approx(PROBE_S)
        # Down for ten minutes: the clock the hint reads from is moved back, not waited out.
        backends.health.changed_monotonic -= 600.0
        with pytest.raises(StateUnavailable) as long_ago:
            await rates.admit("r", take)
        assert unavailable(long_ago.value).retry_after == 10.0
    finally:
        await backends.close()


async def test_a_token_reservation_over_the_local_share_is_told_the_outage_so_far():
    """``on_unavailable: local``: a reservation over this replica's share of the token rate
    but within the whole fits once Redis answers; its wait grows with the outage as the
    other state_unavailable refusals' do, not the probe interval however long it lasts."""
    require_redis()
    url = f"redis://127.0.0.1:{free_port()}/0"
    backends = await redis_backends(url, new_prefix(), TIMEOUT_S, probe_interval_s=PROBE_S)
    backends.fallback = Fallback("local", 10)
    limits = RateLimiter(RateConfig.model_validate({"tokens": "1000/min"}), backends, "r")
    try:
        assert not backends.health.up
        backends.health.changed_monotonic -= 3.0  # down for 3 s so far, not waited out
        with pytest.raises(Rejected) as refused:
            await limits.take([limits.token_take(150)])
        assert refused.value.reason is Reason.STATE_UNAVAILABLE
        assert 3.0 <= refused.value.retry_after <= 3.0 + MARGIN_S
    finally:
        await backends.close()
