"""``sluice dlq``: inspect and replay dead-lettered work (SPEC, "Command line").

* ``list``: one line per record (the newest ``--limit``, 100 by default, oldest first): id,
  time (UTC), route, tenant, method and path, attempts, why retries ended, and the last
  replay's status; a last line says how many older records were left out.
* ``show ID``: the whole record as JSON, with its attempts and replays, and where its
  ``idempotency_key`` came from (``key_origin``: ``caller``, or ``derived`` or ``fresh``
  for a key Sluice made; null in letters written before it was recorded). The credentials
  some APIs take in a JSON body are masked (``"<redacted>"``) at their documented paths,
  listed in ``body_masked`` (:func:`proxy.redact.body_credentials_masked`); a body that
  parsers read differently (a key twice, ``NaN``, ``1e999``) and that names one of those
  fields is withheld whole (``body_masked``: ``["body"]``); ``--unmask`` prints the body as
  stored. The letter keeps them: a replay sends them.
* ``replay ID``: send the recorded request once, straight to its route's upstream as the
  config names it now, with the recorded method, path, headers, body and idempotency key (the
  one the call was handled under: the caller's, or one Sluice derived from ``derive_from``
  headers or an MCP call's tool and arguments, used alike below); the result is stored with
  the record. A record an earlier replay got an answer below 400 for (on an ``mcp`` route,
  one whose tool or JSON-RPC call did not fail: read as the live path reads it for tool
  breakers) is sent again only with ``--again``; with the Redis backend, so is one whose
  ``Idempotency-Key`` got an answer below 400 since (the caller's own retry), as the route's
  shared idempotency records tell when its ``idempotency`` block stores answers (``mode:
  dedup``; the memory backend's are in the server's memory, out of the command's reach).
  The block is the one a request of the letter's operation is under now: the route's, or
  its tool's, endpoint's or model's own (``tools:``, ...), which replaces it, ``mode: off``
  included (:func:`policies.operations.idempotency_of`). Its ``timeouts`` too replace the
  route's for the send, and for how long the replay holds its letter and key; and its
  ``retry`` (or else the route's) bounds the wait for the response headers as it bounded
  each attempt of the call: ``per_try_timeout``, or ``deadline`` when shorter.
  There it also holds the key as the route's requests do while it sends (refused, nothing
  sent, while a request with the key is in flight) and stores its answer for the key, so
  the caller's later retry gets it replayed rather than doing the work again. A
  record another replay is sending now is not sent at all: each replay holds its record until
  its result is stored, so two commands started at once never both send it. Credentials were
  removed when recording, so give them again with ``-H 'Authorization: Bearer ...'`` or
  ``--header-from-env NAME=ENVVAR`` (the latter keeps the secret out of the process list);
  ``--output FILE`` keeps the upstream's answer (a path it could not be written to is refused
  before anything is sent). Exit status 0 when the upstream answered below 400 (and an MCP
  call's tool or JSON-RPC call did not fail), 1 otherwise;
  130 after Ctrl-C and 143 after SIGTERM, the replay then recorded as interrupted and its
  letter free at once for the next; once its request may have been written to the upstream
  (a connection to it was made), as ``interrupted_after_send``, which, like an answer, the
  next replay sends again only with ``--again``: the work may be done.
* ``delete ID``: delete one record, with its replays (exit status 1 when there is none).
* ``purge``: delete every record.

Each reads where the servers of ``--config`` write: with ``state.backend: redis``, the Redis
Stream every replica shares (``state.redis_url`` and ``state.key_prefix``; so any replica's
letters are listed and replayed from any machine with that config); with ``memory``, the
dead-letter file that ``dead_letter.path`` names (the server may be running meanwhile: the
file is in WAL mode). Exit status 1 when Redis does not answer. ``--file PATH`` reads the
dead-letter file at ``PATH`` instead, whatever the backend (the letters written with
``memory`` before a move to ``redis``, which ``list`` then names on stderr:
:func:`file_left_behind`); a replay from it checks and holds no shared idempotency record.
A file that is no dead-letter file (another application's SQLite database, an empty file)
is refused, exit status 1, and left as it was: the commands never make one. A damaged file
(a read fails "database disk image is malformed", or a letter asked for is not found and
``PRAGMA quick_check`` finds damage) is said to be damaged, exit status 1, with how to try
to recover it (:func:`policies.deadletter.recover_hint`), never "no dead letter N". A replay
whose record Sluice cannot read (a ``replays`` row or Redis entry another program wrote: a
status of text, text that is not UTF-8...) is said on stderr with its letter's id and what is
wrong, exit status 1 (``list`` prints its table, ``REPLAY`` ``unreadable``; ``show`` the
letter, that replay ``{"unreadable": WHAT}``); it counts as a replay that may have reached the
upstream, so ``replay`` sends that letter again only with ``--again``. ``list`` reads each
letter's last replay only: an older one that cannot be read is named by ``show``, and still
makes ``replay`` need ``--again``. With ``--file``,
only ``replay`` (which needs the letter's route) reads a config when ``--config`` is not
given; the others read none.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import sqlite3
import sys
import time
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import orjson
from multidict import CIMultiDict

from policies import mcp
from policies.config import (
    HEADER_NAME,
    Config,
    IdempotencyConfig,
    RetryConfig,
    RouteConfig,
    TimeoutsConfig,
)
from policies.deadletter import (
    ANSWERED,
    BUSY,
    CLAIMED,
    INTERRUPTED_AFTER_SEND,
    MISSING,
    UNREADABLE,
    DamagedFile,
    DeadLetter,
    DeadLetterFile,
    NotADeadLetterFile,
    ReplayClaim,
    UnreadableLetter,
    check_dead_letter_file,
    corrupt,
    damage,
    letters_in,
)
from policies.idempotency import (
    DERIVED_KEY,
    FRESH_KEY,
    Capture,
    key_origin,
    parse_key,
    shared_answer,
    shared_record_key,
)
from policies.idempotency_store import DONE, SEEN, TOO_LARGE
from policies.operations import OperationIndex, idempotency_of
from policies.state import DeadLetterStore, StateUnavailable, redact_url, redis_backends
from policies.state.idempotency import CLAIMED as KEY_CLAIMED
from policies.state.idempotency import IN_FLIGHT, IdempotencyRecords, new_owner
from policies.wording import counted
from proxy.attempts import CONNECT_FIRST_S
from proxy.client import client_timeout, upstream_session
from proxy.forward import FORBIDDEN_IN_HEADERS, RESPONSE_DROP, send_failure, upstream_url
from proxy.redact import body_credentials_masked
from proxy.rejections import jsonrpc_id
from proxy.terminal import printable, printable_json

EXIT_FAILED = 1
#: Exit statuses after Ctrl-C and SIGTERM, as a shell reports a process those signals ended.
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM
#: Bound on each Redis call of the command, seconds: at least this, whatever
#: ``state.timeout`` (tuned for the request path) says, as a listing reads many entries.
CLI_TIMEOUT_S = 5.0
#: How much longer than its timeouts (its operation's, or its route's) a replay holds its
#: letter and its key, seconds.
REPLAY_HOLD_MARGIN_S = 10.0
#: Commands that only read: they open the file read-only, so they work on a file they may
#: not write (a backup, a read-only volume) and change no schema or letter of one from an
#: older release (a ``-wal`` file a killed writer left is checkpointed into it at close).
READ_ONLY_COMMANDS = frozenset({"list", "show"})


def run(config: Config | None, args: argparse.Namespace) -> int:
    """Run ``sluice dlq <command>``; returns the exit status (130 after Ctrl-C, 143 after
    SIGTERM: a replay under way is then recorded as interrupted and its letter freed; one
    whose request may have been sent needs ``--again`` next).
    ``config`` may be ``None`` only with ``--file`` and a command other than ``replay``
    (which needs the routes)."""
    try:
        return _run(config, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _Terminated:
        print("terminated", file=sys.stderr)
        return EXIT_TERMINATED


class _Terminated(Exception):
    """SIGTERM arrived (a supervisor, ``timeout``): the command was cancelled, cleanly."""


def _run(config: Config | None, args: argparse.Namespace) -> int:
    if args.file is not None:
        path = args.file
    else:
        assert config is not None  # sluice.cli loads it unless --file is given
        if config.state.backend == "redis":
            return asyncio.run(_terminable(_shared(config, args)))
        path = config.dead_letter.path
    if not Path(path).exists():
        if args.file is not None:  # named on the command line: a typo must not pass as empty
            print(f"--file {path}: no such file", file=sys.stderr)
            return EXIT_FAILED
        if args.dlq_command == "list":
            print(f"no dead letters ({path} does not exist)")
            return 0
        if args.dlq_command == "purge":  # not created: a typo'd path would be left behind
            print(f"purged 0 record(s) ({path} does not exist)")
            return 0
        print(f"no dead letter {args.id} ({path} does not exist)", file=sys.stderr)
        return EXIT_FAILED
    try:
        # Read first, changing nothing: opening it creates the tables, in any database.
        check_dead_letter_file(path)
    except NotADeadLetterFile as exc:
        print(f"{exc}; refused, with nothing written to it", file=sys.stderr)
        return EXIT_FAILED
    except sqlite3.Error as exc:  # locked past the timeout, a damaged schema page
        _say_unavailable(path, exc)
        return EXIT_FAILED
    try:
        file = DeadLetterFile(path, read_only=args.dlq_command in READ_ONLY_COMMANDS)
        try:
            return asyncio.run(_terminable(_command(config, _FileStore(file), path, args)))
        finally:
            file.close()
    except DamagedFile as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    except UnreadableLetter as exc:  # said as with the Redis backend
        print(f"the dead letters in {path} are unavailable: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except sqlite3.Error as exc:  # locked past busy_timeout, a full disk, a damaged page
        _say_unavailable(path, exc)
        return EXIT_FAILED


def _say_unavailable(path: str, exc: sqlite3.Error) -> None:
    """Say why the file at ``path`` could not be read: damaged (with how to recover it),
    or unavailable (locked past the timeout, a full disk)."""
    if corrupt(exc):
        print(DamagedFile(path, str(exc)), file=sys.stderr)
    else:
        print(f"the dead letters in {path} are unavailable: {exc}", file=sys.stderr)


async def _terminable(command: Coroutine[Any, Any, int]) -> int:
    """Run ``command`` so that SIGTERM cancels it as Ctrl-C does (its ``finally`` blocks run:
    a replay's result is stored and its letter freed) rather than ending the process where
    it stands, which left a letter held for the route's whole timeout.

    Raises:
        _Terminated: SIGTERM cancelled it.
    """
    task = asyncio.current_task()
    assert task is not None
    terminated = False

    def on_term() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, on_term)
    try:
        return await command
    except asyncio.CancelledError:
        if terminated:
            raise _Terminated from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def _shared(config: Config, args: argparse.Namespace) -> int:
    """The command on the Redis Stream every replica writes."""
    try:
        url = config.state.resolved_url()
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    where = f"{redact_url(url)} (prefix {config.state.key_prefix})"
    state = await redis_backends(url, config.state.key_prefix,
                                 max(config.state.timeout, CLI_TIMEOUT_S))
    try:
        status = await _command(config, state.dead_letters, where, args, state.idempotency)
        if args.dlq_command == "list":
            hint = file_left_behind(config, args.config)
            if hint is not None:
                print(f"NOTE: {hint}", file=sys.stderr)
        return status
    except StateUnavailable as exc:
        print(f"the dead letters in {where} are unavailable: {exc.cause}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        await state.close()


def file_left_behind(config: Config, config_path: str | None) -> str | None:
    """With ``state.backend: redis``, what to tell a user whose ``dead_letter.path`` still
    holds letters (written with ``memory``, most likely, before a move to Redis), which
    neither the server nor ``sluice dlq`` read there: the file, its count and the command
    that lists them (``--config config_path`` in it when given). ``None`` when the file is
    missing or holds none. Blocking (a count in the file); never raises."""
    path = config.dead_letter.path
    count = letters_in(path)
    if not count:
        return None
    command = f"sluice dlq list --file {shlex.quote(path)}"
    if config_path is not None:
        command += f" --config {shlex.quote(str(config_path))}"
    return (f"dead_letter.path {path} holds {counted(count, 'dead letter')} that "
            f"state.backend: redis does not show (written with state.backend: memory); "
            f"read them with `{command}`")


class _FileStore:
    """The SQLite file behind the store interface the commands use (it never suspends: the
    command does nothing else meanwhile)."""

    def __init__(self, file: DeadLetterFile) -> None:
        self._file = file

    def _found(self, found: bool) -> None:
        """A letter asked for is not there: in a damaged file it may be in a page that
        cannot be read (``dlq show 2`` said ``no dead letter 2`` of a letter that was).

        Raises:
            DamagedFile: ``PRAGMA quick_check`` finds the file damaged.
        """
        if not found and (problems := damage(self._file.path)) is not None:
            raise DamagedFile(self._file.path, problems)

    async def get(self, letter_id: int) -> DeadLetter | None:
        letter = self._file.get(letter_id)
        self._found(letter is not None)
        return letter

    async def list(self, limit: int = 100) -> list[dict[str, Any]]:
        return self._file.list(limit)

    async def claim_replay(self, letter_id: int, token: str, hold_s: float,
                           again: bool = False) -> ReplayClaim:
        claim = self._file.claim_replay(letter_id, token, hold_s, again)
        self._found(claim.state != MISSING)
        return claim

    async def add_replay(self, letter_id: int, status: int | None, error: str | None,
                         duration_s: float, token: str | None = None) -> bool:
        return self._file.add_replay(letter_id, status, error, duration_s, token)

    async def delete(self, letter_id: int) -> bool:
        deleted = self._file.delete(letter_id)
        self._found(deleted)
        return deleted

    async def purge(self) -> int:
        return self._file.purge()

    async def depth(self) -> dict[str, int]:
        return self._file.depth()


async def _command(config: Config | None, store: DeadLetterStore | _FileStore, where: str,
                   args: argparse.Namespace, records: IdempotencyRecords | None = None) -> int:
    if args.dlq_command == "list":
        return await _list(store, args.limit)
    if args.dlq_command == "purge":
        print(f"purged {await store.purge()} record(s) from {where}")
        return 0
    if args.dlq_command == "delete":
        if not await store.delete(args.id):
            print(f"no dead letter {args.id} in {where}", file=sys.stderr)
            return EXIT_FAILED
        print(f"deleted dead letter {args.id} from {where}")
        return 0
    letter = await store.get(args.id)
    if letter is None:
        print(f"no dead letter {args.id} in {where}", file=sys.stderr)
        return EXIT_FAILED
    if args.dlq_command == "show":
        # Header values, paths and tenants are the caller's: no control character raw.
        # UTF-8 bytes, whatever the terminal's or pipe's encoding (a review: a non-UTF-8
        # stdout failed on any non-ASCII letter), as JSON is.
        sys.stdout.flush()
        sys.stdout.buffer.write((printable_json(
            orjson.dumps(_shown(letter, args.unmask), option=orjson.OPT_INDENT_2).decode())
            + "\n").encode())
        sys.stdout.buffer.flush()
        return _say_unreadable_replays(letter)
    assert config is not None  # sluice.cli loads it for a replay
    return await _replay(config, store, letter, args, records)


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _shown(letter: DeadLetter, unmask: bool) -> dict[str, Any]:
    """What ``dlq show`` prints of ``letter``: its :meth:`DeadLetter.as_dict`, the
    credentials some APIs take in a JSON body masked unless ``unmask``
    (:func:`proxy.redact.body_credentials_masked`), and ``body_masked`` naming where (the
    letter keeps them: a replay sends them)."""
    shown = letter.as_dict()
    masked: list[str] = []
    if not unmask and "text" in shown["body"]:
        shown["body"]["text"], masked = body_credentials_masked(shown["body"]["text"])
    at = list(shown).index("body") + 1
    items = list(shown.items())
    return dict([*items[:at], ("body_masked", masked), *items[at:]])


def _unreadable_replay(letter_id: int | None, which: str, what: str, then: str) -> str:
    """What ``list``, ``show`` and ``replay`` say of a replay record Sluice cannot read
    (``which``: "its last replay"...; ``what``: what is wrong with it; ``then``: what the
    next replay needs), printable: such a replay counts as one that may have been sent."""
    return printable(f"dead letter {letter_id}: the record of {which} cannot be read "
                     f"({what}); that replay may have reached the upstream; {then}")


def _say_unreadable_replays(letter: DeadLetter) -> int:
    """Say on stderr which of ``letter``'s replays have a record Sluice cannot read, and
    what is wrong with each; the exit status of ``dlq show`` (1 when there is one)."""
    status = 0
    for number, replay in enumerate(letter.replays, 1):
        if UNREADABLE in replay:
            print(_unreadable_replay(letter.id, f"its replay #{number}", replay[UNREADABLE],
                                     "the next one needs --again"), file=sys.stderr)
            status = EXIT_FAILED
    return status


async def _list(store: DeadLetterStore | _FileStore, limit: int) -> int:
    """Print the table of the newest ``limit`` letters; 1 when the record of a listed
    letter's last replay cannot be read (said on stderr), else 0."""
    rows = await store.list(limit)
    total = sum((await store.depth()).values())
    table = [("ID", "CREATED (UTC)", "ROUTE", "TENANT", "ATTEMPTS", "REASON", "REPLAY",
              "REQUEST")]
    # Tenants and paths are the callers' (and a file may be written by anything): no
    # control character raw, nor one that would break the table's columns.
    table += [tuple(printable(cell) for cell in (
        str(r["id"]), _when(r["created_at"]), r["route"], r["tenant"], str(r["attempts"]),
        r["reason"], "-" if r["last_replay"] is None else str(r["last_replay"]),
        f"{r['method']} {r['path']}")) for r in rows]
    # Each column as wide as its longest cell (a replay's outcome can be an exception's name);
    # the numbers right-aligned, the last column left ragged.
    widths = [max(len(row[at]) for row in table) for at in range(len(table[0]) - 1)]
    for row in table:
        cells = [row[at].rjust(width) if at in (0, 4) else row[at].ljust(width)
                 for at, width in enumerate(widths)]
        print("  ".join([*cells, row[-1]]))
    if total > len(rows):
        print(f"(the newest {len(rows)} of {total} records; "
              f"{counted(total - len(rows), 'older one')} left out: --limit {total} lists them "
              "all)")
    status = 0
    for r in rows:
        if r["unreadable_replay"] is not None:
            print(_unreadable_replay(r["id"], "its last replay", r["unreadable_replay"],
                                     "the next one needs --again"), file=sys.stderr)
            status = EXIT_FAILED
    return status


async def _replay(config: Config, store: DeadLetterStore | _FileStore, letter: DeadLetter,
                  args: argparse.Namespace, records: IdempotencyRecords | None = None) -> int:
    route = next((r for r in config.routes if r.name == letter.route), None)
    if route is None:
        print(f"dead letter {letter.id}: route {letter.route!r} is not in the config",
              file=sys.stderr)
        return EXIT_FAILED
    if letter.truncated:
        print(f"dead letter {letter.id}: its body was cut at {len(letter.body)} of "
              f"{letter.body_size} bytes (dead_letter.max_body_bytes), so it cannot be replayed",
              file=sys.stderr)
        return EXIT_FAILED
    headers: CIMultiDict[str] = CIMultiDict(letter.headers)
    try:
        for at, item in enumerate(args.header, 1):
            name, sep, value = item.partition(":")
            if not sep or not HEADER_NAME.fullmatch(name.strip()):
                # Named by position, never quoted: ``Authorization Bearer sk-...`` (the colon
                # forgotten) is a secret whole.
                raise ValueError(f"--header #{at} is not 'NAME: VALUE' (a name of letters, "
                                 f"digits and !#$%&'*+-.^_`|~, then a colon)")
            headers[name.strip()] = _field_value(value.strip(), "--header")
        for item in args.header_from_env:
            name, sep, var = item.partition("=")
            if not sep or not HEADER_NAME.fullmatch(name.strip()):
                raise ValueError(f"--header-from-env {item!r} is not NAME=ENVVAR")
            if var not in os.environ:
                raise ValueError(f"--header-from-env {item!r}: no environment variable {var!r}")
            headers[name.strip()] = _field_value(os.environ[var], f"the variable {var}")
        if args.output:
            _check_writable(Path(args.output))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    block = _block(route, letter)
    keys = _keys(route, block)
    operation = route.operations()[1].get(block) if block is not None else None
    timeouts = route.timeouts_for(operation)
    limit = _headers_limit(operation.retry if operation is not None and operation.retry
                           else route.retry)
    if records is not None and not args.again:
        since = await _answered_since(records, keys, letter)
        if since is not None:
            print(f"dead letter {letter.id}: {_key_named(letter)} was answered HTTP {since} "
                  f"since it was written (the caller's own retry, most likely), so sending it "
                  f"again may do the work twice; pass --again to send it anyway",
                  file=sys.stderr)
            return EXIT_FAILED
    # Held until the result is stored (or, if this command is killed, for as long as the send
    # may take): the check for an earlier answer and the hold are one step in the store.
    token = os.urandom(16).hex()
    hold_s = timeouts.total + timeouts.connect + REPLAY_HOLD_MARGIN_S
    claim = await store.claim_replay(letter.id or 0, token, hold_s, args.again)
    if claim.state == ANSWERED:
        # Work is dead-lettered because it may not have happened; once a replay was answered,
        # sending it again may do it twice (with no Idempotency-Key nothing dedups it).
        done = claim.replay or {}
        if UNREADABLE in done:
            print(_unreadable_replay(letter.id, "one of its replays", done[UNREADABLE],
                                     "pass --again to send it once more"), file=sys.stderr)
            return EXIT_FAILED
        if done.get("error") == INTERRUPTED_AFTER_SEND:
            print(f"dead letter {letter.id} was replayed ({_when(done['at'])}) and that "
                  f"replay was interrupted after its request was sent, so the upstream may "
                  f"have done the work; pass --again to send it once more", file=sys.stderr)
            return EXIT_FAILED
        print(f"dead letter {letter.id} was already replayed ({_when(done['at'])}, HTTP "
              f"{done['status']}); pass --again to send it once more", file=sys.stderr)
        return EXIT_FAILED
    if claim.state == BUSY:
        store_named = (f"--file {shlex.quote(args.file)}" if args.file is not None
                       else f"--config {shlex.quote(str(args.config))}")
        show = f"sluice dlq show {letter.id} {store_named}"
        print(f"dead letter {letter.id} is being replayed by another command now (its hold "
              f"lapses in {claim.left_s:.0f}s if it never finishes); see `{show}` for its "
              "result", file=sys.stderr)
        return EXIT_FAILED
    if claim.state != CLAIMED:
        print(f"no dead letter {letter.id} (it was deleted or purged meanwhile)", file=sys.stderr)
        return EXIT_FAILED
    # The letter's key too, as a request of the route holds it: a caller's retry with it
    # waits for this replay's answer, and this replay does not run beside one in flight.
    key = None
    if records is not None:
        try:
            key = await _hold_key(records, keys, letter, hold_s)
        except BaseException as exc:  # nothing was sent: the letter is free at once
            failed = "interrupted" if isinstance(exc, asyncio.CancelledError) else \
                type(exc).__name__
            await _record(store, letter, None, failed, 0.0, token, hold_s)
            raise
    if key is not None and key.busy:
        await _record(store, letter, None, "key_in_flight", 0.0, token, hold_s)
        print(f"dead letter {letter.id}: a request with {_key_named(letter)} is in flight now "
              f"(the caller's own retry, most likely), so sending it too may do the work "
              f"twice; it was not sent: see that request's answer, or replay once it is over",
              file=sys.stderr)
        return EXIT_FAILED
    # Said once it is sure to be sent: before a refusal (answered already, held by another
    # replay), it warned of a send that never happened (a new user's trial).
    _warn_removed(letter, headers)
    started = time.monotonic()
    status: int | None = None
    error: str | None = "interrupted"  # what is stored if the send never returns
    answer = b""
    reason, answer_headers = "", CIMultiDict[str]()
    failure = None
    connected = _Connected()
    try:
        status, error, answer, reason, answer_headers = await _send(route, timeouts, limit,
                                                                    letter, headers, connected)
        failure = _call_failure(route.protocol, letter.body, status, answer, answer_headers)
        if failure is not None:  # stored with its status: not answered, like a 4xx or 5xx
            error = failure[0]
    finally:
        if error == "interrupted" and connected.yes:
            # Its request may have reached the upstream, and the work be done: freeing the
            # letter let the next replay send it a second time without --again.
            error = INTERRUPTED_AFTER_SEND
            print(f"dead letter {letter.id}: interrupted after its request was sent, so the "
                  f"upstream may have done the work; the next replay needs --again",
                  file=sys.stderr)
        duration = time.monotonic() - started
        await _record(store, letter, status, error, duration, token, hold_s)
        await _free_key(key, route.protocol, status, reason, answer_headers, answer,
                        letter.body)
    if args.output and status is not None:
        try:
            await asyncio.to_thread(Path(args.output).write_bytes, answer)
        except OSError as exc:  # checked before sending; the path changed meanwhile
            print(f"the answer could not be written to {args.output}: {exc.strerror or exc}",
                  file=sys.stderr)
    result = f"HTTP {status}, {counted(len(answer), 'byte')}" if status is not None else \
        f"failed: {error} ({reason})"
    if failure is not None:
        result += f", {failure[1]}"
    # The upstream as the admin views show it: its user info may hold a password; the path
    # and query are the caller's, so no control character raw.
    print(printable(f"replayed dead letter {letter.id} to "
                    f"{redact_url(route.upstream + letter.path)}: {result} in {duration:.3f}s"))
    return 0 if status is not None and status < 400 and error is None else EXIT_FAILED


def _warn_removed(letter: DeadLetter, headers: CIMultiDict[str]) -> None:
    """Say what the replay is sent without: the credentials removed when the letter was
    written (by name only) that ``--header``/``--header-from-env`` did not give again, and
    its query fields removed so (no option gives those back). A new user's replay printed
    only its status, sent without ten such fields."""
    query = [name for name in letter.redacted if name.startswith("?")]
    missing = [name for name in letter.redacted
               if not name.startswith("?") and name not in headers]
    if missing:
        print(printable(f"WARNING: dead letter {letter.id} is replayed without "
                        f"{', '.join(missing)}, removed as credentials when it was written; "
                        "give them with --header or --header-from-env"), file=sys.stderr)
    if query:
        print(printable(f"WARNING: dead letter {letter.id} is replayed without its query "
                        f"field(s) {', '.join(query)}, removed as credentials when it was "
                        "written"), file=sys.stderr)


def _call_failure(protocol: str, request_body: bytes, status: int | None, answer: bytes,
                  headers: CIMultiDict[str]) -> tuple[str, str] | None:
    """Whether an MCP call's 2xx answer (JSON or SSE) says the call failed, read as the live
    path reads it for tool breakers (:func:`policies.mcp.answer_outcome`): ``(error kind
    stored with the replay, what the message adds)``, or ``None`` (not an MCP call, no 2xx,
    or the call succeeded). Kinds: ``tool_failed`` (a result with ``isError: true``),
    ``jsonrpc_error`` (an error response) and ``no_response`` (none to the call in it)."""
    request_id = jsonrpc_id(protocol, request_body)
    if request_id is None or status is None or not 200 <= status < 300:
        return None  # a notification has no response to read
    found = mcp.answer_outcome(answer, headers.get("Content-Type"), request_id)
    if found is None:
        return "no_response", "but its answer holds no JSON-RPC response to the call"
    if found.is_error_result:
        return "tool_failed", "but the tool failed (its result has isError: true)"
    # Any error, not only a breaker's tool failures (Outcome.tool_failure leaves out invalid
    # params and cancellation, which say nothing of the tool's health): the work was not done.
    if found.error_code is not None:
        return "jsonrpc_error", f"but the call failed (JSON-RPC error {found.error_code})"
    return None


def _key_named(letter: DeadLetter) -> str:
    """How the command's messages name the letter's key: the caller's as it sent it; one
    Sluice derived or made up is said to be, not printed (a derived key holds a digest of
    the caller's credentials; ``dlq show`` has it, marked by ``key_origin``). A letter
    written before ``key_origin`` was kept has none: a key of the form Sluice derives is
    taken for one (a caller's key of that form is then named, not printed, too)."""
    origin = letter.key_origin
    if origin is None and letter.idempotency_key is not None:
        origin = key_origin(letter.idempotency_key, callers=False)
    if origin == DERIVED_KEY:
        return "the key Sluice derived for it"
    if letter.key_origin == FRESH_KEY:  # not by its form alone: a caller's may look alike
        return "the key Sluice made up for it"
    return f"its Idempotency-Key {letter.idempotency_key!r}"


def _field_value(value: str, what: str) -> str:
    """``value`` if it may be sent as a header's value: aiohttp refuses control characters
    but tab (:data:`proxy.forward.FORBIDDEN_IN_HEADERS`; CR and LF would write headers of
    their own) only at send time, after the letter was held.

    Raises:
        ValueError: it may not (the message never quotes it: it may be a secret).
    """
    if FORBIDDEN_IN_HEADERS.search(value):
        raise ValueError(f"{what}: a header value may not hold CR, LF or NUL (nor any other "
                         "control character but tab)")
    return value


def _check_writable(path: Path) -> None:
    """Refuse an ``--output`` path the answer could not be written to, before anything is
    sent (the work would be done and its answer lost).

    Raises:
        ValueError: its directory is missing or not writable, or it is a directory or a file
            that cannot be written.
    """
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"--output {str(path)!r} is a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"--output {str(path)!r} cannot be written")
    if not path.exists() and not (folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)):
        raise ValueError(f"--output {str(path)!r}: its directory is missing or not writable")


async def _record(store: DeadLetterStore | _FileStore, letter: DeadLetter,
                  status: int | None, error: str | None, duration_s: float, token: str,
                  hold_s: float) -> None:
    """Store a replay's result, ending its hold; a store that fails then is said (the result
    is still printed: the send happened), never raised over the upstream's answer."""
    try:
        if not await store.add_replay(letter.id or 0, status, error, duration_s, token):
            print(f"WARNING: dead letter {letter.id} was deleted or purged (or dropped for "
                  f"dead_letter.max_records) during this replay, so its result is not "
                  f"stored", file=sys.stderr)
    except (StateUnavailable, sqlite3.Error) as exc:
        cause = exc.cause if isinstance(exc, StateUnavailable) else exc
        print(f"WARNING: the result of this replay of dead letter {letter.id} was not stored "
              f"({cause}); another replay without --again is refused for up to "
              f"{hold_s:.0f}s, then would send it again", file=sys.stderr)


class _Keys(NamedTuple):
    """The idempotency a letter's request is keyed under, as a request of it is now."""

    #: The group its shared records are named by: the route's, or its operation's.
    group: str
    #: The ``idempotency`` block (never ``mode: off``).
    config: IdempotencyConfig


def _block(route: RouteConfig, letter: DeadLetter) -> str | None:
    """The name of the operation block the letter's request is under now (``None``: none),
    found as the server finds a request's (:class:`policies.operations.OperationIndex`);
    its ``idempotency`` and ``timeouts`` replace the route's. The operation is read from the
    recorded request (an MCP call's tool from its body, an endpoint from its method and
    path, a model from its path or body), which every letter keeps, those written before this read
    too; a block added or renamed since applies as it would to the call."""
    tool = None
    if route.protocol == "mcp" and letter.method == "POST":
        version = CIMultiDict(letter.headers).get(mcp.VERSION_HEADER)
        # A body the route would refuse now names no operation: the route's block.
        with contextlib.suppress(mcp.InvalidMcpRequest):
            tool = mcp.parse_post(letter.body, version).tool
    return OperationIndex(*route.operations(), route.protocol, route.upstream).find(
        letter.method, letter.path, letter.body, tool, CIMultiDict(letter.headers))[1]


def _keys(route: RouteConfig, block: str | None) -> _Keys | None:
    """The idempotency a request under operation block ``block`` (:func:`_block`) is keyed
    under: its block's own replaces the route's. ``None`` when no keys apply (none, or
    ``mode: off``)."""
    group, config = idempotency_of(route, block)
    return _Keys(group, config) if config is not None else None


async def _answered_since(records: IdempotencyRecords, keys: _Keys | None,
                          letter: DeadLetter) -> int | None:
    """The status below 400 the shared idempotency records ``keys`` names hold for the
    letter's key (a later request with that key was answered), or ``None``."""
    if letter.idempotency_key is None or keys is None:
        return None
    try:  # kept as sent (quoted, the draft's form, or bare); records are named by the key
        key = parse_key(letter.idempotency_key)
    except ValueError:
        return None
    answer = await records.get(shared_record_key(keys.group, letter.tenant, key))
    if answer is None or answer.kind not in (DONE, TOO_LARGE) or answer.status >= 400:
        return None
    return answer.status


class _Limit(NamedTuple):
    """The bound on a replay's wait for its response headers, as on each attempt of the
    call: its ``retry`` block's ``per_try_timeout``, or its ``deadline`` when shorter."""

    #: Seconds.
    seconds: float
    #: The setting it comes from, as the failure names it (``retry.per_try_timeout``).
    named: str


def _headers_limit(retry: RetryConfig | None) -> _Limit | None:
    """The :class:`_Limit` of a replay under ``retry`` (its operation's, or else its
    route's: the one its calls' attempts were under), or ``None`` when it sets neither
    bound. One attempt is all a replay sends, so the deadline over all of them bounds it
    as it bounded the first."""
    if retry is None:
        return None
    limits = [_Limit(seconds, f"retry.{name}") for name, seconds in (
        ("per_try_timeout", retry.per_try_timeout), ("deadline", retry.deadline))
        if seconds is not None]
    return min(limits, key=lambda limit: limit.seconds) if limits else None


class _Connected:
    """Whether a replay's send got a connection to the upstream: from then on its request
    may have been written, so an interrupted replay may have done the work."""

    __slots__ = ("yes",)

    def __init__(self) -> None:
        self.yes = False

    def trace(self) -> aiohttp.TraceConfig:
        """A trace that sets :attr:`yes` once a connection is made or reused."""
        config = aiohttp.TraceConfig()

        async def made(*_: object) -> None:
            self.yes = True

        config.on_connection_create_end.append(made)
        config.on_connection_reuseconn.append(made)
        return config


async def _send(route: RouteConfig, timeouts: TimeoutsConfig, limit: _Limit | None,
                letter: DeadLetter, headers: CIMultiDict[str], connected: _Connected,
                ) -> tuple[int | None, str | None, bytes, str, CIMultiDict[str]]:
    """One attempt under ``timeouts`` (the letter's operation's, or its route's), its wait
    for the response headers (connecting included) under ``limit`` too, as a live attempt's
    (:func:`_headers_limit`): ``(status, None, answer body, reason phrase, answer
    headers)``, or, when it got no whole answer, ``(None, error kind, b"", why, {})``
    (:func:`_why_failed`); ``connected`` is told when a connection is made."""
    connect = timeouts.connect
    if limit is not None and limit.seconds < connect:
        connect = limit.seconds  # aiohttp's bound fires first: "no connection" is said
    timeout = client_timeout(timeouts.total, connect)
    async with upstream_session(trace_configs=[connected.trace()]) as session:
        scope = asyncio.timeout(None if limit is None else limit.seconds + CONNECT_FIRST_S)
        try:
            async with scope:
                response = await session.request(
                    letter.method, upstream_url(route.upstream, letter.path), headers=headers,
                    data=letter.body or None, allow_redirects=False, timeout=timeout)
            async with response:
                body = await response.read()
                kept = CIMultiDict((name, value) for name, value in response.headers.items()
                                   if name.lower() not in RESPONSE_DROP)
                return response.status, None, body, response.reason or "", kept
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            # ValueError: aiohttp refused what it was given, before sending it.
            why = _why_failed(exc, timeouts, limit, scope.expired())
            return None, type(exc).__name__, b"", why, CIMultiDict()


def _why_failed(exc: Exception, timeouts: TimeoutsConfig, limit: _Limit | None = None,
                cut: bool = False) -> str:
    """Why a replay's send got no whole answer, in a few words that quote nothing the
    exception holds (an aiohttp ``InvalidURL`` quotes the URL, password and all);
    ``limit``: the bound on its wait for headers, ``cut``: that bound ended it."""
    if isinstance(exc, ValueError):  # InvalidURL too: aiohttp's is both
        return "it could not be sent as it is"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        if limit is not None and limit.seconds < timeouts.connect:
            return f"no connection within {limit.named}, {limit.seconds:g}s"
        return f"no connection within timeouts.connect, {timeouts.connect:g}s"
    if cut and limit is not None:
        return f"no response headers within {limit.named}, {limit.seconds:g}s"
    if isinstance(exc, TimeoutError):
        return f"no whole answer within timeouts.total, {timeouts.total:g}s"
    return send_failure(exc)


class _KeyHold:
    """The letter's key in its shared idempotency records (under ``keys``), as a replay holds
    it: the in-flight marker (``owner``), or ``busy`` when a request with the key holds it
    now."""

    __slots__ = ("busy", "fingerprint", "keys", "name", "owner", "records")

    def __init__(self, records: IdempotencyRecords, keys: _Keys, name: str, owner: str,
                 fingerprint: bytes, busy: bool) -> None:
        self.records, self.keys, self.name, self.owner = records, keys, name, owner
        self.fingerprint, self.busy = fingerprint, busy


async def _hold_key(records: IdempotencyRecords, keys: _Keys | None, letter: DeadLetter,
                    hold_s: float) -> _KeyHold | None:
    """Hold the letter's key while it is replayed, as a request of it would (under ``keys``):
    a caller's retry with the key then waits for the replay's answer and gets it replayed,
    rather than running the work beside it or after it. ``None`` when there is nothing to
    hold: its block stores no answers, the letter has no key, or its key has no record
    (expired) or a final one (the replay goes on as before: ``--again``, or an answer of 400
    or more)."""
    if letter.idempotency_key is None or keys is None or keys.config.mode != "dedup":
        return None
    try:
        key = parse_key(letter.idempotency_key)
    except ValueError:
        return None
    name = shared_record_key(keys.group, letter.tenant, key)
    record = await records.get(name)
    if record is None or record.kind != SEEN:
        return None
    # The fingerprint of the request that left the record: the letter's own request, which
    # the caller's retry sends again.
    owner = new_owner()
    begin = await records.begin(name, owner, record.fingerprint, hold_s)
    if begin.state == IN_FLIGHT:
        return _KeyHold(records, keys, name, owner, record.fingerprint, busy=True)
    if begin.state != KEY_CLAIMED:
        return None
    return _KeyHold(records, keys, name, owner, record.fingerprint, busy=False)


async def _free_key(key: _KeyHold | None, protocol: str, status: int | None = None,
                    reason: str = "", headers: CIMultiDict[str] | None = None,
                    body: bytes = b"", request_body: bytes = b"") -> None:
    """End the replay's hold of its key: store the answer as a request of it would have
    stored it under its block (``key.keys``: ``max_replay_bytes``, ``ttl``; a final one is
    replayed to the key's later requests; an MCP call's by its response, ``request_body``
    being the call, on a route of ``protocol`` ``mcp``), or only a use of the key."""
    if key is None or key.busy:
        return
    config = key.keys.config
    record = None
    mcp_id = jsonrpc_id(protocol, request_body)
    if status is not None and (protocol != "mcp" or mcp_id is not None):
        capture = Capture(config.max_replay_bytes, mcp_id)
        capture.begin(status, reason, headers if headers is not None else CIMultiDict())
        capture.feed(body)
        record = capture.answer(key.fingerprint, f"{status // 100}xx")
    try:
        await key.records.finish(key.name, key.owner, shared_answer(record, key.fingerprint),
                                 config.ttl)
    except StateUnavailable as exc:
        print(f"WARNING: the replay's answer was not stored for its Idempotency-Key "
              f"({exc.cause}): a request with the key waits until its hold lapses, then "
              f"runs it again", file=sys.stderr)
