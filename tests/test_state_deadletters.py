"""Dead letters in a Redis Stream (policies.state.deadletters): memory, one Redis, a Redis
Cluster; the records are policies.deadletter.DeadLetter, as in the SQLite store (whose replay
hold is checked here too)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import policies.deadletter
import policies.state.deadletters
from policies.config import DeadLetterConfig
from policies.deadletter import (
    ANSWERED,
    BUSY,
    CLAIMED,
    MISSING,
    Added,
    Attempt,
    DeadLetter,
    DeadLetterFile,
    DeadLetterQueue,
)
from policies.state import DeadLetterStore, StateBackends
from tests.conftest import wait_until
from tests.redis_servers import replica


def letter(route: str = "openai", **changes: object) -> DeadLetter:
    fields: dict[str, object] = dict(
        route=route, tenant="acme", run="run-1", idempotency_key="k-1", request_id="req-1",
        method="POST", path="/openai/v1/chat/completions",
        headers=[("content-type", "application/json"), ("x-trace", "é")],
        redacted=["Authorization"], body=b'{"model": "m"}\x00\xff', body_size=40,
        attempts=[Attempt(1700000000.5, 503, None, 0.25), Attempt(1700000001.0, None,
                                                                   "timeout", 5.0)],
        reason="attempts", created_at=1700000002.125, key_origin="derived",
    )
    fields.update(changes)
    return DeadLetter(**fields)  # type: ignore[arg-type]


async def test_a_letter_comes_back_whole(backends: StateBackends):
    store = backends.dead_letters
    original = letter()
    first = (await store.add(original)).id
    second = (await store.add(letter(run=None, idempotency_key=None, key_origin=None))).id
    assert second == first + 1
    got = await store.get(first)
    assert got is not None
    assert got.as_dict() == {**original.as_dict(), "id": first}
    bare = await store.get(second)
    assert bare is not None
    assert (bare.run, bare.idempotency_key, bare.key_origin) == (None, None, None)
    assert await store.get(second + 1) is None


async def test_list_replays_delete_and_depth(backends: StateBackends):
    store = backends.dead_letters
    ids = [(await store.add(letter(route))).id for route in ("openai", "tools", "openai")]
    assert await store.add_replay(ids[0], 200, None, 0.5) is True
    assert await store.add_replay(ids[1], None, "connect_error", 0.1) is True
    assert await store.add_replay(ids[2] + 10, 200, None, 0.1) is False
    summaries = await store.list(2)
    assert [s["id"] for s in summaries] == ids[1:]  # the newest, oldest first
    assert summaries[0] == {
        "id": ids[1], "created_at": 1700000002.125, "route": "tools", "tenant": "acme",
        "method": "POST", "path": "/openai/v1/chat/completions", "attempts": 2,
        "reason": "attempts", "last_replay": "connect_error", "unreadable_replay": None}
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
        last = (await store.add(letter())).id
    assert await store.purge() == 3
    assert await store.list() == [] and await store.depth() == {}
    assert (await store.add(letter())).id == last + 1


@pytest.mark.parametrize("backends", ["redis", "cluster"], indirect=True)
async def test_any_replica_reads_what_another_wrote(backends: StateBackends):
    letter_id = (await backends.dead_letters.add(letter())).id
    async with replica(backends) as other:
        got = await other.dead_letters.get(letter_id)
        assert got is not None and got.request_id == "req-1"
        assert [s["id"] for s in await other.dead_letters.list()] == [letter_id]


async def test_a_replay_holds_its_letter_until_its_result_is_stored(backends: StateBackends):
    store = backends.dead_letters
    first = (await store.add(letter())).id
    assert (await store.claim_replay(first + 1, "t0", 5.0)).state == MISSING
    assert (await store.claim_replay(first, "t1", 5.0)).state == CLAIMED
    async with replica(backends) as other:  # another operator's command, anywhere
        busy = await other.dead_letters.claim_replay(first, "t2", 5.0, again=True)
        assert busy.state == BUSY and 0 < busy.left_s <= 5.0
    # A failed send frees the letter for the next replay; an answered one needs `again`.
    assert await store.add_replay(first, None, "connect_error", 0.1, "t1") is True
    assert (await store.claim_replay(first, "t3", 5.0)).state == CLAIMED
    await store.add_replay(first, 201, None, 0.2, "t3")
    done = await store.claim_replay(first, "t4", 5.0)
    assert done.state == ANSWERED and done.replay is not None and done.replay["status"] == 201
    assert (await store.claim_replay(first, "t5", 5.0, again=True)).state == CLAIMED
    # Only the holder's result ends the hold.
    await store.add_replay(first, 500, None, 0.1, "someone-else")
    assert (await store.claim_replay(first, "t6", 5.0, again=True)).state == BUSY


async def test_a_200_whose_mcp_call_failed_is_not_answered(backends: StateBackends):
    """``dlq replay`` stores an MCP call's 200 whose tool (or JSON-RPC) failed with its
    error (``tool_failed``): it was taken for answered, so the next replay needed
    ``--again``. It is listed by its error; an answered replay still needs ``again``."""
    store = backends.dead_letters
    first = (await store.add(letter("tools"))).id
    assert (await store.claim_replay(first, "t1", 5.0)).state == CLAIMED
    await store.add_replay(first, 200, "tool_failed", 0.1, "t1")
    assert (await store.list())[0]["last_replay"] == "tool_failed"
    assert (await store.claim_replay(first, "t2", 5.0)).state == CLAIMED
    await store.add_replay(first, 200, None, 0.1, "t2")
    done = await store.claim_replay(first, "t3", 5.0)
    assert done.state == ANSWERED and done.replay is not None and done.replay["error"] is None


async def test_the_hold_of_a_replay_that_never_finished_lapses(backends: StateBackends):
    store = backends.dead_letters
    letter_id = (await store.add(letter())).id
    assert (await store.claim_replay(letter_id, "killed", 0.05)).state == CLAIMED
    await asyncio.sleep(0.1)
    assert (await store.claim_replay(letter_id, "next", 5.0)).state == CLAIMED
    assert await store.purge() == 1  # the hold goes with its letter
    assert (await store.claim_replay(letter_id, "x", 5.0)).state == MISSING


def test_the_sqlite_file_holds_a_letter_for_one_replay_across_connections(tmp_path):
    """Two ``sluice dlq`` processes on one file: each has its own connection."""
    path = str(tmp_path / "dlq.sqlite")
    one, two = DeadLetterFile(path), DeadLetterFile(path)
    try:
        letter_id = one.add(letter()).id
        assert one.claim_replay(letter_id, "a", 5.0).state == CLAIMED
        assert two.claim_replay(letter_id, "b", 5.0, again=True).state == BUSY
        one.add_replay(letter_id, 200, None, 0.1, "a")
        answered = two.claim_replay(letter_id, "b", 5.0)
        assert answered.state == ANSWERED and answered.replay is not None
        assert answered.replay["status"] == 200
        assert two.claim_replay(letter_id, "b", 0.01, again=True).state == CLAIMED
        time.sleep(0.02)
        assert one.claim_replay(letter_id, "c", 5.0, again=True).state == CLAIMED
        assert one.claim_replay(letter_id + 1, "d", 5.0).state == MISSING
    finally:
        one.close()
        two.close()


def test_a_file_written_before_key_origin_was_kept_is_read_and_written(tmp_path):
    """A letter keeps where its key came from (``key_origin``); a file from before has no
    such column: opening it adds one, its letters read with none, new ones with theirs."""
    path = str(tmp_path / "dlq.sqlite")
    schema = policies.deadletter._SCHEMA.replace(",\n    key_origin TEXT", "")
    assert "key_origin" not in schema
    old = sqlite3.connect(path)
    old.executescript(schema)
    old.execute("INSERT INTO dead_letters (created_at, route, tenant, idempotency_key,"
                " request_id, method, path, headers, redacted, body, body_size, attempts,"
                " reason) VALUES (1.0, 'openai', 'acme', 'k-0', 'req-0', 'POST', '/v1',"
                " '[]', '[]', x'', 0, '[]', 'attempts')")
    old.commit()
    old.close()
    one, two = DeadLetterFile(path), DeadLetterFile(path)  # the second finds it added
    try:
        before = one.get(1)
        assert before is not None and (before.idempotency_key, before.key_origin) == (
            "k-0", None)
        new = two.get(two.add(letter()).id)
        assert new is not None and new.key_origin == "derived"
        assert new.as_dict() == {**letter().as_dict(), "id": new.id}
    finally:
        one.close()
        two.close()


def test_a_key_origin_column_another_process_adds_first_is_taken(tmp_path, monkeypatch):
    """Two processes opening a file written before ``key_origin`` was kept both find the
    column missing; the second's ``ALTER TABLE`` then fails (duplicate column), and the
    column it finds there since is taken, not raised. The test above opens one after the
    other, so the second finds the column and never comes to that branch."""
    path = str(tmp_path / "dlq.sqlite")
    schema = policies.deadletter._SCHEMA.replace(",\n    key_origin TEXT", "")
    old = sqlite3.connect(path)
    old.executescript(schema)
    old.close()
    first = DeadLetterFile(path)  # adds it
    columns = DeadLetterFile._columns
    looked: list[int] = []

    def stale(self: DeadLetterFile) -> set[str]:  # the second looked before the first added
        looked.append(1)
        return set() if len(looked) == 1 else columns(self)

    monkeypatch.setattr(DeadLetterFile, "_columns", stale)
    second = DeadLetterFile(path)
    try:
        assert len(looked) == 2  # the ALTER failed, and the column was looked for again
        got = second.get(second.add(letter()).id)
        assert got is not None and got.key_origin == "derived"
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_letters_go_to_the_file_at_the_path_after_it_was_deleted_or_moved(tmp_path, how):
    """Seen in a hostile trial: after ``rm dlq.sqlite*`` under a running server, every later
    letter went into the deleted file: named in its answer, found by no ``sluice dlq``."""
    path = tmp_path / "dlq.sqlite"
    server = DeadLetterFile(str(path))
    try:
        server.add(letter(request_id="before"))
        if how == "deleted":
            for name in ("dlq.sqlite", "dlq.sqlite-wal", "dlq.sqlite-shm"):
                (tmp_path / name).unlink(missing_ok=True)
        else:  # the main file only, as a careless backup would (its log stays at the path)
            path.rename(tmp_path / "old.sqlite")
        second = server.add(letter(request_id="after")).id
    finally:
        server.close()
    cli = DeadLetterFile(str(path))
    try:
        found = cli.get(second)
        assert found is not None and found.request_id == "after"
        assert [row["id"] for row in cli.list()] == [second]  # nothing of the old log
    finally:
        cli.close()


def test_the_depth_is_read_from_the_file_at_the_path_after_it_was_deleted(tmp_path):
    """After ``rm dlq.sqlite*`` the server's depth reads (``sluice_dead_letter_depth``, every
    ``refresh_s``) went on counting the deleted file's letters until a new letter came, as
    only a write looked for the file at the path: an emptied store said it held them."""
    path = tmp_path / "dlq.sqlite"
    server = DeadLetterFile(str(path))
    try:
        server.add(letter(request_id="before"))
        assert sum(server.depth().values()) == 1
        for name in ("dlq.sqlite", "dlq.sqlite-wal", "dlq.sqlite-shm"):
            (tmp_path / name).unlink(missing_ok=True)
        assert server.depth() == {}
    finally:
        server.close()


# -- the bound: dead_letter.max_records --------------------------------------------------------


async def leftover_keys(backends: StateBackends, letter_ids: list[int]) -> list[str]:
    """The replay lists and replay holds of ``letter_ids`` still in Redis (none in memory)."""
    redis = backends.redis
    if redis is None:
        return []
    names = [f"{redis.key('dlq', kind)}:{n}" for n in letter_ids for kind in ("replays", "claim")]

    async def present(client: object) -> list[str]:
        return [name for name in names if await client.exists(name)]  # type: ignore[attr-defined]

    return await redis.run(present)


async def test_a_full_store_drops_its_oldest_letters_with_their_replays(
        backends: StateBackends):
    store = backends.dead_letters
    ids = [(await store.add(letter(route), max_records=3)).id
           for route in ("tools", "openai", "openai")]
    await store.add_replay(ids[0], 503, None, 0.1)
    assert (await store.claim_replay(ids[1], "held", 60.0)).state == CLAIMED
    added = await store.add(letter("tools"), max_records=3)
    assert added.dropped == {"tools": 1}
    assert [s["id"] for s in await store.list()] == [*ids[1:], added.id]
    assert await store.get(ids[0]) is None
    assert await store.depth() == {"openai": 2, "tools": 1}
    # A bound lowered (at a restart) drops what is over it with the next letter.
    added = await store.add(letter("tools"), max_records=2)
    assert added.dropped == {"openai": 2}
    assert [s["id"] for s in await store.list()] == [ids[2] + 1, added.id]
    assert await store.depth() == {"tools": 2}
    assert (await store.claim_replay(ids[1], "next", 5.0)).state == MISSING
    assert await leftover_keys(backends, ids) == []
    # Without a bound nothing is dropped.
    assert (await store.add(letter())).dropped == {}
    assert await store.depth() == {"tools": 2, "openai": 1}


@pytest.mark.parametrize("backends", ["redis", "cluster"], indirect=True)
async def test_one_redis_write_drops_a_bounded_number_of_letters(
        backends: StateBackends, monkeypatch: pytest.MonkeyPatch):
    """A script blocks every client of Redis: a bound lowered far is reached over writes."""
    monkeypatch.setattr(policies.state.deadletters, "MAX_DROPS_PER_ADD", 2)
    store = backends.dead_letters
    for _ in range(5):
        await store.add(letter())
    assert (await store.add(letter(), max_records=1)).dropped == {"openai": 2}
    assert (await store.add(letter(), max_records=1)).dropped == {"openai": 2}
    assert (await store.add(letter(), max_records=1)).dropped == {"openai": 2}
    assert len(await store.list()) == 2 and await store.depth() == {"openai": 2}
    assert (await store.add(letter(), max_records=1)).dropped == {"openai": 2}
    assert await store.depth() == {"openai": 1}


def test_a_full_sqlite_file_drops_its_oldest_letters_with_their_replays(tmp_path):
    path = str(tmp_path / "dlq.sqlite")
    file, other = DeadLetterFile(path), DeadLetterFile(path)
    try:
        ids = [file.add(letter(route), max_records=3).id
               for route in ("tools", "openai", "openai")]
        file.add_replay(ids[0], 503, None, 0.1)
        assert file.claim_replay(ids[0], "held", 60.0, again=True).state == CLAIMED
        added = file.add(letter("tools"), max_records=3)
        assert added.dropped == {"tools": 1}
        assert [s["id"] for s in other.list()] == [*ids[1:], added.id]
        assert other.get(ids[0]) is None and other.depth() == {"openai": 2, "tools": 1}
        assert file.add(letter("tools"), max_records=1).dropped == {"openai": 2, "tools": 1}
        assert other.depth() == {"tools": 1}
        leftovers = [file._db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                     for table in ("replays", "replay_claims")]
        assert leftovers == [0, 0]
    finally:
        file.close()
        other.close()


def count_letters(file: DeadLetterFile) -> int:
    return file._db.execute("SELECT COUNT(*) FROM dead_letters").fetchone()[0]


def test_a_sqlite_file_over_its_bound_comes_down_over_writes_a_bounded_number_each(tmp_path):
    """A bound lowered far below what a file holds (at a restart) was reached in one write,
    which dropped everything over it in its transaction: 7,501 letters of 64 KiB in 2 s,
    its caller waiting (a review). Now a write drops ``MAX_DROPS_PER_ADD`` at most, as the
    Redis script does, and the file comes down over the next writes."""
    most = policies.deadletter.MAX_DROPS_PER_ADD
    file = DeadLetterFile(str(tmp_path / "dlq.sqlite"))
    try:
        for _ in range(3 * most + 50):
            file.add(letter())
        held = [count_letters(file)]
        while held[-1] > 10:
            added = file.add(letter("tools"), max_records=10)
            assert sum(added.dropped.values()) <= most
            held.append(count_letters(file))
        # Each write adds one and drops up to the limit; the last only what is over.
        assert held == [350, 251, 152, 53, 10]
        assert file.add(letter(), max_records=10).dropped == {"openai": 1}
        assert count_letters(file) == 10
    finally:
        file.close()


def test_one_sqlite_write_drops_about_a_mebibyte_of_letters_and_at_least_two(tmp_path):
    """The bytes bound of the Redis script too: about ``MAX_DROP_BYTES_PER_ADD`` of
    letters a write, and at least two, so letters of 1 MiB still come down against the
    one each write adds."""
    file = DeadLetterFile(str(tmp_path / "dlq.sqlite"))
    try:
        for _ in range(5):
            file.add(letter(body=b"x" * (400 << 10)))
        # 400 KiB, 800 KiB, then one more (under 1 MiB before it): three.
        assert file.add(letter("tools"), max_records=1).dropped == {"openai": 3}
        assert count_letters(file) == 3
        file.purge()
        for _ in range(4):
            file.add(letter(body=b"x" * (1 << 20)))
        assert file.add(letter("tools"), max_records=1).dropped == {"openai": 2}
        assert file.add(letter("tools"), max_records=1).dropped == {"openai": 2}
        assert file.add(letter("tools"), max_records=1).dropped == {"tools": 2}
        assert count_letters(file) == 1
    finally:
        file.close()


@pytest.mark.parametrize("backends", ["memory", "redis"], indirect=True)
async def test_the_queue_counts_and_logs_what_the_bound_dropped(
        backends: StateBackends, tmp_path, caplog: pytest.LogCaptureFixture):
    """The server's side: the SQLite file with the memory backend, the stream with Redis."""
    queue = DeadLetterQueue(DeadLetterConfig(path=str(tmp_path / "dlq.sqlite"), max_records=2),
                            backends)
    await queue.open()
    try:
        with caplog.at_level(logging.WARNING, logger="sluice"):
            ids = [await queue.add(letter(route)) for route in ("tools", "openai", "openai")]
        assert ids == [ids[0], ids[0] + 1, ids[0] + 2]
        assert queue.dropped == {("tools", "max_records"): 1}
        assert (queue.depth("openai"), queue.depth("tools")) == (2, 0)
        warned = [r for r in caplog.records if "dead_letter.max_records" in r.getMessage()]
        assert len(warned) == 1 and "route tools" in warned[0].getMessage()
        assert all(getattr(r, "sluice_per_call", False) for r in warned)  # folded by repeats
    finally:
        await queue.close()


# -- the depth the server reports ---------------------------------------------------------------


def queue_of(backends: StateBackends, tmp_path, refresh_s: float,
             max_records: int = 1000) -> DeadLetterQueue:
    """The server's queue: on the SQLite file with the memory backend, else the stream."""
    config = DeadLetterConfig(path=str(tmp_path / "dlq.sqlite"), max_records=max_records)
    return DeadLetterQueue(config, backends, refresh_s=refresh_s)


class OtherFile:
    """Another process's connection to the SQLite file, as a store."""

    def __init__(self, file: DeadLetterFile) -> None:
        self.file = file

    async def add(self, letter: DeadLetter) -> Added:
        return self.file.add(letter)

    async def purge(self) -> int:
        return self.file.purge()


@contextlib.asynccontextmanager
async def another_process(backends: StateBackends,
                          tmp_path) -> AsyncIterator[DeadLetterStore | OtherFile]:
    """``sluice dlq`` or another replica: its own connection to the same file or stream."""
    if backends.redis is not None:
        async with replica(backends) as other:
            yield other.dead_letters
        return
    file = DeadLetterFile(str(tmp_path / "dlq.sqlite"))
    try:
        yield OtherFile(file)
    finally:
        file.close()


async def test_the_depth_follows_a_purge_and_the_writes_of_other_processes(
        backends: StateBackends, tmp_path):
    """It was the count read at start plus this replica's writes: a purge never lowered it,
    and each replica of a shared stream reported its own count."""
    queue = queue_of(backends, tmp_path, refresh_s=0.05)
    await queue.open()
    try:
        for _ in range(3):
            await queue.add(letter())
        assert queue.depth("openai") == 3
        async with another_process(backends, tmp_path) as other:
            assert await other.purge() == 3
            await wait_until(lambda: queue.depth("openai") == 0, what="the purge seen")
            await other.add(letter("tools"))
            await other.add(letter("tools"))
            await wait_until(lambda: queue.depth("tools") == 2, what="the writes seen")
    finally:
        await queue.close()


async def test_the_depth_is_read_again_after_a_write_drops_letters(backends: StateBackends,
                                                                   tmp_path):
    queue = queue_of(backends, tmp_path, refresh_s=3600.0, max_records=4)  # no periodic read
    await queue.open()
    try:
        await queue.add(letter("tools"))
        async with another_process(backends, tmp_path) as other:
            for _ in range(3):
                await other.add(letter())
        assert (queue.depth("openai"), queue.depth("tools")) == (0, 1)  # not read yet
        await queue.add(letter())  # 5 letters: the oldest ("tools") dropped
        assert queue.dropped == {("tools", "max_records"): 1}
        await wait_until(lambda: (queue.depth("openai"), queue.depth("tools")) == (4, 0),
                         what="the depth read after the drop")
    finally:
        await queue.close()


@pytest.mark.parametrize("backends", ["redis", "cluster"], indirect=True)
async def test_list_and_purge_hold_redis_in_bounded_scripts(
        backends: StateBackends, monkeypatch: pytest.MonkeyPatch):
    """A trial: a purge read every letter, bodies included, in one script (10,000 of 8 KiB
    held Redis 509 ms, 300 of 1 MiB 1.4 s) and a list read its whole page so (100 of 1 MiB:
    356 ms); every replica took Redis for down and refused calls. A list reads ~1 MiB of
    entries a script and reads on; a purge unlinks the stream and deletes the letters'
    replays and claims in batches. Each script is counted here."""
    monkeypatch.setattr(policies.state.deadletters, "LIST_BYTES_PER_SCRIPT", 1)
    monkeypatch.setattr(policies.state.deadletters, "FORGET_PER_SCRIPT", 2)
    store = backends.dead_letters
    ids = [(await store.add(letter(route))).id for route in ("a", "b", "c", "d", "e")]
    for letter_id in ids:
        assert await store.add_replay(letter_id, 500, None, 0.1) is True
    assert (await store.claim_replay(ids[0], "t", 60.0)).state == CLAIMED
    state = backends.redis
    assert state is not None
    scripts = []
    real = state.eval

    async def counted(script, keys, args, read=None):  # type: ignore[no-untyped-def]
        scripts.append(script)
        return await real(script, keys, args, read)

    monkeypatch.setattr(state, "eval", counted)
    assert [s["route"] for s in await store.list(3)] == ["c", "d", "e"]
    assert len(scripts) == 3  # one letter a script, at a byte a script
    assert [s["last_replay"] for s in await store.list()] == [500] * 5
    scripts.clear()
    assert await store.purge() == 5
    # At a byte a script, a letter a walk: 5 walks, one finding none left, the unlink.
    assert len(scripts) == 5 + 1 + 1
    assert await store.list() == [] and await store.depth() == {}
    assert await leftover_keys(backends, ids) == []


@pytest.mark.parametrize("backends", ["redis"], indirect=True)
async def test_a_purge_cut_midway_leaves_the_next_purge_everything(
        backends: StateBackends, monkeypatch: pytest.MonkeyPatch):
    """Reviews: a purge that unlinked the stream first and was cut before deleting the
    letters' replays left them for good (the next purge found no letter); one that walked
    the letters in place let a letter whose replays it had deleted be replayed again, and
    left replays recorded meanwhile. The letters are moved out at once, and a cut purge's
    are walked by the next."""
    monkeypatch.setattr(policies.state.deadletters, "FORGET_PER_SCRIPT", 2)
    store = backends.dead_letters
    ids = [(await store.add(letter())).id for _ in range(5)]
    for letter_id in ids:
        assert await store.add_replay(letter_id, 500, None, 0.1) is True
    state = backends.redis
    assert state is not None
    real, calls = state.eval, []

    async def cut(script, keys, args, read=None):  # type: ignore[no-untyped-def]
        calls.append(script)
        if len(calls) == 2:
            raise policies.state.StateUnavailable("cut")
        return await real(script, keys, args, read)

    monkeypatch.setattr(state, "eval", cut)
    with pytest.raises(policies.state.StateUnavailable):
        await store.purge()
    monkeypatch.setattr(state, "eval", real)
    assert await store.list() == [] and await store.depth() == {}  # gone at once
    assert (await store.claim_replay(ids[0], "t", 60.0)).state == MISSING  # not sent again
    assert await store.add_replay(ids[0], 200, None, 0.1) is False  # nothing recorded
    later = (await store.add(letter())).id
    assert later == ids[-1] + 1
    assert await store.purge() == 1  # the cut one's letters walked, then this one's
    assert await leftover_keys(backends, [*ids, later]) == []

    async def purging_left(client: object) -> int:
        return await client.exists(state.key("dlq", "purging"))  # type: ignore[attr-defined]

    assert await state.run(purging_left) == 0


@pytest.mark.parametrize("backends", ["redis"], indirect=True)
async def test_one_redis_write_drops_about_a_mib_of_letters_at_most(backends: StateBackends):
    """Each letter dropped is read whole (a stream read copies its body): 100 letters of
    1 MiB dropped in one write would hold Redis as a trial's purge did. About 1 MiB a write."""
    store = backends.dead_letters
    big = b"x" * (600 << 10)
    for _ in range(3):
        await store.add(letter(body=big, body_size=len(big)))
    assert (await store.add(letter(), max_records=1)).dropped == {"openai": 2}
    assert (await store.add(letter(), max_records=1)).dropped == {"openai": 2}
    assert len(await store.list()) == 1
    # Letters of 1 MiB (max_body_bytes' default) still shrink to a lowered bound: at least
    # two go a write (a review: one a write, against the one added, never shrank it).
    huge = b"x" * (1 << 20)
    for _ in range(7):
        await store.add(letter(body=huge, body_size=len(huge)))
    for _ in range(6):
        await store.add(letter(), max_records=2)
    assert len(await store.list()) == 2


@pytest.mark.parametrize("backends", ["redis"], indirect=True)
async def test_one_unreadable_letter_is_listed_as_such_not_failing_the_list(
        backends: StateBackends):
    # A hostile trial: one entry Sluice could not read made `dlq list` exit 1 without
    # naming it, so no letter could be listed until the operator guessed which to delete.
    store = backends.dead_letters
    redis = backends.redis
    assert redis is not None
    first = (await store.add(letter("a"))).id

    async def spoil(client: object) -> int:  # an entry another program wrote: no fields
        n = await client.incr(redis.key("dlq", "seq"))  # type: ignore[attr-defined]
        await client.xadd(redis.key("dlq", "letters"), {"route": "b"},  # type: ignore[attr-defined]
                          id=f"0-{n}")
        return int(n)

    bad = await redis.run(spoil)
    ids = [first, bad, (await store.add(letter("c"))).id]
    listed = await store.list()
    assert [s["id"] for s in listed] == ids
    assert [s["route"] for s in listed] == ["a", "?", "c"]
    assert listed[1]["reason"] == f"unreadable (sluice dlq delete {ids[1]})"
    assert await store.delete(ids[1]) is True


@pytest.mark.parametrize("backends", ["redis"], indirect=True)
async def test_a_replay_sluice_cannot_read_is_named_and_counts_as_sent(
        backends: StateBackends):
    # A replay entry another program wrote: the letter was listed as unreadable as a whole
    # ("sluice dlq delete N"), and one whose status was not a number was sent again.
    store = backends.dead_letters
    ids = [(await store.add(letter(route))).id for route in ("a", "b")]
    for n in ids:
        assert await store.add_replay(n, 503, None, 0.1)
    redis = backends.redis
    assert redis is not None
    replays = f"{redis.key('dlq', 'replays')}:{ids[0]}"

    async def spoil(client: object) -> None:
        await client.rpush(replays, b'{"at": 1, "status": "200", "error": null, '  # type: ignore[attr-defined]
                                    b'"duration_s": 0.1}')

    await redis.run(spoil)
    listed = await store.list()
    assert [(s["route"], s["last_replay"]) for s in listed] == [("a", "unreadable"), ("b", 503)]
    what = "its status holds text, not a number"
    assert listed[0]["unreadable_replay"] == what and listed[1]["unreadable_replay"] is None
    got = await store.get(ids[0])
    assert got is not None and got.replays[1] == {"unreadable": what}
    claim = await store.claim_replay(ids[0], "t-1", 5.0)
    assert claim.state == ANSWERED and claim.replay == {"unreadable": what}
    assert (await store.claim_replay(ids[0], "t-1", 5.0, again=True)).state == CLAIMED
    assert (await store.claim_replay(ids[1], "t-2", 5.0)).state == CLAIMED


# -- the claim reads a replay as `dlq show` does -----------------------------------------------
#
# A review: the claim script read a Redis replay entry with Lua's cjson, which takes what orjson
# refuses (a hex number, NaN, Infinity, a leading zero, "1.", bytes that are not UTF-8, text
# after a NUL): `dlq show` called such a replay unreadable, so possibly sent, and `dlq replay`
# took it for a failed one (cjson read 0x1F7 as 503) and sent the letter again without
# --again. The reverse, nesting cjson refuses past 1,000 levels and orjson reads, made a
# failed replay need --again. Each case: the claim answers as what `get` reads says.

#: Tokens of each field: cjson's lenient numbers next to plain ones, text and other kinds.
NUMBERS = [b"0x1F7", b"0x1f4", b"-0x10", b"0503", b"NaN", b"-nan", b"Infinity", b"-Infinity",
           b"inf", b"1.", b"-.5", b"1e999", b"503", b"200", b"99", b"0", b"1000", b"503.0",
           b"5.03e2", b"-1", b"1700000000.5", b"0.25", b"true", b"null", b'"503"', b"[]"]
ERRORS = [b"null", b'"connect_error"', b'"interrupted_after_send"', b'"tool_failed"',
          b'"\xff"', b'"caf\xc3"', b'"\\ud800"', b'"a\x01b"', b'""', b"5", b"{}"]
TOKENS = {"at": NUMBERS + [b"1700000000.5"] * 4, "status": NUMBERS + [b"503", b"200"] * 4,
          "error": ERRORS + [b"null"] * 8, "duration_s": NUMBERS + [b"0.25"] * 4}
#: What may follow the fields in the object, and after it.
EXTRAS = [b"", b',"n":NaN', b',"x":"\xff"', b',"status":200', b',"at":"x"',
          b',"d":' + b"[" * 990 + b"]" * 990, b',"d":' + b"[" * 1010 + b"]" * 1010,
          b',"d":' + b"[" * 1030 + b"]" * 1030]
TRAILERS = [b"", b" ", b"\n", b"\x00", b"\x00 junk", b"]", b"\xff"]


@st.composite
def replay_entries(draw: st.DrawFn) -> bytes:
    """A replay's JSON as another program may have written it to Redis."""
    fields = [b'"%s":%s' % (name.encode(), draw(st.sampled_from(TOKENS[name])))
              for name in policies.deadletter.REPLAY_FIELDS if draw(st.integers(0, 9))]
    fields = draw(st.permutations(fields))
    return (b"{" + b",".join(fields) + (draw(st.sampled_from(EXTRAS)) if fields else b"")
            + b"}" + draw(st.sampled_from(TRAILERS)))


@pytest.mark.parametrize("backends", ["redis"], indirect=True)
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(b'{"at":1,"status":0x1F7,"error":null,"duration_s":0.1}')
@example(b'{"at":1,"status":503,"error":"\xff","duration_s":0.1}')
@example(b'{"at":1,"status":503,"error":null,"duration_s":0.1,"n":NaN}')
@example(b'{"at":1,"status":503,"error":null,"duration_s":0.1}\x00')
@example(b'{"at":1,"status":503,"error":null,"duration_s":0.1,"d":'
         + b"[" * 1010 + b"]" * 1010 + b"}")
@given(st.one_of(replay_entries(), st.binary(max_size=40)))
async def test_the_claim_reads_a_replay_as_show_does(backends: StateBackends, entry: bytes):
    store = backends.dead_letters
    redis = backends.redis
    assert redis is not None
    letter_id = (await store.add(letter())).id
    replays = f"{redis.key('dlq', 'replays')}:{letter_id}"

    async def write(client: object) -> None:
        await client.rpush(replays, entry)  # type: ignore[attr-defined]

    await redis.run(write)
    got = await store.get(letter_id)
    assert got is not None and len(got.replays) == 1
    done = policies.deadletter.answered(got.replays)
    claim = await store.claim_replay(letter_id, "t1", 5.0)
    if done is None:
        assert claim.state == CLAIMED, (entry[:80], got.replays)
    else:
        assert claim.state == ANSWERED and claim.replay == done, (entry[:80], got.replays)
        # ...and holds nothing: the next replay, with --again, is not told it is busy.
        assert (await store.claim_replay(letter_id, "t2", 5.0, again=True)).state == CLAIMED
    assert await store.delete(letter_id)


# -- `list` says of a replay row what `show` reads ---------------------------------------------
#
# A review: the careful read of each letter's last replay doubled the time of a list of 100,000
# letters. The list now reads the row's cells as they are, with one quick test for a record as
# Sluice writes it before the full one, and again with the careful columns only when a cell
# holds text that is not UTF-8; whatever a row holds, it must say what `show` (`get`) reads.


class AsText(bytes):
    """Bytes to write as TEXT (``CAST(? AS TEXT)``): text that need not be UTF-8."""


NUMBERS_OR_NOT = st.one_of(
    st.floats(allow_nan=False), st.integers(-(2**63), 2**63 - 1),  # NaN is stored as NULL
    st.sampled_from([1.7e9, 0.25, 2.5e11, 0, 99]),
    st.text(max_size=3), st.binary(max_size=2), st.binary(max_size=2).map(AsText))
ERRORS_OR_NOT = st.one_of(st.none(), st.sampled_from(["connect_error", "interrupted_after_send"]),
                          NUMBERS_OR_NOT)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@example((1.7e9, 503, None, 0.25))  # as Sluice writes them
@example((1.7e9, None, "connect_error", 0.25))
@example((1.7e9, 503, AsText(b"\xff"), 0.25))  # read again, with the careful columns
@given(st.tuples(NUMBERS_OR_NOT, st.one_of(st.none(), st.integers(-1, 1000), NUMBERS_OR_NOT),
                 ERRORS_OR_NOT, NUMBERS_OR_NOT))
def test_list_says_of_a_replay_row_what_show_reads(tmp_path, cells):
    path = tmp_path / "dlq.sqlite"
    file = DeadLetterFile(str(path))
    try:
        letter_id = file.add(letter()).id
        values = ", ".join("CAST(? AS TEXT)" if isinstance(c, AsText) else "?" for c in cells)
        with contextlib.closing(sqlite3.connect(path)) as db, db:
            db.execute("INSERT INTO replays (dead_letter_id, at, status, error, duration_s)"
                       f" VALUES (?, {values})", (letter_id, *[
                           bytes(c) if isinstance(c, AsText) else c for c in cells]))
        got = file.get(letter_id)
        assert got is not None
        [summary] = file.list(1)
        assert summary["id"] == letter_id
        said = (summary["last_replay"], summary["unreadable_replay"])
        assert said == policies.deadletter.last_replay(got.replays[-1]), cells
    finally:
        file.close()


def test_an_older_replay_sluice_cannot_read_still_needs_again(tmp_path):
    # As the README says: `list` reads the last replay (a failed 503 here), while the older
    # one whose record cannot be read may have reached the upstream, so a replay needs again.
    path = tmp_path / "dlq.sqlite"
    file = DeadLetterFile(str(path))
    try:
        letter_id = file.add(letter()).id
        file.add_replay(letter_id, 503, None, 0.1)
        file.add_replay(letter_id, 503, None, 0.1)
        with contextlib.closing(sqlite3.connect(path)) as db, db:
            db.execute("UPDATE replays SET status = 'two hundred' WHERE id = 1")
        [summary] = file.list()
        assert (summary["last_replay"], summary["unreadable_replay"]) == (503, None)
        what = "its status holds text, not a number"
        claim = file.claim_replay(letter_id, "t1", 5.0)
        assert claim.state == ANSWERED and claim.replay == {"unreadable": what}
        assert file.claim_replay(letter_id, "t1", 5.0, again=True).state == CLAIMED
    finally:
        file.close()
