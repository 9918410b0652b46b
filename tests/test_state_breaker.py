"""Shared circuit-breaker state (policies.state.breaker): memory, one Redis, a Redis Cluster.

The tests of deferred successes feed each outcome as the breaker policy does (``defer``, else
``record``), so the same body checks that memory (records at once) and Redis (batches) end up
alike; a property test then checks that batching on Redis gives the consecutive-failure count
and the openings that recording each outcome at once gives, for any sequence of one replica's
outcomes and flushes, and another that memory's ``defer`` (a closed-state success counted in
a few steps) leaves every count and decision where ``record`` leaves them. Across replicas, a
deferred success resets the failures that happened before it, whenever it is delivered, and
none that happened after it.
"""

from __future__ import annotations

import asyncio
import math

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from policies.breaker import Breaker
from policies.config import CircuitBreakerConfig
from policies.state import StateBackends, memory_backends, redis_backends
from policies.state.breaker import (
    CLOSED,
    CLOSED_AGAIN,
    FAILURE,
    HALF_OPEN,
    HALF_OPENED,
    NEUTRAL,
    OPEN,
    OPENED,
    PROBE_FAILED,
    SUCCESS,
    BreakerParams,
    BreakerStates,
    MemoryBreakerStates,
    Ticket,
    Verdict,
    _Window,
    _window_add,
)
from tests.redis_servers import (
    CLIENT_TIMEOUT_S,
    REDIS_URL,
    TEST_TIMEOUT_S,
    RedisServer,
    delete_prefix,
    new_prefix,
    replica,
    require_redis,
)
from tests.test_shared_rate_budget import reset_stats, round_trips

PARAMS = BreakerParams(fail_max=3, reset_s=0.15, success_threshold=2, probe_s=5)


async def trip(backends: StateBackends, params: BreakerParams = PARAMS) -> None:
    for _ in range(params.fail_max):
        admission = await backends.breakers.admit("r", params)
        verdict = await backends.breakers.record("r", admission.ticket, FAILURE, params)
    assert verdict.transition == OPENED


async def test_consecutive_failures_open_and_a_success_resets_the_count(
        backends: StateBackends):
    breakers = backends.breakers
    for outcome in (FAILURE, FAILURE, SUCCESS, FAILURE, FAILURE):
        admission = await breakers.admit("r", PARAMS)
        assert admission.allowed and admission.ticket.probe is None
        verdict = await breakers.record("r", admission.ticket, outcome, PARAMS)
        assert (verdict.state, verdict.transition) == (CLOSED, None)
    admission = await breakers.admit("r", PARAMS)
    verdict = await breakers.record("r", admission.ticket, FAILURE, PARAMS)
    assert (verdict.state, verdict.transition, verdict.cause) == (OPEN, OPENED, "fail_max")
    assert 0.1 < verdict.open_for_s <= 0.15
    refused = await breakers.admit("r", PARAMS)
    assert (refused.allowed, refused.state) == (False, OPEN)
    assert 0 < refused.wait_s <= 0.15


async def test_half_open_lets_one_probe_at_a_time_and_closes_after_the_threshold(
        backends: StateBackends):
    breakers = backends.breakers
    await trip(backends)
    await asyncio.sleep(0.16)
    probe = await breakers.admit("r", PARAMS)
    assert (probe.allowed, probe.state, probe.transition) == (True, HALF_OPEN, HALF_OPENED)
    assert probe.ticket.probe is not None
    second = await breakers.admit("r", PARAMS)
    assert (second.allowed, second.transition) == (False, None)
    assert 4.5 < second.wait_s <= 5  # until the probe's lease would lapse
    assert (await breakers.view("r")).probing
    verdict = await breakers.record("r", probe.ticket, SUCCESS, PARAMS)
    assert (verdict.state, verdict.transition) == (HALF_OPEN, None)
    probe = await breakers.admit("r", PARAMS)
    assert probe.allowed and probe.ticket.probe is not None
    verdict = await breakers.record("r", probe.ticket, SUCCESS, PARAMS)
    assert (verdict.state, verdict.transition) == (CLOSED, CLOSED_AGAIN)
    assert (await breakers.view("r")).state == CLOSED


async def test_a_failed_probe_opens_again(backends: StateBackends):
    breakers = backends.breakers
    await trip(backends)
    await asyncio.sleep(0.16)
    probe = await breakers.admit("r", PARAMS)
    verdict = await breakers.record("r", probe.ticket, FAILURE, PARAMS)
    assert (verdict.state, verdict.transition, verdict.cause) == (OPEN, OPENED, "probe_failed")


async def test_a_neutral_probe_frees_the_lease_and_changes_nothing(backends: StateBackends):
    breakers = backends.breakers
    await trip(backends)
    await asyncio.sleep(0.16)
    probe = await breakers.admit("r", PARAMS)
    verdict = await breakers.record("r", probe.ticket, NEUTRAL, PARAMS)
    assert (verdict.state, verdict.transition) == (HALF_OPEN, None)
    assert (await breakers.admit("r", PARAMS)).ticket.probe is not None


async def test_an_outcome_from_an_older_state_is_ignored(backends: StateBackends):
    breakers = backends.breakers
    early = await breakers.admit("r", PARAMS)  # admitted while closed
    await trip(backends)
    await asyncio.sleep(0.16)
    probe = await breakers.admit("r", PARAMS)
    assert probe.transition == HALF_OPENED
    verdict = await breakers.record("r", early.ticket, FAILURE, PARAMS)
    assert (verdict.state, verdict.transition) == (HALF_OPEN, None)
    assert (await breakers.view("r")).probing  # the probe still holds the lease


async def test_a_probe_lease_lapses_when_its_replica_dies(backends: StateBackends):
    params = PARAMS._replace(probe_s=0.2)
    await trip(backends, params)
    await asyncio.sleep(0.16)
    assert (await backends.breakers.admit("r", params)).ticket.probe is not None
    assert not (await backends.breakers.admit("r", params)).allowed
    await asyncio.sleep(0.25)  # its outcome never comes
    assert (await backends.breakers.admit("r", params)).ticket.probe is not None


async def test_only_its_holder_renews_a_probe_lease_and_only_while_it_holds_it(
        backends: StateBackends):
    """Renewed, a lease outlives its lease time; a renewal never takes back a lease given
    back, lapsed or taken by another probe since."""
    breakers = backends.breakers
    params = PARAMS._replace(probe_s=1.0)
    await trip(backends, params)
    await asyncio.sleep(0.16)
    probe = await breakers.admit("r", params)
    for _ in range(4):  # 1.2 s in all, past its 1 s
        await asyncio.sleep(0.3)
        assert await breakers.renew("r", probe.ticket, params.probe_s)
    assert not (await breakers.admit("r", params)).allowed
    assert not await breakers.renew("r", Ticket(probe.ticket.epoch, "another"), 1.0)
    await breakers.record("r", probe.ticket, NEUTRAL, params)  # given back
    assert not await breakers.renew("r", probe.ticket, params.probe_s)
    second = await breakers.admit("r", params)
    assert second.ticket.probe is not None  # the renewal took nothing back
    await asyncio.sleep(params.probe_s + 0.1)  # not renewed: it lapses
    third = await breakers.admit("r", params)
    assert third.ticket.probe is not None
    assert not await breakers.renew("r", second.ticket, params.probe_s)  # another's now
    assert not (await breakers.admit("r", params)).allowed
    assert not await breakers.renew("other", third.ticket, params.probe_s)


async def test_a_failure_rate_over_the_window_opens(backends: StateBackends):
    params = BreakerParams(fail_max=100, reset_s=30, window_s=10, rate=0.5, min_calls=4)
    breakers = backends.breakers
    verdicts = []
    for outcome in (SUCCESS, FAILURE, SUCCESS, FAILURE):
        admission = await breakers.admit("r", params)
        verdicts.append(await breakers.record("r", admission.ticket, outcome, params))
    assert [v.transition for v in verdicts] == [None, None, None, OPENED]
    assert verdicts[-1].cause == "failure_rate"


async def test_an_upstream_retry_after_lengthens_the_open_time(backends: StateBackends):
    breakers = backends.breakers
    early = await breakers.admit("r", PARAMS)
    await trip(backends)
    verdict = await breakers.record("r", early.ticket, NEUTRAL, PARAMS, hint_s=5)
    assert 4.9 < verdict.open_for_s <= 5
    verdict = await breakers.record("r", early.ticket, NEUTRAL, PARAMS, hint_s=1)
    assert 4.9 < verdict.open_for_s <= 5  # never shortened


async def test_one_probe_across_replicas_and_open_everywhere_at_once(backends: StateBackends):
    async with replica(backends) as second, replica(backends) as third:
        replicas = [backends, second, third]
        await trip(backends)
        for other in (second, third):
            refused = await other.breakers.admit("r", PARAMS)
            assert (refused.allowed, refused.state) == (False, OPEN)
        await asyncio.sleep(0.16)
        admissions = await asyncio.gather(*(
            replicas[i % 3].breakers.admit("r", PARAMS) for i in range(30)))
    assert sum(a.allowed for a in admissions) == 1
    assert sum(a.transition == HALF_OPENED for a in admissions) == 1


# -- successes deferred (batched on Redis) ----------------------------------------------------


async def feed(breakers: BreakerStates, ticket: Ticket, outcome: int,
               params: BreakerParams = PARAMS) -> Verdict | None:
    """One outcome, as :meth:`policies.breaker.Breaker.record` feeds it: deferred when the
    backend takes it (then ``None``), recorded otherwise."""
    if breakers.defer("r", ticket, outcome, params):
        return None
    return await breakers.record("r", ticket, outcome, params)


async def test_a_deferred_success_resets_the_failure_count_before_the_next_failure(
        backends: StateBackends):
    breakers = backends.breakers
    transitions = []
    for outcome in (FAILURE, FAILURE, SUCCESS, SUCCESS, FAILURE, FAILURE):
        admission = await breakers.admit("r", PARAMS)
        verdict = await feed(breakers, admission.ticket, outcome)
        transitions.append(verdict and verdict.transition)
    assert transitions[-2:] == [None, None]  # two in a row since the successes: still closed
    assert (await breakers.view("r")).state == CLOSED
    admission = await breakers.admit("r", PARAMS)
    verdict = await feed(breakers, admission.ticket, FAILURE)
    assert verdict is not None and (verdict.transition, verdict.cause) == (OPENED, "fail_max")


async def test_a_flush_delivers_the_deferred_successes_once(backends: StateBackends):
    breakers = backends.breakers
    assert await breakers.flush("r", PARAMS) is None  # nothing pending: no round trip
    for outcome in (FAILURE, FAILURE, SUCCESS):
        await feed(breakers, (await breakers.admit("r", PARAMS)).ticket, outcome)
    flushed = await breakers.flush("r", PARAMS)
    assert flushed is None or (flushed.state, flushed.transition) == (CLOSED, None)
    assert await breakers.flush("r", PARAMS) is None
    async with replica(backends) as other:
        # Another replica's failures count from the flushed success: 3 to open.
        for expected in (None, None, OPENED):
            admission = await other.breakers.admit("r", PARAMS)
            verdict = await other.breakers.record("r", admission.ticket, FAILURE, PARAMS)
            assert verdict.transition == expected


async def test_deferred_successes_of_an_older_epoch_are_dropped(backends: StateBackends):
    breakers = backends.breakers
    early = await breakers.admit("r", PARAMS)  # admitted while closed
    await trip(backends)
    await feed(breakers, early.ticket, SUCCESS)  # stale: dropped (at once, or when flushed)
    await asyncio.sleep(0.16)
    probe = await breakers.admit("r", PARAMS)
    assert probe.transition == HALF_OPENED
    flushed = await breakers.flush("r", PARAMS)
    assert flushed is None or (flushed.state, flushed.transition) == (HALF_OPEN, None)
    view = await breakers.view("r")
    assert (view.state, view.probing) == (HALF_OPEN, True)


async def test_a_batch_opens_on_the_rate_where_its_first_success_would_have(
        backends: StateBackends):
    """Recorded one by one, the success that makes min_calls (2 failures in 4) trips the
    rate; batched, the flush opens it, and the later successes of the batch are dropped."""
    params = BreakerParams(fail_max=100, reset_s=30, window_s=10, rate=0.5, min_calls=4)
    breakers = backends.breakers
    verdicts = []
    for outcome in (FAILURE, SUCCESS, FAILURE, SUCCESS, SUCCESS, SUCCESS):
        admission = await breakers.admit("r", params)
        if admission.allowed:
            verdicts.append(await feed(breakers, admission.ticket, outcome, params))
    verdicts.append(await breakers.flush("r", params))
    opened = [v for v in verdicts if v is not None and v.transition is not None]
    assert [(v.transition, v.cause) for v in opened] == [(OPENED, "failure_rate")]
    assert (await breakers.view("r")).state == OPEN


#: Between outcomes whose order a test sets: far beyond a script's delivery delay (what a
#: deferred success's server time may be late by), even on two busy cores.
APART_S = 0.05


async def test_a_success_delivered_after_other_replicas_failures_does_not_reset_them(
        backends: StateBackends):
    """The hostile trial, three replicas on one Redis (fail_max 3): one success on each,
    then three failures, one per replica, each replica's success delivered only after other
    replicas' failures (inside its own failure's script). It opens at the third failure, as
    it does when all three fail on one replica; and again once a probe has closed it. (The
    successes' times counted once delivered, it stayed closed, and opened at the fifth.)"""
    params = PARAMS._replace(success_threshold=1)
    async with replica(backends) as b, replica(backends) as c:
        replicas = (backends, b, c)
        for round_ in range(2):
            for r in replicas:
                admission = await r.breakers.admit("r", params)
                assert admission.allowed and admission.ticket.probe is None
                assert await feed(r.breakers, admission.ticket, SUCCESS, params) is None
            await asyncio.sleep(APART_S)
            transitions = []
            for r in (c, backends, b):
                admission = await r.breakers.admit("r", params)
                assert admission.allowed, (round_, transitions)
                verdict = await feed(r.breakers, admission.ticket, FAILURE, params)
                assert verdict is not None
                transitions.append(verdict.transition)
            assert transitions == [None, None, OPENED], round_
            for r in replicas:
                assert await r.breakers.flush("r", params) is None  # all delivered already
            await asyncio.sleep(params.reset_s + 0.01)
            probe = await backends.breakers.admit("r", params)
            assert probe.ticket.probe is not None
            verdict = await backends.breakers.record("r", probe.ticket, SUCCESS, params)
            assert verdict.transition == CLOSED_AGAIN


async def test_a_deferred_success_resets_the_failures_before_it_and_no_later_one(
        backends: StateBackends):
    """C fails, then A succeeds (deferred), then B fails, then A's success is flushed: it
    resets C's failure, which came before it, not B's, which came after: two more to open."""
    async with replica(backends) as b, replica(backends) as c:
        admission = await c.breakers.admit("r", PARAMS)
        await c.breakers.record("r", admission.ticket, FAILURE, PARAMS)
        await asyncio.sleep(APART_S)
        admission = await backends.breakers.admit("r", PARAMS)
        assert await feed(backends.breakers, admission.ticket, SUCCESS) is None
        await asyncio.sleep(APART_S)
        admission = await b.breakers.admit("r", PARAMS)
        await b.breakers.record("r", admission.ticket, FAILURE, PARAMS)
        flushed = await backends.breakers.flush("r", PARAMS)
        assert flushed is None or (flushed.state, flushed.transition) == (CLOSED, None)
        assert await failures(backends, "r") == 1
        transitions = []
        for r in (c, b):
            admission = await r.breakers.admit("r", PARAMS)
            transitions.append(
                (await r.breakers.record("r", admission.ticket, FAILURE, PARAMS)).transition)
        assert transitions == [None, OPENED]


def breaker(backends: StateBackends, events: list[str]) -> Breaker:
    config = CircuitBreakerConfig(fail_max=3, reset_timeout="30s")
    return Breaker(config, "r", lambda event, **_: events.append(event), backends)


async def test_successes_reach_the_other_replicas_within_the_flush_time(
        backends: StateBackends):
    """Replica B's failures, then replica A's successes, then B's failures: A's successes
    reset B's run once flushed (at most 0.25 s later, or at once on memory), and shutdown
    lets a flush still pending land before the connection closes."""
    async with replica(backends) as other:
        b_events: list[str] = []
        b = breaker(other, b_events)
        for _ in range(2):
            await b.record(await b.attempt(), FAILURE, 500)
        a = breaker(backends, [])
        for _ in range(5):
            await a.record(await a.attempt(), SUCCESS, 200)
        await asyncio.sleep(0.25 + 0.3)  # the flush, with a margin for a loaded machine
        for _ in range(2):
            await b.record(await b.attempt(), FAILURE, 500)
        assert b_events == []  # the run restarted at A's successes: 2 of 3
        await a.record(await a.attempt(), SUCCESS, 200)
        if backends.redis is not None:
            await backends.close()  # A shuts down: it waits for the pending flush
        await b.record(await b.attempt(), FAILURE, 500)
        assert b_events == []  # A's last success reset the run too
        await b.record(await b.attempt(), FAILURE, 500)
        await b.record(await b.attempt(), FAILURE, 500)
        assert b_events == ["circuit_opened"]


async def test_attempts_on_a_stale_closed_view_ask_redis_once(tmp_path):
    """20 attempts at once on a view older than 0.5 s: one asks Redis, the rest keep to the
    closed view until its answer (not one script each); a closed breaker's successes then
    cost one flush."""
    server = RedisServer(tmp_path / "redis").start()
    backends = await redis_backends(server.url, new_prefix(), TEST_TIMEOUT_S)
    try:
        b = breaker(backends, [])
        await b.record(await b.attempt(), FAILURE, 500)  # both scripts loaded
        await asyncio.sleep(0.5 + 0.1)  # the view is stale
        reset_stats(server)
        passes = await asyncio.gather(*(b.attempt() for _ in range(20)))
        assert round_trips(server) == 1
        for ticket in passes:
            await b.record(ticket, SUCCESS, 200)
        await asyncio.sleep(0.25 + 0.25)
        assert round_trips(server) == 2
    finally:
        await backends.close()
        server.stop()


# A replica's sequence: each step an attempt with its outcome, or a flush. PROBE_FAILED (a
# probe's stream failing after its success closed the breaker) is recorded with the ticket
# admitted, of the current epoch, as the pass a probe's success returns is while it holds.
STEP = st.sampled_from([SUCCESS, SUCCESS, SUCCESS, FAILURE, FAILURE, NEUTRAL, PROBE_FAILED,
                        "flush"])


async def failures(backends: StateBackends, group: str) -> int:
    """The breaker's consecutive-failure count, read from where it is kept."""
    if backends.redis is None:
        return backends.breakers._machines[group].failures  # type: ignore[attr-defined]
    key = backends.redis.key(group, "breaker")
    return int(await backends.redis.run(lambda client: client.hget(key, "failures")) or 0)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(STEP, min_size=1, max_size=40),
       fail_max=st.integers(2, 6), min_calls=st.integers(2, 10),
       rate=st.sampled_from([None, 0.3, 0.5, 0.8]))
def test_batching_opens_where_recording_each_outcome_at_once_does(steps, fail_max, min_calls,
                                                                   rate):
    """Redis, with successes deferred and flushed where the sequence says, against memory
    recording each outcome at once (the reference): wherever Redis heard from this replica
    (a record or a flush), both have the same state, consecutive-failure count and
    openings. A 30 s window and open time: nothing expires within an example."""
    url = require_redis(REDIS_URL)
    params = BreakerParams(fail_max=fail_max, reset_s=30, window_s=30 if rate else None,
                           rate=rate or 1.0, min_calls=min_calls)

    async def run() -> None:
        prefix = new_prefix()
        reference = memory_backends()
        batched = await redis_backends(url, prefix, CLIENT_TIMEOUT_S)  # counts, not time
        opened: dict[str, list[str]] = {"reference": [], "batched": []}

        def heard(side: str, verdict: Verdict | None) -> None:
            if verdict is not None and verdict.transition == OPENED:
                opened[side].append(verdict.cause)

        async def attempt(backends: StateBackends) -> Ticket | None:
            admission = await backends.breakers.admit("r", params)
            return admission.ticket if admission.allowed else None

        try:
            for step in steps:
                if step == "flush":
                    verdict = await batched.breakers.flush("r", params)
                    heard("batched", verdict)
                    sent = verdict is not None
                else:
                    ticket = await attempt(reference)
                    if ticket is not None:
                        heard("reference", await reference.breakers.record(
                            "r", ticket, step, params))
                    ticket = await attempt(batched)
                    sent = False
                    if ticket is not None and not batched.breakers.defer("r", ticket, step, params):
                        heard("batched", await batched.breakers.record(
                            "r", ticket, step, params))
                        sent = True
                if sent:
                    assert ((await reference.breakers.view("r")).state,
                            await failures(reference, "r"), opened["reference"]) == (
                        (await batched.breakers.view("r")).state,
                        await failures(batched, "r"), opened["batched"])
            heard("batched", await batched.breakers.flush("r", params))
            assert ((await reference.breakers.view("r")).state, opened["reference"]) == (
                (await batched.breakers.view("r")).state, opened["batched"])
        finally:
            await batched.close()
            delete_prefix(url, prefix)

    asyncio.run(run())


@settings(max_examples=200, deadline=None)
@given(outcomes=st.lists(st.tuples(st.sampled_from([0, 0, 0, 1, 2, 7, 40, -1, -5]),
                                   st.booleans()),
                         max_size=120),
       window_s=st.sampled_from([1, 2.5, 5, 30]), min_calls=st.integers(1, 10),
       rate=st.sampled_from([0.2, 0.5, 1.0]))
def test_the_memory_window_keeps_the_totals_a_plain_sum_would_give(outcomes, window_s,
                                                                    min_calls, rate):
    """The memory window's running totals, as seconds come and go, against summing every
    outcome of the last ``ceil(window_s)`` seconds afresh: the same trip decision each time,
    also when an injected clock steps back."""
    params = BreakerParams(fail_max=5, reset_s=30, window_s=window_s, rate=rate,
                           min_calls=min_calls)
    window = _Window()
    live: list[tuple[int, bool]] = []  # outcomes not yet expired; once expired, gone
    second = 1_000
    for step, failed in outcomes:
        second += step
        live = [(s, f) for s, f in live if s > second - math.ceil(window_s)]
        live.append((second, failed))
        calls, failures = len(live), sum(f for _, f in live)
        tripped = _window_add(window, second, failed, params)
        assert (window.calls, window.failures) == (calls, failures)
        assert tripped == (calls >= min_calls and failures >= rate * calls)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from([SUCCESS, SUCCESS, SUCCESS, SUCCESS, FAILURE,
                                                 NEUTRAL, PROBE_FAILED]),
                                st.sampled_from([0, 0, 0.0004, 0.25, 0.9996, 1, 2.5, 6, 40]),
                                st.integers(0, 8)),
                      max_size=150),
       fail_max=st.integers(2, 8), min_calls=st.integers(1, 12),
       rate=st.sampled_from([None, 0.2, 0.5, 1.0]), window_s=st.sampled_from([1, 2.5, 10]))
# In one second: the success that brings the window to min_calls trips it (2 failures in 4).
@example(steps=[(FAILURE, 0, 8), (FAILURE, 0, 8), (SUCCESS, 0, 8), (SUCCESS, 0, 8)],
         fail_max=8, min_calls=4, rate=0.5, window_s=10)
# A reload within a quiet second: under the new rate (0.5) the next success trips it.
@example(steps=[(FAILURE, 0, 8), (SUCCESS, 0, 1)], fail_max=5, min_calls=2, rate=1.0,
         window_s=10)
def test_memory_defer_counts_a_success_as_record_does(steps, fail_max, min_calls, rate,
                                                      window_s):
    """Memory fed as the breaker policy feeds it (``defer``, else ``record``) against memory
    recording every outcome: after each step the same state, epoch, consecutive-failure
    count, window totals and openings, across quiet seconds, seconds that expire outcomes,
    open and half-open, and reloads (a new params object, now and then other values)."""
    now = [1000.0]
    reference, subject = MemoryBreakerStates(lambda: now[0]), MemoryBreakerStates(lambda: now[0])

    def variant(other: int) -> BreakerParams:  # 0: as given; 1, 2: quicker to trip
        return BreakerParams(fail_max=fail_max, reset_s=5,
                             window_s=(window_s * (2 if other == 2 else 1)) if rate else None,
                             rate=(rate or 1.0) / (2 if other == 1 else 1),
                             min_calls=min_calls // 2 + 1 if other == 2 else min_calls)

    params = variant(0)

    def summary(states: MemoryBreakerStates) -> tuple[object, ...]:
        m = states._machines["r"]
        return m.state, m.epoch, m.failures, m.window.calls, m.window.failures

    async def run() -> None:
        nonlocal params
        for outcome, step, reload in steps:
            now[0] += step
            if reload < 3:  # a reload: new params, whether or not their values changed
                params = variant(reload)
            admissions = [await states.admit("r", params) for states in (reference, subject)]
            assert admissions[0] == admissions[1]._replace(ticket=admissions[0].ticket)
            if not admissions[0].allowed:
                continue
            expected = await reference.record("r", admissions[0].ticket, outcome, params)
            got = None
            if not subject.defer("r", admissions[1].ticket, outcome, params):
                got = await subject.record("r", admissions[1].ticket, outcome, params)
            assert (got.transition if got else None) == expected.transition
            assert summary(subject) == summary(reference)

    asyncio.run(run())
