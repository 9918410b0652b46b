"""During an outage (``on_unavailable: local``) a limit whose shared level says it is spent
gets a local cap of 0; a call whose worst case is 0 there (a model priced at 0 on a usd
budget) fits it, and ``Budgets.headers`` divided by the cap: the admission raised
ZeroDivisionError after the reservation was taken, answered 502 "proxy error" (a review,
2026-12-06)."""

from __future__ import annotations

import time

import orjson
import yaml

from policies.accounting import Accounting
from policies.budget import Budgets
from policies.pipeline import Call
from policies.state import redis_backends
from policies.usage import Usage
from proxy.config import parse_config
from tests.redis_servers import new_prefix


async def test_a_free_call_during_an_outage_on_a_spent_budget_is_answered_not_crashed(
        redis_server):
    config = parse_config(yaml.safe_dump({"pricing": {
        "paid": {"input": 0, "output": 1e6}, "free": {"input": 0, "output": 0}},
        "routes": [{
        "name": "openai", "path_prefix": "/openai/", "upstream": "http://127.0.0.1:1",
        "protocol": "openai", "budget": {"usd": "1/day", "per": "tenant"}}]}), "<t>")
    (route,) = config.routes
    pricing = config.pricing
    backends = await redis_backends(redis_server.url, new_prefix(), 0.5, probe_interval_s=0.1)
    try:
        budgets = Budgets(route.budget, pricing, backends, time.time, "openai")
        acct = Accounting(route, pricing, None, budgets, "X-Run-ID")
        spent = await budgets.reserve("t", None, "paid", 0, 1)  # the whole $1
        budgets.settle(spent, Usage(0, 1))
        await budgets.background.wait()
        redis_server.stop()  # an outage: this replica decides on its local share
        call = Call(request_id="r", route="openai", method="POST",
                    path="/openai/v1/chat/completions", headers={}, tenant="t",
                    body=orjson.dumps({"model": "free", "max_tokens": 10,
                                       "messages": [{"role": "user", "content": "hi"}]}))
        charge = await acct.admit(call)  # it costs nothing: admitted
        assert charge is not None and charge.reservation is not None
        assert charge.headers["X-Sluice-Budget-Remaining"].startswith("0")
    finally:
        await backends.close()
