"""Key faults (a key under the prefix holding what Sluice does not write there) leave nothing
half done, are never sent again, do not poison a whole group, are counted and logged, and
stay told apart from Sluice's own bugs. Against ``REDIS_URL``, each test under a prefix of
its own, deleted at the end."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from prometheus_client import generate_latest

import policies.state.admission as admission_module
from policies.rate import Background
from policies.redelivery import Redeliveries
from policies.state import StateBackends, StateUnavailable, redis_backends
from policies.state.deadletters import DeadLetter
from policies.state.errors import key_fault
from policies.state.ledger import Claim
from policies.state.rate import Take
from policies.state.runs import RedisRuns, qualified
from proxy.metrics import Metrics
from tests.redis_servers import delete_prefix, new_prefix, require_redis


@pytest.fixture
async def shared() -> AsyncIterator[tuple[StateBackends, redis.Redis]]:
    url = require_redis()
    prefix = new_prefix()
    backends = await redis_backends(url, prefix, 1.0)
    admin = redis.Redis.from_url(url)
    try:
        yield backends, admin
    finally:
        await backends.close()
        admin.close()
        delete_prefix(url, prefix)


def claims(*names: str) -> list[Claim]:
    return [Claim(name, 10.0, 1000.0, time.time() + 600) for name in names]


async def test_a_settle_meeting_an_unreadable_counter_writes_nothing(shared) -> None:
    # Seen: the settle added the spend to counter a, then failed on counter b; sent again by
    # the reconciler at every kick, it charged a 28 for a true 7 after four tries.
    b, admin = shared
    assert await b.ledger.reserve("g", "rid", claims("a", "b"), time.time(), 60) == []
    key_a, key_b = b.ledger.counter("g", "a"), b.ledger.counter("g", "b")
    admin.hset(key_b, "s", " 5 ")  # tonumber() reads it; HINCRBYFLOAT refuses it
    faults = []
    for _ in range(3):
        with pytest.raises(StateUnavailable) as fault:
            await b.ledger.settle("g", "rid", [7.0, 7.0])
        faults.append(fault.value)
    assert admin.hget(key_a, "s") is None and float(admin.hget(key_a, "h")) == 10.0
    assert all(fault.key_fault for fault in faults)  # never sent again (Redeliveries)
    admin.hdel(key_b, "s")  # repaired: the settle goes through, once
    assert await b.ledger.settle("g", "rid", [7.0, 7.0]) is True
    assert float(admin.hget(key_a, "s")) == 7.0 and admin.hget(key_a, "h") is None
    assert float(admin.hget(key_b, "s")) == 7.0


async def test_a_charge_and_a_release_meeting_an_unreadable_counter_write_nothing(
        shared) -> None:
    b, admin = shared
    key_a, key_b = b.ledger.counter("g", "a"), b.ledger.counter("g", "b")
    admin.hset(key_b, "h", "1e3x")
    with pytest.raises(StateUnavailable):
        await b.ledger.charge("g", claims("a", "b"), time.time())
    assert not admin.exists(key_a)
    # An admission's release: its bucket is not refunded when the settle cannot be made.
    admin.delete(key_b)
    takes = [Take("requests", 10, 60.0)]
    admitted = await b.admissions.admit("g", takes, "rid", claims("a", "b"), time.time(), 60)
    assert admitted.admitted
    bucket = b.rates.keys("g", takes)[0]
    level = admin.hget(bucket, "l")
    admin.hset(key_b, "h", "garbage")
    with pytest.raises(StateUnavailable):
        await b.admissions.release("g", takes, "rid")
    assert admin.hget(bucket, "l") == level and float(admin.hget(key_a, "h")) == 10.0


async def test_an_unreadable_reservation_is_reaped_not_failing_every_reserve(shared) -> None:
    # Seen: one unreadable record in the group's reservations made the reap raise on every
    # reserve of the route, every tenant's, for as long as the record stayed.
    b, admin = shared
    now = time.time()
    assert await b.ledger.reserve("route", "r1", claims("tenantA"), now, 60) == []
    resv, expiries = b.ledger.reservation_keys("route")
    admin.hset(resv, "junk", "not json")
    admin.zadd(expiries, {"junk": 0})
    admin.hset(resv, "shape", '{"s":"h","c":[["elsewhere","1.0",1]]}')
    admin.zadd(expiries, {"shape": 0})
    # A readable record, due, one of whose counters cannot take the release: the others can.
    admin.hset(resv, "held", json.dumps({"s": "h", "c": [
        [b.ledger.counter("route", "x"), "4.0", 1], [b.ledger.counter("route", "y"), "4.0", 1]]}))
    admin.zadd(expiries, {"held": 0})
    admin.hset(b.ledger.counter("route", "x"), "h", "6.0")
    admin.set(b.ledger.counter("route", "y"), "a string")
    assert await b.ledger.reserve("route", "r2", claims("tenantB"), time.time(), 60) == []
    assert not admin.hexists(resv, "junk") and not admin.hexists(resv, "shape")
    assert admin.zscore(expiries, "junk") is None
    assert float(admin.hget(b.ledger.counter("route", "x"), "h")) == 2.0
    assert admin.hexists(resv, "r1") and admin.hexists(resv, "r2")


async def test_a_run_give_back_meeting_an_unreadable_count_writes_nothing(shared) -> None:
    b, admin = shared
    assert b.redis is not None
    runs = RedisRuns(b.redis)
    full, _ = await runs.take_request("calls", "t", ("child", "root"), 10, "take1")
    assert full is None
    child, root = (runs._runs + qualified("t") + run for run in ("child", "root"))
    assert admin.hget(child, "n:calls") == b"1" == admin.hget(root, "n:calls")
    admin.hset(root, "n:calls", "1.5")
    with pytest.raises(StateUnavailable) as fault:
        await runs.give_back_request("take1", ["calls"], ("t", ("child", "root")))
    assert admin.hget(child, "n:calls") == b"1"  # the first run was given nothing back
    assert fault.value.key_fault


async def test_the_dead_letter_sequence_must_be_an_integer(shared) -> None:
    # "1.5", "1e3" and " 5 " passed tonumber(), then INCR refused them with an error told
    # apart from a bug by nothing.
    b, admin = shared
    assert b.redis is not None
    letter = DeadLetter("r", "t", None, None, "req", "POST", "/", [], [], b"", 0, [], "x")
    seq = b.redis.key("dlq", "seq")
    for garbage in ("1.5", "1e3", " 5 "):
        admin.set(seq, garbage)
        with pytest.raises(StateUnavailable):
            await b.dead_letters.add(letter)
    assert not admin.exists(b.redis.key("dlq", "letters"))


class _Entries(Redeliveries[str]):
    """Entries whose send raises what ``errors`` says for them."""

    def __init__(self, errors: dict[str, Exception]) -> None:
        super().__init__(Background(), 10)
        self.errors = errors
        self.sent: list[str] = []

    async def _send(self, entry: str) -> None:
        if entry in self.errors:
            raise self.errors[entry]
        self.sent.append(entry)

    def _round_name(self) -> str:
        return "test entries"

    def _dropped(self, entry: str) -> None:
        pass

    def _sent(self, count: int) -> None:
        pass


async def test_a_key_fault_is_not_kept_to_be_sent_again() -> None:
    entries = _Entries({"faulty": key_fault("a budget counter holds a non-number"),
                        "down": StateUnavailable("state backend unavailable")})
    for entry in ("faulty", "down"):
        with pytest.raises(StateUnavailable):
            await entries.send(entry)
    assert len(entries) == 1  # only the one Redis did not answer
    # One kept that meets a key fault later is dropped from the round, not first in line
    # for ever ahead of the others.
    entries.keep("faulty")
    entries.keep("fine")
    del entries.errors["down"]
    entries.kick()
    await asyncio.wait_for(entries._task, 5)  # type: ignore[arg-type]
    assert entries.sent == ["down", "fine"] and len(entries) == 0


async def test_a_bug_in_reading_a_reply_is_not_served_as_a_key_fault(
        shared, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen: a TypeError in a reply's read became a silent key fault served on the local
    # share (no log, the backend "up", no metric).
    b, _ = shared

    def bug(*_args: Any) -> None:
        raise TypeError("a bug in the read")

    monkeypatch.setattr(admission_module, "rate_result", bug)
    with pytest.raises(TypeError):
        await b.admissions.admit("g", [Take("requests", 10, 60.0)], "rid", claims("a"),
                                 time.time(), 60)


async def test_key_faults_are_counted_and_logged_without_the_value(
        shared, caplog: pytest.LogCaptureFixture) -> None:
    b, admin = shared
    assert b.redis is not None
    admin.hset(b.ledger.counter("g", "a"), "s", "secret-garbage")
    caplog.set_level(logging.WARNING, "sluice.state")
    for rid in ("r1", "r2", "r3"):
        with pytest.raises(StateUnavailable):
            await b.ledger.reserve("g", rid, claims("a"), time.time(), 60)
    assert b.redis.key_faults["budget"] == 3 and b.health.up
    lines = [r.getMessage() for r in caplog.records if "holds what Sluice" in r.getMessage()]
    assert len(lines) == 1 and "secret-garbage" not in lines[0]
    metrics = Metrics()
    metrics.bind_state_key_faults(lambda: dict(b.redis.key_faults))  # type: ignore[union-attr]
    text = metrics.render(generate_latest, [], metrics.read_on_loop()).decode()
    assert 'sluice_state_key_faults_total{what="budget"} 3.0' in text
