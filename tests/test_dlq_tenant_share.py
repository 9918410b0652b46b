"""A tenant's share of the dead-letter store (``dead_letter.max_records_per_tenant``).

A hostile trial: one caller sent 60 calls with 1 MiB bodies and its own short deadline
against a 2 s upstream; each ended 504 and was dead-lettered whole, and with
``max_records: 50`` the store held 50 of its letters and a victim's real outage letter was
dropped. Now a tenant holding more than its share loses its own oldest letters first (with
their replays and replay holds), in the same transaction (SQLite) or script (Redis), and the
store's bound still holds. Each test runs on the SQLite file, the memory store, one Redis and
a Redis Cluster.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import policies.deadletter
import policies.state.deadletters
from policies.config import DeadLetterConfig
from policies.deadletter import CLAIMED, MISSING, Added, DeadLetterFile, DeadLetterQueue
from policies.state import StateBackends
from tests.test_state_deadletters import leftover_keys, letter

#: Each test on the SQLite file (beside the memory backend), the memory store, one Redis
#: and a Redis Cluster.
STORES = pytest.mark.parametrize(
    ("kind", "backends"),
    [("sqlite", "memory"), ("memory", "memory"), ("redis", "redis"), ("cluster", "cluster")],
    indirect=["backends"])


class OnFile:
    """The SQLite file as an async store (as :class:`DeadLetterQueue` runs it on a thread)."""

    def __init__(self, file: DeadLetterFile) -> None:
        self.file = file

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.file, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return method(*args, **kwargs)

        return call


@pytest.fixture
def store(kind: str, backends: StateBackends, tmp_path) -> Iterator[Any]:
    if kind != "sqlite":
        yield backends.dead_letters
        return
    file = DeadLetterFile(str(tmp_path / "dlq.sqlite"))
    try:
        yield OnFile(file)
    finally:
        file.close()


async def tenant_keys(backends: StateBackends) -> list[bytes]:
    """The Redis keys of the tenants' letter ids (none in memory or SQLite)."""
    redis = backends.redis
    if redis is None:
        return []
    pattern = redis.key("dlq", "tenant") + ":*"

    async def scan(client: Any) -> list[bytes]:
        if hasattr(client, "get_nodes"):  # a cluster: every primary
            return [key async for key in client.scan_iter(match=pattern,
                                                           target_nodes=client.PRIMARIES)]
        return [key async for key in client.scan_iter(match=pattern)]

    return await redis.run(scan)


async def tenants_held(store: Any) -> dict[str, list[int]]:
    """Each tenant's letter ids in the store, oldest first."""
    held: dict[str, list[int]] = {}
    for summary in await store.list(1000):
        held.setdefault(summary["tenant"], []).append(summary["id"])
    return held


@pytest.mark.parametrize("backends", ["memory", "redis"], indirect=True)
async def test_without_a_share_set_one_tenant_keeps_the_whole_store(
        backends: StateBackends, tmp_path):
    """The share is opt-in: a deployment without tenant headers is one tenant (``default``),
    and a default share of a quarter kept it to 2,500 of its 10,000 letters, dropping 7,501
    in one write on upgrade (a review)."""
    config = DeadLetterConfig(path=str(tmp_path / "dlq.sqlite"), max_records=8)
    assert config.max_records_per_tenant is None
    queue = DeadLetterQueue(config, backends)
    await queue.open()
    try:
        for _ in range(9):
            await queue.add(letter())
        assert queue.dropped == {("openai", "max_records"): 1}
        assert queue.depth("openai") == 8
    finally:
        await queue.close()


@STORES
async def test_a_tenant_flooding_past_its_share_drops_only_its_own_oldest(
        store: Any, backends: StateBackends):
    victim = [(await store.add(letter("tools", tenant="victim"), max_records=10,
                               max_per_tenant=4)).id for _ in range(2)]
    await store.add_replay(victim[0], 503, None, 0.1)
    assert (await store.claim_replay(victim[1], "held", 60.0)).state == CLAIMED
    first = [(await store.add(letter(tenant="attacker"), max_records=10,
                              max_per_tenant=4)).id for _ in range(4)]
    await store.add_replay(first[0], 503, None, 0.1)
    assert (await store.claim_replay(first[1], "held", 60.0)).state == CLAIMED
    added: list[Added] = [await store.add(letter(tenant="attacker"), max_records=10,
                                          max_per_tenant=4) for _ in range(20)]
    # Each past the share dropped one of the attacker's own; the store's bound none.
    assert [a.tenant_dropped for a in added] == [{"openai": 1}] * 20
    assert [a.dropped for a in added] == [{}] * 20
    assert await tenants_held(store) == {"victim": victim,
                                         "attacker": [a.id for a in added[-4:]]}
    for n in victim:
        assert await store.get(n) is not None
    got = await store.get(victim[0])
    assert got is not None and [r["status"] for r in got.replays] == [503]
    # The dropped letters' replays and holds went with them.
    assert await store.get(first[0]) is None
    assert (await store.claim_replay(first[1], "next", 5.0)).state == MISSING
    assert await leftover_keys(backends, [*first, *(a.id for a in added[:-4])]) == []
    assert await store.depth() == {"tools": 2, "openai": 4}


@STORES
async def test_the_store_bound_still_holds_across_tenants(store: Any, backends: StateBackends):
    """Five tenants of a share of 2 in a store of 6: the oldest letters overall go too."""
    ids = {}
    for n in range(5):
        for _ in range(2):
            added = await store.add(letter(tenant=f"t{n}"), max_records=6, max_per_tenant=2)
            ids.setdefault(f"t{n}", []).append(added.id)
    held = await tenants_held(store)
    assert sum(len(v) for v in held.values()) == 6
    assert held == {"t2": ids["t2"], "t3": ids["t3"], "t4": ids["t4"]}
    added = await store.add(letter("tools", tenant="t4"), max_records=6, max_per_tenant=2)
    assert (added.tenant_dropped, added.dropped) == ({"openai": 1}, {})
    added = await store.add(letter(tenant="t5"), max_records=6, max_per_tenant=2)
    assert (added.tenant_dropped, added.dropped) == ({}, {"openai": 1})
    assert sum(len(v) for v in (await tenants_held(store)).values()) == 6


@STORES
async def test_deleted_and_purged_letters_leave_no_tenant_behind(
        store: Any, backends: StateBackends):
    ids = [(await store.add(letter(tenant=t), max_records=10, max_per_tenant=2)).id
           for t in ("a", "b", "b", "c")]
    assert len(await tenant_keys(backends)) == (3 if backends.redis else 0)
    assert await store.delete(ids[0])
    assert len(await tenant_keys(backends)) == (2 if backends.redis else 0)
    # A deleted letter counts no more: b's two letters stay, with one more of a.
    fresh = (await store.add(letter(tenant="a"), max_records=10, max_per_tenant=2)).id
    assert await tenants_held(store) == {"b": ids[1:3], "c": [ids[3]], "a": [fresh]}
    assert await store.purge() == 4
    assert await tenant_keys(backends) == []
    # A purge leaves no count behind: a tenant starts again with its whole share.
    again = [await store.add(letter(tenant="b"), max_records=10, max_per_tenant=2)
             for _ in range(2)]
    assert [a.tenant_dropped for a in again] == [{}, {}]


@pytest.mark.parametrize("backends", ["redis", "cluster"], indirect=True)
async def test_redis_letters_from_before_the_share_count_in_the_store_bound_only(
        backends: StateBackends):
    """A stream written before the tenants' ids were kept: its letters are in no tenant's
    ids, so they count in max_records only and go as the oldest overall; new ones keep to
    their share."""
    store = backends.dead_letters
    old = [(await store.add(letter(tenant=t))).id for t in ("a", "a", "b")]
    redis = backends.redis
    assert redis is not None
    keys = await tenant_keys(backends)

    async def forget(client: Any) -> None:
        for key in keys:
            await client.delete(key)

    await redis.run(forget)
    new = [await store.add(letter(tenant="a"), max_records=5, max_per_tenant=2)
           for _ in range(3)]
    assert [a.tenant_dropped for a in new] == [{}, {}, {"openai": 1}]
    assert [a.dropped for a in new] == [{}, {}, {}]
    assert await tenants_held(store) == {"a": [*old[:2], *(a.id for a in new[1:])],
                                         "b": [old[2]]}
    added = await store.add(letter(tenant="c"), max_records=5, max_per_tenant=2)
    assert added.dropped == {"openai": 1} and await store.get(old[0]) is None


@pytest.mark.parametrize("backends", ["redis", "cluster"], indirect=True)
async def test_an_id_sluice_did_not_write_in_a_tenants_ids_is_skipped_not_failing_the_write(
        backends: StateBackends):
    """A member another program put in a tenant's ids ("abc", "-5", "1.5"): the script
    failed at XRANGE '0-abc' after the letter was written and counted, so its caller was
    told the letter was lost though it was stored. Now such a member is taken off and the
    write completes, dropping the tenant's real oldest letter."""
    store = backends.dead_letters
    first = (await store.add(letter(tenant="t"), max_records=10, max_per_tenant=1)).id
    redis = backends.redis
    assert redis is not None
    key = redis.key("dlq", "tenant") + ":t"

    async def spoil(client: Any) -> None:
        await client.zadd(key, {"abc": 0, "-5": 0, "1.5": 0, " 7": 0})

    await redis.run(spoil)
    added = await store.add(letter(tenant="t"), max_records=10, max_per_tenant=1)
    assert added.tenant_dropped == {"openai": 1}
    assert await tenants_held(store) == {"t": [added.id]}
    assert await store.get(first) is None and await store.depth() == {"openai": 1}

    async def members(client: Any) -> list[bytes]:
        return await client.zrange(key, 0, -1)

    assert await redis.run(members) == [str(added.id).encode()]


def test_a_file_written_before_the_tenant_index_is_read_and_bounded(tmp_path):
    """A file from before the share has no ``(tenant, id)`` index: opening it adds one, and
    its letters count in their tenant's share."""
    path = str(tmp_path / "dlq.sqlite")
    index = "CREATE INDEX IF NOT EXISTS dead_letters_tenant ON dead_letters (tenant, id);\n"
    schema = policies.deadletter._SCHEMA.replace(index, "")
    assert "dead_letters_tenant" not in schema
    old = sqlite3.connect(path)
    old.executescript(schema)
    for n, tenant in enumerate(("victim", "attacker", "attacker", "attacker")):
        old.execute("INSERT INTO dead_letters (created_at, route, tenant, idempotency_key,"
                    " request_id, method, path, headers, redacted, body, body_size, attempts,"
                    " reason) VALUES (1.0, 'openai', ?, NULL, ?, 'POST', '/v1', '[]', '[]',"
                    " x'', 0, '[]', 'attempts')", (tenant, f"req-{n}"))
    old.execute("INSERT INTO replays (dead_letter_id, at, status, error, duration_s)"
                " VALUES (2, 1.0, 503, NULL, 0.1)")
    old.commit()
    old.close()
    file = DeadLetterFile(path)
    try:
        indexes = {row[1] for row in file._db.execute("PRAGMA index_list(dead_letters)")}
        assert "dead_letters_tenant" in indexes
        plan = " ".join(str(row[-1]) for row in file._db.execute(
            "EXPLAIN QUERY PLAN SELECT id FROM dead_letters WHERE tenant = ? ORDER BY id",
            ("attacker",)))
        assert "dead_letters_tenant" in plan
        added = file.add(letter(tenant="attacker"), max_records=10, max_per_tenant=2)
        assert added.tenant_dropped == {"openai": 2}
        assert [(s["id"], s["tenant"]) for s in file.list()] == [
            (1, "victim"), (4, "attacker"), (added.id, "attacker")]
        assert file._db.execute("SELECT COUNT(*) FROM replays").fetchone()[0] == 0
    finally:
        file.close()


async def test_a_tenant_over_a_lowered_share_comes_down_over_its_writes_on_sqlite(tmp_path):
    """A share lowered far below what a tenant holds drops a bounded number of its letters
    a write (``MAX_DROPS_PER_ADD``, as the Redis script), not all at once in the caller's
    transaction; other tenants' letters stay."""
    most = policies.deadletter.MAX_DROPS_PER_ADD
    file = DeadLetterFile(str(tmp_path / "dlq.sqlite"))
    try:
        other = file.add(letter(tenant="other")).id
        for _ in range(most + 50):
            file.add(letter(tenant="a"))
        dropped = [sum(file.add(letter(tenant="a"), max_records=1000,
                                max_per_tenant=10).tenant_dropped.values())
                   for _ in range(3)]
        assert dropped == [most, 42, 1]
        held = await tenants_held(OnFile(file))
        assert len(held["a"]) == 10 and held["other"] == [other]
    finally:
        file.close()


@pytest.mark.parametrize("backends", ["memory", "redis"], indirect=True)
async def test_the_queue_counts_and_logs_a_tenants_share_by_name(
        backends: StateBackends, tmp_path, caplog: pytest.LogCaptureFixture):
    """The server's side: the SQLite file with the memory backend, the stream with Redis;
    the share set."""
    config = DeadLetterConfig(path=str(tmp_path / "dlq.sqlite"), max_records=8,
                              max_records_per_tenant=2)
    queue = DeadLetterQueue(config, backends)
    await queue.open()
    try:
        with caplog.at_level(logging.WARNING, logger="sluice"):
            await queue.add(letter("tools", tenant="victim"))
            for _ in range(5):
                await queue.add(letter(tenant="attacker"))
        assert queue.dropped == {("openai", "max_records_per_tenant"): 3}
        assert (queue.depth("openai"), queue.depth("tools")) == (2, 1)
        warned = [r.getMessage() for r in caplog.records
                  if "dead_letter.max_records_per_tenant" in r.getMessage()]
        assert len(warned) == 3 and all("tenant attacker" in w and "route openai" in w
                                        for w in warned)
    finally:
        await queue.close()


# -- any sequence of writes ----------------------------------------------------------------------


def kept(writes: list[tuple[int, str]], max_records: int, share: int) -> list[int]:
    """The ids the rules keep, oldest first (``writes``: id and tenant, in order)."""
    held: list[tuple[int, str]] = []
    for write in writes:
        held.append(write)
        mine = [w for w in held if w[1] == write[1]]
        for gone in mine[:max(0, len(mine) - share)]:
            held.remove(gone)
        del held[:max(0, len(held) - max_records)]
    return [n for n, _ in held]


SEQUENCES = st.tuples(
    st.integers(1, 8),
    st.integers(1, 8),
    st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from(["openai", "tools"])),
             min_size=1, max_size=25))


@STORES
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(SEQUENCES)
async def test_any_sequence_keeps_each_share_and_the_bound_dropping_each_tenants_oldest(
        store: Any, backends: StateBackends, case: tuple[int, int, list[tuple[str, str]]]):
    max_records, share, sequence = case
    share = min(share, max_records)
    await store.purge()
    writes: list[tuple[int, str]] = []
    for tenant, route in sequence:
        added = await store.add(letter(route, tenant=tenant), max_records=max_records,
                                max_per_tenant=share)
        writes.append((added.id, tenant))
        held = await tenants_held(store)
        assert all(len(ids) <= share for ids in held.values()), held
        assert sum(len(ids) for ids in held.values()) <= max_records, held
        # Each tenant keeps its newest letters: every one dropped is older than those kept.
        for name, ids in held.items():
            mine = [n for n, t in writes if t == name]
            assert ids == mine[len(mine) - len(ids):], (name, ids, mine)
        assert sorted(n for ids in held.values() for n in ids) == kept(writes, max_records,
                                                                       share)
    assert await store.purge() == len(kept(writes, max_records, share))
    assert await tenant_keys(backends) == []


def kept_a_write_at_a_time(writes: list[tuple[int, str, int, int]], most: int
                           ) -> tuple[list[int], list[int]]:
    """The ids the rules keep, oldest first, when one write drops ``most`` letters at most
    (its tenant's oldest first, then the oldest overall with what is left), and how many
    each write dropped (``writes``: id, tenant, max_records and share of each, in order)."""
    held: list[tuple[int, str]] = []
    counts = []
    for n, tenant, max_records, share in writes:
        held.append((n, tenant))
        mine = [w for w in held if w[1] == tenant]
        own = mine[:min(most, max(0, len(mine) - share))]
        for gone in own:
            held.remove(gone)
        over = min(most - len(own), max(0, len(held) - max_records))
        del held[:over]
        counts.append(len(own) + over)
    return [n for n, _ in held], counts


LOWERED = st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 12), st.integers(1, 12)),
                   min_size=1, max_size=30)


@STORES
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(LOWERED)
@example([("b", 12, 12)] + [("a", 12, 12)] * 7 + [("a", 1, 1)])
async def test_one_write_drops_at_most_the_stated_number_however_far_both_bounds_are_lowered(
        store: Any, backends: StateBackends, sequence: list[tuple[str, int, int]]):
    """A review: with a tenant's share and max_records both lowered, the store's pass still
    dropped MIN_DROPS_PER_ADD after the tenant's had used the write's budget (102 letters,
    or 4 x 1 MiB). Each write here has its own bounds (raised, lowered), the budget cut to
    3 letters."""
    most = 3
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policies.deadletter, "MAX_DROPS_PER_ADD", most)
        patch.setattr(policies.state.deadletters, "MAX_DROPS_PER_ADD", most)
        await store.purge()
        writes: list[tuple[int, str, int, int]] = []
        for tenant, max_records, share in sequence:
            added = await store.add(letter(tenant=tenant), max_records=max_records,
                                    max_per_tenant=share)
            writes.append((added.id, tenant, max_records, share))
            ids, counts = kept_a_write_at_a_time(writes, most)
            dropped = sum(added.dropped.values()) + sum(added.tenant_dropped.values())
            assert dropped == counts[-1] <= most, (dropped, counts[-1])
            assert sorted(n for held in (await tenants_held(store)).values()
                          for n in held) == ids
        assert await store.purge() == len(ids)
    assert await tenant_keys(backends) == []


@pytest.mark.parametrize(("kind", "backends"), [("sqlite", "memory"), ("redis", "redis")],
                         indirect=["backends"])
async def test_one_write_drops_about_a_mib_with_both_bounds_lowered(store: Any):
    """The bytes bound across both passes: the store's pass dropped MIN_DROPS_PER_ADD more
    letters after the tenant's had read its mebibyte (4 letters of 1 MiB in one write)."""
    big = b"x" * (600 << 10)
    for _ in range(8):
        await store.add(letter(tenant="b", body=big, body_size=len(big)))
    added = await store.add(letter(tenant="b"), max_records=2, max_per_tenant=1)
    assert (added.tenant_dropped, added.dropped) == ({"openai": 2}, {})
