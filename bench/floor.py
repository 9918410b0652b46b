"""The floor for ``bench/overhead.py``: the baseline plus Sluice's per-request work, written tight.

How little can a Python proxy on Sluice's stack spend on what Sluice does for the benchmark's
request? This measures it: ``bench/passthrough.py`` (same server, client, settings, header
copies and collector tuning: see its docstring) plus, in plain Python in this one file,
importing nothing from Sluice, the work the default config's ``openai`` route does for an
uncontended, successful, keyless ``POST /v1/chat/completions``, with the bench's limits
(``bench/overhead.py`` ``sluice_config``: 1024 slots and 1024 per tenant, 6,000,000
requests/min per route and per tenant; the default config has 32, 16, 600/min, 300/min).
The same bytes go upstream and back as through Sluice, and the same events and counters are
kept. For that request it does, in this order:

* route: the path's first segment looked up among two prefixes (``/openai/``,
  ``/anthropic/``), stripped when forwarding; this, the upstream URL, whether the target is
  metered and the door's checks of the target alone (below) are worked out once per
  distinct request target (256 kept);
* door (``proxy/edge.py`` ``EdgeServer.serve``, ``Door.check``): HTTP version, ``Host``
  (the loopback names; values allowed once are remembered), non-ASCII header values, a
  target holding ``%``, ``;``, ``\\`` or ``#`` (refused outright: Sluice refuses only a
  ``%``-encoded control character, a ``#``, and ``%;\\`` paths whose readings name
  different endpoints), dot-segments, ``Content-Length`` against ``max_request_bytes``, and
  the body's bytes counted against ``max_buffered_bytes`` until the call ends;
* the headers most calls lack, found in one key-view intersection (in C), and only when one
  is there read and checked: ``Transfer-Encoding``, ``Expect``, a WebSocket ``Upgrade``,
  ``X-Run-ID``, ``X-Request-ID``, ``X-Parent-Run-ID``, ``X-Priority`` (each once, visible
  ASCII, <= 128 characters), the caller's deadline (``X-Request-Timeout``, else
  ``x-stainless-timeout``, else ``x-stainless-read-timeout``; it then bounds the attempt),
  ``x-stainless-retry-count``, ``Idempotency-Key`` and ``X-Step-ID``, ``Content-Encoding``.
  (The SDKs send two of these on every call; the benchmark's request sends none.);
* identity: ``X-Tenant-ID`` read and checked, the default tenant, a counter-based request
  id (``Runtime.next_request_id``);
* drain: new calls refused once SIGTERM came; the route's in-flight count (below) is what
  the drain waits for (2 s at most);
* idempotency (mode ``dedup``): no key of the caller's, not every ``derive_from`` header:
  a fresh ``sluice-<32 hex>`` key from a pool cut in C from one ``os.urandom`` read, sent
  upstream quoted as ``Idempotency-Key``; a work unit counted unless the SDK says retry;
* circuit breaker: its state tested at admission and before each attempt; the answer's
  verdict counted once it is read: a closed-state success in the same second, with no
  failure in the 30 s window, is ``calls += 1, failures = 0`` (Sluice's
  ``MemoryBreakerStates.defer``); else per-second window buckets, opening on ``fail_max``
  in a row or ``rate`` of ``min_calls``, half-open after ``reset_timeout``;
* rate: two GCRA buckets kept as theoretical arrival times, the tenant's (a dict by
  tenant, swept of drained ones every minute, at most ``max_rate_buckets``) and the
  route's, tested and then taken all or nothing; given back when the call never reached
  the upstream;
* token accounting: a POST to a chat-completions path (kept per path) with an uncompressed
  body parsed once (orjson): ``model``, ``max_completion_tokens`` / ``max_tokens`` (the
  larger), ``n``, ``stream`` (a stream not asking for its usage chunk is sent asking for
  it), input tokens estimated from the body's size (3 bytes a token) with the messages
  walked for attachment parts; ``Accept-Encoding: identity`` sent upstream; the answer's
  last ``"usage":{`` member parsed alone, ``prompt_tokens``, ``completion_tokens`` and
  ``cached_tokens`` read; settled ``reported`` (else ``none`` or ``reserved``), priced
  from ``pricing`` (empty: ``cost_usd`` null). No ledger: the bench route limits no tokens,
  so Sluice reserves none either;
* concurrency: the route's and the tenant's in-flight counts tested, taken, given back in a
  ``finally``;
* retry: the status tested against ``retry.on``; a GET or HEAD answered 502/503/504, or an
  attempt that never connected, is tried again (3 in all, full jitter from 250 ms);
* answer: status range, ``Transfer-Encoding`` and non-ASCII header checks; read whole up to
  256 KiB, else relayed as it comes (and charged ``reserved``);
* events: ``admitted`` and ``completed`` with Sluice's fields, appended as dicts to one
  buffer, encoded by orjson on the loop every 128 events or 0.2 s, written by a thread;
* metrics (plain ints, exposed nowhere): requests by outcome, upstream attempts, work units,
  input and output tokens per tenant (100 tenants, then ``other``), usage missing or over
  the reservation, the upstream-duration histogram (``bisect``).

Left out, as Sluice does it only in other cases, or as connection or bookkeeping work the
brief of this floor leaves aside: the edge's per-connection work (``EdgeProtocol``: header
and body timers, the head-size bound, pipelining bounds, ``max_connections``, counting a
long body as it arrives); queueing (a call past a limit is refused 503 here; Sluice queues
it, and keeps its fair-queueing virtual times and service-time averages on every call);
stall detection; idempotency records (a caller's or derived key is answered 501 here); a
breaker's epochs and probe leases (a 429 with rate-limit headers counts as a success here,
as neither there); dead letters; SSE metering and stripping the usage chunk Sluice asked
for; Anthropic's usage shape (the ``anthropic`` route forwards unmetered); lenient JSON
(BOM, UTF-16, NaN); Sluice's refusal bodies; header look-alikes (``X_Tenant_ID``) in the
dropped set; reloads; the admin port. By hand:

    python bench/floor.py --port 9003 --upstream http://127.0.0.1:9001 --events /tmp/ev.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import logging
import math
import os
import queue
import random
import re
import signal
import threading
import time
import unicodedata
from bisect import bisect_left
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
import uvloop
from aiohttp import HttpVersion10, HttpVersion11, hdrs, web
from multidict import CIMultiDictProxy, istr

# The baseline's own stack pieces (run as a script, bench/ is first on sys.path): the floor is
# the baseline plus Sluice's work by construction, not by a copy kept in step by hand.
from passthrough import (
    _HOP_BY_HOP,
    MAX_REQUEST_BYTES,
    _without,
    client_session,
    server_runner,
    tune_gc,
)
from yarl import URL

log = logging.getLogger("floor")

#: Answer fields never relayed: hop-by-hop ones, and Sluice's own signals an upstream could forge.
_DROP_RESPONSE = _HOP_BY_HOP | {"x-sluice-reason", "x-sluice-dead-letter", "x-sluice-run-warning",
                                "x-sluice-budget-remaining", "x-sluice-budget-policy",
                                "x-sluice-budget-reset", "x-sluice-budget-warning"}
#: ``server.max_buffered_bytes``; a body's first count (the edge's).
MAX_BUFFERED_BYTES = 256 * 1024 * 1024
FIRST_HOLD_BYTES = 64 * 1024
#: ``server.allowed_hosts: null`` on a loopback listen address.
_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# -- identity (the default config's names) ----------------------------------------------------
TENANT, RUN, REQUEST_ID = istr("X-Tenant-ID"), istr("X-Run-ID"), istr("X-Request-ID")
PARENT_RUN, PRIORITY = istr("X-Parent-Run-ID"), istr("X-Priority")
DEFAULT_TENANT = "default"
_IDENTITY_VALUE = re.compile(r"[!-~]{1,128}")
_PRIORITIES = {"critical": 0, "standard": 1, "best-effort": 2}
_DEADLINE = istr("X-Request-Timeout")
_STAINLESS_TIMEOUT = istr("x-stainless-timeout")
_STAINLESS_READ_TIMEOUT = istr("x-stainless-read-timeout")
_SECONDS = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?")

# -- idempotency ------------------------------------------------------------------------------
_KEY = istr("Idempotency-Key")
_DERIVE_FROM = (RUN, istr("X-Step-ID"))
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
_CLIENT_RETRY = istr("x-stainless-retry-count")
#: Request fields read only when present (found in one pass: :func:`make_handler`).
_RARE = frozenset({"transfer-encoding", "expect", "upgrade", "content-encoding", "x-run-id",
                   "x-request-id", "x-parent-run-id", "x-priority", "x-request-timeout",
                   "x-stainless-timeout", "x-stainless-read-timeout", "x-stainless-retry-count",
                   "idempotency-key", "x-step-id"})
_FRESH_KEYS_PER_READ = 64
#: Where each key's 32 hex digits sit in one read's hex string.
_KEY_SLICES = [slice(i, i + 32) for i in range(0, 32 * _FRESH_KEYS_PER_READ, 32)]

# -- circuit breaker, retry (the openai route's blocks) ---------------------------------------
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"
FAIL_MAX, FAILURE_RATE, WINDOW_S, MIN_CALLS, RESET_TIMEOUT_S = 5, 0.5, 30, 20, 30.0
RETRY_ON = frozenset({502, 503, 504})
ATTEMPTS, BACKOFF_BASE_S, BACKOFF_MAX_S = 3, 0.25, 8.0
_RATE_LIMIT_HEADERS = ("retry-after", "retry-after-ms", "x-ratelimit-reset-requests",
                       "x-ratelimit-reset-tokens")

# -- rate, concurrency (the bench's limits: 6,000,000/min each, 1024 slots, 1024 a tenant) ---
RATE_LIMIT, RATE_PER_S = 6_000_000, 6_000_000 / 60
TENANT_RATE_LIMIT, TENANT_RATE_PER_S = 6_000_000, 6_000_000 / 60
#: The same in GCRA's terms: seconds one call adds to a bucket's theoretical arrival time,
#: and how far past now that time may run (the burst a full bucket holds).
INTERVAL_S, BURST_S = 1 / RATE_PER_S, RATE_LIMIT / RATE_PER_S
TENANT_INTERVAL_S, TENANT_BURST_S = 1 / TENANT_RATE_PER_S, TENANT_RATE_LIMIT / TENANT_RATE_PER_S
CONCURRENCY_LIMIT, PER_TENANT = 1024, 1024
MAX_RATE_BUCKETS = 250_000
SWEEP_INTERVAL_S = 60.0

# -- token accounting -------------------------------------------------------------------------
BYTES_PER_TOKEN = 3
ATTACHMENT_TOKENS = 1_000
_ATTACHMENT_PARTS = frozenset({"image_url", "input_audio", "file"})
BUFFER_LIMIT_BYTES = 256 * 1024
#: ``pricing``: USD per million tokens by model (the default config's is empty).
PRICING: dict[str | None, tuple[float, float, float]] = {}

# -- events, metrics --------------------------------------------------------------------------
FLUSH_BATCH = 128
FLUSH_INTERVAL_S = 0.2
MAX_TENANT_LABELS = 100
_STATUS_CLASSES = ("0xx", "1xx", "2xx", "3xx", "4xx", "5xx")
OUTCOMES = (*_STATUS_CLASSES, "rejected", "upstream_error", "upstream_timeout",
            "client_disconnected")
DURATION_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                   600.0)
_line = functools.partial(orjson.dumps, option=orjson.OPT_APPEND_NEWLINE)


class Refused(Exception):
    """A refusal: ``status``, Sluice's ``reason`` code, a detail, maybe a Retry-After, and
    the call's outcome label (``rejected``, or an upstream failure's)."""

    def __init__(self, status: int, reason: str, detail: str = "",
                 retry_after: float | None = None, label: str = "rejected") -> None:
        self.status, self.reason, self.detail = status, reason, detail
        self.retry_after, self.label = retry_after, label


class Breaker:
    """A route's breaker: closed, open for ``RESET_TIMEOUT_S``, then half-open (the next
    call is its probe). Opens on ``FAIL_MAX`` failures in a row, or on ``FAILURE_RATE`` of
    the calls in the last ``WINDOW_S`` seconds once ``MIN_CALLS`` are in.

    ``quiet_until`` (monotonic seconds): until then a success needs only counting
    (``calls += 1``, ``failures = 0``): closed, nothing failed in the window, same second;
    the handler does that inline, as Sluice's ``MemoryBreakerStates.defer`` does."""

    __slots__ = ("calls", "current", "fails", "failures", "open_until", "probing",
                 "quiet_until", "seconds", "state")

    def __init__(self) -> None:
        self.state = CLOSED
        self.failures = 0  # in a row
        self.open_until = 0.0
        self.probing = False
        self.quiet_until = 0.0
        self.current = 0  # the second being counted in
        self.calls = self.fails = 0  # over the window, the current second included
        self.seconds: list[tuple[int, int, int]] = []  # (second, calls, failures), oldest first

    def check(self, now: float) -> None:
        """Refuse a call at admission while no attempt would pass (open, and its wait not
        over; or its probe out); takes nothing. Called only when not closed."""
        if (now < self.open_until if self.state is OPEN else self.probing):
            raise Refused(503, "circuit_open", "the route's circuit breaker is open",
                          max(self.open_until - now, 1.0))

    def attempt(self, now: float) -> None:
        """Let an attempt through, or refuse it (:meth:`check`); an open breaker whose wait
        is over turns half-open, this attempt its probe. Called only when not closed."""
        self.check(now)
        self.state, self.probing = HALF_OPEN, True

    def record(self, ok: bool, now: float) -> None:
        """Count an attempt's outcome (``now``: monotonic seconds)."""
        if self.state is not CLOSED:
            if self.state is HALF_OPEN:
                self.probing = False
                if ok:
                    self.state, self.failures = CLOSED, 0
                else:
                    self._open(now)
            return
        second = int(now)
        if second != self.current:
            self._roll(second)
        self.calls += 1
        if ok:
            self.failures = 0
        else:
            self.fails += 1
            self.failures += 1
            if self.failures >= FAIL_MAX:
                self._open(now)
                return
        if self.fails and self.calls >= MIN_CALLS and self.fails >= FAILURE_RATE * self.calls:
            self._open(now)
            return
        self.quiet_until = 0.0 if self.fails else second + 1.0

    def _roll(self, second: int) -> None:
        """Close the current second's count; drop the seconds that left the window."""
        seconds = self.seconds
        done_calls = self.calls - sum(c for _, c, _ in seconds)
        done_fails = self.fails - sum(f for _, _, f in seconds)
        if done_calls:
            seconds.append((self.current, done_calls, done_fails))
        while seconds and seconds[0][0] <= second - WINDOW_S:
            _, calls, fails = seconds.pop(0)
            self.calls -= calls
            self.fails -= fails
        self.current = second

    def _open(self, now: float) -> None:
        self.state, self.open_until, self.failures, self.probing = (
            OPEN, now + RESET_TIMEOUT_S, 0, False)
        self.calls = self.fails = 0
        self.quiet_until = 0.0
        self.seconds.clear()


class Route:
    """One route: where it forwards, what it drops, and its policies' state and counters."""

    def __init__(self, name: str, prefix: str, upstream: str, openai: bool,
                 removed: tuple[str, ...]) -> None:
        self.name = name
        self.prefix = prefix
        self.cut = len(prefix) - 1  # the prefix less its last slash
        self.upstream = upstream
        self.openai = openai  # its usage is read (the anthropic route's is not, here)
        self.drop = _HOP_BY_HOP | {"host", "content-length", "expect"} | {
            name.lower() for name in removed}
        self.breaker = Breaker()
        # rate: GCRA buckets as their theoretical arrival times (monotonic seconds; one at
        # or before now is empty), the route's and each tenant's (swept of drained ones
        # every minute)
        self.tat = 0.0
        self.tenant_tats: dict[str, float] = {}
        self.next_sweep = 0.0
        # concurrency: the route's calls in flight (the drain waits for them), per tenant
        self.inflight = 0
        self.by_tenant: dict[str, int] = {}
        # metrics
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.attempts = 0
        self.work_units = 0
        self.usage_missing = 0
        self.over_reservation = 0
        self.tokens: dict[str, list[int]] = {}  # tenant label -> [input, output]
        self.duration_counts = [0] * (len(DURATION_BOUNDS) + 1)
        self.duration_sum = 0.0

    def new_bucket(self) -> float:
        """An empty bucket's arrival time for a tenant not yet kept (kept once it takes).

        Raises:
            Refused: 503 ``rate_buckets_full`` past ``MAX_RATE_BUCKETS``.
        """
        if len(self.tenant_tats) >= MAX_RATE_BUCKETS:
            raise Refused(503, "rate_buckets_full", "", 5.0)
        return 0.0

    def give_back(self, tenant: str) -> None:
        """Return one call's units to the tenant's bucket and the route's (a call that never
        reached the upstream); a bucket swept meanwhile had drained, and stays empty."""
        self.tat -= INTERVAL_S
        if tenant in self.tenant_tats:
            self.tenant_tats[tenant] -= TENANT_INTERVAL_S

    def sweep(self, now: float) -> None:
        """Forget the tenants' buckets that have drained (an absent one is empty)."""
        self.tenant_tats = {tenant: tat for tenant, tat in self.tenant_tats.items() if tat > now}
        self.next_sweep = now + SWEEP_INTERVAL_S


class Events:
    """The event log: dicts buffered, encoded in batches on the loop, written by a thread.
    The buffer is one list for the process's life (the handler appends to it directly)."""

    def __init__(self, path: str) -> None:
        self.buffer: list[dict[str, object]] = []
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="floor-events", daemon=True)
        self._thread.start()

    def emit(self, event: str, request_id: str, route: str, tenant: str, run: str | None,
             key: str | None, fields: dict[str, object]) -> None:
        """Queue an event off the common path (a refusal)."""
        self.buffer.append({"ts": time.time(), "event": event, "request_id": request_id,
                            "route": route, "tenant": tenant, "run": run,
                            "idempotency_key": key, **fields})

    def flush(self) -> None:
        buffer = self.buffer
        if buffer:
            data = b"".join(map(_line, buffer))
            buffer.clear()
            self._queue.put(data)

    async def flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self.flush()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(1.0)
        os.close(self._fd)

    def _write(self) -> None:
        while (data := self._queue.get()) is not None:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]


#: Identity values that passed :func:`_checked` (at most 1,024 kept): a tenant's name comes on
#: every call, and a set look-up costs a quarter of the regex's match.
_VALID_IDS: set[str] = set()


def _checked(values: list[str], name: str) -> str | None:
    """The one value of identity header ``name``, ``None`` when empty.

    Raises:
        Refused: 400, sent twice, or not visible ASCII of at most 128 characters.
    """
    if len(values) > 1:
        raise Refused(400, "bad_request", f"{name} is sent {len(values)} times")
    value = values[0]
    if value and not _IDENTITY_VALUE.fullmatch(value):
        raise Refused(400, "bad_request", f"{name} takes at most 128 visible ASCII characters")
    if value and len(_VALID_IDS) < 1024:
        _VALID_IDS.add(value)
    return value or None


def _host_allowed(host: str, seen: set[str]) -> bool:
    name = host.strip().lower()
    name = (name[:name.find("]") + 1] if name.startswith("[") else name.partition(":")[0])
    if name.rstrip(".") in _HOSTS:
        if len(seen) < 1024:
            seen.add(host)
        return True
    return False


def _caller_timeout(headers: CIMultiDictProxy[str]) -> float | None:
    """The caller's own timeout, seconds: ``X-Request-Timeout``, else the Stainless SDKs'."""
    raw = headers.get(_DEADLINE)
    if raw is None:
        raw = headers.get(_STAINLESS_TIMEOUT)
        if raw is None or not _SECONDS.fullmatch(raw):
            raw = headers.get(_STAINLESS_READ_TIMEOUT)
    if raw and _SECONDS.fullmatch(raw) and (value := float(raw)) > 0:
        return value
    return None


#: What :func:`_rare` finds in a request that sends none of :data:`_RARE`.
_NONE_RARE = (None, None, None, None, False, False, False, False)


def _rare(headers: CIMultiDictProxy[str], length: str | None
          ) -> tuple[str | None, str | None, float | None, str | None, bool, bool, bool, bool]:
    """``(run, request id, caller's timeout, Expect, chunked, keyed, coded, SDK retry)`` of a
    request sending some of :data:`_RARE`: its run and request id (``None``: none sent),
    the caller's timeout, its ``Expect``, whether its body is chunked, whether it carries a
    key (its own, or every ``derive_from`` header), whether its body is compressed, and
    whether its SDK says it is its own retry. Its parent run and priority are checked.

    Raises:
        Refused: 400 for a bad identity value or transfer coding, 417 for an expectation
            other than ``100-continue``, 501 for a WebSocket handshake.
    """
    chunked = False
    codings = headers.getall(hdrs.TRANSFER_ENCODING, None)
    if codings is not None:
        if ",".join(codings).strip().lower() != "chunked":
            raise Refused(400, "bad_request", "a transfer coding besides chunked")
        chunked = True
    expect = headers.get(hdrs.EXPECT)
    if expect is not None and expect.lower() != "100-continue":
        raise Refused(417, "expectation_failed")
    if (length is None and hdrs.UPGRADE in headers
            and "websocket" in headers[hdrs.UPGRADE].lower()):
        raise Refused(501, "websocket_not_supported")
    getall = headers.getall
    run = getall(RUN, None)
    if run is not None:
        run = _checked(run, RUN)
    request_id = getall(REQUEST_ID, None)
    if request_id is not None:
        request_id = _checked(request_id, REQUEST_ID)
    parent_run = getall(PARENT_RUN, None)
    if parent_run is not None:
        _checked(parent_run, PARENT_RUN)
    priority = getall(PRIORITY, None)
    if priority is not None:
        _PRIORITIES.get(_checked(priority, PRIORITY) or "")  # unknown: the default class
    coding = headers.get(hdrs.CONTENT_ENCODING)
    return (run, request_id, _caller_timeout(headers), expect, chunked,
            _KEY in headers or all(map(headers.__contains__, _DERIVE_FROM)),
            bool(coding) and coding.lower() != "identity", _client_retry(headers))


def _fresh_keys() -> list[tuple[str, str]]:
    """Keys for :data:`_FRESH_KEYS_PER_READ` calls, as logged and as sent (quoted), cut in
    C from one read."""
    digits = os.urandom(16 * _FRESH_KEYS_PER_READ).hex()
    keys = list(map("sluice-".__add__, map(digits.__getitem__, _KEY_SLICES)))
    return list(zip(keys, map('"{}"'.format, keys), strict=True))


def _client_retry(headers: CIMultiDictProxy[str]) -> bool:
    """Whether the SDK says this is its own retry (``x-stainless-retry-count`` > 0)."""
    count = headers.get(_CLIENT_RETRY)
    return (count is not None and count != "0" and count.isdecimal()
            and any(map(unicodedata.decimal, count)))


def _undecodable(values: object) -> bool:
    """Whether a header value is not UTF-8 (aiohttp keeps such bytes as surrogate escapes,
    which its writer drops)."""
    try:
        for value in values:  # type: ignore[attr-defined]
            value.encode()
    except UnicodeEncodeError:
        return True
    return False


def _read_cost(body: bytes) -> tuple[str | None, int, int | None, bytes] | None:
    """``(model, input tokens estimated, output cap, body to send)`` of a chat completion;
    ``None`` when it is no JSON object or a cap or ``n`` is invalid (it then passes
    unmetered: the route limits no tokens). A stream that does not ask for its usage chunk
    is sent asking for it (``usage.stream_usage``)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(obj) is not dict:
        return None
    get = obj.get
    model = get("model")
    cap, other = get("max_completion_tokens"), get("max_tokens")
    if cap is not None and (type(cap) is not int or cap < 0):
        return None
    if other is not None:
        if type(other) is not int or other < 0:
            return None
        if cap is None or other > cap:
            cap = other
    choices = get("n")
    if choices is not None:
        if type(choices) is not int or choices < 1:
            return None
        if cap:
            cap *= choices
    size, flat = len(body), 0
    if get("stream") is True:
        options = get("stream_options")
        if type(options) is not dict or options.get("include_usage") is not True:
            body = _asking_usage(body, obj, options)
    messages = get("messages")
    if type(messages) is list:
        for message in messages:
            if type(message) is dict and type(parts := message.get("content")) is list:
                for part in parts:
                    if type(part) is dict and part.get("type") in _ATTACHMENT_PARTS:
                        flat += ATTACHMENT_TOKENS
                        size -= len(orjson.dumps(part))
    tokens = -(-size // BYTES_PER_TOKEN)
    return (model if type(model) is str else None, (tokens if tokens > 0 else 1) + flat, cap,
            body)


def _asking_usage(body: bytes, obj: dict, options: object) -> bytes:
    """``body`` with ``stream_options.include_usage`` true: spliced in before its last brace,
    or written whole when it has ``stream_options`` already."""
    if "stream_options" in obj:
        return orjson.dumps({**obj, "stream_options": {
            **(options if type(options) is dict else {}), "include_usage": True}})
    end = body.rstrip().rfind(b"}")
    return body[:end] + b',"stream_options":{"include_usage":true}' + body[end:]


def _usage(data: bytes) -> tuple[int, int, int] | None:
    """``(prompt, completion, cached)`` tokens of a JSON answer's top-level ``usage``: from
    its last ``"usage":{`` key on, parsed alone when that makes an object (its value is
    then an object), else all of it."""
    at = data.rfind(b'"usage":{')
    if at > 0 and data[at - 1] in b"{, \t\r\n":
        try:
            usage = orjson.loads(b"{" + data[at:])["usage"]
        except orjson.JSONDecodeError:  # a key nested deeper
            usage = _whole_usage(data)
    else:
        usage = _whole_usage(data)
    if usage is None:
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is not int or type(completion) is not int or prompt < 0 or completion < 0:
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if type(details) is dict else 0
    return prompt, completion, cached if type(cached) is int and cached > 0 else 0


def _whole_usage(data: bytes) -> dict | None:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    usage = obj.get("usage") if type(obj) is dict else None
    return usage if type(usage) is dict else None


def _verdict(status: int, headers: CIMultiDictProxy[str]) -> bool:
    """Whether an answer is a success for the breaker (a 429 with rate-limit headers, which
    Sluice counts as neither, is one here)."""
    if status < 429:
        return True
    if status == 429:
        return any(name in headers for name in _RATE_LIMIT_HEADERS)
    return status < 500


def _refusal(refused: Refused) -> web.Response:
    headers = {"X-Sluice-Reason": refused.reason}
    if refused.retry_after is not None:
        headers["Retry-After"] = str(math.ceil(refused.retry_after))
    return web.Response(status=refused.status, headers=headers, content_type="application/json",
                        body=orjson.dumps({"error": {"type": refused.reason,
                                                     "message": refused.detail}}))


def _backoff(attempt: int) -> Awaitable[None]:
    """The wait before attempt ``attempt + 1``: full jitter."""
    return asyncio.sleep(random.uniform(0, min(BACKOFF_MAX_S,
                                               BACKOFF_BASE_S * 2 ** (attempt - 1))))


class Process:
    """What the handler shares across routes: bytes of bodies held, the drain's flag."""

    __slots__ = ("buffered", "draining")

    def __init__(self) -> None:
        self.buffered = 0
        self.draining = False


#: What a request target comes to: its route (``None``: no route serves it), the upstream URL,
#: whether a POST to it is a chat completion to meter, and the door's refusal of the target
#: itself (``(status, reason, detail)``) or ``None``. All of it is a function of the target
#: alone, so it is worked out once per distinct target (:func:`make_handler` keeps 256).
Target = tuple[Route | None, URL | None, bool, tuple[int, str, str] | None]


def _target(raw_path: str, by_segment: dict[str, Route]) -> Target:
    """:data:`Target` of ``raw_path`` (found by its first segment among the routes' prefixes)."""
    end = raw_path.find("/", 1)
    route = by_segment.get(raw_path[:end + 1]) if end > 0 else None
    if route is None:
        return None, None, False, None
    bad = None
    # Stricter than Sluice, which forwards the paths whose readings agree.
    if "%" in raw_path or ";" in raw_path or "\\" in raw_path or "#" in raw_path:
        bad = (400, "bad_request", "%, ;, \\ or # in the request target")
    elif "." in raw_path and any(segment in (".", "..") for segment in
                                 raw_path.partition("?")[0].split("/")):
        bad = (400, "bad_request", "dot-segments in path")
    metered = route.openai and raw_path.partition("?")[0].endswith("/chat/completions")
    return (route, URL(route.upstream + raw_path[route.cut:], encoded=True), metered, bad)


def make_handler(session: aiohttp.ClientSession, routes: list[Route], events: Events,
                 proc: Process, loop: asyncio.AbstractEventLoop
                 ) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """The one handler: the door, the route's policies, the forward, the accounts."""
    by_segment = {route.prefix: route for route in routes}
    targets: dict[str, Target] = {}
    # Runtime.next_request_id: a process prefix and a counter (formatted in C).
    next_id = map(f"{os.getpid():x}-{os.urandom(3).hex()}-{{}}".format,
                  itertools.count(1)).__next__
    hosts_seen: set[str] = set()
    key_pool: list[tuple[str, str]] = []
    buffer, flush, call_soon = events.buffer, events.flush, loop.call_soon
    monotonic, wall = time.monotonic, time.time

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        raw_path = request.raw_path
        target = targets.get(raw_path)
        if target is None:
            if len(targets) >= 256:
                targets.clear()
            target = targets[raw_path] = _target(raw_path, by_segment)
        route, url, metered, bad = target
        if route is None or request.method == "CONNECT":
            return _refusal(Refused(404, "no_route", "no route serves this path"))
        headers = request.headers
        held = 0
        tenant = run = request_id = key = None  # as the refusal's event names them
        try:
            # -- door
            version = request.version
            if version is not HttpVersion11 and version != HttpVersion10:
                raise Refused(400, "bad_request", "only HTTP/1.1 and HTTP/1.0 are served")
            host = headers.get(hdrs.HOST)
            if host is None:
                if version is HttpVersion11:
                    raise Refused(400, "bad_request", "no Host")
            elif host not in hosts_seen and not _host_allowed(host, hosts_seen):
                raise Refused(421, "misdirected_request", "Host is not served here")
            if not "".join(headers.values()).isascii() and _undecodable(headers.values()):
                raise Refused(400, "bad_request", "a header value is not UTF-8")
            if bad is not None:
                raise Refused(*bad)
            length = headers.get(hdrs.CONTENT_LENGTH)
            # Every other header read, looked for in one pass (in C): most calls send none.
            run, request_id, timeout, expect, chunked, keyed, coded, client_retry = (
                _NONE_RARE if headers.keys().isdisjoint(_RARE) else _rare(headers, length))
            declared = (int(length.lstrip("0") or "0") if length is not None
                        else MAX_REQUEST_BYTES if chunked else 0)
            if declared > MAX_REQUEST_BYTES:
                raise Refused(413, "request_too_large", f"limit {MAX_REQUEST_BYTES} bytes")
            first = declared if declared < FIRST_HOLD_BYTES else FIRST_HOLD_BYTES
            if proc.buffered + first > MAX_BUFFERED_BYTES:
                raise Refused(503, "buffers_full", "", 1.0)
            held = first
            proc.buffered += first
            # -- identity
            tenant = headers.getall(TENANT, None)
            if tenant is not None:
                tenant = (tenant[0] if len(tenant) == 1 and tenant[0] in _VALID_IDS
                          else _checked(tenant, TENANT))
            tenant = tenant or DEFAULT_TENANT
            request_id = request_id or next_id()
            # -- body
            if expect is not None and request.transport is not None:
                request.transport.write(_CONTINUE)
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise Refused(413, "request_too_large",
                              f"limit {MAX_REQUEST_BYTES} bytes") from None
            if held != len(body):
                proc.buffered += len(body) - held
                held = len(body)
            if proc.draining:
                raise Refused(503, "draining", "it takes no new calls", 1.0)
            method = request.method
            # -- idempotency
            if method not in _SAFE_METHODS:
                if keyed:
                    raise Refused(501, "not_in_floor", "idempotency records")
                if not key_pool:
                    key_pool.extend(_fresh_keys())
                key, quoted = key_pool.pop()
            # -- circuit breaker
            breaker = route.breaker
            now = monotonic()
            if breaker.state is not CLOSED:
                breaker.check(now)
            # -- rate: the tenant's bucket and the route's, all or nothing
            if now >= route.next_sweep:
                route.sweep(now)
            tats = route.tenant_tats
            mine = tats.get(tenant)
            if mine is None:
                mine = route.new_bucket()
            ours = route.tat
            mine = (mine if mine > now else now) + TENANT_INTERVAL_S
            ours = (ours if ours > now else now) + INTERVAL_S
            if mine - now > TENANT_BURST_S or ours - now > BURST_S:
                raise Refused(429, "rate_limited", "", max(mine - now - TENANT_BURST_S, 0.0)
                              + max(ours - now - BURST_S, 0.0))
            tats[tenant] = mine
            route.tat = ours
        except Refused as refused:
            proc.buffered -= held
            route.outcomes["rejected"] += 1
            # Logged under validated values only (a refused identity header's are not).
            events.emit("rejected", request_id if type(request_id) is str else next_id(),
                        route.name, tenant if type(tenant) is str else DEFAULT_TENANT,
                        run if type(run) is str else None, key,
                        {"status": refused.status, "reason": refused.reason})
            return _refusal(refused)
        reached = False
        try:
            # -- token accounting
            cost = None
            if metered and method == "POST" and not coded:
                cost = _read_cost(body)
            # -- concurrency
            in_tenant = route.by_tenant.get(tenant, 0)
            if in_tenant >= PER_TENANT:
                raise Refused(429, "tenant_concurrency", f"{PER_TENANT} calls in flight")
            if route.inflight >= CONCURRENCY_LIMIT:
                raise Refused(503, "concurrency_full", "this floor has no queue", 1.0)
        except Refused as refused:
            route.give_back(tenant)
            proc.buffered -= held
            route.outcomes["rejected"] += 1
            events.emit("rejected", request_id, route.name, tenant, run, key,
                        {"status": refused.status, "reason": refused.reason})
            return _refusal(refused)
        route.inflight += 1
        route.by_tenant[tenant] = in_tenant + 1
        admitted_at = now  # the rate step's
        status, label, usage = 0, "client_disconnected", None
        try:
            buffer.append({"ts": wall(), "event": "admitted", "request_id": request_id,
                           "route": route.name, "tenant": tenant, "run": run,
                           "idempotency_key": key})
            if len(buffer) == FLUSH_BATCH:
                call_soon(flush)
            # -- forward
            out = _without(headers, route.drop)
            peer = request.remote
            if peer:
                prior = out.getall("X-Forwarded-For", None)
                out["X-Forwarded-For"] = (", ".join([*filter(None, prior), peer]) if prior
                                          else peer)
            if key is not None:
                out[_KEY] = quoted
            if cost is not None:
                out[hdrs.ACCEPT_ENCODING] = "identity"  # an answer whose usage can be read
                body = cost[3]
            attempt = 0
            while True:
                attempt += 1
                if breaker.state is not CLOSED:
                    breaker.attempt(monotonic())
                route.attempts += 1
                sent_before, reached = reached, True
                try:
                    if timeout is None:
                        answer = await session.request(method, url, headers=out,
                                                       data=body or None, allow_redirects=False)
                    else:
                        async with asyncio.timeout(admitted_at + timeout - monotonic()):
                            answer = await session.request(method, url, headers=out,
                                                           data=body or None,
                                                           allow_redirects=False)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    breaker.record(False, monotonic())
                    never_left = isinstance(exc, aiohttp.ClientConnectorError)
                    reached = sent_before or not never_left
                    if never_left and attempt < ATTEMPTS:
                        await _backoff(attempt)
                        continue
                    if isinstance(exc, TimeoutError):
                        raise Refused(504, "upstream_timeout", "no answer in time",
                                      label="upstream_timeout") from None
                    raise Refused(502, "upstream_unreachable", "the upstream did not answer",
                                  label="upstream_error") from None
                status = answer.status
                # -- retry
                if status in RETRY_ON and method in _SAFE_METHODS and attempt < ATTEMPTS:
                    answer.release()
                    breaker.record(False, monotonic())
                    await _backoff(attempt)
                    continue
                break
            try:
                # -- the answer
                if not 200 <= status <= 599:
                    raise Refused(502, "upstream_unreachable", f"status {status}",
                                  label="upstream_error")
                upstream_headers = answer.headers
                if hdrs.TRANSFER_ENCODING in upstream_headers and ",".join(
                        upstream_headers.getall(hdrs.TRANSFER_ENCODING)
                ).strip().lower() != "chunked":
                    raise Refused(502, "upstream_unreachable", "a transfer coding",
                                  label="upstream_error")
                answer_headers = _without(upstream_headers, _DROP_RESPONSE)
                if (not "".join(answer_headers.values()).isascii()
                        and _undecodable(answer_headers.values())):
                    log.warning("route %s: an answer header is not UTF-8; its undecodable "
                                "bytes do not reach the caller", route.name)
                length = upstream_headers.get(hdrs.CONTENT_LENGTH)
                # (Fewer than 6 digits: below the limit, with no int() to build.)
                if length is not None and (len(length) < 6 or int(length.lstrip("0") or "0")
                                           <= BUFFER_LIMIT_BYTES):
                    try:
                        data = await answer.read()
                    except (aiohttp.ClientError, TimeoutError):
                        breaker.record(False, monotonic())
                        raise Refused(502, "upstream_unreachable", "the answer was cut short",
                                      label="upstream_error") from None
                    if (cost is not None and not upstream_headers.get(hdrs.CONTENT_ENCODING)
                            and "json" in upstream_headers.get(hdrs.CONTENT_TYPE, "").lower()):
                        usage = _usage(data)
                    response: web.StreamResponse = web.Response(
                        status=status, reason=answer.reason, body=data, headers=answer_headers)
                else:
                    response = web.StreamResponse(status=status, reason=answer.reason,
                                                  headers=answer_headers)
                    await response.prepare(request)
                    async for chunk in answer.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                now = monotonic()
                if status < 429 and now < breaker.quiet_until:
                    breaker.calls += 1
                    breaker.failures = 0
                else:
                    breaker.record(_verdict(status, upstream_headers), now)
                label = _STATUS_CLASSES[status // 100]
                return response
            except BaseException:
                # An answer read to its end gave its connection back; one cut short or
                # refused is released here (as the baseline does).
                answer.release()
                raise
        except Refused as failed:
            status, label = failed.status, failed.label
            return _refusal(failed)
        finally:
            # -- settle: everything taken is given back, the call counted and logged
            route.inflight -= 1
            left = route.by_tenant[tenant] - 1
            if left:
                route.by_tenant[tenant] = left
            else:
                del route.by_tenant[tenant]
            if not reached:
                route.give_back(tenant)
            proc.buffered -= held
            elapsed = monotonic() - admitted_at
            route.duration_counts[bisect_left(DURATION_BOUNDS, elapsed)] += 1
            route.duration_sum += elapsed
            route.outcomes[label] += 1
            if cost is None or label == "rejected":
                record = {"ts": wall(), "event": "completed", "request_id": request_id,
                          "route": route.name, "tenant": tenant, "run": run,
                          "idempotency_key": key, "status": status, "outcome": label,
                          "duration_s": round(elapsed * 1e6) / 1e6}
            else:
                model, estimate, cap, _ = cost
                cached = 0
                if not reached:
                    used_in = used_out = 0
                    source = "none"
                elif usage is not None:
                    used_in, used_out, cached = usage
                    source = "reported"
                elif 400 <= status:
                    used_in = used_out = 0
                    source = "none"
                else:
                    used_in, used_out = estimate, cap or 0
                    source = "reserved"
                    route.usage_missing += 1
                price = PRICING.get(model)
                record = {"ts": wall(), "event": "completed", "request_id": request_id,
                          "route": route.name, "tenant": tenant, "run": run,
                          "idempotency_key": key, "status": status, "outcome": label,
                          "duration_s": round(elapsed * 1e6) / 1e6, "model": model,
                          "input_tokens": used_in, "output_tokens": used_out,
                          "cost_usd": None if price is None else round(
                              ((used_in - cached) * price[0] + used_out * price[1]
                               + cached * price[2]) / 1e6, 9), "usage": source}
                if source == "reported" and cap is not None and (
                        over := used_in + used_out - estimate - cap) > 0:
                    record["over_reservation_tokens"] = over
                    route.over_reservation += 1
                tokens = route.tokens.get(tenant)
                if tokens is None:
                    tokens = route.tokens.setdefault(
                        tenant if len(route.tokens) < MAX_TENANT_LABELS else "other", [0, 0])
                tokens[0] += used_in
                tokens[1] += used_out
            if not client_retry:
                route.work_units += 1
            buffer.append(record)
            if len(buffer) == FLUSH_BATCH:
                call_soon(flush)

    return handle


async def serve(port: int, upstream: str, events_path: str) -> None:
    """Serve on 127.0.0.1:``port`` until SIGTERM or SIGINT; then drain (2 s at most)."""
    loop = asyncio.get_running_loop()
    session = client_session()
    removed = ("X-Tenant-ID", "X-Run-ID", "X-Parent-Run-ID", "X-Priority")
    routes = [Route("openai", "/openai/", upstream, True, removed),
              Route("anthropic", "/anthropic/", "https://api.anthropic.com", False, removed)]
    events = Events(events_path)
    proc = Process()
    runner = server_runner(make_handler(session, routes, events, proc, loop), loop)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    flusher = asyncio.create_task(events.flush_forever())
    try:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
        tune_gc()
        await stop.wait()
        proc.draining = True
        deadline = time.monotonic() + 2.0
        while any(route.inflight for route in routes) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        flusher.cancel()
        await runner.cleanup()
        await session.close()
        events.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the openai route's, e.g. "
                        "http://127.0.0.1:9001")
    parser.add_argument("--events", required=True, help="the event log (JSON lines) path")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.upstream.rstrip("/"), args.events))


if __name__ == "__main__":
    main()
