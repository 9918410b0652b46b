"""A retry's extra budget hold (``Charge.hold_retry``) is taken in its call's windows, where
every attempt of the call is charged (a review, 2026-12-06): taken in the window current at
the retry, a retry just past a minute's end was held in the next minute while both attempts
were charged to the first, which a 1000/min budget then passed (1,425 spent)."""

from __future__ import annotations

import orjson
import pytest
import yaml
from multidict import CIMultiDict

from policies.accounting import Accounting
from policies.budget import Budgets
from policies.pipeline import SENT_UNANSWERED, Call, Outcome
from policies.reasons import Reason, Rejected
from policies.state import memory_backends
from policies.usage import Usage
from proxy.config import parse_config
from tests.test_budget_ledger import Clock, at


@pytest.mark.parametrize("room_for_retry", [False, True])
async def test_a_retry_hold_across_a_window_end_is_held_where_the_call_is_charged(
        room_for_retry):
    config = parse_config(yaml.safe_dump({"routes": [{
        "name": "openai", "path_prefix": "/openai/", "upstream": "http://127.0.0.1:1",
        "protocol": "openai", "budget": {"tokens": "1000/min", "per": "tenant"}}]}), "<t>")
    (route,) = config.routes
    clock = Clock(at("2026-03-01 12:00:59"))
    budgets = Budgets(route.budget, {}, memory_backends(), clock, "openai")
    acct = Accounting(route, {}, None, budgets, "X-Run-ID")
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 400})
    call = Call(request_id="r", route="openai", method="POST",
                path="/openai/v1/chat/completions", headers={}, body=body, tenant="t")
    charge = await acct.admit(call)
    worst = charge.cost.input_tokens + 400
    # Earlier spend this minute leaves room for this call's worst case, once or twice.
    earlier = 1000 - worst * (2 if room_for_retry else 1)
    other = await budgets.reserve("t", None, "m", 0, earlier)
    budgets.settle(other, Usage(0, earlier))
    key = f"tokens-per-tenant-min:t:{int(clock.now // 60)}"
    # Attempt 1 is sent and times out (the forwarder's bookkeeping, proxy/attempts.py).
    call.reached, call.answer_status = True, SENT_UNANSWERED
    clock.now += 2  # the retry comes in the next minute
    if not room_for_retry:
        with pytest.raises(Rejected) as refused:
            await charge.hold_retry()
        assert refused.value.reason is Reason.BUDGET_EXHAUSTED
        charge.release(Outcome("upstream_timeout", True, 0))
        assert budgets.backends.ledger.level("openai", key) == (1000, 0)
        return
    await charge.hold_retry()
    assert budgets.backends.ledger.level("openai", key) == (earlier, 2 * worst)
    # Attempt 2 (call.unanswered counts attempt 1) is answered with a full count.
    call.unanswered += 1
    charge.start(200, CIMultiDict({"Content-Type": "application/json"}))
    charge.body(orjson.dumps({"id": "c", "choices": [], "usage": {
        "prompt_tokens": charge.cost.input_tokens, "completion_tokens": 400}}))
    charge.release(Outcome("2xx", True, 200))
    assert budgets.backends.ledger.level("openai", key) == (1000, 0)
