"""One admission across rate buckets and budget holds (policies/state/admission.py).

Each test body runs against the memory backend, one Redis and a 3-master Redis Cluster (the
``backends`` fixture): all or nothing, both verdicts in the answer, a held id taken once.
A property test then drives the memory and the Redis implementation with the same random
sequence and checks that they answer alike.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.state import StateBackends, memory_backends, redis_backends
from policies.state.ledger import Claim
from policies.state.rate import Holder, Take
from tests.redis_servers import (
    CLIENT_TIMEOUT_S,
    REDIS_URL,
    delete_prefix,
    new_prefix,
    require_redis,
)

DAY = 86400.0
REQUESTS = Take("requests", 3, 60.0)


def claim(amount: float, cap: float = 100.0, key: str = "tokens:acme:1") -> Claim:
    return Claim(key, amount, cap, time.time() + DAY)


def rid() -> str:
    return uuid.uuid4().hex


async def admit(backends: StateBackends, takes: list[Take], claims: list[Claim],
                reservation: str | None = None):
    return await backends.admissions.admit("r", takes, reservation or rid(), claims,
                                           time.time(), 900.0)


async def test_a_budget_refusal_takes_no_rate_unit(backends):
    first = await admit(backends, [REQUESTS], [claim(60)])
    assert first.admitted and first.rates.remaining == (2,) and first.denied == []
    refused = await admit(backends, [REQUESTS], [claim(50)])  # 60 held + 50 > 100
    assert not refused.admitted and refused.denied == [0]
    assert refused.rates.denied is None and not refused.rates.admitted
    # The bucket did not move: two more requests fit, then the third is refused by the rate.
    assert await backends.rates.available("r", [REQUESTS]) == (2,)
    assert (await admit(backends, [REQUESTS], [claim(10)])).admitted
    assert (await admit(backends, [REQUESTS], [claim(10)])).admitted
    limited = await admit(backends, [REQUESTS], [claim(10)])
    assert not limited.admitted and limited.rates.denied == 0
    assert 19.0 < limited.rates.retry_after_s <= 20.0  # one unit per 20 s
    assert limited.denied == []  # the budget would have fitted: 80 + 10 <= 100
    assert await backends.ledger.levels("r", ["tokens:acme:1"]) == [(0.0, 80.0)]


async def test_a_rate_refusal_holds_no_budget(backends):
    full = Take("tokens", 100, 60.0, 100)
    assert (await admit(backends, [full], [claim(10)])).admitted
    refused = await admit(backends, [full], [claim(10)])
    assert not refused.admitted and refused.rates.denied == 0
    assert 59.0 < refused.rates.retry_after_s <= 60.0
    assert await backends.ledger.levels("r", ["tokens:acme:1"]) == [(0.0, 10.0)]


async def test_both_verdicts_come_back_when_both_deny(backends):
    assert (await admit(backends, [REQUESTS], [claim(100)])).admitted
    await admit(backends, [REQUESTS], [])
    await admit(backends, [REQUESTS], [])
    both = await admit(backends, [REQUESTS], [claim(1)])
    assert not both.admitted and both.rates.denied == 0 and both.denied == [0]


async def test_an_admission_settles_once_and_a_held_id_is_not_taken_twice(backends):
    reservation = rid()
    claims = [claim(40), claim(40, 50, "tokens:route:1")]
    assert (await admit(backends, [REQUESTS], claims, reservation)).admitted
    again = await admit(backends, [REQUESTS], claims, reservation)
    assert again.admitted  # the same id: admitted, nothing taken again
    assert await backends.rates.available("r", [REQUESTS]) == (2,)
    keys = [c.key for c in claims]
    assert await backends.ledger.levels("r", keys) == [(0.0, 40.0), (0.0, 40.0)]
    assert await backends.ledger.settle("r", reservation, [25.0, 25.0])
    assert not await backends.ledger.settle("r", reservation, [25.0, 25.0])
    assert await backends.ledger.levels("r", keys) == [(25.0, 0.0), (25.0, 0.0)]


async def test_rates_alone_and_claims_alone(backends):
    assert (await admit(backends, [REQUESTS], [])).rates.remaining == (2,)
    alone = await admit(backends, [], [claim(30)])
    assert alone.admitted and alone.rates.remaining == ()
    assert await backends.ledger.levels("r", ["tokens:acme:1"]) == [(0.0, 30.0)]


async def test_concurrent_admissions_never_overshoot(backends):
    """40 admissions at once, each 1 request unit (limit 30/min) and 10 tokens (budget
    250): exactly 25 pass, the budget's limit, and the bucket took 25 units."""
    bucket = Take("requests", 30, 60.0)
    results = await asyncio.gather(*(admit(backends, [bucket], [claim(10, 250)])
                                     for _ in range(40)))
    assert sum(r.admitted for r in results) == 25
    assert await backends.rates.available("r", [bucket]) == (5,)
    assert await backends.ledger.levels("r", ["tokens:acme:1"]) == [(0.0, 250.0)]


# -- memory and Redis answer alike ----------------------------------------------------------

step = st.tuples(
    st.lists(st.sampled_from(["requests", "tenant", "tokens"]), unique=True, max_size=3),
    st.integers(min_value=1, max_value=40),  # tokens taken and held
    st.lists(st.sampled_from(["day", "route"]), unique=True, max_size=2),
)
LIMITS = {"requests": (4, 1, 3600.0), "tenant": (3, 1, 3600.0), "tokens": (100, None, 3600.0)}
CAPS = {"day": 90.0, "route": 70.0}


def build(names: list[str], tokens: int, budgets: list[str], now: float
          ) -> tuple[list[Take], list[Claim]]:
    takes = []
    for name in names:
        limit, amount, period = LIMITS[name]
        takes.append(Take(name, limit, period, tokens if amount is None else amount))
    claims = [Claim(f"{b}:1", float(tokens), CAPS[b], now + DAY) for b in budgets]
    return takes, claims


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(step, min_size=1, max_size=12))
def test_memory_and_redis_answer_the_same_sequence_alike(steps):
    """Hour-long buckets, so the few milliseconds between the two backends' clocks cannot
    change a verdict; Retry-After may differ by that much."""
    url = require_redis(REDIS_URL)

    async def run() -> None:
        prefix = new_prefix()
        memory = memory_backends()
        shared = await redis_backends(url, prefix, CLIENT_TIMEOUT_S)  # counts, not time
        try:
            now = time.time()
            for names, tokens, budgets in steps:
                takes, claims = build(names, tokens, budgets, now)
                ids = rid()
                a = await memory.admissions.admit("g", takes, ids, claims, now, 900.0)
                b = await shared.admissions.admit("g", takes, ids, claims, now, 900.0)
                assert (a.admitted, a.rates.denied, a.denied, a.rates.remaining) == (
                    b.admitted, b.rates.denied, b.denied, b.rates.remaining)
                assert abs(a.rates.retry_after_s - b.rates.retry_after_s) < 1.0
            keys = [f"{b}:1" for b in CAPS]
            assert await memory.ledger.levels("g", keys) == await shared.ledger.levels("g", keys)
        finally:
            await shared.close()
            delete_prefix(url, prefix)

    asyncio.run(run())


async def test_a_release_refunds_and_releases_once(backends):
    reservation = rid()
    assert (await admit(backends, [REQUESTS], [claim(60)], reservation)).admitted
    assert await backends.admissions.release("r", [REQUESTS], reservation)
    assert await backends.rates.available("r", [REQUESTS]) == (3,)
    assert await backends.ledger.levels("r", ["tokens:acme:1"]) == [(0.0, 0.0)]
    assert not await backends.ledger.settle("r", reservation, [60.0])  # nothing left to settle
    assert not await backends.admissions.release("r", [], reservation)
    assert await backends.ledger.levels("r", ["tokens:acme:1"]) == [(0.0, 0.0)]


async def test_a_release_that_lands_before_its_admission_leaves_nothing_taken(backends):
    """A Redis fault trial: an admission sent as Redis stalled timed out (the call went to
    the local fallback, and its release was sent), but its script reached Redis after the
    release: it held the call's tokens, found by nobody, until the reap minutes later. The
    release marks the id gone: the late admission (and a late ledger reserve) takes nothing,
    and the release refunds no unit it never took. (Memory has no late scripts: there the
    release of an id not held just refunds nothing.)"""
    late = rid()
    assert not await backends.admissions.release("r", [REQUESTS], late)
    assert await backends.rates.available("r", [REQUESTS]) == (3,)  # none refunded
    if backends.redis is None:
        return
    assert (await admit(backends, [REQUESTS], [claim(60)], late)).admitted  # as it lands
    assert await backends.rates.available("r", [REQUESTS]) == (3,)
    assert await backends.ledger.levels("r", ["tokens:acme:1"]) == [(0.0, 0.0)]
    also_late = rid()
    assert not await backends.ledger.settle("r", also_late, [0.0])
    now = time.time()
    assert await backends.ledger.reserve("r", also_late, [claim(60)], now, 900.0) == []
    assert await backends.ledger.levels("r", ["tokens:acme:1"]) == [(0.0, 0.0)]
    assert not await backends.ledger.settle("r", also_late, [60.0])  # a mark settles nothing


async def test_holders_rates_and_claims_in_one_admission(backends):
    """With a holder, the script also keeps the buckets' records (keys between the buckets
    and the counters): the claims still land on their counters, and on Redis the bucket
    applies the lowest rate of the live holders (memory: its own)."""
    a, b = Holder("replica-a", 5.0), Holder("replica-b", 5.0)
    mine, theirs = Take("requests", 10, 60.0), Take("requests", 2, 60.0)
    now = time.time()
    first = await backends.admissions.admit("r", [mine], rid(), [claim(30)], now, 900.0, a)
    assert first.admitted and first.rates.remaining == (9,)
    second = await backends.admissions.admit("r", [theirs], rid(), [claim(30)], now, 900.0, b)
    assert second.admitted and second.rates.remaining == (0,)
    third = await backends.admissions.admit("r", [mine], rid(), [claim(30)], now, 900.0, a)
    if backends.redis is None:
        assert third.admitted and third.rates.remaining == (7,)
        held = 90.0
    else:  # B's 2 applies to A too
        assert (third.admitted, third.rates.denied, third.denied) == (False, 0, [])
        held = 60.0
    assert await backends.ledger.levels("r", ["tokens:acme:1"]) == [(0.0, held)]
    over = await backends.admissions.admit("r", [], rid(), [claim(50)], now, 900.0, a)
    assert (over.admitted, over.denied) == (False, [0])
