"""Shared circuit-breaker state (policies.state.breaker): memory, one Redis, a Redis Cluster."""

from __future__ import annotations

import asyncio

from policies.state import StateBackends
from policies.state.breaker import (
    CLOSED,
    CLOSED_AGAIN,
    FAILURE,
    HALF_OPEN,
    HALF_OPENED,
    NEUTRAL,
    OPEN,
    OPENED,
    SUCCESS,
    BreakerParams,
)
from tests.redis_servers import replica

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
