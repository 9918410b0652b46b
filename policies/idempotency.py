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
  body): the stored status, headers (less framing and ``Set-Cookie``) and body, with
  ``Idempotent-Replayed: true``; streamed answers (SSE) are stored as the bytes of the whole
  stream and replayed at once as one response, so the client's SSE parser sees the same events.
* same key, different fingerprint: 422 ``idempotency_mismatch`` (the draft's status), whether
  the first request is done or still in flight.
* duplicate while the first is in flight: with ``on_in_flight: wait`` (default) it waits,
  holding no concurrency slot, and gets the first one's answer as a replay; with ``reject``
  it gets 409 ``idempotency_conflict`` with ``Retry-After: 1`` (the draft's answer; the
  official SDKs retry a 409).
* what is stored: the upstream's answer when it is a final one: every status below 500 except
  401, 403, 407 (the caller may fix its credentials and retry the same payload), 408, 409, 425
  and 429 (the upstream says "try again"). Never stored, so the key is free again for a
  retry: Sluice's own refusals (429/503 before the upstream), connect errors, timeouts, 5xx,
  a stream cut short, and a caller that disconnected (its upstream request is cancelled, and
  the next waiter, if any, runs its own identical request). This follows Stripe's rule that a
  result is saved only once the endpoint executed, made stricter for 5xx: those are mostly
  transient here (overload, a bad deploy), and storing one would fail that key for ``ttl``
  although a retry would succeed. The draft would replay errors too.
* an answer larger than ``max_replay_bytes`` is passed through to its caller but not stored:
  a duplicate gets 409 ``idempotency_conflict`` with ``x-should-retry: false`` and a
  ``Retry-After`` equal to the time left until the key expires (it must not execute again,
  and there is nothing to replay).

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
import hashlib
import os
import re
from collections import deque
from collections.abc import Hashable

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from policies.config import IdempotencyConfig
from policies.idempotency_store import DONE, SEEN, TOO_LARGE, MemoryStore, Record, ResultStore
from policies.pipeline import Call, Outcome
from policies.reasons import Reason, Rejected
from policies.retry import is_client_retry

#: Methods that are idempotent by definition and never get a key (RFC 9110 §9.2.1).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
#: Longest key accepted, characters (Stripe's limit; the draft leaves it to the resource).
MAX_KEY_LENGTH = 255
#: What a duplicate refused while its twin is in flight is told to wait, seconds.
IN_FLIGHT_RETRY_AFTER_S = 1.0

#: Upstream statuses that are not an outcome (see the module docstring).
_NOT_STORED = frozenset({401, 403, 407, 408, 409, 425, 429})
#: ``sluice_requests_total`` outcomes that mean the upstream's whole answer was relayed.
_ANSWERED = frozenset({"2xx", "3xx", "4xx"})
#: Response headers not replayed: framing is recomputed; a cookie belongs to one exchange.
_NOT_REPLAYED = frozenset({"content-length", "set-cookie", "idempotent-replayed"})

# RFC 8941 §3.3.3 sf-string (printable ASCII, only \" and \\ escaped), and a bare value:
# visible ASCII without the quote and the comma (a comma would join two header lines).
_QUOTED = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"[ \t]*')
_BARE = re.compile(r"[\x21\x23-\x2b\x2d-\x7e]+")
_ESCAPE = re.compile(r'\\(["\\])')

#: A waiter's future resolves to this when the key is handed to it: it runs its own request.
_HANDOVER = object()


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


class Capture:
    """Collects the upstream's answer as it is relayed (fed by ``proxy.forward``).

    Only a storable status is collected, and only up to ``limit`` bytes; past that the
    chunks are dropped and only the size is kept, so a long stream costs no memory here.
    """

    __slots__ = ("chunks", "headers", "limit", "reason", "size", "status", "storable")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.status = 0
        self.reason = ""
        self.headers: tuple[tuple[str, str], ...] = ()
        self.chunks: list[bytes] = []
        self.size = 0
        self.storable = False

    def begin(self, status: int, reason: str | None, headers: CIMultiDict[str]) -> None:
        """The upstream's status line and headers (hop-by-hop fields already dropped)."""
        self.status = status
        self.reason = reason or ""
        self.storable = status < 500 and status not in _NOT_STORED
        if self.storable:
            self.headers = tuple(
                (name, value) for name, value in headers.items()
                if name.lower() not in _NOT_REPLAYED
            )

    def feed(self, chunk: bytes) -> None:
        """Bytes of the body, in order, as they were sent on to the caller."""
        if not self.storable:
            return
        self.size += len(chunk)
        if self.size <= self.limit:
            self.chunks.append(chunk)
        elif self.chunks:
            self.chunks = []

    def record(self, fingerprint: bytes) -> Record:
        """The record to store once the whole answer was relayed."""
        if self.size > self.limit:
            return Record(TOO_LARGE, fingerprint, self.status)
        return Record(DONE, fingerprint, self.status, self.reason, self.headers,
                      b"".join(self.chunks))


class Replay(Exception):
    """The call's answer is a stored one: reply with :func:`replay_response` of ``record``.

    Attributes:
        record: the stored answer.
        waited_s: how long the call waited for its in-flight twin, seconds.
    """

    def __init__(self, record: Record, waited_s: float) -> None:
        super().__init__("replay")
        self.record = record
        self.waited_s = waited_s


class _Flight:
    """A key whose request is running: its payload and who waits for it."""

    __slots__ = ("fingerprint", "waiters")

    def __init__(self, fingerprint: bytes) -> None:
        self.fingerprint = fingerprint
        self.waiters: deque[asyncio.Future[object]] = deque()


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

    __slots__ = ("_flight", "_policy", "_store_key", "capture", "fingerprint", "header", "key",
                 "new_unit", "rejected", "replay", "waited_s")

    def __init__(self, key: str | None) -> None:
        self.key = key
        self.header: str | None = None
        self.capture: Capture | None = None
        self.fingerprint = b""
        self.new_unit = False
        self.rejected: Rejected | None = None
        self.replay: Record | None = None
        self.waited_s = 0.0
        self._policy: Idempotency | None = None
        self._store_key: Hashable = None
        self._flight: _Flight | None = None

    def release(self, outcome: Outcome) -> None:
        """The pipeline's end of the claim (a :class:`policies.pipeline.Holding`)."""
        self.finish(outcome.label)

    def finish(self, outcome: str) -> None:
        """Settle the key: store the answer or free the key for a retry.

        ``outcome`` is the ``sluice_requests_total`` outcome of the request (``2xx`` ...,
        ``rejected``, ``upstream_error``, ``upstream_timeout``, ``client_disconnected``).
        Calling it again, or on a claim that holds no key, does nothing.
        """
        flight = self._flight
        if flight is None or self._policy is None:
            return
        self._flight = None
        self._policy._finish(self, flight, outcome)


class Idempotency:
    """The idempotency policy of one route, with its store and its in-flight keys.

    Args:
        config: the route's ``idempotency`` block (mode is not ``off``).
        route: the route's name; part of every derived key.
        store: where records live (default: a :class:`MemoryStore` sized by ``config``).
    """

    def __init__(self, config: IdempotencyConfig, route: str,
                 store: ResultStore | None = None) -> None:
        self.mode = config.mode
        self.dedup = config.mode == "dedup"
        self.wait_in_flight = config.on_in_flight == "wait"
        self.derive_from = tuple(config.derive_from)
        self.max_replay_bytes = config.max_replay_bytes
        self.store: ResultStore = store or MemoryStore(config.max_entries, config.max_bytes,
                                                       config.ttl)
        self.waiting = 0
        self._route = route.encode()
        self._flights: dict[Hashable, _Flight] = {}

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
        claim = await self.claim(call.method, call.path, call.headers, call.tenant, call.body)
        call.new_unit = claim.new_unit
        call.idempotency_key = claim.key
        if claim.rejected is not None:
            raise claim.rejected
        if claim.replay is not None:
            raise Replay(claim.replay, claim.waited_s)
        call.upstream_key = claim.header
        call.capture = claim.capture
        return claim if claim._flight is not None else None

    @property
    def in_flight(self) -> int:
        """Keys whose request is running now."""
        return len(self._flights)

    async def claim(self, method: str, path: str, headers: CIMultiDictProxy[str], tenant: str,
                    body: bytes) -> Claim:
        """Resolve the request's key and its standing; may wait for an in-flight twin.

        ``path`` is the path and query as received. Never raises for the request's own
        faults: they come back as :attr:`Claim.rejected` (400, 409 or 422).

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
            claim = Claim(key)
        else:
            key = self._derive(headers, tenant)
            if key is None:
                # A fresh key: unknown to anyone else, so there is nothing to look up.
                claim = Claim(f"sluice-{os.urandom(16).hex()}")
                claim.header = f'"{claim.key}"'
                claim.new_unit = not is_client_retry(headers)
                return claim
            claim = Claim(key)
            claim.header = f'"{key}"'

        store_key = (tenant, key)
        flight = self._flights.get(store_key)
        record = self.store.get(store_key) if flight is None else None
        if self.mode == "forward":
            if record is None:
                self.store.put(store_key, Record(SEEN, b""))
            claim.new_unit = record is None and not is_client_retry(headers)
            return claim

        fingerprint = _fingerprint(method, path, body) if self.dedup else b""
        claim.fingerprint = fingerprint
        claim._policy = self
        claim._store_key = store_key
        if flight is None and record is None:
            claim.new_unit = not is_client_retry(headers)
        if flight is not None:
            if self.dedup and flight.fingerprint != fingerprint:
                claim.rejected = _mismatch()
                return claim
            if not self.wait_in_flight:
                claim.rejected = Rejected(
                    Reason.IDEMPOTENCY_CONFLICT, IN_FLIGHT_RETRY_AFTER_S,
                    "a request with this Idempotency-Key is in flight")
                return claim
            loop = asyncio.get_running_loop()
            started = loop.time()
            outcome = await self._wait(store_key, flight)
            claim.waited_s = loop.time() - started
            if outcome is _HANDOVER:
                claim._flight = flight
                self._arm(claim)
                return claim
            assert isinstance(outcome, Record)
            record = outcome
        if record is not None and record.kind != SEEN:
            if record.fingerprint != fingerprint:
                claim.rejected = _mismatch()
            elif record.kind == DONE:
                claim.replay = record
            else:
                claim.rejected = Rejected(
                    Reason.IDEMPOTENCY_CONFLICT, self.store.ttl_left(record),
                    f"the first request with this key completed, but its answer exceeded "
                    f"max_replay_bytes ({self.max_replay_bytes}) and was not kept")
            return claim
        claim._flight = _Flight(fingerprint)
        self._flights[store_key] = claim._flight
        self._arm(claim)
        return claim

    def _arm(self, claim: Claim) -> None:
        if self.dedup:
            claim.capture = Capture(self.max_replay_bytes)

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
        return f"sluice-d-{digest.hexdigest()[:32]}"

    async def _wait(self, store_key: Hashable, flight: _Flight) -> object:
        """Wait for ``flight`` to settle: a :class:`Record` to replay, or ``_HANDOVER``."""
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        flight.waiters.append(future)
        self.waiting += 1
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.result() is _HANDOVER:
                # The key was handed over just as this caller left: pass it on.
                self._pass_on(store_key, flight)
            else:
                try:
                    flight.waiters.remove(future)
                except ValueError:
                    pass
            raise
        finally:
            self.waiting -= 1

    def _finish(self, claim: Claim, flight: _Flight, outcome: str) -> None:
        store_key = claim._store_key
        capture = claim.capture
        if capture is not None and capture.storable and outcome in _ANSWERED:
            record = capture.record(claim.fingerprint)
            self.store.put(store_key, record)
            del self._flights[store_key]
            for future in flight.waiters:
                if not future.done():
                    future.set_result(record)
            return
        # No outcome to keep: the key is free for a retry, which is recognised as one.
        self.store.put(store_key, Record(SEEN, claim.fingerprint))
        self._pass_on(store_key, flight)

    def _pass_on(self, store_key: Hashable, flight: _Flight) -> None:
        """Hand the key to the longest waiter still there, or forget the flight."""
        waiters = flight.waiters
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(_HANDOVER)
                return
        del self._flights[store_key]


def _fingerprint(method: str, path: str, body: bytes) -> bytes:
    """SHA-256 of method, path and body: what makes two uses of a key "the same request"."""
    digest = hashlib.sha256(method.encode())
    digest.update(b"\0" + path.encode("utf-8", "surrogateescape") + b"\0")
    digest.update(body)
    return digest.digest()


def _mismatch() -> Rejected:
    return Rejected(Reason.IDEMPOTENCY_MISMATCH, None,
                    "this Idempotency-Key was used with a different method, path or body")


def replay_response(record: Record) -> web.Response:
    """The stored answer as a fresh response, marked ``Idempotent-Replayed: true``."""
    headers = CIMultiDict(record.headers)
    headers[REPLAYED_HEADER] = "true"
    return web.Response(status=record.status, reason=record.reason or None, body=record.body,
                        headers=headers)
