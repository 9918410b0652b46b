"""A damaged dead-letter file (a page overwritten, as a disk or a careless copy does).

A hostile ops trial overwrote page 2 (the ``dead_letters`` table's root) with 0xff bytes:
``sluice serve`` started and reported ready with no word and went on writing letters; ``dlq
list`` said "database disk image is malformed"; ``dlq show 2`` said "no dead letter 2", of
a letter the file had held. The real CLI and a real ``sluice serve``, in subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path

import pytest

from policies.deadletter import Attempt, DeadLetter, DeadLetterFile
from tests.conftest import route, wait_until
from tests.sluice_child import sluice_cli

PAGE = 4096  # SQLite's default page size, which the file is made with


def damaged_file(path: Path, letters: int = 3) -> None:
    """A dead-letter file holding ``letters`` letters, then its page 2 overwritten."""
    file = DeadLetterFile(str(path))
    try:
        for n in range(letters):
            file.add(DeadLetter(route="openai", tenant="acme", run=None, idempotency_key=None,
                                request_id=f"req-{n}", method="POST", path="/v1/x",
                                headers=[], redacted=[], body=b"{}", body_size=2,
                                attempts=[Attempt(1700000000.0, 503, None, 0.1)],
                                reason="attempts_exhausted"))
    finally:
        file.close()  # the last connection: the write-ahead log is written into the file
    with open(path, "r+b") as raw:
        raw.seek(PAGE)
        raw.write(b"\xff" * PAGE)


def says_damaged(err: str, path: Path) -> bool:
    return (f"the dead-letter file {path} is damaged" in err and ".recover" in err
            and "no dead letter" not in err)


async def test_show_of_a_letter_in_a_damaged_page_says_the_file_is_damaged(tmp_path):
    path = tmp_path / "dlq.sqlite"
    damaged_file(path)
    for command in (("show", "2"), ("delete", "2")):
        code, out, err = await sluice_cli("dlq", *command, "--file", str(path))
        assert code == 1 and says_damaged(err, path), (command, out, err)


async def test_list_of_a_damaged_file_says_so_and_how_to_recover(tmp_path):
    path = tmp_path / "dlq.sqlite"
    damaged_file(path)
    code, out, err = await sluice_cli("dlq", "list", "--file", str(path))
    assert code == 1 and says_damaged(err, path), (out, err)


@pytest.mark.parametrize(("column", "value"), [("headers", "[["), ("attempts", "{}x")])
async def test_a_row_sluice_cannot_read_is_said_so_not_a_traceback(tmp_path, column, value):
    """A row whose ``headers`` (or ``attempts``) is not JSON, in a sound file (written by
    something else, edited by hand): ``dlq show`` ended in orjson's traceback, where the
    Redis backend says what is wrong (a hostile trial)."""
    path = tmp_path / "dlq.sqlite"
    file = DeadLetterFile(str(path))
    try:
        for n in range(2):
            file.add(DeadLetter(route="openai", tenant="acme", run=None, idempotency_key=None,
                                request_id=f"req-{n}", method="POST", path="/v1/x",
                                headers=[], redacted=[], body=b"{}", body_size=2,
                                attempts=[], reason="attempts_exhausted"))
    finally:
        file.close()
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute(f"UPDATE dead_letters SET {column} = ? WHERE id = 1", (value,))
    commands = [("show", "1")] + ([("list",)] if column == "attempts" else [])
    for command in commands:
        code, out, err = await sluice_cli("dlq", *command, "--file", str(path))
        assert code == 1 and "Traceback" not in err, (command, out, err)
        assert (f"the dead letters in {path} are unavailable: a dead letter holds what "
                "Sluice cannot read (JSONDecodeError)") in err, (command, err)
    code, out, err = await sluice_cli("dlq", "show", "2", "--file", str(path))
    assert code == 0 and json.loads(out)["id"] == 2, err


async def test_a_letter_not_in_a_sound_file_is_still_no_dead_letter(tmp_path):
    path = tmp_path / "dlq.sqlite"
    file = DeadLetterFile(str(path))
    file.close()
    code, _, err = await sluice_cli("dlq", "show", "7", "--file", str(path))
    assert code == 1 and f"no dead letter 7 in {path}" in err and "damaged" not in err


async def test_serve_warns_at_start_of_a_damaged_file(upstream, start_sluice, tmp_path):
    path = tmp_path / "dlq.sqlite"
    damaged_file(path)
    sluice = await start_sluice({
        "dead_letter": {"path": str(path)},
        "routes": [route("openai", upstream.url, retry={"attempts": 1})]})
    await wait_until(lambda: f"dead-letter file {path} is damaged" in sluice.stderr(),
                     what="the warning of a damaged file")
    said = next(line for line in sluice.stderr().splitlines() if "is damaged" in line)
    assert "ERROR" in said and ".recover" in said


def test_show_writes_utf8_json_whatever_the_terminals_encoding(tmp_path):
    # A review: `dlq show` of a letter holding non-ASCII text failed with UnicodeEncodeError
    # on a stdout that is not UTF-8 (a Latin-1 locale, a cp1252 pipe).
    import os
    import subprocess
    import sys

    path = tmp_path / "dlq.sqlite"
    file = DeadLetterFile(str(path))
    try:
        file.add(DeadLetter(route="openai", tenant="acme", run=None, idempotency_key=None,
                            request_id="req-1", method="POST", path="/v1/x",
                            headers=[("X-Note", "中文 ☃")], redacted=[],
                            body="{\"q\": \"中文\"}".encode(), body_size=12,
                            attempts=[Attempt(1700000000.0, 503, None, 0.1)],
                            reason="attempts_exhausted"))
    finally:
        file.close()
    done = subprocess.run([sys.executable, "-m", "proxy", "dlq", "show", "1", "--file",
                           str(path)], capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONIOENCODING": "latin-1"})
    assert done.returncode == 0, done.stderr.decode()
    shown = json.loads(done.stdout.decode("utf-8"))
    assert ["X-Note", "中文 ☃"] in [list(pair) for pair in shown["headers"]]


# -- a damaged replay record -------------------------------------------------------------------
#
# A hostile trial wrote a `replays` row by hand (sqlite3): `dlq replay` ended in a traceback
# (TypeError comparing its status), `dlq show` too (bytes in the JSON), and an undecodable
# error failed `list` and `show` whole. Each replay below was sent and failed (HTTP 503), so a
# sound one needs no --again; damaged, it may have been anything: it counts as sent.

#: How the replay's row is damaged (an UPDATE's SET clause), and what the message says of it.
DAMAGED_REPLAY_ROWS = [
    ("status = 'two hundred'", "its status holds text, not a number"),
    ("status = x'c800'", "its status holds binary data, not a number"),
    ("error = CAST(x'ff' AS TEXT)", "its error holds text that is not UTF-8"),
    ("at = 'yesterday'", "its at holds text, not a number"),
    ("duration_s = x'00'", "its duration_s holds binary data, not a number"),
    ("at = 9e999", "its at is not a finite number"),
    ("status = -5", "its status is no HTTP status"),
    ("status = NULL", "it holds neither a status nor an error"),
]


def replay_config(tmp_path: Path, dead_letters: dict, upstream_url: str) -> str:
    """A config whose route ``openai`` goes to ``upstream_url``, the letters where
    ``dead_letters`` (top-level blocks) say; its path."""
    import yaml

    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump({**dead_letters, "routes": [route("openai", upstream_url)]}))
    return str(path)


def one_failed_replay_each(path: Path) -> None:
    """Letters 1 and 2 in a new file at ``path``, each replayed once and answered 503."""
    file = DeadLetterFile(str(path))
    try:
        for n in (1, 2):
            file.add(DeadLetter(route="openai", tenant="acme", run=None, idempotency_key=None,
                                request_id=f"req-{n}", method="POST", path="/v1/x",
                                headers=[], redacted=[], body=b"{}", body_size=2,
                                attempts=[], reason="attempts_exhausted"))
            file.add_replay(n, 503, None, 0.1)
    finally:
        file.close()


async def says_unreadable_replay_of_letter_1(store: list[str], what: str, upstream) -> None:
    """``list``, ``show`` and ``replay`` of letter 1 (its one replay's record damaged, ``what``
    naming how) through the real CLI on ``store`` (``--file`` and ``--config``, or
    ``--config``): each says so, exit 1, no traceback; letter 2 is shown as before; a replay
    is sent only with --again."""
    code, out, err = await sluice_cli("dlq", "list", *store)
    assert code == 1 and "Traceback" not in err, (out, err)
    assert (f"dead letter 1: the record of its last replay cannot be read ({what}"
            in err), err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "unreadable" in rows["1"] and " 503 " in rows["2"], out

    code, out, err = await sluice_cli("dlq", "show", "1", *store)
    assert code == 1 and "Traceback" not in err, err
    assert f"dead letter 1: the record of its replay #1 cannot be read ({what}" in err, err
    shown = json.loads(out)
    assert shown["id"] == 1 and len(shown["replays"]) == 1
    assert shown["replays"][0]["unreadable"].startswith(what)
    code, out, err = await sluice_cli("dlq", "show", "2", *store)
    assert code == 0 and json.loads(out)["replays"][0]["status"] == 503, err

    code, out, err = await sluice_cli("dlq", "replay", "1", *store)
    assert code == 1 and "Traceback" not in err, (out, err)
    assert (f"dead letter 1: the record of one of its replays cannot be read ({what}" in err
            and "may have reached the upstream; pass --again" in err), err
    assert upstream.requests == []
    code, out, err = await sluice_cli("dlq", "replay", "1", *store, "--again")
    assert code == 0 and "HTTP 200" in out, (out, err)
    assert len(upstream.requests) == 1


@pytest.mark.parametrize(("damage", "what"), DAMAGED_REPLAY_ROWS)
async def test_a_replay_row_sluice_cannot_read_is_said_so_and_counts_as_sent(
        tmp_path, upstream, damage, what):
    path = tmp_path / "dlq.sqlite"
    one_failed_replay_each(path)
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute(f"UPDATE replays SET {damage} WHERE dead_letter_id = 1")
    config = replay_config(tmp_path, {"dead_letter": {"path": str(path)}}, upstream.url)
    await says_unreadable_replay_of_letter_1(["--file", str(path), "--config", config], what,
                                             upstream)


#: A replay's JSON in the Redis list, damaged, and what the message says of it.
DAMAGED_REPLAY_ENTRIES = [
    (b"not json", "it is not JSON"),
    (b"\xff", "it is not JSON"),
    (b"[1]", "it holds a list, not an object"),
    (b'{"at": 1.0, "status": 200, "duration_s": 0.1}', "it has no error"),
    # Read by the old claim script as a failed replay, and sent again without --again:
    (b'{"at": 1.0, "status": "200", "error": null, "duration_s": 0.1}',
     "its status holds text, not a number"),
    (b'{"at": 1.0, "status": null, "error": 5, "duration_s": 0.1}',
     "its error holds a number, not text"),
    (b'{"at": 1.0, "status": 503.5, "error": null, "duration_s": 0.1}',
     "its status is no HTTP status"),
]


@pytest.mark.parametrize(("entry", "what"), DAMAGED_REPLAY_ENTRIES)
async def test_a_redis_replay_entry_sluice_cannot_read_is_said_so_and_counts_as_sent(
        tmp_path, upstream, entry, what):
    from policies.state import redis_backends
    from tests.redis_servers import delete_prefix, new_prefix, require_redis

    url = require_redis()
    prefix = new_prefix()
    try:
        state = await redis_backends(url, prefix, 2.0)
        try:
            for n in (1, 2):
                added = await state.dead_letters.add(DeadLetter(
                    route="openai", tenant="acme", run=None, idempotency_key=None,
                    request_id=f"req-{n}", method="POST", path="/v1/x", headers=[],
                    redacted=[], body=b"{}", body_size=2, attempts=[],
                    reason="attempts_exhausted"))
                assert added.id == n
                assert await state.dead_letters.add_replay(n, 503, None, 0.1)
            redis = state.redis
            assert redis is not None
            replays = f"{redis.key('dlq', 'replays')}:1"

            async def spoil(client: object) -> None:
                await client.lset(replays, 0, entry)  # type: ignore[attr-defined]

            await redis.run(spoil)
        finally:
            await state.close()
        config = replay_config(tmp_path, {"state": {"backend": "redis", "redis_url": url,
                                                    "key_prefix": prefix}}, upstream.url)
        await says_unreadable_replay_of_letter_1(["--config", config], what, upstream)
    finally:
        delete_prefix(url, prefix)


@pytest.mark.parametrize(("line", "status"), [(b"000", 0), (b"099", 99)])
async def test_a_status_below_100_that_replay_recorded_is_read_as_recorded(
        tmp_path, line, status):
    # A review: an upstream answering "HTTP/1.1 000" (aiohttp reads 0; "099", 99) had the
    # replay recorded as sent, then list and show called that record unreadable, exit 1.
    # Below 400 with no error, it counts as answered, as it did before records were checked.
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 " + line + b" Odd\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        path = tmp_path / "dlq.sqlite"
        one_failed_replay_each(path)
        config = replay_config(tmp_path, {"dead_letter": {"path": str(path)}},
                               f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        code, out, err = await sluice_cli("dlq", "replay", "1", "--config", config)
        assert code == 0 and f"HTTP {status}," in out, (out, err)
        code, out, err = await sluice_cli("dlq", "list", "--config", config)
        assert code == 0 and err == "", err
        assert f" {status} " in {line.split()[0]: line for line in out.splitlines()[1:]}["1"]
        code, out, err = await sluice_cli("dlq", "show", "1", "--config", config)
        assert code == 0 and err == "", err
        assert [r["status"] for r in json.loads(out)["replays"]] == [503, status]
        code, out, err = await sluice_cli("dlq", "replay", "1", "--config", config)
        assert code == 1 and "--again" in err, (out, err)
    finally:
        server.close()
        await server.wait_closed()
