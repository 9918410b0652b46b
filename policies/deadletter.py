"""Dead letters: work Sluice gave up on, kept so that it does not vanish (key ``dead_letter``).

A request on a route with ``retry`` whose failure was one Sluice retries on (a status or error
kind in ``retry.on``) and that still failed when the retries ended (attempts spent, deadline,
retry budget, breaker opened, unsafe to repeat, upstream asking for too long a wait) is
written here with its route, tenant, run, idempotency key, method, path, headers, body and
every attempt (time, status or error, duration), and the reason retries ended. The key is the
one the call was handled under: the caller's ``Idempotency-Key``, or the key Sluice derived
for it (``derive_from``, an MCP call's tool and arguments) or made up, with where it came
from (``key_origin``; letters written before it was recorded have none). The answer to
the caller names the record in ``X-Sluice-Dead-Letter``.

Secrets are never written: headers whose name or value says they carry credentials
(:func:`policies.secrets.secret_header`: ``Authorization``, ``Cookie``, anything with ``auth``,
``key``, ``token``, ``secret``, ``password``, ``credential``, ``session``...; a value such as
``Bearer ...`` or ``sk-...``, whatever its name) are removed and only their names kept, so
``sluice dlq replay`` must be given them again. Query parameters go by the same rule
(:func:`policies.secrets.secret_query_field`: ``?api_key=``, ``?sig=``...; a value such as
``?q=sk-...``, whatever its name): the path is stored, and replayed, without them, and
``?NAME`` for each is listed with the removed headers' names. Bodies are kept up to
``max_body_bytes``; a cut body is marked and cannot be replayed.

Storage follows the ``state`` block. With the memory backend: one SQLite file per replica
(``dead_letter.path``; WAL mode, so ``sluice dlq`` can read while the server writes); the
server does all SQLite work on one dedicated thread, so the event loop never waits on the
disk. With the Redis backend: one Redis Stream shared by every replica
(:class:`policies.state.deadletters.RedisDeadLetterStore`), so ``sluice dlq`` pointed at the
same config reads and replays what any replica wrote; a write Redis does not answer is not
kept (the caller still gets its answer; the failure is logged and counted as a failed write,
whatever ``state.on_unavailable`` says: a letter kept in one replica's memory would be read
by nobody). Either way, a request that is dead-lettered waits for its own record to be
written (the ``X-Sluice-Dead-Letter`` id needs it), nothing else does, and that request for a
second at most (``proxy.attempts.DEAD_LETTER_WAIT_S``): a file another process keeps locked
is answered without the id, and the record is written once the lock is gone. The server
holds such letters in memory, in order, up to ``MAX_HELD_LETTERS`` letters and
``MAX_HELD_BYTES`` bytes (one past either is lost: :class:`LetterNotKept`, counted and logged
as a failed write), tries the first again until the file takes it (a try waits
``WRITE_BUSY_TIMEOUT_S`` for the lock), and at shutdown writes them until the drain's deadline
(``FLUSH_MIN_S`` at least) or a second stop signal; those still held then are lost, and
logged with their requests.

The server checks its file for damage once, at start, in the background
(:func:`damage`: ``PRAGMA quick_check`` reads every page), and logs an error naming it and
how to recover it if damaged; letters it then cannot write are counted as failed writes.

The store is bounded: the write that would keep more than ``max_records`` letters drops the
oldest (with their replays and replay holds) in the same transaction or script, so a long
outage cannot fill the disk or the Redis every replica shares. With
``max_records_per_tenant`` set (unset: no share), each tenant has a share of it: the write
that would keep more of its tenant's letters drops that tenant's own oldest first, in the
same step. One bound for every tenant let one caller push out the others' letters (a hostile
trial: 60 calls with 1 MiB bodies and their own short deadline, each dead-lettered, left 50
letters of that caller in a store of 50, and a victim's outage letter was gone). Each drop
is logged (once per route, and tenant for a share, every few seconds,
:data:`policies.logs.PER_CALL`) and counted in :attr:`DeadLetterQueue.dropped`, by the bound
that dropped it.

The depth the server reports (:meth:`DeadLetterQueue.depth`) is read from the store every
``DEPTH_REFRESH_S`` and after a write that dropped letters, off the request path (on the
SQLite thread; one ``HGETALL`` with Redis), and follows this replica's writes in between: so
it falls after ``sluice dlq purge`` from another process, and every replica of a shared
stream reports the same count.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import logging
import math
import os
import shlex
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import quote, unquote_plus

import orjson

from policies.config import DeadLetterConfig
from policies.logs import PER_CALL
from policies.secrets import secret_header, secret_query_field, secret_query_name

if TYPE_CHECKING:  # policies.state.deadletters imports this module's records
    from policies.state import StateBackends

log = logging.getLogger("sluice")

#: How often the depth is read again from the store, seconds: other processes change it
#: (``sluice dlq purge``, the other replicas writing to a shared stream).
DEPTH_REFRESH_S = 15.0
#: How long opening the SQLite file (and each write of a ``sluice dlq`` command) waits for
#: another process's lock before it fails with ``database is locked``, seconds.
OPEN_BUSY_TIMEOUT_S = 5.0
#: How long one try of the server's writer waits for another process's lock, seconds. A
#: write that gets no lock is tried again, so this bounds only how long a try keeps the
#: store's thread (depth reads, and the shutdown's flush, wait behind it).
WRITE_BUSY_TIMEOUT_S = 1.0
#: Letters the server keeps in memory, in order, while the file is locked by another
#: process (or they come faster than the disk takes them), at most: this many, and this many
#: bytes (bodies as cut to ``max_body_bytes``, headers and path). One past either bound is
#: lost: :class:`LetterNotKept`. The bytes count in ``server.max_buffered_bytes`` too.
MAX_HELD_LETTERS = 1000
MAX_HELD_BYTES = 64 * 1024 * 1024
#: At shutdown, letters held for a locked file are written until the drain's deadline, or
#: for this long at least (a second stop signal ends it sooner), seconds; those still held then
#: are lost (logged, with their ids).
FLUSH_MIN_S = 1.0
#: How often a close interrupts the damage check again until it has ended, seconds.
CHECK_INTERRUPT_EVERY_S = 0.05
#: Pause between two tries of a letter the file refused as locked, seconds (a try usually
#: waits ``WRITE_BUSY_TIMEOUT_S`` itself; some lock conflicts fail at once).
RETRY_PAUSE_S = 0.05
#: Most letters one write drops (SQLite: in its transaction; Redis: in its script,
#: :mod:`policies.state.deadletters`), for its tenant's share and the store's bound together,
#: and about how many bytes of them; at least ``MIN_DROPS_PER_ADD`` whatever their bytes
#: (letters of 1 MiB, one dropped a write against the one added, never brought a store down
#: to a lowered bound: a review), counted across both, never on top of the budget (a review:
#: the store's pass dropped 2 more after the tenant's had dropped 100). A ``max_records`` or
#: ``max_records_per_tenant`` lowered far below what the store holds (at a restart) is
#: reached over the next writes, this many more each: one write dropped 7,501 letters of
#: 64 KiB in 2 s on SQLite, its caller waiting (a review), and a script blocks every
#: client of Redis while it runs.
MAX_DROPS_PER_ADD = 100
MAX_DROP_BYTES_PER_ADD = 1 << 20
MIN_DROPS_PER_ADD = 2
#: A letter's bytes as a write that drops it counts them against ``MAX_DROP_BYTES_PER_ADD``
#: (what freeing its pages costs; the Redis script counts its entry's field values).
_LETTER_BYTES = "length(body) + length(headers) + length(attempts) + length(path)"

#: What a file opened for writing is given where missing (:class:`DeadLetterFile`), never a
#: file opened read-only: ``dead_letters_route`` came with the table, ``dead_letters_tenant``
#: later, and a file from before it is read, not changed, by ``sluice dlq list``.
_SCHEMA = """
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
CREATE INDEX IF NOT EXISTS dead_letters_tenant ON dead_letters (tenant, id);
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


def redact(headers: Iterable[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[str]]:
    """Split headers into those safe to store and the names of those removed as secrets."""
    kept: list[tuple[str, str]] = []
    removed: list[str] = []
    for name, value in headers:
        if secret_header(name, value):
            removed.append(name)
        else:
            kept.append((name, value))
    return kept, removed


#: What stands for a query field's name that is itself a credential (``?sk-...``).
REDACTED_NAME = "<redacted>"
#: The answer field naming the dead letter a call was written to.
DEAD_LETTER_HEADER = "X-Sluice-Dead-Letter"


def redact_path(path: str) -> tuple[str, list[str]]:
    """Drop query parameters that carry credentials, by name or by value
    (:func:`policies.secrets.secret_query_field`), from ``path`` (as received,
    percent-encoded; read decoded).

    Returns the path to store and ``?NAME`` for each parameter dropped, so a replay knows what
    must be supplied again (:data:`REDACTED_NAME` for a name that is itself a credential).
    """
    target, sep, query = path.partition("?")
    if not sep:
        return path, []
    kept: list[str] = []
    removed: list[str] = []
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        name_read = unquote_plus(name)
        if secret_query_field(name_read, unquote_plus(value)):
            removed.append("?" + (REDACTED_NAME if secret_query_name(name_read) else name))
        else:
            kept.append(pair)
    return (f"{target}?{'&'.join(kept)}" if kept else target), removed


#: The error kind of a replay interrupted (Ctrl-C, SIGTERM) once its request may have been
#: written to the upstream: the work may be done, so it counts as :func:`answered`.
INTERRUPTED_AFTER_SEND = "interrupted_after_send"

#: :attr:`ReplayClaim.state` values.
CLAIMED = "claimed"
ANSWERED = "answered"
BUSY = "busy"
MISSING = "missing"


class ReplayClaim(NamedTuple):
    """Whether a replay of a letter may be sent now (``claim_replay`` of a store).

    Attributes:
        state: ``claimed`` (this replay holds the letter until it records its result),
            ``answered`` (an earlier replay was answered, :func:`answered`, and ``again``
            was not given), ``busy`` (another replay holds the letter) or ``missing`` (no letter).
        replay: when answered, that earlier replay (``at``, ``status``, ``error``,
            ``duration_s``).
        left_s: when busy, seconds until the other replay's hold lapses if it never records
            a result (its command was killed).
    """

    state: str
    replay: dict[str, Any] | None = None
    left_s: float = 0.0


class Added(NamedTuple):
    """What writing a letter did (``add`` of a store).

    Attributes:
        id: the new letter's id.
        dropped: how many of the oldest letters were dropped to stay within ``max_records``
            (with their replays and replay holds), by route; empty when none were.
        tenant_dropped: how many of the letter's tenant's own oldest letters were dropped
            to stay within its share (``max_records_per_tenant``), by route; empty when none
            were. Those go first: ``dropped`` counts what the store bound took after them.
    """

    id: int
    dropped: dict[str, int]
    tenant_dropped: dict[str, int]


def answered(replays: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The last replay that may have done the work, or ``None``: one the upstream answered
    below 400 with no error, one interrupted after its request may have been sent
    (:data:`INTERRUPTED_AFTER_SEND`: its answer was never read), or one whose record cannot
    be read (:data:`UNREADABLE`: it may have been either). An MCP call's 200 whose tool (or
    JSON-RPC) failed is kept with its status and the error (``tool_failed``...), and is not
    answered. Every store's ``claim_replay`` decides with it (the Redis one in Python, on the
    replays its claim script read under the hold it took)."""
    return next((r for r in reversed(list(replays))
                 if UNREADABLE in r
                 or (r["status"] is not None and r["status"] < 400 and r.get("error") is None)
                 or r.get("error") == INTERRUPTED_AFTER_SEND),
                None)


#: The one key of a replay record Sluice cannot read (:func:`replay_record`), in place of
#: its fields: what is wrong with it. Such a replay counts as :func:`answered`.
UNREADABLE = "unreadable"
#: The fields of a stored replay, as Sluice writes them.
REPLAY_FIELDS = ("at", "status", "error", "duration_s")
#: A replay's ``at`` Sluice reads, Unix seconds: from 1970 to the end of year 9999 (a
#: date the commands can print).
LAST_REPLAY_AT = 253402300800.0


def replay_record(fields: object) -> dict[str, Any]:
    """A stored replay (``fields``: its decoded JSON, or its row's columns by name) as
    Sluice writes one: ``at`` (Unix seconds), ``status`` (an HTTP status as aiohttp read
    it, 0 to 999, or ``None``), ``error`` (an error kind, or ``None``; at least one of the
    two set: an MCP call's 200 whose tool failed has both) and ``duration_s``; or, when
    it is not that (another program wrote it, a hand edit), ``{UNREADABLE: what is wrong}``,
    naming no value."""
    if not isinstance(fields, dict):
        return {UNREADABLE: f"it holds {_kind(fields)}, not an object"}
    for name in REPLAY_FIELDS:
        if name not in fields:
            return {UNREADABLE: f"it has no {name}"}
    at, status, error, took = (fields[name] for name in REPLAY_FIELDS)
    problem = _replay_problem(at, status, error, took)
    if problem is not None:
        return {UNREADABLE: problem}
    return {"at": at, "status": None if status is None else int(status), "error": error,
            "duration_s": took}


def _replay_problem(at: Any, status: Any, error: Any, took: Any) -> str | None:
    if not (_number(at) and _finite(at)):
        return _number_problem("at", at)
    if not (_number(took) and _finite(took)):
        return _number_problem("duration_s", took)
    if not 0 <= at < LAST_REPLAY_AT:
        return "its at is no time from 1970 to 9999"
    if took < 0:
        return "its duration_s is negative"
    if error is not None and not isinstance(error, str):
        return f"its error holds {_kind(error)}, not text"
    if status is None:
        return "it holds neither a status nor an error" if error is None else None
    if not _number(status):
        return f"its status holds {_kind(status)}, not a number"
    # From 0: an upstream's "HTTP/1.1 000" or "099" is read by aiohttp as 0 or 99, and a
    # replay records it as it was read (a review: its record was then called unreadable).
    if not (_finite(status) and status == int(status) and 0 <= status <= 999):
        return "its status is no HTTP status, a whole number from 0 to 999"
    return None


def _number_problem(name: str, value: object) -> str:
    """What is wrong with ``value``, a field that holds no finite number."""
    if not _number(value):
        return f"its {name} holds {_kind(value)}, not a number"
    return f"its {name} is not a finite number"


def _number(value: object) -> bool:
    """Whether ``value`` is a number (not a boolean, which is an ``int`` too)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _kind(value: object) -> str:
    """What ``value`` is, as a message about a stored record names it (never the value):
    one orjson or :mod:`sqlite3` gives, so a JSON value or bytes."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if _number(value):
        return "a number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, bytes):
        return "binary data"
    if isinstance(value, list):
        return "a list"
    return "an object"


@dataclass(slots=True)
class Attempt:
    """One upstream attempt: when (Unix seconds), its status or error kind, how long (s)."""

    at: float
    status: int | None
    error: str | None
    duration_s: float

    def as_dict(self) -> dict[str, Any]:
        return {"at": round(self.at, 6), "status": self.status, "error": self.error,
                "duration_s": round(self.duration_s, 6)}


@dataclass(slots=True)
class DeadLetter:
    """One record; ``body`` is already cut to the store's limit, ``body_size`` is the original."""

    route: str
    tenant: str
    run: str | None
    idempotency_key: str | None
    request_id: str
    method: str
    path: str
    headers: list[tuple[str, str]]
    redacted: list[str]
    body: bytes
    body_size: int
    attempts: list[Attempt]
    reason: str
    created_at: float = field(default_factory=time.time)
    #: Where ``idempotency_key`` came from (:func:`policies.idempotency.key_origin`:
    #: ``caller``, ``derived`` or ``fresh``); ``None`` for a letter written before this was
    #: recorded, or with no key.
    key_origin: str | None = None
    id: int | None = None
    replays: list[dict[str, Any]] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        """True when the body was cut, so the request cannot be replayed as it was."""
        return self.body_size > len(self.body)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view; the body is text when it is UTF-8, else base64."""
        try:
            body: dict[str, Any] = {"text": self.body.decode()}
        except UnicodeDecodeError:
            body = {"base64": base64.b64encode(self.body).decode()}
        return {
            "id": self.id, "created_at": self.created_at, "route": self.route,
            "tenant": self.tenant, "run": self.run,
            "idempotency_key": _key_as_logged(self.idempotency_key),
            "key_origin": self.key_origin, "request_id": self.request_id,
            "method": self.method, "path": self.path,
            "headers": [list(h) for h in self.headers], "redacted_headers": self.redacted,
            "body": body, "body_size": self.body_size, "body_truncated": self.truncated,
            "attempts": [a.as_dict() for a in self.attempts], "reason": self.reason,
            "replays": self.replays,
        }


def _key_as_logged(key: str | None) -> str | None:
    """A letter's key (the ``Idempotency-Key`` value it went upstream with, quoted when
    Sluice or the caller quoted it) as the event log and the timeline name it: the key
    itself. ``dlq show`` printed ``"\"sluice-d-..\""``, which a grep of the log missed."""
    # Here, not at the top: at import time it would close a cycle (through policies.rate).
    from policies.idempotency import parse_key

    if key is None:
        return None
    try:
        return parse_key(key)
    except ValueError:  # stored before the key was checked: shown as it was sent
        return key


@dataclass(slots=True)
class _Drops:
    """What one write dropped so far: letters, and their bytes (``_LETTER_BYTES``)."""

    count: int = 0
    bytes: int = 0


class DeadLetterFile:
    """Blocking access to the SQLite file: for the server's writer thread and the CLI.

    A letter is written to (and the depth read from) the file at ``path`` even when the one
    open was deleted or moved away meanwhile (``rm sluice-dlq.sqlite*`` to empty it): the
    connection is then closed and the file opened, or created, again. Before, every later
    letter went into the deleted file, named in its answer's ``X-Sluice-Dead-Letter`` and
    found by no ``sluice dlq``.

    Opened ``read_only`` (``sluice dlq list`` and ``show``), it changes no schema or
    letter: the file must exist, and its tables, indexes and columns are as an older
    release left them (``key_origin`` read as none where it is missing). Its bytes may
    change all the same: closing the connection checkpoints a ``-wal`` file a writer left
    (one killed) into the main file, the letters in it unchanged. Opened for writing (the server's
    store, ``replay``, ``delete``, ``purge``), it creates what is missing: creating the
    ``(tenant, id)`` index in a file from before it fails on a file Sluice may not write (a
    backup, a read-only volume) with ``attempt to write a readonly database``.

    Raises:
        sqlite3.Error: the file cannot be opened or created, or is no SQLite database.
    """

    def __init__(self, path: str, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self._busy_timeout_ms = round(OPEN_BUSY_TIMEOUT_S * 1000)
        self._reopening = False  # a moved file's replacement not opened yet (said once)
        self._open()

    def wait_for_locks(self, seconds: float) -> None:
        """Wait at most ``seconds`` for another process's lock before a write (or a read
        during its recovery) fails with ``database is locked``, from now on (a file opened
        again after a move too)."""
        self._busy_timeout_ms = round(seconds * 1000)
        self._db.execute(f"PRAGMA busy_timeout={self._busy_timeout_ms}")

    def _open(self) -> None:
        try:
            self._connect()
        except BaseException:
            # A connection made before the failure (a pragma past the busy timeout) is
            # closed, not left to the collector. On a first open that failed to connect
            # there is no _db yet; on a reopen, _db is the old one _follow closed already.
            with contextlib.suppress(AttributeError):
                self._db.close()
            raise
        self._inode = _inode(self.path)

    def _connect(self) -> None:
        if self.read_only:
            # mode=rw, not ro, as _reading: no file created, and a read-only connection
            # leaves the -wal and -shm files behind (so a -wal left here is checkpointed at
            # close: bytes, not letters, change). SQLite reads a file it may not write.
            self._db = sqlite3.connect(f"file:{quote(self.path)}?mode=rw", uri=True,
                                       timeout=self._busy_timeout_ms / 1000,
                                       isolation_level=None, check_same_thread=False)
            self._db.execute(f"PRAGMA busy_timeout={self._busy_timeout_ms}")
            # What get() reads for it: none in a file written before it was recorded.
            self._key_origin = "key_origin" if "key_origin" in self._columns() else "NULL"
        else:
            self._open_for_writing()
            self._key_origin = "key_origin"

    def _open_for_writing(self) -> None:
        """Open the file, created if missing, in WAL mode, with every table, index and
        column this release writes (those a file from an older release lacks added)."""
        # Created readable by its owner only: its letters hold whole request bodies (prompts,
        # tool arguments), and it was made 0644 in the working directory (a new user's
        # trial). SQLite gives its write-ahead log the same mode. A path that cannot be
        # created here is left to SQLite, whose error says why.
        with contextlib.suppress(OSError):
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        # The busy timeout from the connection's start: ``PRAGMA journal_mode=WAL`` takes
        # a lock, and under sqlite3.connect's default (5 s) a try of the writer on a moved
        # file's locked replacement kept the store's thread 5 s, not WRITE_BUSY_TIMEOUT_S.
        self._db = sqlite3.connect(self.path, timeout=self._busy_timeout_ms / 1000,
                                   isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(f"PRAGMA busy_timeout={self._busy_timeout_ms}")
        self._db.executescript(_SCHEMA)
        if "key_origin" not in self._columns():  # a file written before it was recorded
            try:
                self._db.execute("ALTER TABLE dead_letters ADD COLUMN key_origin TEXT")
            except sqlite3.OperationalError:
                if "key_origin" not in self._columns():  # not another process's, just now
                    raise

    def _columns(self) -> set[str]:
        return {row[1] for row in self._db.execute("PRAGMA table_info(dead_letters)")}

    def _follow(self) -> None:
        """Open the file at ``path`` again if it is no longer the one open. The old
        connection is closed first: its write-ahead log, if left at the path, must not be
        read into the new file."""
        there = _inode(self.path)
        if there is None or self._inode is None or there == self._inode:
            return
        if not self._reopening:  # once, not at every try while the new file stays locked
            log.warning("dead-letter file %s was deleted or moved away: letters go to a new "
                        "file at that path from now", self.path)
            self._reopening = True
        self._db.close()
        self._open()
        self._reopening = False

    def close(self) -> None:
        self._db.close()

    def add(self, letter: DeadLetter, max_records: int | None = None,
            max_per_tenant: int | None = None) -> Added:
        """Store ``letter``; with ``max_per_tenant``, drop the oldest letters of its tenant
        beyond it, then with ``max_records`` the oldest letters beyond that (their replays
        and replay holds too), in the same transaction: ``MAX_DROPS_PER_ADD`` letters and
        about ``MAX_DROP_BYTES_PER_ADD`` bytes of them at most, so a store over its bound
        comes down over the next writes."""
        self._follow()
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            cursor = self._db.execute(
                "INSERT INTO dead_letters (created_at, route, tenant, run, idempotency_key,"
                " request_id, method, path, headers, redacted, body, body_size, attempts,"
                " reason, key_origin) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (letter.created_at, letter.route, letter.tenant, letter.run,
                 letter.idempotency_key, letter.request_id, letter.method, letter.path,
                 orjson.dumps(letter.headers), orjson.dumps(letter.redacted), letter.body,
                 letter.body_size, orjson.dumps([a.as_dict() for a in letter.attempts]),
                 letter.reason, letter.key_origin),
            )
            drops = _Drops()
            own = ({} if max_per_tenant is None
                   else self._drop_oldest(max_per_tenant, MAX_DROPS_PER_ADD, drops,
                                          letter.tenant))
            dropped = ({} if max_records is None else self._drop_oldest(
                max_records, MAX_DROPS_PER_ADD - drops.count, drops))
        return Added(int(cursor.lastrowid or 0), dropped, own)

    def _oldest(self, where: str, args: tuple[Any, ...], most: int,
                drops: _Drops) -> tuple[int | None, dict[str, int]]:
        """Pick the oldest letters ``where`` (SQL on ``dead_letters``) selects to drop: up
        to ``most``, fewer once those this write dropped reach ``MAX_DROP_BYTES_PER_ADD``
        bytes (unless the write dropped fewer than ``MIN_DROPS_PER_ADD`` in all), counted in
        ``drops``. Returns the last one's id (``None``: none) and how many by route."""
        last, routes, picked = None, {}, 0
        for letter_id, route, size in self._db.execute(
                f"SELECT id, route, {_LETTER_BYTES} FROM dead_letters WHERE {where}"
                " ORDER BY id LIMIT ?", (*args, most)):
            if (drops.bytes >= MAX_DROP_BYTES_PER_ADD
                    and drops.count + picked >= MIN_DROPS_PER_ADD):
                break
            last, picked = letter_id, picked + 1
            routes[route] = routes.get(route, 0) + 1
            drops.bytes += size
        drops.count += picked
        return last, routes

    def _drop_oldest(self, keep: int, most: int, drops: _Drops,
                     tenant: str | None = None) -> dict[str, int]:
        """Delete the oldest letters beyond the newest ``keep``, of ``tenant`` (read through
        the ``(tenant, id)`` index, which opening a file for writing creates) or, ``None``,
        of the whole store, up to ``most`` (:meth:`_oldest`); returns how many went, by
        route."""
        where, args = ("1", ()) if tenant is None else ("tenant = ?", (tenant,))
        over = self._db.execute(f"SELECT COUNT(*) FROM dead_letters WHERE {where}",
                                args).fetchone()[0] - keep
        if over <= 0 or most <= 0:
            return {}
        # Ids only grow, so the oldest letters are those up to the last one picked.
        last, dropped = self._oldest(where, args, min(over, most), drops)
        gone = f"SELECT id FROM dead_letters WHERE {where} AND id <= ?"
        for table in ("replays", "replay_claims"):
            self._db.execute(f"DELETE FROM {table} WHERE dead_letter_id IN ({gone})",
                             (*args, last))
        self._db.execute(f"DELETE FROM dead_letters WHERE {where} AND id <= ?", (*args, last))
        return dropped

    def depth(self) -> dict[str, int]:
        """Records per route (in the file at ``path``, as :meth:`add` writes to)."""
        self._follow()
        rows = self._db.execute("SELECT route, COUNT(*) FROM dead_letters GROUP BY route")
        return {route: count for route, count in rows}

    def list(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest ``limit`` records as short summaries, oldest first (the keys of
        :meth:`policies.state.DeadLetterStore.list`)."""
        query = ("SELECT d.id, d.created_at, d.route, d.tenant, d.method, d.path, d.attempts,"
                 " d.reason, r.id, {} FROM dead_letters d LEFT JOIN replays r ON r.id ="
                 "  (SELECT MAX(id) FROM replays WHERE dead_letter_id = d.id)"
                 " ORDER BY d.id DESC LIMIT ?")
        # The last replays' cells as they are: what _replay_columns gives, faster. A cell
        # holding text that is not UTF-8 fails this read, made again with those columns (a
        # review: they, and a record made for each letter, doubled the time of a list of
        # 100,000 letters).
        try:
            rows = self._db.execute(query.format(", ".join(f"r.{name}" for name in REPLAY_FIELDS)),
                                    (limit,)).fetchall()
            read = _last_of
        except sqlite3.OperationalError as exc:
            if not str(exc).startswith("Could not decode to UTF-8"):
                raise
            rows = self._db.execute(query.format(_replay_columns("r")), (limit,)).fetchall()
            read = _last_of_stored
        out = []
        with _readable():
            for r in reversed(rows):
                last, unreadable = (None, None) if r[8] is None else read(r[9:])
                out.append({"id": r[0], "created_at": r[1], "route": r[2], "tenant": r[3],
                            "method": r[4], "path": r[5], "attempts": len(orjson.loads(r[6])),
                            "reason": r[7], "last_replay": last, "unreadable_replay": unreadable})
        return out

    def get(self, letter_id: int) -> DeadLetter | None:
        """The whole record ``letter_id`` with its replays, or ``None``."""
        row = self._db.execute(
            "SELECT id, created_at, route, tenant, run, idempotency_key, request_id, method,"
            f" path, headers, redacted, body, body_size, attempts, reason, {self._key_origin}"
            " FROM dead_letters WHERE id = ?", (letter_id,),
        ).fetchone()
        if row is None:
            return None
        replays = self._replays(letter_id)
        with _readable():
            return DeadLetter(
                id=row[0], created_at=row[1], route=row[2], tenant=row[3], run=row[4],
                idempotency_key=row[5], request_id=row[6], method=row[7], path=row[8],
                headers=[(n, v) for n, v in orjson.loads(row[9])],
                redacted=orjson.loads(row[10]), body=bytes(row[11]), body_size=row[12],
                attempts=[Attempt(**a) for a in orjson.loads(row[13])], reason=row[14],
                key_origin=row[15], replays=replays,
            )

    def claim_replay(self, letter_id: int, token: str, hold_s: float,
                     again: bool = False) -> ReplayClaim:
        """Hold ``letter_id`` for one replay (``token``: the replay's own, random) for at most
        ``hold_s`` seconds, in one transaction, unless another replay holds it or, without
        ``again``, an earlier one was answered (:func:`answered`). Two commands replaying one letter
        at once would both send it: only one gets ``claimed``."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            if self._db.execute("SELECT 1 FROM dead_letters WHERE id = ?",
                                (letter_id,)).fetchone() is None:
                return ReplayClaim(MISSING)
            now = time.time()
            held = self._db.execute("SELECT until FROM replay_claims WHERE dead_letter_id = ?",
                                    (letter_id,)).fetchone()
            if held is not None and held[0] > now:
                return ReplayClaim(BUSY, left_s=held[0] - now)
            if not again:
                done = answered(self._replays(letter_id))
                if done is not None:
                    return ReplayClaim(ANSWERED, done)
            self._db.execute("INSERT OR REPLACE INTO replay_claims VALUES (?, ?, ?)",
                             (letter_id, token, now + hold_s))
        return ReplayClaim(CLAIMED)

    def add_replay(self, letter_id: int, status: int | None, error: str | None,
                   duration_s: float, token: str | None = None) -> bool:
        """Record the result of replaying ``letter_id``, and end the hold of ``token``;
        ``False``, recording nothing, if there is no such letter (deleted, purged or dropped
        while the replay was sent), as the Redis store does."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            # Checked in the transaction: a delete between the check and the insert would
            # leave a replay row no letter owns (and no delete or purge ever removes).
            if self._db.execute("SELECT 1 FROM dead_letters WHERE id = ?",
                                (letter_id,)).fetchone() is None:
                return False
            self._db.execute(
                "INSERT INTO replays (dead_letter_id, at, status, error, duration_s)"
                " VALUES (?, ?, ?, ?, ?)", (letter_id, time.time(), status, error, duration_s),
            )
            self._db.execute("DELETE FROM replay_claims WHERE dead_letter_id = ? AND token = ?",
                             (letter_id, token))
        return True

    def _replays(self, letter_id: int) -> list[dict[str, Any]]:
        """The letter's replays, oldest first; one whose row Sluice cannot read as
        ``{UNREADABLE: what is wrong}`` (:func:`replay_record`)."""
        return [_stored_replay(row) for row in self._db.execute(
            f"SELECT {_replay_columns('replays')} FROM replays WHERE dead_letter_id = ?"
            " ORDER BY id", (letter_id,))]

    def delete(self, letter_id: int) -> bool:
        """Delete one record with its replays and any replay's hold on it; ``False`` if
        there was none (a replay sending it meanwhile then records nothing, as after a
        purge)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            found = self._db.execute("DELETE FROM dead_letters WHERE id = ?",
                                     (letter_id,)).rowcount
            self._db.execute("DELETE FROM replays WHERE dead_letter_id = ?", (letter_id,))
            self._db.execute("DELETE FROM replay_claims WHERE dead_letter_id = ?",
                             (letter_id,))
        return found > 0

    def purge(self) -> int:
        """Delete every record and replay; returns how many records there were."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            count = self._db.execute("DELETE FROM dead_letters").rowcount
            self._db.execute("DELETE FROM replays")
            self._db.execute("DELETE FROM replay_claims")
        return count


def _replay_columns(table: str) -> str:
    """The columns of a ``replays`` row to select, each as its type and its value, text as
    its bytes: a column holding text that is not UTF-8 (written by another program) fails
    the whole read in :mod:`sqlite3` ("Could not decode to UTF-8"), where the row alone is
    unreadable (:func:`_stored_replay`)."""
    return ", ".join(f"typeof({table}.{name}), CASE typeof({table}.{name}) WHEN 'text'"
                     f" THEN CAST({table}.{name} AS BLOB) ELSE {table}.{name} END"
                     for name in REPLAY_FIELDS)


def _stored_replay(cells: Sequence[Any]) -> dict[str, Any]:
    """A replay from its row's :func:`_replay_columns` (:func:`replay_record`)."""
    fields: dict[str, Any] = {}
    for name, kind, value in zip(REPLAY_FIELDS, cells[0::2], cells[1::2], strict=True):
        if kind == "text":
            try:
                value = bytes(value).decode()
            except UnicodeDecodeError:
                return {UNREADABLE: f"its {name} holds text that is not UTF-8"}
        fields[name] = value
    return replay_record(fields)


def last_replay(replay: dict[str, Any] | None) -> tuple[Any, str | None]:
    """What a letter's summary says of its last replay (``None``: none): ``last_replay``,
    its error, else its status (``"unreadable"`` when its record cannot be read), and
    ``unreadable_replay``, what is wrong with that record (else ``None``)."""
    if replay is None:
        return None, None
    if UNREADABLE in replay:
        return UNREADABLE, replay[UNREADABLE]
    return replay["error"] if replay["error"] is not None else replay["status"], None


def _last_of(cells: Sequence[Any]) -> tuple[Any, str | None]:
    """:func:`last_replay` of a replay row's columns, as they are, without the record
    :func:`replay_record` would make of them: a list reads one for each letter (a review:
    that and a slower query doubled the time of a list of 100,000)."""
    at, status, error, took = cells
    # A record as Sluice writes it passes this one test, a subset of _replay_problem's (a
    # float at and duration in range, an int status from 0 to 999, error text or null).
    if (type(at) is float and 0 <= at < LAST_REPLAY_AT and type(took) is float
            and 0 <= took < math.inf and (error is None or type(error) is str)
            and ((type(status) is int and 0 <= status <= 999)
                 or (status is None and error is not None))):
        return error if error is not None else status, None
    problem = _replay_problem(at, status, error, took)
    if problem is not None:
        return UNREADABLE, problem
    return error if error is not None else int(status), None


def _last_of_stored(cells: Sequence[Any]) -> tuple[Any, str | None]:
    """:func:`last_replay` of a replay row's :func:`_replay_columns`."""
    return last_replay(_stored_replay(cells))


def letters_in(path: str, busy_timeout_s: float = 1.0) -> int | None:
    """How many dead letters the SQLite file at ``path`` holds, read without creating the
    file or its tables (a server on another backend must not leave one behind); ``None``
    when there is no file, or it is no dead-letter file, or it stayed locked longer than
    ``busy_timeout_s`` seconds. Never raises."""
    if not os.path.isfile(path):
        return None
    try:
        with _reading(path, busy_timeout_s) as db:
            return int(db.execute("SELECT COUNT(*) FROM dead_letters").fetchone()[0])
    except sqlite3.Error:
        return None


class NotADeadLetterFile(Exception):
    """The file is a SQLite database (an empty file reads as one) without the
    ``dead_letters`` table: another application's, or none yet."""


#: The columns of every dead-letter file's ``dead_letters`` table (``key_origin``, added
#: later, is added when a file without it is opened for writing).
_LETTER_COLUMNS = frozenset({
    "id", "created_at", "route", "tenant", "run", "idempotency_key", "request_id", "method",
    "path", "headers", "redacted", "body", "body_size", "attempts", "reason"})


def check_dead_letter_file(path: str, busy_timeout_s: float = 5.0) -> None:
    """Check that the existing file at ``path`` is a dead-letter file (it has the
    ``dead_letters`` table, with its columns) by reading it only, before
    :class:`DeadLetterFile` opens it: that would add the tables to any SQLite database and
    switch it to WAL mode for good (``sluice dlq list --file app.db``).

    Raises:
        NotADeadLetterFile: it is no SQLite database, or one (or an empty file) without
            that table, or with a table of that name that lacks its columns.
        sqlite3.Error: there is no file there, or it stayed locked longer than
            ``busy_timeout_s`` seconds.
    """
    try:
        with _reading(path, busy_timeout_s) as db:
            columns = {row[1] for row in db.execute("PRAGMA table_info(dead_letters)")}
    except sqlite3.DatabaseError as exc:
        if getattr(exc, "sqlite_errorname", None) != "SQLITE_NOTADB":
            raise
        raise NotADeadLetterFile(f"{path} is no Sluice dead-letter file (it is no SQLite "
                                 "database)") from None
    if not columns:
        raise NotADeadLetterFile(f"{path} is no Sluice dead-letter file (it holds no "
                                 "dead_letters table)")
    if missing := _LETTER_COLUMNS - columns:
        # Another application's table of that name: opened, it was switched to WAL mode
        # and then failed on "no such column: route" (a new user's trial).
        raise NotADeadLetterFile(f"{path} is no Sluice dead-letter file (its dead_letters "
                                 f"table has no {', '.join(sorted(missing))} column)")


@contextlib.contextmanager
def _reading(path: str, busy_timeout_s: float) -> Iterator[sqlite3.Connection]:
    """A connection to the existing SQLite file at ``path`` that creates nothing when it
    opens (no file, no table, no journal mode set), closed at the end of the block: it
    changes no schema or letter (a ``-wal`` file left there is checkpointed at close).

    Raises:
        sqlite3.Error: there is no file there (``unable to open database file``).
    """
    # mode=rw, not ro: a read-only connection leaves the -wal and -shm files behind.
    db = sqlite3.connect(f"file:{quote(path)}?mode=rw", uri=True, timeout=busy_timeout_s)
    try:
        yield db
    finally:
        db.close()


def corrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's ``database disk image is malformed`` (``SQLITE_CORRUPT``
    and its extended codes): pages of the file are damaged."""
    name = getattr(exc, "sqlite_errorname", None) or ""
    return isinstance(exc, sqlite3.DatabaseError) and name.startswith("SQLITE_CORRUPT")


#: Problems ``PRAGMA quick_check`` lists at most in :func:`damage`.
_PROBLEMS_SHOWN = 3


def damage(path: str, busy_timeout_s: float = OPEN_BUSY_TIMEOUT_S,
           connected: Callable[[sqlite3.Connection], object] | None = None) -> str | None:
    """What ``PRAGMA quick_check`` finds wrong with the SQLite file at ``path`` (its first
    problems, ``; ``-joined), or ``None`` when it finds nothing. It reads every page: about
    0.4 s for 400 MB in the page cache, 7 s from disk (100k letters of 2 KiB bodies), so
    the server runs it in the background, once at start, and the commands only when a
    letter they were asked for is not found or a read fails. ``connected`` is given the
    check's own connection as it starts (to ``interrupt()`` it from another thread).

    Raises:
        sqlite3.Error: the file could not be read for another reason (no file, locked past
            ``busy_timeout_s``, the check interrupted).
    """
    with _reading(path, busy_timeout_s) as db:
        if connected is not None:
            connected(db)
        try:
            rows = db.execute(f"PRAGMA quick_check({_PROBLEMS_SHOWN})").fetchall()
        except sqlite3.DatabaseError as exc:
            if corrupt(exc) or getattr(exc, "sqlite_errorname", None) == "SQLITE_NOTADB":
                return str(exc)
            raise
    # A row can hold several lines, the first naming the database ("*** in database main").
    problems = [line for row in rows for line in str(row[0]).splitlines()
                if not line.startswith("***")]
    return None if problems == ["ok"] else "; ".join(problems[:_PROBLEMS_SHOWN])


def recover_hint(path: str) -> str:
    """How to get the letters a damaged file still holds into a new one (Sluice stopped)."""
    quoted, new = shlex.quote(path), shlex.quote(f"{path}.recovered")
    return (f"with Sluice stopped, recover what it holds with `sqlite3 {quoted} .recover | "
            f"sqlite3 {new}` and move {new} to {quoted} (or move the damaged file away to "
            f"start an empty one)")


class UnreadableLetter(Exception):
    """A letter's row holds what this version never writes (its headers or attempts not
    JSON of their shape): a file written by something else, or edited by hand. Its message
    is the Redis store's for such a letter, and names no value."""


@contextlib.contextmanager
def _readable() -> Iterator[None]:
    """Turn a failure to decode a letter's row into :class:`UnreadableLetter` (orjson's
    ``JSONDecodeError`` is a ``ValueError``)."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as exc:
        raise UnreadableLetter(f"a dead letter holds what Sluice cannot read "
                               f"({type(exc).__name__})") from None


class DamagedFile(Exception):
    """The dead-letter file is damaged (``PRAGMA quick_check`` finds problems): what a
    command reads of it cannot be trusted, a letter it does not find may be in a damaged
    page."""

    def __init__(self, path: str, problems: str) -> None:
        super().__init__(f"the dead-letter file {path} is damaged ({problems}); "
                         f"{recover_hint(path)}")
        self.path = path
        self.problems = problems


def _inode(path: str) -> tuple[int, int] | None:
    """The device and inode of the file at ``path``; ``None`` if there is none or it cannot
    be told (then the open file is kept)."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return (-1, -1)  # gone: no file is the open one
    except (OSError, ValueError):
        return None
    return (status.st_dev, status.st_ino)


class LetterNotKept(Exception):
    """A letter the server could not keep for a locked SQLite file: as many letters or bytes
    as it holds at most (``MAX_HELD_LETTERS``, ``MAX_HELD_BYTES``) were held already, or the
    server stopped before the file took it."""


def locked(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's ``database is locked`` (``SQLITE_BUSY``, or
    ``SQLITE_LOCKED``, and their extended codes): another connection holds the lock, and
    the same write can succeed once it lets go."""
    name = getattr(exc, "sqlite_errorname", None) or ""
    return isinstance(exc, sqlite3.OperationalError) and (
        name.startswith("SQLITE_BUSY") or name.startswith("SQLITE_LOCKED"))


class _CheckStopped(Exception):
    """The store was closed before its damage check connected: the check does not start."""


class _Held(NamedTuple):
    """A letter waiting for the server's writer, and what its :meth:`DeadLetterQueue.add`
    awaits."""

    letter: DeadLetter
    size: int
    written: asyncio.Future[Added]


def _size(letter: DeadLetter) -> int:
    """The bytes of ``letter`` a held copy keeps: its body (as cut), headers and path."""
    return (len(letter.body) + len(letter.path)
            + sum(len(name) + len(value) for name, value in letter.headers))


class DeadLetterQueue:
    """The server's side: the SQLite file, written on one thread of its own off the event
    loop, or the Redis Stream of a Redis state backend.

    Args:
        config: the ``dead_letter`` block.
        state: the server's state; with Redis, letters go to its stream and the file is unused.
        refresh_s: seconds between two reads of the depth from the store.
    """

    def __init__(self, config: DeadLetterConfig, state: StateBackends | None = None,
                 refresh_s: float = DEPTH_REFRESH_S) -> None:
        self.path = config.path
        self.max_body_bytes = config.max_body_bytes
        self.max_records = config.max_records
        #: A tenant's share; ``None`` when unset or the whole store: a tenant then holds
        #: more only when the store does, and the drop is the store bound's (so counted).
        share = config.max_records_per_tenant
        self.max_per_tenant = share if share is not None and share < config.max_records else None
        #: Letters dropped since start, by route and the bound that dropped them
        #: (``max_records``, or ``max_records_per_tenant``: a tenant's share) (a counter).
        self.dropped: dict[tuple[str, str], int] = {}
        self._depth: dict[str, int] = {}
        self._state = state
        self._shared = state.dead_letters if state is not None and state.redis else None
        self._file: DeadLetterFile | None = None
        self._writes: set[asyncio.Future[Added]] = set()
        #: Letters for the file not written yet, oldest first (one writer, in order).
        self._held: collections.deque[_Held] = collections.deque()
        self._held_bytes = 0
        self._writer: asyncio.Task[None] | None = None
        self._locked_since: float | None = None  # monotonic; while the file refuses writes
        self._stopping = False
        self._checking: asyncio.Task[None] | None = None
        self._checked_on: sqlite3.Connection | None = None  # the check's, to interrupt it
        self._closing = False  # set by close: a check not connected yet does not start
        #: Letters lost since start because they could not be kept for a locked file
        #: (``MAX_HELD_LETTERS`` or ``MAX_HELD_BYTES`` reached, or still held at shutdown).
        self.not_kept = 0
        self.refresh_s = refresh_s
        self._refreshing: asyncio.Task[None] | None = None  # every refresh_s, once open
        self._reading: asyncio.Future[None] | None = None  # one read after drops at a time
        self._opening: asyncio.Future[None] | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sluice-dlq"
        )

    def depth(self, route: str) -> int:
        """Records of ``route`` in the store (for the depth gauge), as last read from it (at
        start, every ``refresh_s`` and after drops) plus this replica's writes since."""
        return self._depth.get(route, 0)

    async def refresh(self) -> None:
        """Read the depth of every route from the store again; an unavailable store leaves
        the last count in place until the next read."""
        # Imported here: the state package imports this module's records.
        from policies.state import StateUnavailable

        try:
            if self._shared is not None:
                depth = await self._shared.depth()
            elif self._file is not None:
                depth = await self._run(self._file.depth)
            else:
                return
        except StateUnavailable:
            return  # the state backend logs its own outage
        except sqlite3.Error as exc:
            log.warning("dead-letter depth not read from %s: %s", self.path, exc)
            return
        self._depth = depth

    async def open(self) -> None:
        """Open (or create) the file and read the current depth, once: concurrent callers
        share one opening, and a failed one is tried again by the next caller.

        Raises:
            sqlite3.Error: the file cannot be opened or created (the shared stream never
                raises here: an unavailable Redis leaves the depth at 0 until it answers).
        """
        if self._opening is None or (self._opening.done() and self._file is None):
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)

    async def _open(self) -> None:
        if self._shared is None:
            file = await self._run(DeadLetterFile, self.path)
            await self._run(file.wait_for_locks, WRITE_BUSY_TIMEOUT_S)
            self._depth = await self._run(file.depth)
            self._file = file
            if self._checking is None:
                self._checking = asyncio.create_task(self._check(), name="sluice-dlq-check")
        else:
            await self.refresh()
        if self._refreshing is None:
            self._refreshing = asyncio.create_task(self._refresh_every(),
                                                   name="sluice-dlq-depth")

    async def _refresh_every(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def _check(self) -> None:
        """Check the file for damage once, on a thread and a connection of its own (it
        reads every page: seconds for a large file; the writer goes on meanwhile, WAL
        letting both), and warn if it is damaged: opening it and reading its depth read a
        few pages only, and a server whose file had a damaged page started, reported ready
        and wrote letters that ``sluice dlq`` could not read, without a word."""
        def connected(db: sqlite3.Connection) -> None:
            self._checked_on = db
            # Looked at after _checked_on is set, as close sets the flag before it looks at
            # _checked_on: a close either sees the connection to interrupt, or is seen here.
            if self._closing:
                raise _CheckStopped

        started = time.monotonic()
        try:
            # A short wait for a lock: an interrupt does not end SQLite's wait for one, and a
            # close waited out the 5 s of a file another process held locked (a clean-clone
            # run); a locked file is checked at the next start.
            found = await asyncio.to_thread(damage, self.path, WRITE_BUSY_TIMEOUT_S, connected)
        except _CheckStopped:
            return  # closed before the check started
        except sqlite3.Error as exc:
            if self._closing:
                return  # interrupted: the server is stopping
            log.warning("dead-letter file %s not checked for damage: %s", self.path, exc)
            return
        finally:
            self._checked_on = None
        if found is None:
            log.debug("dead-letter file %s checked, no damage found (%.2fs)", self.path,
                      time.monotonic() - started)
            return
        log.error("dead-letter file %s is damaged (%s): letters written to it may be lost, "
                  "and `sluice dlq` cannot read them all; %s", self.path, found,
                  recover_hint(self.path))

    def _refresh_soon(self) -> None:
        """Read the depth after a write that dropped letters: with a shared stream, what
        this replica counted is not what the stream holds. One read at a time: writes
        dropping letters while one is under way are counted by arithmetic meanwhile."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self.refresh())

    async def add(self, letter: DeadLetter) -> int:
        """Write ``letter`` (its body cut to ``max_body_bytes`` here, the oldest letters of
        its tenant beyond its share, then the oldest beyond ``max_records``, dropped with it)
        and return its id.

        The write completes even if the awaiting request is cancelled meanwhile. A letter
        for a file another process keeps locked is held in memory (``MAX_HELD_LETTERS``,
        ``MAX_HELD_BYTES``) and written, after those before it, once the lock is gone.

        Raises:
            LetterNotKept: the file is locked and as many letters as are held at most are
                held already, or the server stopped before the file took it.
            sqlite3.Error: the file could not be written for another reason (a full disk,
                a damaged file).
            StateUnavailable: the shared stream did not answer (Redis).
        """
        letter.body_size = len(letter.body)
        letter.body = letter.body[: self.max_body_bytes]
        write: asyncio.Future[Added]
        if self._shared is not None:
            write = asyncio.ensure_future(
                self._shared.add(letter, self.max_records, self.max_per_tenant))
            self._writes.add(write)  # the loop keeps only a weak reference to a task
            write.add_done_callback(self._writes.discard)
            assert self._state is not None
            self._state.keep(write)  # shutdown waits for it (StateBackends.close)
        else:
            if self._file is None and not self._stopping:  # a reload gave a route its
                await self.open()  # first retry block (not after close: _hold refuses it)
            write = self._hold(letter)
        route, tenant = letter.route, letter.tenant

        def count(done: asyncio.Future[Added]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            self._depth[route] = self._depth.get(route, 0) + 1
            added = done.result()
            for name, n in added.tenant_dropped.items():
                self._count_dropped(name, "max_records_per_tenant", n)
                # PER_CALL: once a tenant's share is full, each of its new letters drops one.
                log.warning("dead-letter share of tenant %s full "
                            "(dead_letter.max_records_per_tenant: %d): its oldest letters of "
                            "route %s are dropped to keep its newest", tenant,
                            self.max_per_tenant, name, extra=PER_CALL)
            for name, n in added.dropped.items():
                self._count_dropped(name, "max_records", n)
                # PER_CALL: once the store is full, every new letter drops one.
                log.warning("dead-letter store full (dead_letter.max_records: %d): the "
                            "oldest letters of route %s are dropped to keep the newest",
                            self.max_records, name, extra=PER_CALL)
            if added.dropped or added.tenant_dropped:
                self._refresh_soon()

        write.add_done_callback(count)
        return (await asyncio.shield(write)).id

    def _count_dropped(self, route: str, bound: str, n: int) -> None:
        self._depth[route] = max(0, self._depth.get(route, 0) - n)
        self.dropped[route, bound] = self.dropped.get((route, bound), 0) + n

    def _hold(self, letter: DeadLetter) -> asyncio.Future[Added]:
        """Put ``letter`` in line for the writer; a future of its write, failed at once with
        :class:`LetterNotKept` when the line is full (or the server is stopping)."""
        written: asyncio.Future[Added] = asyncio.get_running_loop().create_future()
        size = _size(letter)
        if self._stopping or len(self._held) >= MAX_HELD_LETTERS or (
                self._held and self._held_bytes + size > MAX_HELD_BYTES):
            self.not_kept += 1
            written.set_exception(LetterNotKept(
                f"the server is stopping: {self.path} takes no more letters" if self._stopping
                else f"{len(self._held)} letter(s), {self._held_bytes} bytes, are held for "
                f"{self.path} already (at most {MAX_HELD_LETTERS} letters, {MAX_HELD_BYTES} "
                f"bytes), the file {self._state_said()}"))
            return written
        self._held.append(_Held(letter, size, written))
        self._held_bytes += size
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_held(), name="sluice-dlq-writer")
        return written

    async def _write_held(self) -> None:
        """Write the held letters, oldest first, each once the file takes it: a try refused
        for another process's lock is made again (the letter stays first in line), any other
        failure loses that letter only. Ends when none is left, or the server stops."""
        while self._held and not self._stopping:
            held = self._held[0]
            try:
                # In the try: a writer that died here left its letters' callers waiting.
                if self._file is None:
                    raise LetterNotKept(f"the server stopped before {self.path} took it")
                added = await self._run(self._file.add, held.letter, self.max_records,
                                        self.max_per_tenant)
            except Exception as exc:  # handed to the letter's caller
                if locked(exc):
                    self._note_locked()
                    await asyncio.sleep(RETRY_PAUSE_S)
                    continue
                self._release()
                held.written.set_exception(exc)
                continue
            self._note_free()
            self._release()
            held.written.set_result(added)

    def _release(self) -> None:
        held = self._held.popleft()
        self._held_bytes -= held.size

    def _state_said(self) -> str:
        """Why letters are held, as the log and :class:`LetterNotKept` say it: the file
        locked by another process (its last try refused), or slow to take them (writing)."""
        return ("locked by another process" if self._locked_since is not None
                else "slow to take them")

    def _note_locked(self) -> None:
        if self._locked_since is None:
            self._locked_since = time.monotonic()
            log.warning("dead-letter file %s is locked by another process: its letters are "
                        "held in memory (at most %d, %d MiB) and written, in order, once the "
                        "lock is gone", self.path, MAX_HELD_LETTERS, MAX_HELD_BYTES >> 20)

    def _note_free(self) -> None:
        if self._locked_since is not None:
            log.warning("dead-letter file %s is free again after %.1fs: the letters held "
                        "for it are being written (%d left)", self.path,
                        time.monotonic() - self._locked_since, len(self._held) - 1)
            self._locked_since = None

    async def _flush(self, until: float | None, cut: asyncio.Event | None) -> None:
        """Let the writer write what is held until ``until`` (monotonic; ``FLUSH_MIN_S``
        from now at least), or until ``cut`` is set (a second stop signal; one that came
        before brought ``until`` to the drain's cut already), then stop it; letters still
        held are lost, and said so."""
        started = time.monotonic()
        budget = max(FLUSH_MIN_S, (until or 0.0) - started)
        cut_now = cut is not None and not cut.is_set()
        if self._held and self._writer is not None and not self._writer.done():
            # Said: the drain said "drained", and a wait of drain_timeout without a word
            # looked like a hang (and a second Ctrl-C was not heard here).
            log.warning("%d dead letter(s) held for %s, %s; waiting up to %.1fs for it to "
                        "take them%s", len(self._held), self.path, self._state_said(), budget,
                        "; a second SIGTERM or Ctrl-C ends the wait" if cut_now else "")
            waits: set[asyncio.Future[Any]] = {self._writer}
            if cut_now:
                assert cut is not None
                waits.add(asyncio.ensure_future(cut.wait()))
            try:
                await asyncio.wait(waits, timeout=budget, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in waits - {self._writer}:
                    waiting.cancel()
        if self._writer is not None and not self._writer.done():
            # Not cancelled: the try under way on the store's thread would go on, and a
            # letter it wrote would be said lost. It ends within WRITE_BUSY_TIMEOUT_S.
            self._stopping = True
            await asyncio.gather(self._writer, return_exceptions=True)
        if not self._held:  # (any left by a writer that ended are lost below, not left)
            return
        ids = [held.letter.request_id for held in self._held]
        said = self._state_said()
        log.error("dead-letter file %s %s at shutdown, after %.1fs%s: %d letter(s) "
                  "held for it are lost (requests %s)", self.path, f"still {said}",
                  time.monotonic() - started,
                  " (a second stop signal ended the wait)" if cut_now and cut.is_set()
                  else "", len(ids), ", ".join(ids))
        while self._held:
            held = self._held[0]
            self._release()
            self.not_kept += 1
            held.written.set_exception(LetterNotKept(
                f"the server stopped with {self.path} still {said}"))
        await asyncio.sleep(0)  # their callbacks (events, counts) run before the log closes

    async def close(self, flush_until: float | None = None,
                    cut: asyncio.Event | None = None) -> None:
        """Stop reading the depth, write the letters held for a locked file until
        ``flush_until`` (monotonic seconds; ``FLUSH_MIN_S`` from now at least; those still
        held then are lost, logged, and their writes fail with :class:`LetterNotKept`; or
        until ``cut`` is set, if it is not yet: a second stop signal),
        finish pending writes and close the file (the shared stream's connection is the
        state backend's, closed with it). The damage check is stopped, not waited for."""
        self._closing = True  # before _checked_on is looked at (_check's ``connected``)
        for task in (self._refreshing, self._reading):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        try:
            # A check of a large file is not waited for: interrupted, again until it ends
            # (an interrupt that comes before its statement starts is lost). One not
            # connected yet sees _closing and does not start.
            while self._checking is not None and not self._checking.done():
                if (db := self._checked_on) is not None:
                    # Closed already, the check ending (ProgrammingError): nothing to stop.
                    with contextlib.suppress(sqlite3.ProgrammingError):
                        db.interrupt()
                await asyncio.wait((self._checking,), timeout=CHECK_INTERRUPT_EVERY_S)
            if self._checking is not None:
                await asyncio.gather(self._checking, return_exceptions=True)
            await self._flush(flush_until, cut)
        finally:
            # Whatever failed above, the file is closed and the thread ends: a close that
            # raised before them left the thread behind (and the runtime's close stopped).
            self._stopping = True  # a letter added from now on is refused, not reopened
            file, self._file = self._file, None
            try:
                if file is not None:
                    await self._run(file.close)
            except sqlite3.Error as exc:
                log.warning("dead-letter file %s not closed cleanly: %s", self.path, exc)
            finally:
                self._thread.shutdown(wait=True)

    def _run(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
