"""A bucket's records hash holding a record this version cannot read (from a hostile review):
another version's format, or a value that is not a positive finite number. Before, a record
whose fields did not parse as numbers made every take on the bucket fail with a Lua error
(``attempt to compare nil with number``) until the record lapsed; it now counts as lapsed,
as a record without an expiry already did."""

from __future__ import annotations

import time

import pytest

from policies.state import StateBackends
from policies.state.rate import Holder, Take
from tests.test_state_rate import records

A = Holder("replica-a", 5.0)


@pytest.mark.parametrize("value", ["x y {exp}", "0 6e6 {exp}", "nan 6e6 {exp}",
                                   "10 inf {exp}", "10 -1 {exp}"])
@pytest.mark.parametrize("backends", ["redis"], indirect=True)
async def test_an_unreadable_record_is_dropped_not_a_lua_error(backends: StateBackends,
                                                               value: str):
    state = backends.redis
    assert state is not None
    key = state.key("r", "rate", "lim", "requests")
    expiry = int(time.time() * 1000) + 60_000
    await state.run(lambda client: client.hset(key, "other", value.format(exp=expiry)))
    taken = await backends.rates.admit("r", [Take("requests", 10, 60.0)], A)
    assert (taken.admitted, taken.remaining) == (True, (9,))  # by A's own rate
    assert set(await records(backends, "requests")) == {A.id}
