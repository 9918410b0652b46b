"""``sluice dlq ... --file PATH``: it reads (and deletes from, and records replays in) a
dead-letter file only, never making one of another file. The real CLI in subprocesses, on
files in the test's own directory."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.test_dlq_messages import letter_file
from tests.test_dlq_replay import outcome


async def cli_in(cwd: Path, *args: str) -> tuple[int, str, str]:
    """The CLI run from ``cwd`` (so ``config/sluice.yaml`` is looked for there): its exit
    status, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", *args, cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    return await outcome(proc)


def another_apps_database(path: Path) -> None:
    db = sqlite3.connect(path)
    try:
        db.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        db.execute("INSERT INTO users (name) VALUES ('ada')")
        db.commit()
    finally:
        db.close()


@pytest.mark.parametrize("kind", ["another-apps-database", "empty-file"])
async def test_a_file_that_is_no_dead_letter_file_is_refused_and_left_as_it_was(
        tmp_path, kind):
    """``--file`` on another application's SQLite database added the dead-letter tables to
    it and switched it to WAL mode for good; a zero-byte file became a 28 KB dead-letter
    file (a review). Every command now refuses it, exit 1, and changes nothing in it."""
    foreign = tmp_path / "app.db"
    if kind == "empty-file":
        foreign.touch()
    else:
        another_apps_database(foreign)
    before = foreign.read_bytes()
    os.utime(foreign, ns=(1_000_000_000, 1_000_000_000))  # a change would move it
    config, _ = letter_file(tmp_path, f"http://127.0.0.1:{free_port()}")
    for command in (["list"], ["show", "1"], ["delete", "1"], ["purge"], ["replay", "1"]):
        code, out, err = await cli_in(tmp_path, "dlq", *command, "--file", str(foreign),
                                      "--config", config)
        assert (code, out) == (1, ""), (command, out, err)
        assert err == (f"{foreign} is no Sluice dead-letter file (a SQLite database without "
                       "a dead_letters table): nothing was read or changed in it\n"), command
    assert foreign.read_bytes() == before
    assert foreign.stat().st_mtime_ns == 1_000_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db", "dlq.sqlite",
                                                          "sluice.yaml"]
    if kind == "another-apps-database":
        with sqlite3.connect(foreign) as db:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)
