"""The event log's buffering (proxy/events.py): when lines are written, that emitting
never fails a request whatever the values, and that log rotation is followed."""

from __future__ import annotations

import asyncio
import os
import threading

import aiohttp
import orjson

from proxy import events
from proxy.events import EventLog
from tests.conftest import route, status_of, wait_until

CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}


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


def request_ids(path) -> list[str]:
    """The request ids of the events in the file at ``path`` (none if there is no file)."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return []
    return [orjson.loads(line).get("request_id") for line in text.splitlines()]


async def test_a_rotated_event_log_is_reopened_at_its_path(upstream, start_sluice):
    # Seen in a hostile trial: after logrotate's move the events went on into the moved
    # file, and once that was deleted, into a deleted file that nobody could read.
    sluice = await start_sluice({"routes": [route("openai", upstream.url, "openai")]})
    url = sluice.url + "/openai/v1/chat/completions"
    path = sluice.events_path
    moved = path.with_name(path.name + ".1")
    async with aiohttp.ClientSession() as session:
        async def call(request_id: str) -> None:
            assert await status_of(session, url, CHAT, {"X-Request-ID": request_id}) == 200

        await call("before")
        # Both of its events (admitted, completed) written before the move: the second,
        # flushed after it, went to the new file on a loaded machine (a clean-clone run).
        await wait_until(lambda: request_ids(path).count("before") == 2,
                         what="the first events")
        path.rename(moved)  # logrotate's move; the new file is Sluice's to create
        await call("after-move")
        await wait_until(lambda: request_ids(path).count("after-move") == 2,
                         what="the events after the move in a new file at the path")
        assert "after-move" not in request_ids(moved)
        assert request_ids(moved).count("before") == 2

        path.unlink()
        await call("after-delete")
        await wait_until(lambda: request_ids(path).count("after-delete") == 2,
                         what="the events after the delete in a file created again")
    assert "after-delete" not in request_ids(moved)


async def test_a_truncated_event_log_is_written_from_its_new_end(tmp_path):
    # logrotate's copytruncate: the file is cut to 0 under the open descriptor. Appending
    # writes at the new end; a plain write would go on at the old offset past a hole of NULs.
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path))
    await log.start()
    try:
        log.emit("admitted", "r1", "up", "t", None, pad="x" * 1000)
        log.flush()
        await written(path, 1)
        os.truncate(path, 0)
        log.emit("admitted", "r2", "up", "t", None)
        log.flush()
        [line] = await written(path, 1)
    finally:
        await log.close()
    assert orjson.loads(line)["request_id"] == "r2"
    assert b"\0" not in path.read_bytes()


async def test_an_event_log_that_is_not_a_regular_file_is_not_reopened(tmp_path):
    # A FIFO (or /dev/stdout) at the path: removing it must not make a regular file appear.
    path = tmp_path / "events.fifo"
    os.mkfifo(path)
    read: list[bytes] = []

    def reader() -> None:
        with open(path, "rb") as fifo:
            read.extend(fifo)  # line by line, as they come

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    log = EventLog(str(path))
    await log.start()
    try:
        log.emit("admitted", "r1", "up", "t", None)
        log.flush()
        # Removed once the writer has the FIFO open (its first line read): before, on a busy
        # machine, the writer's thread could come to open it after the unlink.
        await wait_until(lambda: len(read) == 1, what="the first line through the FIFO")
        path.unlink()
        log.emit("admitted", "r2", "up", "t", None)
        log.flush()
    finally:
        await log.close()
    await asyncio.to_thread(thread.join, 10)
    assert [orjson.loads(line)["request_id"] for line in read] == ["r1", "r2"]
    assert not path.exists()


async def test_a_fifo_nobody_reads_yet_holds_up_neither_the_start_nor_its_lines(tmp_path):
    # Seen in a hostile trial: `events.path` naming a FIFO whose reader (a log shipper) had
    # not started made `sluice serve` wait in open() on the event loop: never ready, and
    # SIGTERM unanswered until a reader came.
    path = tmp_path / "events.fifo"
    os.mkfifo(path)
    started = threading.Event()
    rescued: list[bool] = []

    def rescue() -> None:  # a reader for a start that waits for one, so the test cannot hang
        if not started.wait(10):
            rescued.append(True)
            with open(path, "rb"):
                pass

    threading.Thread(target=rescue, daemon=True).start()
    log = EventLog(str(path))
    await log.start()
    started.set()
    assert not rescued, "the start waited for the FIFO's reader"
    read: list[bytes] = []
    try:
        log.emit("admitted", "r1", "up", "t", None)
        log.flush()

        def reader() -> None:  # the shipper comes late, and gets what waited for it
            with open(path, "rb") as fifo:
                read.extend(fifo.readline() for _ in range(2))

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        log.emit("admitted", "r2", "up", "t", None)
        log.flush()
        await asyncio.to_thread(thread.join, 10)
    finally:
        await log.close()
    assert [orjson.loads(line)["request_id"] for line in read] == ["r1", "r2"]
    assert log.dropped == 0


async def test_a_fifo_removed_before_its_reader_came_leaves_no_file_in_its_place(tmp_path):
    # The FIFO is opened by the first write when no reader had it at the start; removed
    # before then, that open created a regular file there, which the lines then filled.
    path = tmp_path / "events.fifo"
    os.mkfifo(path)
    log = EventLog(str(path))
    await log.start()
    try:
        path.unlink()
        log.emit("admitted", "r1", "up", "t", None)
        log.flush()
        await wait_until(lambda: log.dropped == 1, what="the line counted as dropped")
    finally:
        await log.close()
    assert not path.exists()
