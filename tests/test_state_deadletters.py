"""Dead letters in a Redis Stream (policies.state.deadletters): memory, one Redis, a Redis
Cluster; the records are policies.deadletter.DeadLetter, as in the SQLite store."""

from __future__ import annotations

import pytest

from policies.deadletter import Attempt, DeadLetter
from policies.state import StateBackends
from tests.redis_servers import replica


def letter(route: str = "openai", **changes: object) -> DeadLetter:
    fields: dict[str, object] = dict(
        route=route, tenant="acme", run="run-1", idempotency_key="k-1", request_id="req-1",
        method="POST", path="/openai/v1/chat/completions",
        headers=[("content-type", "application/json"), ("x-trace", "é")],
        redacted=["Authorization"], body=b'{"model": "m"}\x00\xff', body_size=40,
        attempts=[Attempt(1700000000.5, 503, None, 0.25), Attempt(1700000001.0, None,
                                                                   "timeout", 5.0)],
        reason="attempts", created_at=1700000002.125,
    )
    fields.update(changes)
    return DeadLetter(**fields)  # type: ignore[arg-type]


async def test_a_letter_comes_back_whole(backends: StateBackends):
    store = backends.dead_letters
    original = letter()
    first = await store.add(original)
    second = await store.add(letter(run=None, idempotency_key=None))
    assert second == first + 1
    got = await store.get(first)
    assert got is not None
    assert got.as_dict() == {**original.as_dict(), "id": first}
    bare = await store.get(second)
    assert bare is not None and (bare.run, bare.idempotency_key) == (None, None)
    assert await store.get(second + 1) is None


async def test_list_replays_delete_and_depth(backends: StateBackends):
    store = backends.dead_letters
    ids = [await store.add(letter(route)) for route in ("openai", "tools", "openai")]
    assert await store.add_replay(ids[0], 200, None, 0.5) is True
    assert await store.add_replay(ids[1], None, "connect_error", 0.1) is True
    assert await store.add_replay(ids[2] + 10, 200, None, 0.1) is False
    summaries = await store.list(2)
    assert [s["id"] for s in summaries] == ids[1:]  # the newest, oldest first
    assert summaries[0] == {
        "id": ids[1], "created_at": 1700000002.125, "route": "tools", "tenant": "acme",
        "method": "POST", "path": "/openai/v1/chat/completions", "attempts": 2,
        "reason": "attempts", "last_replay": "connect_error"}
    assert (await store.list())[0]["last_replay"] == 200
    got = await store.get(ids[0])
    assert got is not None and [(r["status"], r["error"]) for r in got.replays] == [(200, None)]
    assert await store.depth() == {"openai": 2, "tools": 1}
    assert await store.delete(ids[0]) is True
    assert await store.delete(ids[0]) is False
    assert await store.depth() == {"openai": 1, "tools": 1}


async def test_purge_empties_and_ids_never_repeat(backends: StateBackends):
    store = backends.dead_letters
    last = 0
    for _ in range(3):
        last = await store.add(letter())
    assert await store.purge() == 3
    assert await store.list() == [] and await store.depth() == {}
    assert await store.add(letter()) == last + 1


@pytest.mark.parametrize("backends", ["redis", "cluster"], indirect=True)
async def test_any_replica_reads_what_another_wrote(backends: StateBackends):
    letter_id = await backends.dead_letters.add(letter())
    async with replica(backends) as other:
        got = await other.dead_letters.get(letter_id)
        assert got is not None and got.request_id == "req-1"
        assert [s["id"] for s in await other.dead_letters.list()] == [letter_id]
