"""``sluice dlq ... --file PATH``: it reads (and deletes from, and records replays in) a
dead-letter file only, never making one of another file, and it needs a config for
``replay`` only. The real CLI in subprocesses, on files in the test's own directory."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port, wait_until
from tests.sluice_child import ForkedCli, sluice_cli
from tests.test_dlq_messages import letter_file, stalled_upstream


async def cli_in(cwd: Path, *args: str) -> tuple[int, str, str]:
    """The CLI run from ``cwd`` (so ``config/sluice.yaml`` is looked for there): its exit
    status, stdout and stderr."""
    return await sluice_cli(*args, cwd=str(cwd))


def another_apps_database(path: Path, table: str = "users") -> None:
    db = sqlite3.connect(path)
    try:
        db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, name TEXT)")
        db.execute(f"INSERT INTO {table} (name) VALUES ('ada')")
        db.commit()
    finally:
        db.close()


@pytest.mark.parametrize("kind", ["another-apps-database", "empty-file", "no-database",
                                  "another-apps-dead-letters"])
async def test_a_file_that_is_no_dead_letter_file_is_refused_and_left_as_it_was(
        tmp_path, kind):
    """``--file`` on another application's SQLite database added the dead-letter tables to
    it and switched it to WAL mode for good; a zero-byte file became a 28 KB dead-letter
    file (a review). Every command now refuses it, exit 1, and changes nothing in it."""
    foreign = tmp_path / "app.db"
    if kind == "empty-file":
        foreign.touch()
    elif kind == "no-database":  # it printed SQLite's own "file is not a database"
        foreign.write_text("notes, not a database\n" * 200)
    elif kind == "another-apps-dead-letters":  # switched to WAL, then "no such column"
        another_apps_database(foreign, "dead_letters")
    else:
        another_apps_database(foreign)
    before = foreign.read_bytes()
    os.utime(foreign, ns=(1_000_000_000, 1_000_000_000))  # a change would move it
    config, _ = letter_file(tmp_path, f"http://127.0.0.1:{free_port()}")
    for command in (["list"], ["show", "1"], ["delete", "1"], ["purge"], ["replay", "1"]):
        code, out, err = await cli_in(tmp_path, "dlq", *command, "--file", str(foreign),
                                      "--config", config)
        assert (code, out) == (1, ""), (command, out, err)
        why = {"no-database": "it is no SQLite database",
               "another-apps-dead-letters": "its dead_letters table has no attempts, "
               "body, body_size, created_at, headers, idempotency_key, method, path, "
               "reason, redacted, request_id, route, run, tenant column",
               }.get(kind, "it holds no dead_letters table")
        assert err == (f"{foreign} is no Sluice dead-letter file ({why}); refused, with "
                       "nothing written to it\n"), command
    assert foreign.read_bytes() == before
    assert foreign.stat().st_mtime_ns == 1_000_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db", "dlq.sqlite",
                                                          "sluice.yaml"]
    if kind.startswith("another-apps"):
        with sqlite3.connect(foreign) as db:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)


async def test_with_file_only_replay_needs_a_config(tmp_path):
    """``--file`` names the store, so ``list``, ``show``, ``delete`` and ``purge`` read no
    config: they ended with exit 2 where no ``config/sluice.yaml`` was found. ``replay``
    needs the letter's route, so it still reads one."""
    _, letter = letter_file(tmp_path, f"http://127.0.0.1:{free_port()}")
    letters = str(tmp_path / "dlq.sqlite")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()  # no config/sluice.yaml here
    code, out, err = await cli_in(elsewhere, "dlq", "list", "--file", letters)
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == [letter], err
    code, out, err = await cli_in(elsewhere, "dlq", "show", letter, "--file", letters)
    assert code == 0 and json.loads(out)["route"] == "tools", err
    code, out, err = await cli_in(elsewhere, "dlq", "replay", letter, "--file", letters)
    assert (code, out) == (2, "") and err == (
        "sluice dlq replay --file reads the letter's route from --config (default "
        "config/sluice.yaml, not found here): pass --config PATH\n"), err
    code, out, err = await cli_in(elsewhere, "dlq", "delete", letter, "--file", letters)
    assert (code, err) == (0, "") and out == f"deleted dead letter {letter} from {letters}\n"
    code, out, err = await cli_in(elsewhere, "dlq", "purge", "--file", letters)
    assert (code, err) == (0, "") and out == f"purged 0 record(s) from {letters}\n"
    # A config given is still read, and a broken one said (as for every command).
    broken = elsewhere / "broken.yaml"
    broken.write_text("routes: [\n")
    code, _, err = await cli_in(elsewhere, "dlq", "list", "--file", letters,
                                "--config", str(broken))
    assert code == 2 and "broken.yaml" in err, err


# -- a read-only file written by an older release ------------------------------------------------

#: The schema of the release before the ``(tenant, id)`` index (d6daa20^1), exactly.
SCHEMA_BEFORE_TENANT_INDEX = """
CREATE TABLE IF NOT EXISTS dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,
    route TEXT NOT NULL,
    tenant TEXT NOT NULL,
    run TEXT,
    idempotency_key TEXT,
    request_id TEXT NOT NULL,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    headers TEXT NOT NULL,
    redacted TEXT NOT NULL,
    body BLOB NOT NULL,
    body_size INTEGER NOT NULL,
    attempts TEXT NOT NULL,
    reason TEXT NOT NULL,
    key_origin TEXT
);
CREATE INDEX IF NOT EXISTS dead_letters_route ON dead_letters (route);
CREATE TABLE IF NOT EXISTS replays (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    dead_letter_id INTEGER NOT NULL,
    at REAL NOT NULL,
    status INTEGER,
    error TEXT,
    duration_s REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS replays_dead_letter ON replays (dead_letter_id);
CREATE TABLE IF NOT EXISTS replay_claims (
    dead_letter_id INTEGER PRIMARY KEY,
    token TEXT NOT NULL,
    until REAL NOT NULL
);
"""
#: ... and of the release before ``key_origin`` (3f6c61c^1).
SCHEMA_BEFORE_KEY_ORIGIN = SCHEMA_BEFORE_TENANT_INDEX.replace(",\n    key_origin TEXT", "")


def older_file(path: Path, schema: str) -> None:
    """Three letters in a file as an older release wrote it (WAL mode, its schema)."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(schema)
        db.executemany(
            "INSERT INTO dead_letters (created_at, route, tenant, request_id, method, path,"
            " headers, redacted, body, body_size, attempts, reason) VALUES (1.0, 'openai',"
            " 'acme', ?, 'POST', '/v1', '[]', '[]', x'7b7d', 2, '[]', 'attempts')",
            [(f"req-{n}",) for n in range(3)])
        db.commit()


def cli_bound_by_file_modes(*args: str) -> subprocess.CompletedProcess[str]:
    """``sluice ARGS`` in a process that file modes bind: root writes a file of mode 0444,
    so under root without the capabilities that override them (``setpriv``)."""
    bound = (["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
             if os.geteuid() == 0 else [])
    return subprocess.run([*bound, sys.executable, "-m", "proxy", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("schema", [SCHEMA_BEFORE_TENANT_INDEX, SCHEMA_BEFORE_KEY_ORIGIN],
                         ids=["before-tenant-index", "before-key-origin"])
def test_list_and_show_read_an_older_read_only_file_and_change_no_schema(tmp_path, schema):
    """``list`` and ``show`` only read: on a read-only file (a backup, a read-only volume)
    from before the ``(tenant, id)`` index, ``list`` failed with ``attempt to write a
    readonly database``, as opening the file created the index (a review). Both work, and
    a file they may write keeps its schema too."""
    path = tmp_path / "dlq.sqlite"  # in a directory it may write
    older_file(path, schema)
    path.chmod(0o444)
    listed = cli_bound_by_file_modes("dlq", "list", "--file", str(path))
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()[1:]] == ["1", "2", "3"]
    shown = cli_bound_by_file_modes("dlq", "show", "2", "--file", str(path))
    assert shown.returncode == 0, shown.stderr
    letter = json.loads(shown.stdout)
    assert (letter["request_id"], letter["key_origin"]) == ("req-1", None)
    path.chmod(0o644)
    for command in (["list"], ["show", "1"]):
        code = subprocess.run([sys.executable, "-m", "proxy", "dlq", *command, "--file",
                               str(path)], capture_output=True, timeout=60).returncode
        assert code == 0, command
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        assert sorted(row[0] for row in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")) == [
            "dead_letters_route", "replays_dead_letter"]
        columns = {row[1] for row in db.execute("PRAGMA table_info(dead_letters)")}
        assert ("key_origin" in columns) == ("key_origin" in schema)


def held(letters: str) -> bool:
    """Whether a replay holds a letter of the file now."""
    with contextlib.closing(sqlite3.connect(letters)) as db:
        return db.execute("SELECT COUNT(*) FROM replay_claims").fetchone()[0] > 0


async def test_a_replay_refused_as_busy_names_the_file_it_read(tmp_path):
    """A replay refused because another holds the letter points at ``dlq show`` for the
    other's result: with ``--file`` it named ``--config``, whose store is another one."""
    async with stalled_upstream() as upstream:
        config, letter = letter_file(tmp_path, upstream)
        letters = str(tmp_path / "dlq.sqlite")
        first = ForkedCli(["dlq", "replay", letter, "--file", letters, "--config", config],
                          str(tmp_path))
        try:
            await wait_until(lambda: held(letters), timeout=30, what="the first replay's hold")
            code, _, err = await cli_in(tmp_path, "dlq", "replay", letter, "--file", letters,
                                        "--config", config)
        finally:
            first.kill()
            await first.wait()
    assert code == 1 and "is being replayed by another command" in err, err
    assert f"see `sluice dlq show {letter} --file {letters}` for its result" in err, err
