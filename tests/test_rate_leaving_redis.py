"""A caller that leaves while its rate take is on its way to Redis gets back what it took.

With the Redis backend the take (the rate step's request units, or the accounting step's one
round trip of request units, tokens and budget reservation) is a script that may already have
run when the caller leaves: only its reply is late (a slow link, a busy Redis). The take then
ends in the background and what its reply says it took is given back; a reply saying it took
nothing gives nothing back (a refund is not idempotent: it would free units others hold).
Found by a review: the units stayed taken, and later calls were refused ``rate_limited`` /
``token_rate_limited`` until the bucket drained.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from policies.pipeline import Admission, Call
from policies.reasons import Reason, Rejected
from policies.state import Fallback, StateBackends, redis_backends
from proxy.config import parse_config
from proxy.events import EventLog
from proxy.routes import Route
from tests.redis_servers import RedisServer, new_prefix

REDIS = pytest.mark.parametrize("backends", ["redis"], indirect=True)
#: How late each reply of a slowed state call arrives, seconds.
LATE_S = 0.3


def build(backends: StateBackends, blocks: str, protocol: str = "http") -> Route:
    text = f"""
routes:
  - name: a
    path_prefix: /a/
    upstream: http://127.0.0.1:1
    protocol: {protocol}
{blocks}"""
    (config,) = parse_config(text).routes
    return Route(config, EventLog(None), state=backends)


def call(path: str = "/a/x", body: bytes = b"") -> Call:
    return Call(request_id="r", route="a", method="POST", path=path, headers={}, body=body,
                tenant="t")


def late_replies(obj: object, name: str) -> Callable[[], None]:
    """Slow ``obj.name``: the real script runs, its reply reaches the caller ``LATE_S``
    later. Returns what restores it."""
    real = getattr(obj, name)

    async def slow(*args: object, **kwargs: object) -> object:
        result = await real(*args, **kwargs)
        await asyncio.sleep(LATE_S)
        return result
    setattr(obj, name, slow)
    return lambda: setattr(obj, name, real)


async def admit(route: Route, c: Call) -> Admission:
    admission = Admission()
    await admission.admit(route.base_plan.policies, c)
    return admission


async def leave_during(route: Route, obj: object, name: str, c: Call) -> None:
    """A caller admitted through ``route`` leaves once ``obj.name``'s script has run and
    before its reply arrives; returns once that reply has come and been acted on."""
    restore = late_replies(obj, name)
    leaver = asyncio.create_task(admit(route, c))
    await asyncio.sleep(LATE_S / 2)  # the script has run; its reply is on its way
    leaver.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaver
    restore()
    await asyncio.sleep(LATE_S)
    for owner in (route.rate, route.budgets):  # where the give-back runs
        if owner is not None:
            await owner.background.wait()


@REDIS
async def test_a_caller_leaving_during_the_rate_take_gets_its_unit_back(backends):
    route = build(backends, "    rate: {requests: 2/min}\n")
    await leave_during(route, backends.rates, "admit", call())
    await admit(route, call())  # 1 of 2
    await admit(route, call())  # 2 of 2: refused when the leaver's unit stayed taken


@REDIS
async def test_a_caller_leaving_during_a_refused_take_gives_nothing_back(backends):
    route = build(backends, "    rate: {requests: 1/min}\n")
    await admit(route, call())  # the one unit, held
    await leave_during(route, backends.rates, "admit", call())  # its reply: refused
    with pytest.raises(Rejected) as refused:
        await admit(route, call())  # a refund for the refused take would let this pass
    assert refused.value.reason is Reason.RATE_LIMITED


CHAT = b'{"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}'
CHAT_PATH = "/a/v1/chat/completions"


@REDIS
async def test_a_caller_leaving_during_the_token_admission_gets_its_tokens_back(backends):
    route = build(backends, "    rate: {tokens: 100/min}\n", protocol="openai")
    await leave_during(route, backends.admissions, "admit", call(CHAT_PATH, CHAT))
    await admit(route, call(CHAT_PATH, CHAT))  # ~55 of 100 tokens: refused if ~55 stayed


@REDIS
async def test_a_caller_leaving_during_the_admission_gets_units_tokens_and_budget_back(
        backends):
    route = build(backends, "    rate: {requests: 1/min, tokens: 100/min}\n"
                            "    budget: {tokens: 100/day, per: tenant}\n", protocol="openai")
    rounds = backends.admissions.release
    released: list[str] = []

    async def counted(group, takes, rid, claimed=True):
        released.append(rid)
        return await rounds(group, takes, rid, claimed)
    backends.admissions.release = counted
    await leave_during(route, backends.admissions, "admit", call(CHAT_PATH, CHAT))
    assert len(released) == 1  # the request unit, the tokens and the reservation: one trip
    # Its request unit, its ~55 tokens and its ~55 reserved on the budget are all free again.
    await admit(route, call(CHAT_PATH, CHAT))


@REDIS
async def test_a_caller_leaving_during_a_budget_only_admission_frees_its_reservation(
        backends):
    route = build(backends, "    budget: {tokens: 100/day, per: tenant}\n", protocol="openai")
    await leave_during(route, backends.admissions, "admit", call(CHAT_PATH, CHAT))
    await admit(route, call(CHAT_PATH, CHAT))  # ~55 of 100: refused if ~55 stayed held


@REDIS
async def test_a_caller_leaving_during_a_refused_admission_gives_nothing_back(backends):
    route = build(backends, "    rate: {tokens: 100/min}\n", protocol="openai")
    await admit(route, call(CHAT_PATH, CHAT))  # ~55 of 100 tokens, held
    await leave_during(route, backends.admissions, "admit", call(CHAT_PATH, CHAT))
    with pytest.raises(Rejected) as refused:
        await admit(route, call(CHAT_PATH, CHAT))  # a refund of ~55 would let this pass
    assert refused.value.reason is Reason.TOKEN_RATE_LIMITED


async def test_a_caller_leaving_during_an_admission_redis_never_answers_frees_its_reservation(
        redis_server: RedisServer):
    """The reply never comes (Redis frozen past ``state.timeout``): the script may still run
    when Redis wakes, so the reservation is released by id once Redis answers again (the
    units, which have no id, drain within their period)."""
    backends = await redis_backends(redis_server.url, new_prefix(), 0.2, probe_interval_s=0.05)
    backends.fallback = Fallback("local", 2)
    try:
        route = build(backends, "    budget: {tokens: 100/day, per: tenant}\n",
                      protocol="openai")
        budgets = route.budgets
        redis_server.freeze()
        leaver = asyncio.create_task(admit(route, call(CHAT_PATH, CHAT)))
        await asyncio.sleep(0.05)  # the script is sent; Redis runs it when thawed
        leaver.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaver
        await budgets.background.wait()  # the admission timed out; its release is kept
        assert budgets.reconciler
        redis_server.thaw()
        deadline = time.monotonic() + 15
        while not backends.health.up or budgets.reconciler:
            assert time.monotonic() < deadline, "the release was never sent"
            await asyncio.sleep(0.02)
        await budgets.background.wait()
        await admit(route, call(CHAT_PATH, CHAT))  # ~55 of 100: refused if ~55 stayed held
        with pytest.raises(Rejected) as refused:
            await admit(route, call(CHAT_PATH, CHAT))  # the budget still counts
        assert refused.value.reason is Reason.BUDGET_EXHAUSTED
    finally:
        await backends.close()
