"""Idempotency records and in-flight markers shared by every replica.

What :mod:`policies.idempotency` keeps per process, made shared: for each key (the caller
scopes it, e.g. ``route + tenant + Idempotency-Key``)

* a *record* (:class:`Answer`): ``SEEN`` (used, no outcome kept), ``DONE`` (the upstream's
  answer: status, reason, headers, body) or ``TOO_LARGE`` (answered, body not kept); the
  kinds are :mod:`policies.idempotency_store`'s. It expires ``ttl_s`` after it was written;
* an *in-flight marker*: one request holds the key while it runs (``SET NX PX``, renewed with
  :meth:`IdempotencyRecords.renew` for long calls), carrying the request's payload
  fingerprint so that a different payload is told apart at once (422) even mid-flight. A
  replica that dies leaves a marker that lapses after its ``flight_s``.

:meth:`IdempotencyRecords.begin` is the one decision, atomic: *in flight* (someone holds the
key), *done* (a final record to replay or refuse), or *claimed* (this request now holds the
key; a ``SEEN`` record, if any, is returned so the caller knows it is a retry). A duplicate
that should wait calls :func:`wait_for_answer`: it watches the key's channel (``finish``
publishes on it) and calls ``begin`` again on every wake-up and at least every poll interval,
until the key is done, becomes free (then it holds it: the first request left without an
answer to keep, and this one runs its own), the request it waited for *failed* (below), or
the timeout passes.

A request that ends with a failure, nothing kept (an upstream 5xx after Sluice's retries...),
leaves that failure beside its ``SEEN`` record for a lease, under its owner token
(``finish``'s ``failure``). A waiter names the owner whose marker it waited on
(``begin``'s ``waited_on``), and only such a waiter is given it (*failed*): the duplicates
that waited for that call, on any replica, get its failure instead of each running the call
again in turn, while a request that arrives after it names no one and finds the key free. No
clock is compared: the token tells which call a waiter waited for.

Redis layout, one hash slot per key (the tag is a digest of the key, as keys may hold any
character): ``<prefix>:{<digest>}:idem`` the record (a hash), ``...:idem:flight`` the marker
(a string ``<fingerprint hex>|<owner>``), ``...:idem:failed`` the failure of the last call
that ended with one (a hash: its owner and the answer's fields; it lapses after a lease),
channel ``...:idem:done``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import orjson

from policies.idempotency_store import DONE, SEEN, TOO_LARGE
from policies.state.connection import RedisState, Script
from policies.state.notify import MemoryNotifier, Signal
from policies.state.stored import built, stored_hex, stored_text

__all__ = [
    "CLAIMED",
    "DONE",
    "FAILED",
    "FINISHED",
    "IN_FLIGHT",
    "SEEN",
    "TOO_LARGE",
    "Answer",
    "Begin",
    "IdempotencyRecords",
    "MemoryIdempotencyRecords",
    "RedisIdempotencyRecords",
    "new_owner",
    "wait_for_answer",
]

#: :attr:`Begin.state` values (the record kinds SEEN, DONE, TOO_LARGE are
#: :mod:`policies.idempotency_store`'s, re-exported here).
CLAIMED = "claimed"
IN_FLIGHT = "in_flight"
FINISHED = "done"
FAILED = "failed"


class Answer(NamedTuple):
    """A record: ``kind`` is SEEN, DONE or TOO_LARGE; ``fingerprint`` the SHA-256 of the
    request that made it (bytes; may be empty); ``headers`` a tuple of ``(name, value)``."""

    kind: int
    fingerprint: bytes
    status: int = 0
    reason: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""


class Begin(NamedTuple):
    """The standing of a request with its key, from :meth:`IdempotencyRecords.begin`.

    Attributes:
        state: ``claimed`` (this request holds the key now), ``in_flight`` (another request
            holds it), ``done`` (a final record exists) or ``failed`` (the request it waited
            for ended with a failure, not kept: ``begin``'s ``waited_on``).
        answer: the record: a ``SEEN`` one when claimed after an earlier use, the ``DONE`` or
            ``TOO_LARGE`` one when done, the failure (``DONE``) when failed; ``None``
            otherwise.
        fingerprint: when in flight, the fingerprint of the request holding the key.
        ttl_s: seconds until the record expires (done), or the marker lapses (in flight).
        owner: when in flight, the owner token of the request holding the key (``""`` for a
            marker lost: ``expected``).
    """

    state: str
    answer: Answer | None = None
    fingerprint: bytes = b""
    ttl_s: float = 0.0
    owner: str = ""


class IdempotencyRecords(Protocol):
    """Shared records and markers. Every async method is one round trip.

    Raises (every async method):
        StateUnavailable: the backend did not answer in time (Redis only).
    """

    async def begin(self, key: str, owner: str, fingerprint: bytes,
                    flight_s: float, expected: bool = False, waited_on: str = "") -> Begin:
        """Decide the request's standing, claiming the key (marker for ``flight_s``) when it
        is neither in flight nor done; ``failed`` instead when the key is free and the request
        ``waited_on`` (the owner of the marker this one waited on) left a failure
        (:meth:`finish`). ``owner`` identifies this request (random, unique);
        beginning again with the owner that holds the marker renews it. An empty
        ``fingerprint`` (``mode: serialize``, which replays nothing) is never ``done``: a
        stored answer (kept from ``dedup`` before a reload) does not stop it claiming.

        ``expected``: the caller saw another request's marker that has not lapsed yet. A key
        with neither that marker nor a record then was not freed (a request's end always
        leaves a record) but lost (Redis restarted empty, flushed, evicted): it is answered
        ``in_flight`` (no fingerprint, no ttl), not claimed, as the request that holds it
        takes its marker again once its replica sees Redis back, or at its next renewal."""
        ...

    async def renew(self, key: str, owner: str, flight_s: float) -> bool:
        """Extend ``owner``'s marker; ``False`` if it no longer holds it."""
        ...

    async def finish(self, key: str, owner: str, answer: Answer, ttl_s: float,
                     strict: bool = False, failure: Answer | None = None,
                     failure_s: float = 0.0) -> bool:
        """Store ``answer`` for ``ttl_s`` seconds, drop ``owner``'s marker and wake waiters.

        ``failure``: with a ``SEEN`` answer, the failure the request ended with, given for
        ``failure_s`` seconds to the requests that waited on ``owner``'s marker
        (``begin``'s ``waited_on``); kept only while ``owner`` held the marker.

        No answer replaces a final one: another replica's request may have finished
        meanwhile (this ``owner``'s marker lapsed while its replica stalled, and the request
        that took the key over stored its answer, which its caller was given): the key's
        answer stays the first stored. ``strict``: store it only while the marker is
        ``owner``'s or no one's (a write tried again late must not pre-empt a request that
        took the key over and still runs).
        Returns whether ``owner`` still held the marker.
        """
        ...

    async def seen(self, key: str, ttl_s: float) -> bool:
        """Record a ``SEEN`` use if the key has no record (mode ``forward``); ``True`` if it
        had none (the request is new work)."""
        ...

    async def get(self, key: str) -> Answer | None:
        """The record, or ``None``."""
        ...

    def watch(self, key: str) -> contextlib.AbstractAsyncContextManager[Signal]:
        """A signal set when ``key``'s request finishes on any replica."""
        ...


def new_owner() -> str:
    """A random owner token (128 bits, hex)."""
    return os.urandom(16).hex()


async def wait_for_answer(records: IdempotencyRecords, key: str, owner: str,
                          fingerprint: bytes, flight_s: float, timeout_s: float,
                          poll_s: float = 0.25, lapses_in_s: float = 0.0,
                          holder: str = "") -> Begin:
    """Wait until ``key`` is no longer in flight, for at most ``timeout_s`` seconds.

    Returns the last :class:`Begin`: ``done`` (replay or refuse it), ``claimed`` (the key was
    freed without an answer and this request holds it now; run it and ``finish``),
    ``failed`` (the request it waited for, ``holder`` or whoever held the key after, ended
    with a failure: answer with it), or ``in_flight`` when the timeout passed, or at once
    when the request in flight has another fingerprint (the caller answers 422; not when
    either is empty, which compares no payloads: a call of ``mode: serialize``).

    Until the marker last seen (``lapses_in_s``: the in-flight look-up's ttl that made the
    caller wait, seconds) would lapse, a key found with neither marker nor record is not
    claimed (``expected`` of :meth:`IdempotencyRecords.begin`): after a Redis restart or
    flush, waiters claimed every such key and ran its call a second time while the first
    still ran (a hostile trial: 10 of 10 keys), before the first's replica took its marker
    again.

    Raises:
        StateUnavailable: the backend did not answer (Redis only).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    lapse_at = loop.time() + lapses_in_s
    async with records.watch(key) as finished:
        while True:
            begin = await records.begin(key, owner, fingerprint, flight_s,
                                        loop.time() < lapse_at, holder)
            if begin.state == IN_FLIGHT and begin.ttl_s > 0:
                lapse_at = loop.time() + begin.ttl_s
            if begin.owner:
                holder = begin.owner
            left = deadline - loop.time()
            if (begin.state != IN_FLIGHT or left <= 0 or (
                    fingerprint and begin.fingerprint and begin.fingerprint != fingerprint)):
                return begin
            await finished.wait(min(poll_s, left))


# -- memory -----------------------------------------------------------------------------------


class MemoryIdempotencyRecords:
    """Records and markers of one process; nothing suspends.

    Args:
        clock: seconds (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: dict[str, tuple[Answer, float]] = {}
        self._flights: dict[str, tuple[str, bytes, float]] = {}  # owner, fingerprint, expiry
        self._failed: dict[str, tuple[str, Answer, float]] = {}  # owner, failure, expiry
        self.notifier = MemoryNotifier()

    def _record(self, key: str, now: float) -> tuple[Answer, float] | None:
        entry = self._records.get(key)
        if entry is not None and entry[1] <= now:
            del self._records[key]
            return None
        return entry

    def _flight(self, key: str, now: float) -> tuple[str, bytes, float] | None:
        entry = self._flights.get(key)
        if entry is not None and entry[2] <= now:
            del self._flights[key]
            return None
        return entry

    async def begin(self, key: str, owner: str, fingerprint: bytes,
                    flight_s: float, expected: bool = False, waited_on: str = "") -> Begin:
        now = self._clock()
        flight = self._flight(key, now)
        if flight is not None and flight[0] == owner:
            self._flights[key] = (owner, flight[1], now + flight_s)
            return Begin(CLAIMED)
        record = self._record(key, now)
        failed = self._failed.get(key) if waited_on else None
        if failed is not None and failed[2] <= now:
            del self._failed[key]
        elif (failed is not None and failed[0] == waited_on
                and (record is None or record[0].kind == SEEN)):
            # (Whoever took the key since: this request waited for that call, which failed.)
            return Begin(FAILED, failed[1])
        if flight is not None:
            return Begin(IN_FLIGHT, None, flight[1], flight[2] - now, flight[0])
        if record is None and expected:
            return Begin(IN_FLIGHT)
        if record is not None and record[0].kind != SEEN and fingerprint:
            return Begin(FINISHED, record[0], b"", record[1] - now)
        self._flights[key] = (owner, fingerprint, now + flight_s)
        return Begin(CLAIMED, None if record is None else record[0])

    async def renew(self, key: str, owner: str, flight_s: float) -> bool:
        now = self._clock()
        flight = self._flight(key, now)
        if flight is None or flight[0] != owner:
            return False
        self._flights[key] = (owner, flight[1], now + flight_s)
        return True

    async def finish(self, key: str, owner: str, answer: Answer, ttl_s: float,
                     strict: bool = False, failure: Answer | None = None,
                     failure_s: float = 0.0) -> bool:
        now = self._clock()
        record = self._record(key, now)
        flight = self._flight(key, now)
        held = flight is not None and flight[0] == owner
        if (record is None or record[0].kind == SEEN) and (not strict or held or flight is None):
            self._records[key] = (answer, now + ttl_s)
        if held:
            del self._flights[key]
            if failure is not None and answer.kind == SEEN:
                self._failed[key] = (owner, failure, now + failure_s)
        self.notifier.publish(key)
        return held

    async def seen(self, key: str, ttl_s: float) -> bool:
        now = self._clock()
        if self._record(key, now) is not None:
            return False
        self._records[key] = (Answer(SEEN, b""), now + ttl_s)
        return True

    async def get(self, key: str) -> Answer | None:
        record = self._record(key, self._clock())
        return None if record is None else record[0]

    def watch(self, key: str) -> contextlib.AbstractAsyncContextManager[Signal]:
        return self.notifier.watch(key)


# -- redis ------------------------------------------------------------------------------------

_FIELDS = "'kind', 'fp', 'status', 'reason', 'headers', 'body'"

# KEYS: record, marker, failure. ARGV: owner, fingerprint hex (empty: serialize, never done),
# flight ms, expected ('1'), waited on (the owner whose marker the caller waited on, or '').
# Returns {1 claimed, seen fields...} | {2 in flight, fingerprint hex, marker ttl ms, owner}
#       | {3 done, record fields..., record ttl ms} | {4 failed, failure fields...}.
_BEGIN = Script("""
local marker = redis.call('GET', KEYS[2])
local bar = marker and string.find(marker, '|', 1, true)
if marker and not bar then bad('an idempotency marker', 'holds no owner') end
if marker and string.sub(marker, bar + 1) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return {1}
end
if ARGV[5] ~= '' then
  local kind = redis.call('HGET', KEYS[1], 'kind')
  if not kind or kind == '0' then
    local failed = redis.call('HMGET', KEYS[3], 'by', """ + _FIELDS + """)
    if failed[1] == ARGV[5] then
      local reply = {4}
      for i = 1, 6 do reply[i + 1] = failed[i + 1] or '' end
      return reply
    end
  end
end
if marker then
  return {2, string.sub(marker, 1, bar - 1), redis.call('PTTL', KEYS[2]),
          string.sub(marker, bar + 1)}
end
local rec = redis.call('HMGET', KEYS[1], """ + _FIELDS + """)
if not rec[1] and ARGV[4] == '1' then return {2, '', -1} end
if rec[1] and rec[1] ~= '0' and ARGV[2] ~= '' then
  local reply = {3}
  for i = 1, 6 do reply[i + 1] = rec[i] or '' end
  reply[8] = redis.call('PTTL', KEYS[1])
  return reply
end
redis.call('SET', KEYS[2], ARGV[2] .. '|' .. ARGV[1], 'NX', 'PX', ARGV[3])
if rec[1] then
  local reply = {1}
  for i = 1, 6 do reply[i + 1] = rec[i] or '' end
  return reply
end
return {1}
""", "idempotency")

# KEYS: marker. ARGV: owner, flight ms.
_RENEW = Script("""
local marker = redis.call('GET', KEYS[1])
if not marker then return 0 end
local bar = string.find(marker, '|', 1, true)
if not bar then bad('an idempotency marker', 'holds no owner') end
if string.sub(marker, bar + 1) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""", "idempotency")

# KEYS: record, marker, failure. ARGV: owner, kind, fingerprint hex, status, reason, headers
# JSON, body, ttl ms, channel, strict ('1': store only if the marker is the owner's or gone),
# then, for a failure given to the owner's waiters (a SEEN record only), its fingerprint hex,
# status, reason, headers JSON, body and how long it is kept, ms.
# Returns 1 if the owner held the marker.
_FINISH = Script("""
local kind = ARGV[2]
local held = 0
local marker = redis.call('GET', KEYS[2])
if marker then
  local bar = string.find(marker, '|', 1, true)
  if not bar then bad('an idempotency marker', 'holds no owner') end
  if string.sub(marker, bar + 1) == ARGV[1] then held = 1 end
end
local current = redis.call('HGET', KEYS[1], 'kind')
if (not current or current == '0') and (ARGV[10] ~= '1' or held == 1 or not marker) then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'kind', kind, 'fp', ARGV[3], 'status', ARGV[4],
             'reason', ARGV[5], 'headers', ARGV[6], 'body', ARGV[7])
  redis.call('PEXPIRE', KEYS[1], ARGV[8])
end
if held == 1 then
  redis.call('DEL', KEYS[2])
  if ARGV[11] and kind == '0' then
    redis.call('DEL', KEYS[3])
    redis.call('HSET', KEYS[3], 'by', ARGV[1], 'kind', '1', 'fp', ARGV[11],
               'status', ARGV[12], 'reason', ARGV[13], 'headers', ARGV[14], 'body', ARGV[15])
    redis.call('PEXPIRE', KEYS[3], ARGV[16])
  end
end
redis.call('PUBLISH', ARGV[9], kind)
return held
""", "idempotency")

# KEYS: record. ARGV: ttl ms. Returns 1 if the key had no record.
_SEEN = Script("""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'kind', '0', 'fp', '', 'status', '0', 'reason', '',
           'headers', '[]', 'body', '')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
""", "idempotency")

_GET = Script("return redis.call('HMGET', KEYS[1], " + _FIELDS + ")", "idempotency")


class RedisIdempotencyRecords:
    """Records and markers in Redis; one ``EVALSHA`` per call on the key's slot."""

    def __init__(self, state: RedisState) -> None:
        self._state = state

    def _group(self, key: str) -> str:
        return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:24]

    def _keys(self, key: str) -> list[str]:
        group = self._group(key)
        return [self._state.key(group, "idem"), self._state.key(group, "idem", "flight"),
                self._state.key(group, "idem", "failed")]

    def channel(self, key: str) -> str:
        """The channel :meth:`finish` publishes on for ``key``."""
        return self._state.key(self._group(key), "idem", "done")

    async def begin(self, key: str, owner: str, fingerprint: bytes,
                    flight_s: float, expected: bool = False, waited_on: str = "") -> Begin:
        return await self._state.eval(_BEGIN, self._keys(key),
                                      [owner, fingerprint.hex(), _ms(flight_s),
                                       "1" if expected else "0", waited_on], _begin)

    async def renew(self, key: str, owner: str, flight_s: float) -> bool:
        return bool(await self._state.eval(_RENEW, self._keys(key)[1:2],
                                           [owner, _ms(flight_s)]))

    async def finish(self, key: str, owner: str, answer: Answer, ttl_s: float,
                     strict: bool = False, failure: Answer | None = None,
                     failure_s: float = 0.0) -> bool:
        args: list[object] = [
            owner, answer.kind, answer.fingerprint.hex(), answer.status, answer.reason,
            orjson.dumps(answer.headers), answer.body, _ms(ttl_s), self.channel(key),
            "1" if strict else "0"]
        if failure is not None:
            args += [failure.fingerprint.hex(), failure.status, failure.reason,
                     orjson.dumps(failure.headers), failure.body, _ms(failure_s)]
        return bool(await self._state.eval(_FINISH, self._keys(key), args))

    async def seen(self, key: str, ttl_s: float) -> bool:
        return bool(await self._state.eval(_SEEN, self._keys(key)[:1], [_ms(ttl_s)]))

    async def get(self, key: str) -> Answer | None:
        return await self._state.eval(
            _GET, self._keys(key)[:1], [],
            lambda fields: None if fields[0] is None else _answer(fields))

    def watch(self, key: str) -> contextlib.AbstractAsyncContextManager[Signal]:
        return self._state.notifier.watch(self.channel(key))


def _begin(reply: list[Any]) -> Begin:
    """:meth:`RedisIdempotencyRecords.begin`'s reply read (``_BEGIN``'s shapes)."""
    state = int(reply[0])
    if state == 1:
        return Begin(CLAIMED, _answer(reply[1:7]) if len(reply) > 1 else None)
    if state == 2:
        return Begin(IN_FLIGHT, None, stored_hex(reply[1], _MARKER),
                     max(int(reply[2]), 0) / 1000,
                     stored_text(reply[3], _MARKER) if len(reply) > 3 else "")
    if state == 4:
        return Begin(FAILED, _answer(reply[1:7]))
    return Begin(FINISHED, _answer(reply[1:7]), b"", max(int(reply[7]), 0) / 1000)


def _answer(fields: list[bytes]) -> Answer:
    """The answer a record's fields hold (a key fault if they hold what Sluice does not
    write there)."""
    return built(_RECORD, _stored_answer, *fields)


def _stored_answer(kind: bytes, fp: bytes, status: bytes | None, reason: bytes,
                   headers: bytes | None, body: bytes | None) -> Answer:
    """Decoding only (:func:`_answer`)."""
    return Answer(int(kind), bytes.fromhex(fp.decode()), int(status or 0), reason.decode(),
                  tuple((n, v) for n, v in orjson.loads(headers or b"[]")), body or b"")


#: What a key fault names an idempotency record and a marker (never their content).
_RECORD = "an idempotency record"
_MARKER = "an idempotency marker"


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)
