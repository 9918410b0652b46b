"""What the command line and refusal messages print: no exponent in a wait, a listing that says
what it left out, and no traceback when the reader of a pipe goes away."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import orjson
import pytest
import yaml

from policies.config import MAX_DEAD_LETTERS
from policies.deadletter import Attempt, DeadLetter, DeadLetterFile
from policies.reasons import Reason, Rejected
from proxy.cli import MAX_LETTER_ID, MAX_LIST_LIMIT, main
from proxy.rejections import human_duration, rejection_body
from tests.conftest import REPO, route
from tests.redis_servers import delete_prefix, new_prefix, require_redis


@pytest.mark.parametrize("seconds, text", [
    (0.25, "0.25s"), (1.5, "1.5s"), (42.1, "43s"), (59.5, "1m"), (725, "12m 5s"),
    (3599.5, "1h"), (63500, "17h 39m"), (86400, "1d"), (90000, "1d 1h"), (10**9, "11574d 2h"),
])
def test_waits_read_as_people_write_them(seconds, text):
    assert human_duration(seconds) == text


def test_a_budget_refusal_says_when_without_an_exponent():
    """It said "retry after 6.35e+04s"."""
    rejected = Rejected(Reason.BUDGET_EXHAUSTED, 63500.0, "tokens-per-tenant-day")
    message = orjson.loads(rejection_body(rejected, "openai"))["error"]["message"]
    assert message.endswith("; retry after 17h 39m")
    assert "e+" not in message


@pytest.fixture
def dead_letters(tmp_path):
    path = tmp_path / "dlq.sqlite"
    store = DeadLetterFile(str(path))
    for n in range(3000):
        store.add(DeadLetter(route="up", tenant="t", run=None, idempotency_key=None,
                             request_id=f"r{n}", method="POST", path=f"/v1/x/{n}", headers=[],
                             redacted=[], body=b"", body_size=0,
                             attempts=[Attempt(0.0, 503, None, 0.1)], reason="attempts"))
    store.close()
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump({"dead_letter": {"path": str(path)},
                                      "routes": [route("up", "http://127.0.0.1:1")]}))
    return config


def test_dlq_list_says_how_many_it_left_out(dead_letters, capsys):
    assert main(["dlq", "list", "--config", str(dead_letters), "--limit", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4  # the header, two records, the note
    assert lines[1].split()[0] == "2999" and lines[2].split()[0] == "3000"
    assert lines[3] == ("(the newest 2 of 3000 records; 2998 older ones left out: "
                        "--limit 3000 lists them all)")
    assert main(["dlq", "list", "--config", str(dead_letters), "--limit", "3000"]) == 0
    assert "left out" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["dlq", "list", "--config", str(dead_letters), "--limit", "0"])


def test_dlq_list_says_one_older_one_in_the_singular(dead_letters, capsys):
    assert main(["dlq", "list", "--config", str(dead_letters), "--limit", "2999"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "(the newest 2999 of 3000 records; 1 older one left out: --limit 3000 lists them all)")


def test_dlq_list_into_head_prints_no_traceback(dead_letters):
    result = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m proxy dlq list --limit 3000 --config "
         f"{dead_letters} | head -1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.stdout.split()[0] == "ID"
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


@pytest.mark.parametrize("command", [["list"], ["show", "1"], ["replay", "1"], ["purge"]])
def test_a_dead_letter_file_that_is_not_a_database_is_said_without_a_traceback(
        dead_letters, command, capsys):
    # Seen in a hostile trial: garbage bytes in dead_letter.path (or a file locked past its
    # busy timeout) made every `sluice dlq` command end in a Python traceback.
    path = dead_letters.parent / "dlq.sqlite"
    for name in ("dlq.sqlite-wal", "dlq.sqlite-shm"):
        (dead_letters.parent / name).unlink(missing_ok=True)
    path.write_bytes(bytes(range(256)) * 16)
    assert main(["dlq", *command, "--config", str(dead_letters)]) == 1
    err = capsys.readouterr().err
    assert err == (f"{path} is no Sluice dead-letter file (it is no SQLite database); "
                   "refused, with nothing written to it\n")
    assert path.read_bytes() == bytes(range(256)) * 16


def test_dlq_list_columns_line_up_whatever_a_cell_holds(tmp_path, capsys):
    # Seen: fixed widths, so a replay that failed with ClientConnectorError (20 characters in
    # an 8-wide column) pushed that row's REQUEST out of line.
    path = tmp_path / "dlq.sqlite"
    store = DeadLetterFile(str(path))
    for n, tenant in enumerate(["t", "a-tenant-with-a-long-name"]):
        store.add(DeadLetter(route="up", tenant=tenant, run=None, idempotency_key=None,
                             request_id=f"r{n}", method="POST", path=f"/v1/x/{n}", headers=[],
                             redacted=[], body=b"", body_size=0,
                             attempts=[Attempt(0.0, 503, None, 0.1)], reason="attempts"))
    store.add_replay(1, None, "ClientConnectorError", 0.01)
    store.close()
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump({"dead_letter": {"path": str(path)},
                                      "routes": [route("up", "http://127.0.0.1:1")]}))
    assert main(["dlq", "list", "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "ClientConnectorError" in "".join(lines)
    for column in ("TENANT", "REPLAY", "REQUEST"):  # every row's cell starts under its title
        at = lines[0].index(column)
        assert all(line[at - 2:at] == "  " and line[at] != " " for line in lines[1:]), column


@pytest.fixture(params=["memory", "redis"])
def either_store(request: pytest.FixtureRequest, tmp_path):
    """A config whose dead letters are in a SQLite file (memory backend) or a Redis Stream."""
    path = tmp_path / "dlq.sqlite"
    DeadLetterFile(str(path)).close()
    block: dict[str, object] = {"dead_letter": {"path": str(path)}}
    url, prefix = None, new_prefix()
    if request.param == "redis":
        url = require_redis()
        block = {"state": {"backend": "redis", "redis_url": url, "key_prefix": prefix,
                           "timeout": "2s"}}
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump({**block, "routes": [route("up", "http://127.0.0.1:1")]}))
    try:
        yield str(config)
    finally:
        if url is not None:
            delete_prefix(url, prefix)


@pytest.mark.parametrize("command", [
    ["list", "--limit", "999999999999999999999"], ["list", "--limit", str(MAX_LIST_LIMIT + 1)],
    ["list", "--limit", "0"], ["show", "999999999999999999999"], ["show", "0"],
    ["replay", str(MAX_LETTER_ID + 1)],
])
def test_dlq_numbers_out_of_range_are_usage_errors_not_tracebacks(either_store, command,
                                                                  capsys):
    """``--limit 999999999999999999999`` raised OverflowError (SQLite) or a Redis error."""
    with pytest.raises(SystemExit) as exited:
        main(["dlq", *command, "--config", either_store])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "is not a whole number from 1 to" in err and "Traceback" not in err


def test_dlq_numbers_at_their_bounds_are_answered(either_store, capsys):
    assert MAX_LIST_LIMIT == MAX_DEAD_LETTERS  # no store keeps more than --limit can list
    assert main(["dlq", "list", "--limit", str(MAX_LIST_LIMIT), "--config", either_store]) == 0
    assert capsys.readouterr().out.split()[0] == "ID"
    assert main(["dlq", "show", str(MAX_LETTER_ID), "--config", either_store]) == 1
    assert f"no dead letter {MAX_LETTER_ID} in" in capsys.readouterr().err


def test_version_is_the_installed_distributions(capsys):
    """``sluice --version`` was a usage error ("the following arguments are required")."""
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"sluice {importlib.metadata.version('sluice')}\n"


@pytest.mark.parametrize("argv, usage, choices", [
    ([], "usage: sluice [-h] [--version]", "{serve,check-config,timeline,dlq,runs,demo}"),
    (["dlq"], "usage: sluice dlq [-h]", "{list,show,replay,delete,purge}"),
    (["runs"], "usage: sluice runs [-h]", "{list,show,cancel}"),
])
def test_a_missing_command_is_named_by_its_choices(argv, usage, choices, capsys):
    """The error named argparse's internal dests ("required: runs_command"), words a user
    cannot type; it names the commands that would do."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(usage) and choices in lines[0]
    assert lines[-1].endswith(f": error: the following arguments are required: {choices}")
