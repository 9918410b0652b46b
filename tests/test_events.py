"""The event log's buffering (proxy/events.py): when lines are written, and that emitting
never fails a request whatever the values."""

from __future__ import annotations

import asyncio

import orjson

from proxy import events
from proxy.events import EventLog


async def written(path, count: int) -> list[bytes]:
    """The file's lines once it has ``count`` of them (the writer's thread writes them)."""
    async with asyncio.timeout(10):
        while len(lines := path.read_bytes().splitlines()) < count:
            await asyncio.sleep(0.01)
    return lines


async def test_a_full_batch_is_written_on_the_next_loop_turn_not_at_the_timer(tmp_path):
    log = EventLog(str(tmp_path / "events.jsonl"))
    await log.start()
    try:
        for n in range(events.FLUSH_BATCH - 1):
            log.emit("admitted", f"r{n}", "up", "t", None)
        await asyncio.sleep(0)
        assert (tmp_path / "events.jsonl").read_bytes() == b""  # the timer's 200 ms not up
        log.emit_record("completed", "last", "up", "t", "run-1", None, {"status": 200})
        await asyncio.sleep(0)
        assert log.lines() == b""  # handed to the writer on this turn, not at the timer
        lines = await written(tmp_path / "events.jsonl", events.FLUSH_BATCH)
        assert orjson.loads(lines[-1])["request_id"] == "last"
        assert orjson.loads(lines[-1])["status"] == 200
    finally:
        await log.close()


async def test_what_is_left_is_written_at_close_and_a_full_batch_after_it_raises_nothing(tmp_path):
    log = EventLog(str(tmp_path / "events.jsonl"))
    await log.start()
    log.emit("admitted", "r1", "up", "t", None, priority=1)
    await log.close()
    assert [orjson.loads(line)["request_id"]
            for line in (tmp_path / "events.jsonl").read_bytes().splitlines()] == ["r1"]
    for n in range(events.FLUSH_BATCH):  # after close: buffered, never scheduled, no error
        log.emit("admitted", f"late{n}", "up", "t", None)


def test_emitting_outside_a_loop_and_unencodable_values_never_raise():
    log = EventLog(None)
    for n in range(events.FLUSH_BATCH + 1):  # never started: no loop to schedule a flush on
        log.emit("completed", f"r{n}", "up", "t", None, header="caf\udce9", obj=object())
    lines = log.lines().splitlines()
    assert len(lines) == events.FLUSH_BATCH + 1
    first = orjson.loads(lines[0])
    assert first["header"] == "caf\\udce9"  # the caller's byte 0xe9, kept as an escape
    assert first["obj"].startswith("<object object")
