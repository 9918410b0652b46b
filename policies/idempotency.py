"""Idempotency keys (config key ``idempotency``): inject, deduplicate, replay, serialize.

Follows draft-ietf-httpapi-idempotency-key-header-06, and Stripe's documented behaviour where
the draft is silent. Applies to requests with a method that is not safe (RFC 9110 §9.2.1:
GET, HEAD, OPTIONS and TRACE pass untouched).

**The key**, in this order:

1. the caller's ``Idempotency-Key``: an RFC 8941 sf-string (``"abc"``, the draft's form) or a
   bare value (``abc``, what Stripe and most clients send), 1 to 255 characters of printable
   ASCII; both forms name the same key. Anything else is answered 400 ``bad_request``. It goes
   upstream exactly as the caller wrote it.
2. a key derived from the ``derive_from`` headers (e.g. ``[X-Run-ID, X-Step-ID]``: the
   business's natural key for one logical call) together with the tenant and the route, when
   every one of those headers is present: ``"sluice-d-<32 hex>"`` (a SHA-256 prefix). The
   headers must identify one call: two different calls in the same run and step would share
   a key, and the second would get 422.
3. otherwise a fresh random key for this request, ``"sluice-<32 hex>"``: nobody else can know
   it, so it is not looked up or stored. The handler holds it for the whole request
   (:attr:`Claim.header`), so a retry layer inside Sluice sends every attempt with it.

Sluice's keys go upstream as sf-strings (quoted), the draft's form. Records are scoped by
tenant and route: two tenants never share a stored result, whatever keys they send.

**Modes**:

* ``dedup``: Sluice stores the upstream's answer and replays it to later requests with the
  same key and payload, with ``Idempotent-Replayed: true``.
* ``forward``: the key is only injected; the upstream deduplicates.
* ``serialize``: for tools with no idempotency support: requests with the same key run one
  at a time, never concurrently (a per-key lock, gone when nobody holds or waits for it).
* ``off``: nothing (the route pays nothing).

**Dedup semantics**:

* completed duplicate, same payload fingerprint (SHA-256 of method, path with query, and
  body; for a key the caller sent, bound to the caller's credentials too, so another caller
  who learns the key is never given the answer: :func:`_with_credentials`): the stored
  status, headers (less framing and ``Set-Cookie``) and body, with
  ``Idempotent-Replayed: true``; streamed answers (SSE) are stored as the bytes of the whole
  stream and replayed at once as one response, so the client's SSE parser sees the same events.
* same key, different fingerprint (another payload, or another caller's credentials): 422
  ``idempotency_mismatch`` (the draft's status), whether the first request is done or still in
  flight.
* duplicate while the first is in flight: with ``on_in_flight: wait`` (default) it waits,
  holding no concurrency slot, and gets the first one's answer as a replay; with ``reject``
  it gets 409 ``idempotency_conflict`` with ``Retry-After: 1`` (the draft's answer; the
  official SDKs retry a 409). The wait is bounded by ``max_wait`` and by the caller's own
  timeout (``Call.wait_left``: ``identity.timeout_header``, ``X-Request-Timeout`` by
  default, else the Stainless SDKs' ``x-stainless-timeout``), whichever ends first; past it
  the duplicate gets the same 409 (the first request still holds the key), so nobody waits
  on a stuck twin for ever. It
  is bounded in number too: at most ``max_waiters`` duplicates of one key wait at once in a
  process (each holds its caller's connection meanwhile); one more gets the same 409 at once,
  saying so. A retry storm on one key then costs one waiter list, not one per retry.
* what is stored: the upstream's answer when it is a final one: every status below 500 except
  401, 403, 407 (the caller may fix its credentials and retry the same payload), 408, 409, 425
  and 429 (the upstream says "try again"). Never stored, so the key is free again for a
  retry: Sluice's own refusals (429/503 before the upstream), connect errors, timeouts, 5xx,
  a stream cut short, and a caller that disconnected (its upstream request is cancelled, and
  the next waiter, if any, runs its own identical request; an MCP call, whose server runs the
  tool anyway, is instead finished without its caller and its answer kept: ``proxy.handler``).
  This follows Stripe's rule that a result is saved only once the endpoint executed, made
  stricter for 5xx: those are mostly transient here (overload, a bad deploy), and storing one
  would fail that key for ``ttl`` although a retry would succeed. The draft would replay errors too.
* what is shared, not stored: the failure of a call that reached the upstream (at least one
  attempt was sent, connect errors included) and ended with an answer the store does not
  keep, its caller given that answer whole: an upstream status above (5xx, 401, 403, 407,
  408, 409, 425, 429) relayed in full, or the failure Sluice writes once its attempts end
  without an answer (502 ``upstream_unreachable``, 504 ``upstream_timeout``). The duplicates
  *already waiting* for the key are given it (status, headers less framing, body, Sluice's
  ``x-should-retry`` and ``X-Sluice-Dead-Letter``), with ``Idempotent-Replayed: true``,
  instead of each taking the key in turn and running the call again with its own retries (a
  hostile trial: 20 copies of one step made 60 attempts and 20 dead letters). A request that
  arrives after it finds the key free and runs. Not shared (the next waiter takes the key
  and runs, judged on its own): Sluice's refusals before any attempt, a caller that
  disconnected, a failure that came of its caller rather than of the call
  (:attr:`Capture.callers_own`: an attempt its deadline cut short or a retry it left no time
  for, its SDK's retry, which Sluice tries once, the retries a drain of its replica or its
  run's budget stopped: a twin tries for itself), a drain's or a run's cancel, a stream cut
  short or ended by an error event, an answer over ``max_replay_bytes``, and an MCP call's
  failure (its body names its own JSON-RPC id). With Redis the failure is left beside the
  key's ``SEEN`` record for ``state.lease``, under the owner token of the marker its waiters
  waited on (:mod:`policies.state.idempotency`), so waiters on every replica get it and
  nobody else does.
* an answer larger than ``max_replay_bytes`` is passed through to its caller but not stored:
  a duplicate gets 409 ``idempotency_conflict`` with ``x-should-retry: false`` and a
  ``Retry-After`` equal to the time left until the key expires (it must not execute again,
  and there is nothing to replay).

**Where the records live**: with the memory state backend, in this process
(:class:`~policies.idempotency_store.MemoryStore`, bounded by ``max_entries`` and ``max_bytes``,
and per-process in-flight keys whose waiters are woken directly). With the Redis backend, in
Redis (:mod:`policies.state.idempotency`), so every replica sees every key: a request holds its
key with an in-flight marker (``SET NX`` with an expiry of ``state.lease``, 5 s by default,
renewed every third of it while it runs, so a replica killed mid-call frees it within that time)
carrying its payload fingerprint; a duplicate on any replica sees the marker (422 at once for
another payload), and waits for the first one's answer, woken by the ``finish`` that stores it
(pub/sub, with polling as a floor). The answer is written once the call ends, in the background
(a holding's release never awaits); until it is, the marker keeps duplicates waiting. Records
expire ``ttl`` after they were written (Redis evicts by its own policy). When Redis does not
answer at the request's first look-up, ``state.on_unavailable: local`` uses this process's
memory store instead (keys are then deduplicated per replica), and ``reject`` answers 503
``state_unavailable``; an answer's write that fails later is tried again until the marker
would have lapsed (only while the marker is still its request's or no one's), then left: the
key is free again within ``state.lease``. Until that write is over, the answer is kept in
this process's memory store too, for a retry that falls back to it.

**MCP tool calls** (``mcp`` routes; issue 11): the payload fingerprint of an MCP request is
:func:`policies.mcp.fingerprint` (method, params but ``_meta``, and the ``derive_from``
headers; never the JSON-RPC ``id``, which differs on every call, so ``derive_from`` keys no
longer get 422), and a ``tools/call`` that names no key and no ``derive_from`` headers gets
one derived from that fingerprint (``"sluice-t-<32 hex>"``, with the tenant, the route and a
digest of the caller's credentials): the same tool with the same arguments from the same
caller is one call, so a client's retry replays the first answer instead of running the tool
again. Other methods get a fresh key whatever their headers: a resource read or a task's
poll asked again must reach the server again. Another
caller's identical call (other credentials) is not answered with it. A ``derive_from`` key
includes the credentials too. An answer is stored once it holds the response to the call,
whatever happened after (the MCP SDKs close the connection right after the result event), with
the response's id replaced by a placeholder; a replay gets the id of the request it answers
(:func:`policies.mcp.rewrite_id`). An answer without the response is not stored.

**Amplification** (SPEC metrics): ``sluice_upstream_attempts_total`` counts every request sent
upstream; ``sluice_work_units_total`` counts distinct logical calls: a request is a new unit
unless its key was seen before on the route (a replay, a wait on an in-flight twin, or a retry
after a failure) or it carries ``x-stainless-retry-count`` above 0 (the OpenAI and Anthropic
SDKs' retries). The SDKs do not send ``Idempotency-Key`` by default: a caller who wants its
SDK's retries deduplicated sets one per call (``extra_headers``) or configures
``derive_from`` headers it already sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import time
from collections import deque
from collections.abc import Awaitable, Hashable
from typing import TypeVar

from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy, istr

from policies import mcp
from policies.config import IdempotencyConfig
from policies.idempotency_store import DONE, SEEN, TOO_LARGE, MemoryStore, Record, ResultStore
from policies.logs import PER_CALL
from policies.pipeline import Call, Outcome, survive_leaving
from policies.rate import Background
from policies.reasons import Reason, Rejected
from policies.retry import is_client_retry
from policies.secrets import CREDENTIAL_HEADERS
from policies.state import DEFAULT_LEASE_S, IdempotencyRecords, StateBackends, StateUnavailable
from policies.state.idempotency import (
    CLAIMED,
    FAILED,
    FINISHED,
    IN_FLIGHT,
    Answer,
    Begin,
    new_owner,
    wait_for_answer,
)
from policies.untyped import UntypedResponse

log = logging.getLogger("sluice")

T = TypeVar("T")

#: Methods that are idempotent by definition and never get a key (RFC 9110 §9.2.1).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
KEY_HEADER = istr("Idempotency-Key")
REPLAYED_HEADER = "Idempotent-Replayed"
#: Longest key accepted, characters (Stripe's limit; the draft leaves it to the resource).
MAX_KEY_LENGTH = 255
#: What a duplicate refused while its twin is in flight is told to wait, seconds.
IN_FLIGHT_RETRY_AFTER_S = 1.0

#: Upstream statuses that are not an outcome (see the module docstring).
_NOT_STORED = frozenset({401, 403, 407, 408, 409, 425, 429})
#: ``sluice_requests_total`` outcomes that mean the upstream's whole answer was relayed.
_ANSWERED = frozenset({"2xx", "3xx", "4xx"})
#: Outcomes of a failure relayed whole (its status one the store does not keep), and of one
#: Sluice wrote after its attempts: what a key's waiting duplicates are given
#: (:meth:`Capture.failure`).
_FAILED_WHOLE = frozenset({"4xx", "5xx"})
_FAILED_BY_SLUICE = frozenset({"upstream_error", "upstream_timeout"})
#: Response headers not replayed: framing is recomputed; a cookie belongs to one exchange,
#: and an MCP session id to one session (the TypeScript SDK 1.x client takes the id of every
#: response: a replay moved it into the first caller's session).
_NOT_REPLAYED = frozenset({"content-length", "set-cookie", "idempotent-replayed",
                           "mcp-session-id"})

# RFC 8941 §3.3.3 sf-string (printable ASCII, only \" and \\ escaped), and a bare value:
# visible ASCII without the quote and the comma (a comma would join two header lines).
_QUOTED = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"[ \t]*')
_BARE = re.compile(r"[\x21\x23-\x2b\x2d-\x7e]+")
_ESCAPE = re.compile(r'\\(["\\])')

#: The id a stored MCP answer's response carries until a replay gives it the replaying
#: request's own (never sent to anyone as it is).
STORED_ID = "sluice-stored-response"

#: A waiter's future resolves to this when the key is handed to it: it runs its own request.
_HANDOVER = object()
#: A waiter's wait returns this when its bound passed first.
_TIMED_OUT = object()


#: Where a call's key came from (:func:`key_origin`; a dead letter records it): the caller's
#: ``Idempotency-Key``; derived by Sluice (``derive_from``, or an MCP call's tool and
#: arguments, each with a digest of the caller's credentials); made up fresh for the call.
CALLER_KEY = "caller"
DERIVED_KEY = "derived"
FRESH_KEY = "fresh"
#: How the keys Sluice makes begin: derived from ``derive_from`` headers, from an MCP call's
#: tool and arguments, and fresh (every one ``"sluice-"``).
DERIVED_PREFIX = "sluice-d-"
TOOL_CALL_PREFIX = "sluice-t-"
FRESH_PREFIX = "sluice-"

#: Fresh keys drawn from one ``os.urandom`` read: one ``getrandom`` syscall per this many
#: requests instead of one each; every key is still 128 bits from the OS's CSPRNG.
FRESH_KEYS_PER_READ = 256
#: Keys of one read not handed out yet, each ``"sluice-<32 hex>"``.
_fresh_pool: list[str] = []
_HEX_KEY = re.compile("[0-9a-f]{32}")


def _forget_fresh_pool() -> None:
    _fresh_pool.clear()  # a forked child must not hand out its parent's keys


os.register_at_fork(after_in_child=_forget_fresh_pool)


def fresh_key() -> str:
    """A new random key, ``"sluice-<32 hex>"`` (128 bits, never handed out twice)."""
    if not _fresh_pool:
        # One read cut into keys by C code (findall, map): no Python step per key.
        hexed = os.urandom(16 * FRESH_KEYS_PER_READ).hex()
        _fresh_pool.extend(map(FRESH_PREFIX.__add__, _HEX_KEY.findall(hexed)))
    return _fresh_pool.pop()


def key_origin(key: str, callers: bool) -> str:
    """Where ``key``, the key a call was handled under (as parsed or as sent upstream), came
    from: :data:`CALLER_KEY` when ``callers`` (the caller sent an ``Idempotency-Key``), else
    :data:`DERIVED_KEY` or :data:`FRESH_KEY`, by the form Sluice gives its own keys."""
    if callers:
        return CALLER_KEY
    bare = key.strip('"')
    return DERIVED_KEY if bare.startswith((DERIVED_PREFIX, TOOL_CALL_PREFIX)) else FRESH_KEY


def parse_key(raw: str) -> str:
    """The key named by an ``Idempotency-Key`` field value, quoted or bare.

    Raises:
        ValueError: with a sentence for the caller when the value is not a valid key.
    """
    value = raw.strip(" \t")
    if value[:1] == '"':
        match = _QUOTED.fullmatch(value)
        if match is None:
            raise ValueError(
                "a quoted Idempotency-Key must be an RFC 8941 string: printable ASCII between "
                'double quotes, with only \\" and \\\\ escaped'
            )
        key = match.group(1)
        if "\\" in key:
            key = _ESCAPE.sub(r"\1", key)
    elif _BARE.fullmatch(value):
        key = value
    else:
        raise ValueError(
            "an Idempotency-Key must be visible ASCII without spaces, quotes or commas, "
            'or an RFC 8941 string such as "8e03978e-40d5-43e8-bc93-6894a57f9324"'
        )
    if not key:
        raise ValueError("the Idempotency-Key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"the Idempotency-Key is longer than {MAX_KEY_LENGTH} characters")
    return key


def names_a_key(values: list[str]) -> bool:
    """Whether the ``Idempotency-Key`` field values of a message name one valid key
    (:func:`parse_key`): an empty, blank or malformed value, or two fields, name none an
    upstream could deduplicate by (a hostile trial: an empty key made a POST retried three
    times)."""
    if len(values) != 1:
        return False
    try:
        parse_key(values[0])
    except ValueError:
        return False
    return True


class Continuations:
    """The MRTR rounds this process saw end ``input_required`` on a route, so that a
    continuation's fingerprint stands on the round it continues rather than on the sealed
    ``requestState`` it echoes (:func:`policies.mcp.continuation_of`): by tenant and the
    state's SHA-256 (:func:`policies.mcp.state_key`), what the round stands for. Bounded:
    at most ``max_entries`` in all (the oldest go first), each for ``ttl_s`` seconds (the
    Python SDK's states expire after 600 s), and at most ``per_tenant`` of one tenant's: a
    tenant holding that many makes room from its own oldest, so that one tenant's rounds
    (4,096 in a hostile review) no longer evict every other tenant's notes. A state not
    found here (another replica made it, a reload or a restart came between, or it was
    evicted) counts as itself: no replay across retries, as before, and never two
    different continuations taken for one."""

    __slots__ = ("_order", "_tenants", "max_entries", "per_tenant", "ttl_s")

    def __init__(self, max_entries: int = 4096, ttl_s: float = 600.0,
                 per_tenant: int = 512) -> None:
        self.max_entries = max_entries
        self.per_tenant = min(per_tenant, max_entries)
        self.ttl_s = ttl_s
        #: Each tenant's notes, oldest first: state key -> (what it stands for, expiry).
        self._tenants: dict[str, dict[bytes, tuple[bytes, float]]] = {}
        #: Every note, oldest first, for the global bound.
        self._order: dict[tuple[str, bytes], None] = {}

    def _drop(self, tenant: str, key: bytes) -> None:
        del self._order[(tenant, key)]
        own = self._tenants[tenant]
        del own[key]
        if not own:
            del self._tenants[tenant]

    def note(self, tenant: str, state: str, stands_for: bytes) -> None:
        key = mcp.state_key(state)
        own = self._tenants.get(tenant)
        if own is not None:
            if key in own:
                self._drop(tenant, key)
            elif len(own) >= self.per_tenant:
                self._drop(tenant, next(iter(own)))
        order = self._order
        while len(order) >= self.max_entries:
            self._drop(*next(iter(order)))
        self._tenants.setdefault(tenant, {})[key] = (stands_for, time.monotonic() + self.ttl_s)
        order[(tenant, key)] = None

    def find(self, tenant: str, state: str) -> bytes | None:
        own = self._tenants.get(tenant)
        found = None if own is None else own.get(mcp.state_key(state))
        if found is None or found[1] < time.monotonic():
            return None
        return found[0]


class Capture:
    """Collects the upstream's answer as it is relayed (fed by ``proxy.forward``).

    A storable status is collected to be kept for the key; any other answer (a 5xx, a 429,
    or the failure Sluice writes when its attempts found no answer: :meth:`written`) to be
    given to the duplicates waiting for the key (:meth:`failure`). Only up to ``limit``
    bytes; past that the chunks are dropped and only the size is kept, so a long stream
    costs no memory here.
    """

    __slots__ = ("added", "by_sluice", "callers_own", "chunks", "continues", "headers",
                 "limit", "mcp_id", "reason", "shareable", "size", "status", "storable",
                 "tracker")

    def __init__(self, limit: int, mcp_id: mcp.RequestId | None = None) -> None:
        self.limit = limit
        #: The JSON-RPC id of an MCP call, whose answer is followed by :attr:`tracker`.
        self.mcp_id = mcp_id
        self.tracker: mcp.AnswerTracker | None = None
        self.status = 0
        self.reason = ""
        self.headers: tuple[tuple[str, str], ...] = ()
        self.chunks: list[bytes] = []
        self.size = 0
        self.storable = False
        #: The answer is a failure its key's waiting duplicates may be given (:meth:`failure`).
        self.shareable = False
        #: Sluice wrote the answer itself, its attempts having found none to relay.
        self.by_sluice = False
        #: Headers Sluice adds to a failure that its waiting duplicates get too
        #: (:meth:`add_to_failure`).
        self.added: tuple[tuple[str, str], ...] = ()
        #: The failure came of its caller, not of the call: its deadline cut an attempt or left
        #: no time for the next, its SDK retries it (one attempt here), this replica drains,
        #: its run's budget had no room for a retry (``proxy.attempts``). A waiting twin runs
        #: the call itself.
        self.callers_own = False
        #: An MCP tool call's round, should its answer be ``input_required`` (MRTR): where to
        #: note its ``requestState``, its tenant and its fingerprint (:meth:`_continues`).
        self.continues: tuple[Continuations, str, bytes] | None = None

    def begin(self, status: int, reason: str | None, headers: CIMultiDict[str]) -> None:
        """The upstream's status line and headers (hop-by-hop fields already dropped)."""
        self.status = status
        self.reason = reason or ""
        self.storable = status < 500 and status not in _NOT_STORED
        # An MCP call's failure is not given to its twins: its body names the call's own
        # JSON-RPC id, if any (they run their own call, as before).
        self.shareable = not self.storable and self.mcp_id is None
        if self.storable and self.mcp_id is not None:
            self.tracker = mcp.AnswerTracker(headers.get("Content-Type"), self.mcp_id)
        self.headers = tuple(
            (name, value) for name, value in headers.items()
            if name.lower() not in _NOT_REPLAYED
        )

    def written(self, response: web.Response) -> None:
        """The failure Sluice answers with after its attempts found no answer to relay (502
        ``upstream_unreachable``, 504 ``upstream_timeout``...), in place of whatever began.
        Never kept for the key; not an MCP call's (:meth:`begin`)."""
        if self.mcp_id is not None:
            return
        self.chunks = []  # of an answer that began, then was cut: not what its caller got
        self.size = 0
        self.added = ()  # its headers are all it carries (not a relayed answer's additions)
        self.begin(response.status, response.reason, CIMultiDict(response.headers))
        self.storable = False
        body = response.body
        self.by_sluice = self.shareable = isinstance(body, bytes)
        if isinstance(body, bytes):
            self.feed(body)

    def add_to_failure(self, headers: dict[str, str]) -> None:
        """Headers Sluice sets on the answer that also belong to its failure as its key's
        waiting duplicates get it: ``x-should-retry: false`` (Sluice retried it: theirs
        must not retry either) and ``X-Sluice-Dead-Letter`` (the call's one dead letter)."""
        self.added = tuple(headers.items())

    def feed(self, chunk: bytes) -> None:
        """Bytes of the body, in order, as they were sent on to the caller."""
        if not (self.storable or self.shareable):
            return
        self.size += len(chunk)
        if self.size <= self.limit:
            self.chunks.append(chunk)
        elif self.chunks:
            self.chunks = []
        if self.tracker is not None:
            found = self.tracker.feed(chunk)
            if found is not None and found.request_state is not None:
                self._continues(found)

    def _continues(self, found: mcp.Outcome) -> None:
        """The answer is ``input_required`` with a ``requestState``: note what a continuation
        echoing it stands on, once, as soon as its response is in (before the client has it,
        so before its continuation can come)."""
        continues, self.continues = self.continues, None
        if continues is not None and found.request_state is not None:
            rounds, tenant, fingerprint = continues
            rounds.note(tenant, found.request_state, mcp.continuation_of(fingerprint, found))

    def not_an_outcome(self) -> None:
        """The answer turned out to be no outcome to replay: as a 429 is none (a stream the
        upstream ended with a rate-limit or quota error event after HTTP 200), or a stream
        it ended cleanly before its last event (maybe a part of the answer). Nothing is
        kept for the key, which is free for a retry."""
        self.storable = self.shareable = False
        self.chunks = []

    def failure(self, fingerprint: bytes, outcome: str) -> Record | None:
        """The answer to give the duplicates waiting for the key of a call that ended with
        ``outcome`` and left nothing to keep (:meth:`answer` is ``None``), or ``None``: they
        then take the key in turn, as a later retry does. Given only a failure of a call that
        reached the upstream (an attempt was made) and whose answer its caller got whole: an
        upstream answer the store does not keep (5xx, 429, 408...) relayed in full, or the
        failure Sluice wrote once its attempts ended (:meth:`written`). Not a refusal of
        Sluice's before any attempt (never captured), a stream cut short or ended by an
        error event, a caller that left, a drain's cut, a failure of its caller's
        (:attr:`callers_own`), an answer over ``limit``, nor an MCP call's failure."""
        if not self.shareable or self.callers_own or self.size > self.limit:
            return None
        if outcome not in _FAILED_WHOLE and not (self.by_sluice and outcome in _FAILED_BY_SLUICE):
            return None
        headers = self.headers
        if self.added:
            names = {name.lower() for name, _ in self.added}
            headers = (*(h for h in headers if h[0].lower() not in names), *self.added)
        return Record(DONE, fingerprint, self.status, self.reason, headers,
                      b"".join(self.chunks))

    def record(self, fingerprint: bytes) -> Record:
        """The record to store once the whole answer was relayed."""
        if self.size > self.limit:
            return Record(TOO_LARGE, fingerprint, self.status)
        return Record(DONE, fingerprint, self.status, self.reason, self.headers,
                      b"".join(self.chunks))

    def answer(self, fingerprint: bytes, outcome: str) -> Record | None:
        """The record to store for a call that ended with ``outcome``, or ``None`` to store
        nothing (the key is then free for a retry): the whole answer, relayed in full; for an
        MCP call, the answer up to the end of its response, whether or not the rest came,
        its response id replaced by :data:`STORED_ID`."""
        if not self.storable:
            return None
        if self.mcp_id is None:
            return self.record(fingerprint) if outcome in _ANSWERED else None
        tracker = self.tracker
        if tracker is not None and tracker.complete_at is None and outcome in _ANSWERED:
            # A JSON answer holds its response only once it has all come; an SSE one may end
            # in a CR held back for an LF to follow (proxy.forward.relay).
            tracker.finish()
        if tracker is None or tracker.complete_at is None:
            return None  # the response never came: the call may not have run to its end
        found = tracker.outcome
        if found is not None and found.input_required:
            self._continues(found)  # a JSON answer's response is known only now
        if found is not None and (found.cancelled or found.input_required):
            # Its client cancelled it: no outcome (as when a caller leaves), and never the
            # answer to give the key's next caller, who cancelled nothing. Or the call is not
            # over (MRTR): its continuation, with inputResponses, comes under the same key.
            return None
        record = self.record(fingerprint)
        if record.kind != DONE:
            return record
        try:
            body = mcp.rewrite_id(record.body[:tracker.complete_at], _content_type(record),
                                  self.mcp_id, STORED_ID)
        except mcp.UnusableAnswer:
            return None
        return Record(DONE, fingerprint, record.status, record.reason, record.headers, body)


class Replay(Exception):
    """The call's answer is a stored one: reply with :func:`replay_response` of ``record``.

    Attributes:
        record: the stored answer, or the failure of the twin it waited for (``failure``).
        waited_s: how long the call waited for its in-flight twin, seconds.
        failure: ``record`` is its twin's failure, not stored (:meth:`Capture.failure`).
    """

    def __init__(self, record: Record, waited_s: float, failure: bool = False) -> None:
        super().__init__("replay")
        self.record = record
        self.waited_s = waited_s
        self.failure = failure


class _Failed:
    """What a waiter's future resolves to when its twin failed: the failure to answer with
    (:meth:`Capture.failure`), kept for no one else."""

    __slots__ = ("record",)

    def __init__(self, record: Record) -> None:
        self.record = record


class _Flight:
    """A key whose request is running: its payload and who waits for it."""

    __slots__ = ("fallback", "fingerprint", "waiters")

    def __init__(self, fingerprint: bytes) -> None:
        self.fingerprint = fingerprint
        self.waiters: deque[asyncio.Future[object]] = deque()
        #: The Redis marker of a request claimed from memory during an outage, while it runs
        #: (:attr:`Claim._fallback`): a duplicate that leaves it waiting hands its own marker
        #: over to it (:meth:`Idempotency._leave_to_twin`).
        self.fallback: _Lease | None = None


class _Lease:
    """A key this request holds in the shared records: its marker's owner token, and the task
    that renews the marker while the request runs."""

    __slots__ = ("key", "local", "owner", "records", "renewer", "store_key")

    def __init__(self, records: IdempotencyRecords, key: str, owner: str) -> None:
        self.records = records
        self.key = key
        self.owner = owner
        self.renewer: asyncio.Task[None] | None = None
        #: The key in this process's in-flight keys too (under ``store_key``), so that a
        #: duplicate that finds Redis unavailable (``on_unavailable: local``) still waits for
        #: its twin here; ``None`` when the local records had the key in flight already.
        self.local: _Flight | None = None
        #: The key in this process's records (``(tenant, key)``), where the answer is kept
        #: while its write to Redis is under way (:meth:`Idempotency._finish_shared`).
        self.store_key: Hashable = None


class Claim:
    """One request's standing with its idempotency key, from :meth:`Idempotency.claim`.

    Exactly one of these holds: ``rejected`` is set (answer it), ``replay`` is set (answer
    with :func:`replay_response`), or the request goes on to admission and upstream, sending
    ``header`` (when not ``None``) as its ``Idempotency-Key`` on every attempt and feeding
    ``capture`` (when not ``None``) with the answer. In that last case :meth:`finish` must be
    called exactly once on every exit path; it never suspends.

    Attributes:
        key: the key (for events); ``None`` if the caller's key was invalid.
        new_unit: this request is a new unit of work (``sluice_work_units_total``).
        waited_s: how long it waited for an in-flight twin, seconds.
    """

    __slots__ = ("_fallback", "_flight", "_lease", "_policy", "_shared", "_store_key",
                 "capture", "fingerprint", "header", "key", "mcp_id", "new_unit", "rejected",
                 "replay", "twin_failed", "waited_s")

    def __init__(self, key: str | None, mcp_id: mcp.RequestId | None = None) -> None:
        self.key = key
        #: The JSON-RPC id of an MCP call (its answer is stored and replayed by response).
        self.mcp_id = mcp_id
        self.header: str | None = None
        self.capture: Capture | None = None
        self.fingerprint = b""
        self.new_unit = False
        self.rejected: Rejected | None = None
        self.replay: Record | None = None
        #: :attr:`replay` is the failure of the twin it waited for, not a stored answer.
        self.twin_failed = False
        self.waited_s = 0.0
        self._policy: Idempotency | None = None
        self._store_key: Hashable = None
        self._flight: _Flight | None = None
        self._lease: _Lease | None = None
        #: The shared records' name and owner token of a look-up Redis did not answer.
        self._shared: tuple[IdempotencyRecords, str, str] | None = None
        #: The marker a key claimed from this process's memory takes in Redis once it answers.
        self._fallback: _Lease | None = None

    @property
    def holds(self) -> bool:
        """The request holds its key until :meth:`finish`."""
        return self._flight is not None or self._lease is not None

    def release(self, outcome: Outcome) -> None:
        """The pipeline's end of the claim (a :class:`policies.pipeline.Holding`)."""
        self.finish(outcome.label)

    def finish(self, outcome: str) -> None:
        """Settle the key: store the answer or free the key for a retry.

        ``outcome`` is the ``sluice_requests_total`` outcome of the request (``2xx`` ...,
        ``rejected``, ``upstream_error``, ``upstream_timeout``, ``client_disconnected``).
        Calling it again, or on a claim that holds no key, does nothing.
        """
        policy = self._policy
        if policy is None:
            return
        flight, lease = self._flight, self._lease
        self._flight = self._lease = None
        if flight is not None:
            policy._finish(self, flight, outcome)
        elif lease is not None:
            policy._finish_shared(self, lease, outcome)


class Idempotency:
    """The idempotency policy of one route, with its store and its in-flight keys.

    Args:
        config: the route's ``idempotency`` block (mode is not ``off``).
        route: the route's name; part of every derived key, and of every shared record's
            key (replicas share a route's records by its name).
        store: where this process's records live (default: a :class:`MemoryStore` sized by
            ``config``): every record with the memory backend, and the ``local`` fallback's
            with Redis.
        backends: the route's state; with Redis, records and in-flight markers are shared
            there (default: this process only).
        mcp_calls: the route is an ``mcp`` route: calls are keyed and stored as MCP calls
            (the module docstring).
    """

    def __init__(self, config: IdempotencyConfig, route: str,
                 store: ResultStore | None = None,
                 backends: StateBackends | None = None, mcp_calls: bool = False) -> None:
        self.mcp = mcp_calls
        self.store: ResultStore = store or MemoryStore(config.max_entries, config.max_bytes,
                                                       config.ttl)
        self._adopt(config)
        self.waiting = 0
        #: Duplicates waiting here per shared key (the Redis records); the memory records
        #: count theirs in their flight's waiter list.
        self._shared_waiting: dict[str, int] = {}
        self._route = route.encode()
        self._flights: dict[Hashable, _Flight] = {}
        self._backends = backends if backends is not None and backends.redis is not None else None
        #: How long an in-flight marker in Redis lives unless renewed (``state.lease``,
        #: seconds): a replica killed mid-call frees its keys within this time.
        # Not StateBackends.lease_s: on a slotted dataclass that is the field's descriptor.
        self._lease_s = backends.lease_s if backends is not None else DEFAULT_LEASE_S
        #: Its own Redis calls that nobody awaits: shutdown waits for them.
        self._background = Background(self._backends)
        #: The MRTR rounds seen end ``input_required``, for their continuations' fingerprints.
        self.continuations = Continuations()

    def _adopt(self, config: IdempotencyConfig) -> None:
        self.mode = config.mode
        self.dedup = config.mode == "dedup"
        self.wait_in_flight = config.on_in_flight == "wait"
        self.derive_from = tuple(config.derive_from)
        self.max_replay_bytes = config.max_replay_bytes
        self.max_wait = config.max_wait
        self.max_waiters = config.max_waiters
        self.ttl = config.ttl

    def reconfigure(self, config: IdempotencyConfig) -> None:
        """Adopt a changed block in place (a reload): the keys in flight and the stored answers
        are kept, since forgetting either would let a side effect run again. The store keeps
        what fits its new bounds; the new ``ttl`` applies to answers stored from now."""
        self._adopt(config)
        if isinstance(self.store, MemoryStore):
            self.store.resize(config.max_entries, config.max_bytes, config.ttl)

    async def admit(self, call: Call) -> Claim | None:
        """The pipeline step (:class:`policies.pipeline.Policy`): resolve the call's key
        (:meth:`claim`) and hold it until the call ends. Safe methods pass untouched.

        Sets ``call.idempotency_key``, ``call.upstream_key``, ``call.capture`` and
        ``call.new_unit``.

        Raises:
            Rejected: 400, 409 or 422 (see :meth:`claim`); nothing is held.
            Replay: a stored answer is the reply; nothing is held.
            asyncio.CancelledError: the caller left while waiting for a twin.
        """
        if call.method in SAFE_METHODS:
            return None
        headers = call.headers
        derive_from = self.derive_from
        if not (self.mcp or KEY_HEADER in headers
                or (derive_from and all(map(headers.__contains__, derive_from)))):
            return self._fresh(call)  # most calls: no key sent, no derive_from header set
        parsed, turns = call.parsed or (self._mcp_call(call.body), None)
        call.parsed = None  # the call keeps no parsed tree while it waits or runs
        if parsed is not None and parsed.method != "tools/call":
            # Only a tool call is one unit of work: a resource read, a task's poll or a log
            # level asked again must reach the server again, under whatever key its
            # headers make (an MCP client sets headers per session, not per request).
            return self._fresh(call)
        wait_s = self.max_wait
        left = call.wait_left()
        if left is not None:
            wait_s = min(wait_s, left)
        fingerprint = call_key = mcp_id = None
        if parsed is not None:
            mcp_id = parsed.id
            if turns is None:
                call_key = self._mcp_fingerprint(call, parsed)
            else:  # a large body: fingerprinted, and its tree freed, in its turn
                async with turns.turn(holding=True):
                    call_key = self._mcp_fingerprint(call, parsed)
                    parsed = None
            fingerprint = _of_generation(call_key, call.headers.get(mcp.VERSION_HEADER))
        claim = await self.claim(call.method, call.path, call.headers, call.tenant, call.body,
                                 wait_s=wait_s, fingerprint=fingerprint, call_key=call_key,
                                 mcp_id=mcp_id)
        call.new_unit = claim.new_unit
        call.idempotency_key = claim.key
        if claim.rejected is not None:
            raise claim.rejected
        if claim.replay is not None:
            raise Replay(self._for_request(claim), claim.waited_s, claim.twin_failed)
        call.upstream_key = claim.header
        call.capture = claim.capture
        if claim.capture is not None and fingerprint is not None:
            claim.capture.continues = (self.continuations, call.tenant, fingerprint)
        return claim if claim.holds else None

    @staticmethod
    def _fresh(call: Call) -> None:
        """Give ``call`` a fresh key (:meth:`claim`'s last rule): nobody else can know it,
        so nothing is looked up or held."""
        key = fresh_key()
        call.idempotency_key = key
        call.upstream_key = f'"{key}"'
        call.new_unit = not call.client_retry

    def _mcp_fingerprint(self, call: Call, message: mcp.Message) -> bytes:
        """The fingerprint of ``call``, an MCP ``tools/call`` whose request is ``message``.

        Raises:
            Rejected: 400 ``bad_request``: its params are nested too deeply to fingerprint.
        """
        params = message.params
        state = params.get("requestState") if params is not None else None
        after = (self.continuations.find(call.tenant, state) if isinstance(state, str)
                 else None)
        try:
            return bytes.fromhex(mcp.fingerprint(message, call.headers, self.derive_from,
                                                 call.body, after))
        except mcp.InvalidMcpRequest as bad:
            raise Rejected(Reason.BAD_REQUEST, None, bad.detail) from None

    def _mcp_call(self, body: bytes) -> mcp.Message | None:
        """The request of an MCP POST holding one request (``mcp`` routes), else ``None``."""
        if not self.mcp:
            return None
        try:
            request = mcp.parse_post(body).request
        except mcp.InvalidMcpRequest:
            return None
        return request if request is not None and request.id is not None else None

    def _for_request(self, claim: Claim) -> Record:
        """The stored answer to replay to ``claim``'s request: an MCP answer's response gets
        the request's own id, and its server's requests to the first call's client and its
        progress are left out (:func:`policies.mcp.for_replay`).

        Raises:
            Rejected: ``idempotency_conflict`` when the stored answer holds no response to
                give it (nothing to replay; the key stays taken until it expires).
        """
        record = claim.replay
        assert record is not None
        if claim.mcp_id is None:
            return record
        content_type = _content_type(record)
        try:
            body = mcp.rewrite_id(record.body, content_type, STORED_ID, claim.mcp_id)
        except mcp.UnusableAnswer:
            raise Rejected(Reason.IDEMPOTENCY_CONFLICT, None,
                           "the stored answer for this call holds no response", retry=False
                           ) from None
        # Not the first call's requests to its client (an elicitation, a sampling call):
        # asked again of this one, for a tool that does not run again; nor its progress.
        body = mcp.for_replay(body, content_type)
        return Record(DONE, record.fingerprint, record.status, record.reason, record.headers,
                      body)

    @property
    def in_flight(self) -> int:
        """Keys whose request is running now."""
        return len(self._flights)

    async def claim(self, method: str, path: str, headers: CIMultiDictProxy[str], tenant: str,
                    body: bytes, *, wait_s: float | None = None,
                    fingerprint: bytes | None = None, call_key: bytes | None = None,
                    mcp_id: mcp.RequestId | None = None) -> Claim:
        """Resolve the request's key and its standing; may wait for an in-flight twin.

        ``path`` is the path and query as received; ``wait_s`` bounds the wait for a twin,
        seconds (default ``max_wait``). An MCP call passes its ``fingerprint`` (32 bytes,
        :func:`policies.mcp.fingerprint`, with the client's protocol generation) and
        JSON-RPC id ``mcp_id``: the fingerprint then stands for the payload and, without a
        caller's or derived key, ``call_key`` (the fingerprint without the generation) makes
        the key.
        Never raises for the request's own faults: they come back as :attr:`Claim.rejected`
        (400, 409 or 422; 503 ``state_unavailable`` when the shared records do not answer and
        ``state.on_unavailable`` is ``reject``).

        Raises:
            asyncio.CancelledError: the caller left while waiting; nothing is left held.
        """
        raw = headers.get(KEY_HEADER)
        if raw is not None:
            try:
                if len(headers.getall(KEY_HEADER)) > 1:
                    raise ValueError("send one Idempotency-Key, not several")
                key = parse_key(raw)
            except ValueError as exc:
                claim = Claim(None)
                claim.rejected = Rejected(Reason.BAD_REQUEST, None, str(exc))
                return claim
            claim = Claim(key, mcp_id)
        else:
            key = self._derive(headers, tenant)
            if key is None and call_key is not None:
                key = self._call_key(tenant, call_key, headers)
            if key is None:
                # A fresh key: unknown to anyone else, so there is nothing to look up.
                claim = Claim(fresh_key())
                claim.header = f'"{claim.key}"'
                claim.new_unit = not is_client_retry(headers)
                return claim
            claim = Claim(key, mcp_id)
            claim.header = f'"{key}"'

        if self.dedup:
            if fingerprint is None:
                fingerprint = _fingerprint(method, path, body)
            if raw is not None:
                fingerprint = _with_credentials(fingerprint, headers)
        bound = self.max_wait if wait_s is None else max(wait_s, 0.0)
        if self._backends is not None:
            try:
                return await self._claim_shared(claim, key, method, path, headers, tenant, body,
                                                bound, fingerprint)
            except StateUnavailable as exc:
                if self._backends.fallback.mode == "reject":
                    claim.rejected = Rejected(
                        Reason.STATE_UNAVAILABLE, exc.hint or IN_FLIGHT_RETRY_AFTER_S,
                        "the idempotency records are unavailable")
                    return claim
                # local: this process's own store decides, as with the memory backend.

        store_key = (tenant, key)
        flight = self._flights.get(store_key)
        record = self.store.get(store_key) if flight is None else None
        if self.mode == "forward":
            if record is None:
                self.store.put(store_key, Record(SEEN, b""))
            claim.new_unit = record is None and not is_client_retry(headers)
            return claim

        if not self.dedup:
            fingerprint = b""
        assert fingerprint is not None  # made above for dedup
        claim.fingerprint = fingerprint
        claim._policy = self
        claim._store_key = store_key
        if flight is None and record is None:
            claim.new_unit = not is_client_retry(headers)
        if flight is not None:
            return await self._wait_here(claim, store_key, flight, bound)
        if record is not None and record.kind != SEEN and self.dedup:
            # (An answer kept from dedup before a reload to serialize is not this call's:
            # serialize replays nothing.)
            return self._answered(claim, record, fingerprint, self.store.ttl_left(record))
        claim._flight = _Flight(fingerprint)
        self._flights[store_key] = claim._flight
        self._take_marker(claim)
        self._arm(claim)
        return claim

    async def _wait_here(self, claim: Claim, store_key: Hashable, flight: _Flight,
                         bound_s: float) -> Claim:
        """``claim`` waits (at most ``bound_s`` seconds more) for its twin ``flight`` in this
        process's memory, and gets its answer, the key (it runs, and takes its marker in
        Redis once it answers: :meth:`_take_marker`) or 409 past the bound."""
        fingerprint = claim.fingerprint
        claim.rejected = self._refuse_waiting(claim, flight.fingerprint, fingerprint,
                                              len(flight.waiters))
        if claim.rejected is not None:
            return claim
        loop = asyncio.get_running_loop()
        started = loop.time() - claim.waited_s
        outcome = await self._wait(store_key, flight, bound_s)
        claim.waited_s = loop.time() - started
        if outcome is _TIMED_OUT:
            claim.rejected = _still_in_flight(claim.waited_s)
            return claim
        if outcome is _HANDOVER:
            claim._flight = flight
            claim._store_key = store_key
            self._take_marker(claim)
            self._arm(claim)
            return claim
        if isinstance(outcome, _Failed):
            return _given_failure(claim, outcome.record)
        # The answer of the call it waited for, under dedup then (a reload to serialize
        # since, before this one resumed, does not make it run: a review saw the
        # waiters run at once).
        assert isinstance(outcome, Record)
        return self._answered(claim, outcome, fingerprint, self.store.ttl_left(outcome))

    def _take_marker(self, claim: Claim) -> None:
        """A key ``claim`` holds in this process's memory (its flight started, or handed
        over by a twin that left no answer) while Redis did not answer its look-up takes its
        marker there once it answers, so a duplicate sent to another replica then waits for
        it. A request handed the key once took none: a duplicate sent to another replica ran
        the upstream while it ran."""
        if claim._shared is None or not self.dedup or claim._flight is None:
            return
        records, shared_key, owner = claim._shared
        fallback = claim._fallback = claim._flight.fallback = _Lease(records, shared_key, owner)
        fallback.renewer = self._background.spawn(
            _register(records, shared_key, owner, claim.fingerprint, self._lease_s,
                      self._shared_backends))

    def _keep_marker(self, records: IdempotencyRecords, key: str, owner: str,
                     fingerprint: bytes) -> asyncio.Future[None]:
        """Renew ``owner``'s marker of ``key`` (payload ``fingerprint``) in the background
        until cancelled (:func:`_renew`)."""
        return self._background.spawn(_renew(records, key, owner, fingerprint, self._lease_s,
                                             self._shared_backends))

    @property
    def _shared_backends(self) -> StateBackends:
        """The Redis backends (only a shared claim's markers are kept, so there are some)."""
        assert self._backends is not None
        return self._backends

    def _arm(self, claim: Claim) -> None:
        """Capture the answer of a call that holds its key, to replay it: in ``dedup``, for a
        call that has a fingerprint (one that began under ``serialize`` and was handed the
        key after a reload to dedup has none: its answer, stored, would refuse every later
        request of the key 422 ``idempotency_mismatch``, a review)."""
        if self.dedup and claim.fingerprint:
            claim.capture = Capture(self.max_replay_bytes, claim.mcp_id)

    def _call_key(self, tenant: str, fingerprint: bytes,
                  headers: CIMultiDictProxy[str]) -> str:
        """The key of an MCP call that names none: its tool and arguments (the
        fingerprint), with the tenant, the route and the caller's credentials
        (:func:`_credentials`)."""
        digest = hashlib.sha256(self._route)
        digest.update(b"\0" + tenant.encode("utf-8", "surrogateescape") + b"\0" + fingerprint)
        digest.update(_credentials(headers))
        return f"{TOOL_CALL_PREFIX}{digest.hexdigest()[:32]}"

    def _derive(self, headers: CIMultiDictProxy[str], tenant: str) -> str | None:
        if not self.derive_from:
            return None
        values = [headers.get(name) for name in self.derive_from]
        if None in values:  # most requests: decided before any hashing
            return None
        digest = hashlib.sha256(self._route)
        digest.update(b"\0" + tenant.encode("utf-8", "surrogateescape"))
        for value in values:
            digest.update(b"\0" + value.encode("utf-8", "surrogateescape"))
        digest.update(_credentials(headers))
        return f"{DERIVED_PREFIX}{digest.hexdigest()[:32]}"

    async def _wait(self, store_key: Hashable, flight: _Flight, bound_s: float) -> object:
        """Wait at most ``bound_s`` seconds for ``flight`` to settle: a :class:`Record` to
        replay, ``_HANDOVER``, or ``_TIMED_OUT``."""
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        flight.waiters.append(future)
        self.waiting += 1
        try:
            async with asyncio.timeout(bound_s):
                try:
                    return await future
                except asyncio.CancelledError:
                    if (future.done() and not future.cancelled()
                            and future.result() is _HANDOVER):
                        # The key was handed over just as this caller left: pass it on.
                        self._pass_on(store_key, flight)
                    else:
                        with contextlib.suppress(ValueError):
                            flight.waiters.remove(future)
                    raise
        except TimeoutError:
            if future.done() and not future.cancelled() and future.result() is not _HANDOVER:
                return future.result()  # the answer came as the bound passed
            return _TIMED_OUT
        finally:
            self.waiting -= 1

    # -- shared records (Redis) ----------------------------------------------------------------

    async def _claim_shared(self, claim: Claim, key: str, method: str, path: str,
                            headers: CIMultiDictProxy[str], tenant: str, body: bytes,
                            bound_s: float, call_fingerprint: bytes | None = None) -> Claim:
        """:meth:`claim` against the shared records (one round trip, plus the wait for an
        in-flight twin).

        Raises:
            StateUnavailable: the first look-up got no answer (nothing is held).
        """
        assert self._backends is not None
        records = self._backends.idempotency
        shared_key = shared_record_key(self._route.decode(), tenant, key)
        if self.mode == "forward":
            claim.new_unit = await records.seen(shared_key, self.ttl) and not is_client_retry(
                headers)
            return claim
        fingerprint = call_fingerprint if self.dedup else b""
        assert fingerprint is not None  # claim() made it for dedup
        claim.fingerprint = fingerprint
        claim._policy = self
        owner = new_owner()
        claim._shared = (records, shared_key, owner)
        begin = await survive_leaving(
            records.begin(shared_key, owner, fingerprint, self._lease_s),
            lambda b: self._drop(records, shared_key, owner, fingerprint)
            if b.state == CLAIMED else None, self._background.spawn)
        if begin.state == CLAIMED:
            claim.new_unit = begin.answer is None and not is_client_retry(headers)
        elif begin.state == IN_FLIGHT:
            claim.rejected = self._refuse_waiting(claim, begin.fingerprint, fingerprint,
                                                  self._shared_waiting.get(shared_key, 0))
            if claim.rejected is not None:
                return claim
            try:
                begin = await self._wait_shared(claim, records, shared_key, owner,
                                                fingerprint, bound_s, begin.ttl_s, begin.owner)
            except StateUnavailable as exc:
                if self._backends is not None and self._backends.fallback.mode == "reject":
                    raise
                # A look-up that may have claimed the key frees it.
                self._drop(records, shared_key, owner, fingerprint)
                store_key = (tenant, key)
                flight = self._flights.get(store_key)
                if flight is not None:
                    # Its twin runs here (or another it may wait for): it waits for it in
                    # memory, as with the memory backend; refused 409 at once, it was told
                    # to retry while this replica answered the twin seconds later (a
                    # hostile trial: two duplicates refused 0.6 s into a freeze). Handed the
                    # key, it takes the marker under an owner of its own: the one just freed
                    # might be freed again after it is taken.
                    claim._shared = (records, shared_key, new_owner())
                    return await self._wait_here(claim, store_key, flight,
                                                 max(bound_s - claim.waited_s, 0.0))
                # Its twin is known to be in flight on another replica: the local fallback,
                # which knows no flight of it, would run it again (a hostile trial: the work
                # ran twice after a 1 s freeze).
                claim.rejected = Rejected(
                    Reason.IDEMPOTENCY_CONFLICT, exc.hint or IN_FLIGHT_RETRY_AFTER_S,
                    "a request with this Idempotency-Key is in flight, and the shared "
                    "idempotency records stopped answering while this one waited for it")
                return claim
            if begin.state == IN_FLIGHT:
                claim.rejected = (_mismatch(claim)
                                  if self.dedup and begin.fingerprint
                                  and begin.fingerprint != fingerprint
                                  else _still_in_flight(claim.waited_s))
                return claim
        if begin.state == FAILED:  # the twin it waited for failed, on any replica
            answer = begin.answer
            assert answer is not None
            return _given_failure(claim, Record(DONE, answer.fingerprint, answer.status,
                                                answer.reason, answer.headers, answer.body))
        if begin.state == FINISHED:
            answer = begin.answer
            assert answer is not None
            return self._answered(claim, Record(answer.kind, answer.fingerprint, answer.status,
                                                answer.reason, answer.headers, answer.body),
                                  fingerprint, begin.ttl_s)
        store_key = (tenant, key)
        if self.dedup:
            here = await self._held_here(claim, records, shared_key, owner, store_key,
                                         fingerprint, bound_s)
            if here is not None:
                return here
        # Claimed: nothing awaits from here to the return, so the lease cannot leak.
        lease = _Lease(records, shared_key, owner)
        lease.store_key = store_key
        if claim._flight is not None:  # handed over by a twin this replica held
            lease.local, claim._flight = claim._flight, None
        elif store_key not in self._flights:
            lease.local = self._flights[store_key] = _Flight(fingerprint)
        lease.renewer = self._keep_marker(records, shared_key, owner, fingerprint)
        claim._lease = lease
        self._arm(claim)
        return claim

    async def _held_here(self, claim: Claim, records: IdempotencyRecords, shared_key: str,
                         owner: str, store_key: tuple[str, str], fingerprint: bytes,
                         bound_s: float) -> Claim | None:
        """What this replica itself knows of a key Redis has just let ``claim`` take: a twin
        it claimed from its own memory while Redis did not answer may still be in flight
        here, or have left its answer here; Redis knows neither (a hostile trial: the key
        ran twice, twice at once on one replica). The claim answers from that (its Redis
        marker then stores the answer for every replica, or is freed) and is returned;
        ``None`` when there is nothing here, or the twin here handed the key over
        (``claim._flight`` is then set: this request runs, holding both).

        Raises:
            asyncio.CancelledError: the caller left while waiting; the marker is freed.
        """
        flight = self._flights.get(store_key)
        record = self.store.get(store_key) if flight is None else None
        if flight is None and (record is None or record.kind == SEEN):
            return None
        if flight is not None:
            claim.rejected = self._refuse_waiting(claim, flight.fingerprint, fingerprint,
                                                  len(flight.waiters))
            renewer = self._keep_marker(records, shared_key, owner, fingerprint)
            if claim.rejected is not None:
                self._leave_to_twin(flight, records, shared_key, owner, fingerprint, renewer)
                return claim
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                outcome = await self._wait(store_key, flight, bound_s)
            except asyncio.CancelledError:
                self._leave_to_twin(flight, records, shared_key, owner, fingerprint, renewer)
                raise
            claim.waited_s = loop.time() - started
            if outcome is _TIMED_OUT:
                self._leave_to_twin(flight, records, shared_key, owner, fingerprint, renewer)
                claim.rejected = _still_in_flight(claim.waited_s)
                return claim
            renewer.cancel()
            if outcome is _HANDOVER:
                claim._flight = flight
                return None
            if isinstance(outcome, _Failed):
                # The twin here failed: the key is free, and duplicates waiting on this
                # request's marker on other replicas get the failure too.
                self._drop(records, shared_key, owner, fingerprint, outcome.record)
                return _given_failure(claim, outcome.record)
            assert isinstance(outcome, Record)
            record = outcome
        assert record is not None
        # The answer kept here is the key's: Redis stores it for every replica.
        self._background.spawn(self._quietly(records.finish(
            shared_key, owner, shared_answer(record, record.fingerprint), self.ttl)))
        return self._answered(claim, record, fingerprint, self.store.ttl_left(record))

    def _leave_to_twin(self, flight: _Flight, records: IdempotencyRecords, shared_key: str,
                       owner: str, fingerprint: bytes, renewer: asyncio.Task[None]) -> None:
        """A request that took the key in Redis leaves (refused, timed out, or its caller
        gone) while ``flight``, its twin claimed here from memory, still runs: the twin
        takes over its marker (``owner``, kept by ``renewer``) and writes its answer with
        it. Freed instead, the key was unknown to Redis while the twin ran (its own
        registration gives up on meeting this marker), and a duplicate sent to another
        replica ran the upstream a second time, concurrently. With no such twin, or one of
        another payload (the marker names the payload: the twin's duplicates elsewhere would
        read it as a mismatch), the marker is freed and the twin's registration takes the
        key again."""
        fallback = flight.fallback
        if (fallback is None or fallback.key != shared_key or fallback.records is not records
                or flight.fingerprint != fingerprint):
            renewer.cancel()
            self._drop(records, shared_key, owner, fingerprint)
            return
        if fallback.renewer is not None:
            fallback.renewer.cancel()
        fallback.owner = owner
        fallback.renewer = renewer

    def _refuse_waiting(self, claim: Claim, twin: bytes, fingerprint: bytes,
                        waiting: int) -> Rejected | None:
        """Why ``claim`` may not wait for its twin in flight (payload fingerprint ``twin``,
        ``waiting`` duplicates waiting for it already): 422 ``idempotency_mismatch`` for
        another payload (``dedup``), 409 ``idempotency_conflict`` with ``on_in_flight:
        reject`` or past ``max_waiters``; ``None`` when it may wait."""
        if self.dedup and twin and twin != fingerprint:  # (none: a serialized call)
            return _mismatch(claim)
        if not self.wait_in_flight:
            return Rejected(Reason.IDEMPOTENCY_CONFLICT, IN_FLIGHT_RETRY_AFTER_S,
                            "a request with this Idempotency-Key is in flight")
        if waiting >= self.max_waiters:
            return _too_many_waiting(waiting)
        return None

    def _answered(self, claim: Claim, record: Record, fingerprint: bytes,
                  ttl_left_s: float) -> Claim:
        """``claim`` answered from its key's kept ``record`` (``ttl_left_s``: seconds it is
        kept still): the answer replayed, 422 ``idempotency_mismatch`` for another payload,
        or 409 ``idempotency_conflict`` when the first answer was too big to keep."""
        if record.fingerprint != fingerprint:
            claim.rejected = _mismatch(claim)
        elif record.kind == DONE:
            claim.replay = record
        else:
            claim.rejected = Rejected(
                Reason.IDEMPOTENCY_CONFLICT, ttl_left_s,
                f"the first request with this key completed, but its answer exceeded "
                f"max_replay_bytes ({self.max_replay_bytes}) or what the store holds "
                f"(max_bytes) and was not kept")
        return claim

    async def _wait_shared(self, claim: Claim, records: IdempotencyRecords, key: str,
                           owner: str, fingerprint: bytes, bound_s: float,
                           lapses_in_s: float, holder: str) -> Begin:
        """Wait (bounded) for the key's twin on any replica (``holder``: its owner token) to
        finish (its marker seen to lapse in ``lapses_in_s``); a key freed without an answer
        is claimed by this request, unless the twin left a failure (``failed``)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.waiting += 1
        self._shared_waiting[key] = self._shared_waiting.get(key, 0) + 1
        try:
            return await wait_for_answer(records, key, owner, fingerprint, self._lease_s,
                                         bound_s, lapses_in_s=lapses_in_s, holder=holder)
        except asyncio.CancelledError:
            # Its last look-up may have claimed the key just as the caller left.
            self._drop(records, key, owner, fingerprint)
            raise
        finally:
            self.waiting -= 1
            left = self._shared_waiting.pop(key) - 1
            if left:
                self._shared_waiting[key] = left
            claim.waited_s = loop.time() - started

    def _finish_shared(self, claim: Claim, lease: _Lease, outcome: str) -> None:
        """Store the answer (or a ``SEEN`` use) and free the key, in the background. The
        answer is kept in this process's records too until that write has ended (written,
        or given up as the marker would have lapsed): a retry that finds Redis unavailable
        meanwhile falls back to them (``on_unavailable: local``), and, finding neither the
        call nor its answer there, ran the keyed work again during a freeze shorter than
        the lease, on the very replica that had answered it (a hostile trial). Once the
        write has ended, Redis's record is the key's (or, given up, the key is free), so
        no copy of it stays here to be replayed in a later outage."""
        if lease.renewer is not None:
            lease.renewer.cancel()
        record = _answer_to_keep(claim, outcome)
        answer = shared_answer(record, claim.fingerprint)
        # Its waiters may be on any replica: the failure goes with the write.
        failure = self._failure(claim, outcome, None) if record is None else None
        here = None
        if record is not None and self.dedup:
            here = self._keep_here(lease.store_key, record)
        local = lease.local
        if local is not None and self._flights.get(lease.store_key) is local:
            # Duplicates that found Redis unavailable wait here: the answer, the failure, or
            # the key (as :meth:`_finish` does, also when a reload left dedup while this
            # call ran).
            if record is not None and self.dedup:
                del self._flights[lease.store_key]
                for future in local.waiters:
                    if not future.done():
                        future.set_result(record)
            elif record is None:
                self._settle_waiters(lease.store_key, local, failure)
            else:
                self._pass_on(lease.store_key, local)
        self._background.spawn(self._store(lease, answer, kept_here=here, failure=failure))

    async def _store(self, lease: _Lease, answer: Answer, strict: bool = False,
                     kept_here: Record | None = None, failure: Record | None = None) -> None:
        """Write the answer ``lease``'s request leaves for its key; a write Redis did not
        answer is tried again (``strict``: only while the key's marker is still this
        request's or no one's) until the marker would have lapsed. Dropped at once, a write
        that met a short freeze lost the answer, and a retry sent after it ran the keyed
        work again (a hostile trial: a 1.5 s freeze, a 3 s lease). ``kept_here``: the
        record kept for the key in this process's records while the write is under way,
        dropped once it has ended, however it ended. ``failure``: what the request's
        waiting duplicates, on any replica, are given (:meth:`Capture.failure`)."""
        try:
            await self._write(lease, answer, strict, failure)
        finally:
            if kept_here is not None:
                self.store.discard(lease.store_key, kept_here)

    async def _write(self, lease: _Lease, answer: Answer, strict: bool,
                     failure: Record | None = None) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + self._lease_s
        while True:
            try:
                await lease.records.finish(lease.key, lease.owner, answer, self.ttl,
                                           strict=strict, failure=_shared_failure(failure),
                                           failure_s=self._lease_s)
                return
            except StateUnavailable as exc:
                wait = exc.retry_after or IN_FLIGHT_RETRY_AFTER_S
                if loop.time() + wait >= until:
                    log.warning("an idempotency record was not written (its key is free "
                                "again within %.0fs): %s", self._lease_s, exc.cause,
                                extra=PER_CALL)
                    return
                strict = True
                await asyncio.sleep(wait)

    def _drop(self, records: IdempotencyRecords, key: str, owner: str,
              fingerprint: bytes, failure: Record | None = None) -> None:
        """Free a key this request may hold although its caller left (background); with the
        ``failure`` its duplicates waiting on its marker are given."""
        self._background.spawn(self._quietly(
            records.finish(key, owner, Answer(SEEN, fingerprint), self.ttl,
                           failure=_shared_failure(failure), failure_s=self._lease_s)))

    async def _quietly(self, call: Awaitable[object]) -> None:
        try:
            await call
        except StateUnavailable as exc:
            log.warning("an idempotency record was not written (its key is free again "
                        "within %.0fs): %s", self._lease_s, exc.cause, extra=PER_CALL)

    # -- this process's records ---------------------------------------------------------------

    def _finish(self, claim: Claim, flight: _Flight, outcome: str) -> None:
        store_key = claim._store_key
        record = _answer_to_keep(claim, outcome)
        fallback, claim._fallback = claim._fallback, None
        flight.fallback = None
        failure = None
        if record is None:
            failure = self._failure(claim, outcome, None if fallback is not None else flight)
        if fallback is not None:
            if fallback.renewer is not None:
                fallback.renewer.cancel()
            # Strict: this request may never have held the marker.
            self._background.spawn(self._store(
                fallback, shared_answer(record, claim.fingerprint), strict=True,
                failure=failure))
        if record is not None:
            self._keep_here(store_key, record)
            if not self.dedup:
                # A reload left dedup while this call ran: its answer is kept (for a return
                # to dedup), but its waiters replay nothing now: they take the key in turn.
                self._pass_on(store_key, flight)
                return
            del self._flights[store_key]
            for future in flight.waiters:
                if not future.done():
                    future.set_result(record)
            return
        # No outcome to keep: the key is free for a retry, which is recognised as one. An
        # answer kept from dedup (before a reload to serialize) stays, as in Redis.
        self._settle_waiters(store_key, flight, failure)
        kept = self.store.get(store_key)
        if kept is None or kept.kind == SEEN:
            self.store.put(store_key, Record(SEEN, claim.fingerprint))

    def _keep_here(self, store_key: Hashable, record: Record) -> Record:
        """Keep ``record``, an answer for a key, in this process's records; returns what was
        kept."""
        kept = record
        if (record.kind == DONE and isinstance(self.store, MemoryStore)
                and not self.store.fits(record)):
            # Within max_replay_bytes, but with its headers and overhead more than the
            # store holds at all: the fact is kept, as for an answer over the limit, so
            # that the key never runs again (its waiters still get the answer itself).
            kept = Record(TOO_LARGE, record.fingerprint, record.status)
        self.store.put(store_key, kept)
        return kept

    def _failure(self, claim: Claim, outcome: str, flight: _Flight | None) -> Record | None:
        """The failure ``claim``'s call (ended with ``outcome``, nothing kept) leaves for the
        duplicates waiting for it (:meth:`Capture.failure`), or ``None``; looked for only
        when some wait (``flight``'s waiters here; ``None``: maybe on another replica)."""
        capture = claim.capture
        if capture is None or not self.dedup or (flight is not None and not flight.waiters):
            return None
        return capture.failure(claim.fingerprint, outcome)

    def _settle_waiters(self, store_key: Hashable, flight: _Flight,
                        failure: Record | None) -> None:
        """A key's call ended with nothing to keep: every duplicate waiting for it here is
        given its ``failure`` (instead of each running the call again, one after another,
        each with its own retries: a hostile trial's 20 copies made 60 attempts), and the key
        is free for whoever comes next; with no failure to give, the key is handed to the
        longest waiter (:meth:`_pass_on`)."""
        if failure is None:
            self._pass_on(store_key, flight)
            return
        del self._flights[store_key]
        failed = _Failed(failure)
        for future in flight.waiters:
            if not future.done():
                future.set_result(failed)

    def _pass_on(self, store_key: Hashable, flight: _Flight) -> None:
        """Hand the key to the longest waiter still there, or forget the flight."""
        waiters = flight.waiters
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(_HANDOVER)
                return
        del self._flights[store_key]


def shared_answer(record: Record | None, fingerprint: bytes) -> Answer:
    """What the shared records keep for a key when the request holding it ends: its
    ``record`` (an answer to replay, or the fact one was too large), or, for ``None``, a use
    of the key by the request of ``fingerprint`` (``SEEN``: free for a retry)."""
    if record is None:
        return Answer(SEEN, fingerprint)
    return Answer(record.kind, record.fingerprint, record.status, record.reason,
                  record.headers, record.body)


def _shared_failure(failure: Record | None) -> Answer | None:
    """A failure given to waiting duplicates, as the shared records keep it."""
    if failure is None:
        return None
    return Answer(DONE, failure.fingerprint, failure.status, failure.reason, failure.headers,
                  failure.body)


def shared_record_key(route: str, tenant: str, key: str) -> str:
    """The name of a key's record in the shared records: route, tenant and the key (as the
    caller sent it, or derived), since a record is scoped by tenant and route."""
    return "\0".join((route, tenant, key))


def _answer_to_keep(claim: Claim, outcome: str) -> Record | None:
    """The record ``claim``'s call leaves for its key, or ``None`` (the key is free for a
    retry). Never raises: an answer that cannot be read is not kept (and logged), so that
    ending a call always frees its key (an MCP answer nested deeper than ``orjson`` writes
    once held a key for the life of the process)."""
    capture = claim.capture
    if capture is None:
        return None
    try:
        return capture.answer(claim.fingerprint, outcome)
    except Exception:
        log.exception("the answer to idempotency key %r is not kept (the key is free for a "
                      "retry)", claim.key)
        return None


def _content_type(record: Record) -> str | None:
    return next((value for name, value in record.headers if name.lower() == "content-type"),
                None)


def _fingerprint(method: str, path: str, body: bytes) -> bytes:
    """SHA-256 of method, path and body: what makes two uses of a key "the same request"."""
    digest = hashlib.sha256(method.encode())
    digest.update(b"\0" + path.encode("utf-8", "surrogateescape") + b"\0")
    digest.update(body)
    return digest.digest()


def _with_credentials(fingerprint: bytes, headers: CIMultiDictProxy[str]) -> bytes:
    """``fingerprint`` (32 bytes) bound to the credentials ``headers`` carry
    (:func:`_credentials`): a key the caller chose is that caller's, so the same key and
    payload from other credentials, or none, is answered 422 ``idempotency_mismatch``, never
    with the first caller's stored answer. Records stay scoped by tenant; with
    self-declared tenants (no ``identity.tenants``) that scope alone would replay an answer
    to anyone who learnt the key (a new user's trial: a request with no ``Authorization``
    was given another caller's completion)."""
    return hashlib.sha256(fingerprint + _credentials(headers)).digest()


def _credentials(headers: CIMultiDictProxy[str]) -> bytes:
    """A digest of the credentials ``headers`` carry in
    :data:`policies.secrets.CREDENTIAL_HEADERS` (none: the digest of nothing; a list, not
    every field that may hold a secret, a review: those that change with every request would
    make a call's retry another call, its side effect run twice under a key Sluice derives).
    A key Sluice makes itself (derived, or an MCP call's tool and arguments) includes it, and
    a caller's own key is bound to it (:func:`_with_credentials`), so an answer is never
    replayed to a caller with other credentials: keyed by tenant alone, a new user's second
    caller, sharing the tenant, was given the first one's ``my_inbox`` result; bound to three
    headers, a caller with another Gemini key was given the first one's answer (a review)."""
    digest = hashlib.sha256()
    for name in CREDENTIAL_HEADERS:
        for value in headers.getall(name, ()):
            digest.update(name.encode() + b"\0" + value.encode("utf-8", "surrogateescape")
                          + b"\0")
    return b"\0" + digest.digest()


async def _register(records: IdempotencyRecords, key: str, owner: str, fingerprint: bytes,
                    lease_s: float, backends: StateBackends) -> None:
    """Take ``owner``'s marker for a key claimed from memory while Redis did not answer, once
    it answers, and keep it (until cancelled) every third of ``lease_s``; give up when the
    key has an answer already. Another request's marker is waited out, not given up on:
    it may be the previous holder's, whose write frees it a moment later (a key handed over
    here), or another replica's twin that ran during the outage and may end without an
    answer, while this one still runs. Between tries it waits for ``backends`` to see Redis
    back (:meth:`StateBackends.seen_back`, then :meth:`StateBackends.paced`): tried only on
    schedule, the marker came up to a third of the lease after Redis answered, and a
    duplicate sent to another replica meanwhile ran the upstream a second time."""
    woken = False
    while True:
        try:
            async with backends.paced(woken):
                begin = await records.begin(key, owner, fingerprint, lease_s)
            if begin.state == FINISHED:
                return
        except StateUnavailable:
            pass
        woken = await backends.seen_back(lease_s / 3)


async def _renew(records: IdempotencyRecords, key: str, owner: str, fingerprint: bytes,
                 lease_s: float, backends: StateBackends) -> None:
    """Keep ``owner``'s in-flight marker alive while its request runs (until cancelled),
    renewing it every third of ``lease_s``, and as soon as Redis is seen back after an
    outage (as :func:`_register` waits). A marker Redis lost meanwhile (frozen past the
    lease, or restarted empty) is taken again while the key is free: given up, a
    duplicate sent to another replica ran the upstream while this request still ran.
    Once another request holds the key, or it has an answer, the renewal ends. (A take
    that Redis runs after the request's own end wrote its answer finds that answer; one
    after an end that kept none leaves a marker no one renews, which lapses within
    ``lease_s``: duplicates wait that long at worst, as for a replica killed mid-call.)"""
    while True:
        woken = await backends.seen_back(lease_s / 3)
        try:
            async with backends.paced(woken):
                if await records.renew(key, owner, lease_s):
                    continue
                begin = await records.begin(key, owner, fingerprint, lease_s)
        except StateUnavailable:
            continue  # the marker lives on for its expiry; try again next time
        if begin.state != CLAIMED:
            return


def _given_failure(claim: Claim, failure: Record) -> Claim:
    """``claim``, a duplicate that waited for its twin, answered with the twin's failure."""
    claim.replay = failure
    claim.twin_failed = True
    return claim


def _still_in_flight(waited_s: float) -> Rejected:
    return Rejected(Reason.IDEMPOTENCY_CONFLICT, IN_FLIGHT_RETRY_AFTER_S,
                    f"a request with this Idempotency-Key is still in flight after "
                    f"{waited_s:.3g}s of waiting (max_wait, or the caller's timeout)")


def _too_many_waiting(waiting: int) -> Rejected:
    return Rejected(Reason.IDEMPOTENCY_CONFLICT, IN_FLIGHT_RETRY_AFTER_S,
                    f"a request with this Idempotency-Key is in flight and {waiting} "
                    f"duplicates already wait for it (idempotency.max_waiters)")


def _of_generation(fingerprint: bytes, version: str | None) -> bytes:
    """An MCP call's fingerprint for comparing stored answers: the 2026-07-28 generation's
    results carry ``resultType`` and the earlier ones' do not, and a 2026-07-28 client (the
    Python SDK 2.x) fails its whole session on an earlier one's answer. So a call from one
    generation never replays the other's answer: same key, other fingerprint, 422 for that
    call alone. (The earlier generation's fingerprint is the plain one, as it always was.)"""
    if not mcp.is_modern(version):
        return fingerprint
    return hashlib.sha256(fingerprint + b"\0" + mcp.MODERN_VERSION.encode()).digest()


def _mismatch(claim: Claim) -> Rejected:
    if claim.mcp_id is not None:  # an MCP call
        return Rejected(Reason.IDEMPOTENCY_MISMATCH, None,
                        "this call's key was used for another call: other params, the same "
                        "call from other credentials, or from an MCP client of another "
                        "protocol generation (a stored "
                        "answer is replayed only within its generation); to run it again, "
                        "change an argument or send an Idempotency-Key of its own")
    policy = claim._policy
    if (claim.key is not None and policy is not None and policy.derive_from
            and key_origin(claim.key, callers=False) == DERIVED_KEY):
        # The caller sent no key: name the headers Sluice made it from (a new user saw the
        # message speak of an Idempotency-Key it never sent).
        headers = ", ".join(policy.derive_from)
        return Rejected(Reason.IDEMPOTENCY_MISMATCH, None,
                        f"Sluice derived it from this request's {headers}; it was used with "
                        "a different method, path or body, or by a caller with other "
                        "credentials; to run it again, send other values of those headers "
                        "or an Idempotency-Key of its own")
    # What to do, not only what happened (a new user's trial, round 36): the stored
    # fingerprint is one digest, so which of these differed is not known here.
    return Rejected(Reason.IDEMPOTENCY_MISMATCH, None,
                    "its Idempotency-Key was used with a different method, path or body, or "
                    "by a caller with other credentials; send this key again only with that "
                    "same request, and a new request with an Idempotency-Key of its own")


def replay_response(record: Record) -> web.Response:
    """The stored answer as a fresh response, marked ``Idempotent-Replayed: true``; the
    headers a replay leaves out (``_NOT_REPLAYED``) are left out here too, for a record
    stored before one joined them (an ``Mcp-Session-Id`` kept by an earlier release, for up
    to its ``ttl``)."""
    headers = CIMultiDict((name, value) for name, value in record.headers
                          if name.lower() not in _NOT_REPLAYED)
    headers[REPLAYED_HEADER] = "true"
    made = web.Response if hdrs.CONTENT_TYPE in headers else UntypedResponse
    return made(status=record.status, reason=record.reason or None, body=record.body,
                headers=headers)
