"""Property-based test of the memory rate buckets (hypothesis) against a plain GCRA model.

The memory buckets (``policies/state/rate.py``) work in one pass and update a bucket's stored
state in place; the model below keeps the continuous-state leaky bucket of ITU-T I.371 as the
module docstring defines it, one bucket at a time, with no shortcuts. A random program of
admissions (1-3 buckets of a group, with amounts up to and beyond a bucket's limit), refunds
of admitted calls, reads of what is available, and clock moves (forwards, and now and then a
step back, which drains nothing) runs on both; every answer must agree: admitted or not, the
refusing bucket, the wait, and the units left per bucket. Buckets must also be the only state:
once everything has drained, the memory buckets hold nothing.
"""

from __future__ import annotations

import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from policies.rate import finish_now
from policies.state.rate import MemoryRateBuckets, RateResult, Take

#: name -> (limit, period in seconds): a few buckets of different sizes and speeds.
BUCKETS = {"requests": (5, 60.0), "tenant:a": (3, 1.0), "tenant:b": (2, 0.5),
           "tokens": (1000, 60.0)}
GROUPS = ("route-1", "route-2")


class Model:
    """One level and its time per (group, bucket); the GCRA rules written out plainly."""

    def __init__(self) -> None:
        self.levels: dict[tuple[str, str], tuple[float, int]] = {}

    def level(self, group: str, take: Take, now: int) -> float:
        stored = self.levels.get((group, take.name))
        if stored is None:
            return 0.0
        level, t = stored
        per_unit_us = take.period_s * 1e6 / take.limit
        return max(level - max(now - t, 0) / per_unit_us, 0.0)

    def left(self, take: Take, level: float) -> int:
        return max(math.floor(take.limit - level + take.limit * 1e-9), 0)

    def set(self, group: str, take: Take, level: float, now: int) -> None:
        if level > 0:
            self.levels[(group, take.name)] = (level, now)
        else:
            self.levels.pop((group, take.name), None)

    def admit(self, group: str, takes: list[Take], now: int) -> RateResult:
        levels = [self.level(group, take, now) for take in takes]
        waits = []
        for take, level in zip(takes, levels, strict=True):
            over = level + take.amount - take.limit
            if take.amount > take.limit:
                waits.append(math.inf)
            elif over > take.limit * 1e-9:
                waits.append(over * take.period_s * 1e6 / take.limit)
            else:
                waits.append(-1.0)
        worst = max(waits)
        if worst >= 0:
            denied = waits.index(worst)
            return RateResult(False, denied, math.inf if worst == math.inf else worst / 1e6,
                              tuple(self.left(t, lv) for t, lv in zip(takes, levels,
                                                                       strict=True)))
        after = [level + take.amount for take, level in zip(takes, levels, strict=True)]
        for take, level in zip(takes, after, strict=True):
            self.set(group, take, level, now)
        return RateResult(True, None, 0.0,
                          tuple(self.left(t, lv) for t, lv in zip(takes, after, strict=True)))

    def refund(self, group: str, takes: list[Take], now: int) -> None:
        for take in takes:
            self.set(group, take, self.level(group, take, now) - take.amount, now)

    def available(self, group: str, takes: list[Take], now: int) -> tuple[int, ...]:
        return tuple(self.left(take, self.level(group, take, now)) for take in takes)


def _take(name: str, amount: float) -> Take:
    limit, period = BUCKETS[name]
    return Take(name, limit, period, amount)


takes_st = st.lists(
    st.tuples(st.sampled_from(["tenant:a", "tenant:a", *sorted(BUCKETS)]),
              # Mostly amounts that fit, so buckets fill, drain and get refused in turn.
              st.one_of(st.sampled_from([1.0, 1.0, 1.0, 0.5, 2.0]), st.floats(0.5, 4.0),
                        st.integers(1, 1200).map(float))),
    min_size=1, max_size=3, unique_by=lambda t: t[0],
).map(lambda pairs: [_take(name, amount) for name, amount in pairs])

# Mostly one group and one busy bucket, so that the same state is read and written often.
admit_st = st.tuples(st.just("admit"), st.sampled_from([GROUPS[0], *GROUPS]), takes_st)
ops_st = st.lists(st.one_of(
    admit_st, admit_st,  # twice as many admissions as each other step
    st.tuples(st.just("refund"), st.integers(0, 50)),
    st.tuples(st.just("available"), st.sampled_from(GROUPS), takes_st),
    st.tuples(st.just("clock"), st.one_of(
        st.sampled_from([1, 1_000, 100_000, 250_000, 333_334, 1_000_000]),
        st.integers(0, 2_000_000), st.integers(-50_000, 0))),
), min_size=5, max_size=80)


@settings(max_examples=500, deadline=None)
@given(ops_st)
# A bucket taken from again after a drain must be stored with the new time (a one-pass take
# that updates it in place can miss that; random programs find it only some of the time).
@example([("admit", "route-1", [_take("tenant:a", 1.0)]), ("clock", 1_000_000),
          ("admit", "route-1", [_take("tenant:a", 1.0)]),
          ("admit", "route-1", [_take("tenant:a", 1.0)])])
def test_memory_buckets_answer_as_the_plain_gcra_model(ops: list[tuple]) -> None:
    now = [1_000_000_000]
    buckets = MemoryRateBuckets(lambda: now[0] * 1000)
    model = Model()
    admitted: list[tuple[str, list[Take]]] = []
    for op in ops:
        if op[0] == "admit":
            _, group, takes = op
            got = finish_now(buckets.admit(group, takes))
            want = model.admit(group, takes, now[0])
            assert (got.admitted, got.denied, got.remaining) == (
                want.admitted, want.denied, want.remaining), op
            assert math.isclose(got.retry_after_s, want.retry_after_s, rel_tol=1e-9), op
            if got.admitted:
                admitted.append((group, takes))
        elif op[0] == "refund":
            if admitted:
                group, takes = admitted.pop(op[1] % len(admitted))
                finish_now(buckets.refund(group, takes))
                model.refund(group, takes, now[0])
        elif op[0] == "available":
            _, group, takes = op
            assert finish_now(buckets.available(group, takes)) == model.available(
                group, takes, now[0]), op
        else:
            now[0] += op[1]
    # Long after, every bucket has drained: nothing is kept, in either.
    now[0] += 10 ** 12
    for group in GROUPS:
        every = [_take(name, 1.0) for name in BUCKETS]
        assert finish_now(buckets.available(group, every)) == tuple(
            BUCKETS[name][0] for name in BUCKETS)
    finish_now(buckets.admit("route-1", [_take("requests", 1.0)]))  # sweeps the drained
    assert len(buckets) == 1
