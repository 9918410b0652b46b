"""A half-open probe judged by its status line, whose answer then fails (an LLM stream that
ends in a server-side error event, or is cut): the pass its success returned
(:meth:`policies.breaker.Breaker.record`) opens the breaker again at once, for another
``reset_timeout``, as a failed probe does, as long as the breaker is still in the epoch that
success left it in; once it has moved on, it changes nothing. On memory and on one Redis
(``REDIS_URL``, under a ``probe-`` key prefix of its own, deleted afterwards)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from policies.breaker import Breaker, Pass
from policies.config import CircuitBreakerConfig
from policies.reasons import Rejected
from policies.state import StateBackends, memory_backends, redis_backends
from policies.state.breaker import FAILURE, NEUTRAL, SUCCESS
from tests.redis_servers import CLIENT_TIMEOUT_S, TEST_PROBE_S, delete_prefix, require_redis
from tests.test_breaker_probe_lease import probe_of


@pytest.fixture(params=["memory", "redis"])
async def states(request: pytest.FixtureRequest) -> AsyncIterator[StateBackends]:
    if request.param == "memory":
        yield memory_backends()
        return
    url = require_redis()
    prefix = f"probe-{uuid.uuid4().hex[:12]}"
    backends = await redis_backends(url, prefix, CLIENT_TIMEOUT_S, probe_interval_s=TEST_PROBE_S)
    try:
        assert backends.health.up, backends.health.last_error
        yield backends
    finally:
        await backends.close()
        delete_prefix(url, prefix)


class Watched:
    """A breaker and the transitions it reported (``(event, cause)``)."""

    def __init__(self, backends: StateBackends, fail_max: int = 2,
                 success_threshold: int = 1, reset_timeout: str = "100ms") -> None:
        self.events: list[tuple[str, str | None]] = []
        self.breaker = Breaker(
            CircuitBreakerConfig(fail_max=fail_max, reset_timeout=reset_timeout,
                                 success_threshold=success_threshold),
            "r", lambda event, **fields: self.events.append((event, fields.get("cause"))),
            backends)

    async def open(self) -> None:
        """Closed-state failures up to ``fail_max``: open."""
        b = self.breaker
        while b.current != "open":
            await b.record(await b.attempt(), FAILURE, 500)

    async def probe_succeeds(self) -> Pass:
        """The next probe's status line (a success): the pass of its stream's end."""
        b = self.breaker
        after = await b.record(await probe_of(b), SUCCESS, 200)
        assert after is not None and after.after
        return after

    def opened(self) -> list[str | None]:
        return [cause for event, cause in self.events if event == "circuit_opened"]


async def test_a_probe_that_closed_the_breaker_opens_it_again_when_its_stream_fails(
        states: StateBackends):
    """The probe's success closes; a failure meanwhile under ``fail_max`` does not move it
    on; the probe's stream failing opens it at once, for ``reset_timeout``, and the next
    probe comes after that as after any failed probe. (A reset_timeout of 1 s: the refusal
    is checked after a few Redis round trips, which took over 100 ms on a loaded machine.)"""
    w = Watched(states, reset_timeout="1s")
    b = w.breaker
    await w.open()
    after = await w.probe_succeeds()
    assert b.current == "closed"
    await b.record(await b.attempt(), FAILURE, 500)
    assert await b.record(after, FAILURE) is None
    assert b.current == "open"
    assert w.opened() == ["fail_max", "probe_failed"]
    with pytest.raises(Rejected) as refused:
        await b.attempt()
    assert "opened by probe_failed" in refused.value.detail
    assert 0 < b.blocked_for() <= 1
    await probe_of(b)  # one reset_timeout later


async def test_after_another_calls_success_the_probes_stream_failing_is_one_failure(
        states: StateBackends):
    """A hostile review: 2,041 streams answered well after the probe's 200, then the probe's
    own stream cut by ``timeouts.total``, and the breaker opened, refusing every call for a
    ``reset_timeout``. A success heard since the probe closed it makes its failure one more
    closed-state failure (towards ``fail_max: 2`` here), as any stream's; a success recorded
    in a batch (Redis defers closed-state successes) counts as well."""
    w = Watched(states)
    b = w.breaker
    await w.open()
    after = await w.probe_succeeds()
    for _ in range(3):
        await b.record(await b.attempt(), SUCCESS, 200)
    await b.record(after, FAILURE)
    assert (b.current, w.opened()) == ("closed", ["fail_max"])
    await b.record(await b.attempt(), FAILURE, 500)  # the second in a row: fail_max
    assert (b.current, w.opened()) == ("open", ["fail_max", "fail_max"])


async def test_a_stream_that_ends_well_or_neutral_changes_nothing(states: StateBackends):
    """Its success, or a neutral end (a rate-limit event, the caller gone), leaves the
    breaker closed: the probe's status line said it all."""
    w = Watched(states)
    b = w.breaker
    for outcome in (SUCCESS, NEUTRAL):
        await w.open()
        after = await w.probe_succeeds()
        assert await b.record(after, outcome) is None
        assert b.current == "closed"
        await b.record(await b.attempt(), FAILURE, 500)  # one failure: under fail_max
        assert b.current == "closed"
        await b.record(await b.attempt(), SUCCESS, 200)
    assert w.opened() == ["fail_max", "fail_max"]


async def test_once_the_breaker_moved_on_a_probes_stream_failing_changes_nothing(
        states: StateBackends):
    """A's success closed the breaker; other calls' failures opened it again (still open,
    then closed by B's probe): A's stream failing, in either, changes nothing, as an
    outcome of an older state never does. B's own stream failing still opens it."""
    w = Watched(states)
    b = w.breaker
    await w.open()
    after_a = await w.probe_succeeds()
    await w.open()
    left = b.blocked_for()
    assert await b.record(after_a, FAILURE) is None
    assert (b.current, w.opened()) == ("open", ["fail_max", "fail_max"])
    assert b.blocked_for() <= left + 0.002  # nor is the open time lengthened (ms rounding)
    after_b = await w.probe_succeeds()
    assert b.current == "closed"
    await b.record(after_a, FAILURE)
    assert b.current == "closed"
    await b.record(after_b, FAILURE)
    assert (b.current, w.opened()) == ("open", ["fail_max", "fail_max", "probe_failed"])


async def test_a_stale_probes_failure_leaves_a_new_probe_in_flight_seen():
    """A's success closed the breaker; it opened again and B now probes. A's stream failing
    then changed nothing in the state, but its record's answer told this replica's view no
    probe was in flight: ``check()`` stopped refusing, and calls queued only to be refused
    at their attempt (a review). The view knows the breaker has moved on: nothing is sent,
    and the view keeps refusing while B's probe runs. (Memory only: on Redis the view
    leaves a probe in flight to the attempt's script.)"""
    w = Watched(memory_backends())
    b = w.breaker
    await w.open()
    after_a = await w.probe_succeeds()
    await w.open()
    probe_b = await probe_of(b)
    with pytest.raises(Rejected):
        b.check()
    assert await b.record(after_a, FAILURE) is None
    with pytest.raises(Rejected) as refused:
        b.check()
    assert "probe" in refused.value.detail
    await b.record(probe_b, SUCCESS, 200)
    assert b.current == "closed"


async def test_under_a_success_threshold_the_half_open_state_is_the_probes_too(
        states: StateBackends):
    """``success_threshold: 2``: A's success leaves the breaker half-open; A's stream
    failing then opens it, as a failed probe would. If B's success closed it first, the
    breaker moved on from the state A's success left it in: A's failure changes nothing,
    B's opens it."""
    w = Watched(states, success_threshold=2)
    b = w.breaker
    await w.open()
    after_a = await w.probe_succeeds()
    assert b.current == "half-open"
    await b.record(after_a, FAILURE)
    assert (b.current, w.opened()) == ("open", ["fail_max", "probe_failed"])
    after_a = await w.probe_succeeds()
    after_b = await w.probe_succeeds()
    assert b.current == "closed"
    await b.record(after_a, FAILURE)
    assert b.current == "closed"
    await b.record(after_b, FAILURE)
    assert (b.current, w.opened()) == ("open", ["fail_max", "probe_failed", "probe_failed"])
