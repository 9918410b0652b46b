"""The Redis connection every Redis state backend shares: built from ``(url, prefix, timeout)``.

:class:`RedisState` owns one client, either ``redis.asyncio.Redis`` (a single server) or
``redis.asyncio.RedisCluster`` (the URL names any node of a Redis Cluster), chosen at
:meth:`RedisState.start` by asking the node ``INFO cluster`` (``cluster_enabled:1``); no other
setting says which. Whatever the client, every call made through :meth:`RedisState.run`

* is bounded by ``asyncio.timeout(timeout_s)`` (:class:`Deadline`: plus a few milliseconds
  for a reply that arrived while the loop was busy): redis-py's own retries are off
  (``Retry(NoBackoff(), 0)``, redis 8 otherwise retries 10 times with 5 s socket timeouts,
  shared/notes/library-pitfalls.md §5), and a single server's connections come from a
  ``BlockingConnectionPool`` whose wait for a free connection falls within that bound (a
  cluster client has no blocking pool: its per-node ``max_connections`` answers
  ``MaxConnectionsError`` at once, which counts as unavailable). redis-py's own connect and
  pool timeouts are only a backstop (:attr:`RedisState.backstop_s`): they are plain asyncio
  timeouts, which a busy loop turns into false outages; it has no read or write timeout (its
  write timeout loses cancellations on Python 3.11, see ``_connect``);
* is tried once more, within the same bound, when its connection turns out broken
  (``ConnectionError``, e.g. "Connection closed by server"): a pooled connection opened before
  a Redis restart fails on its first use (redis-py's check before handing it out does not see
  a closed socket), and so would each of its idle siblings, marking the backend down again
  although Redis answers. The idle ones are dropped first, so the second try opens a fresh
  connection. A script whose connection broke after Redis ran it runs twice: budget
  reservations, settles and leases are keyed by their id, so that is a no-op for them; rate
  buckets and breaker windows count that call twice;
* raises :class:`~policies.state.errors.StateUnavailable` when Redis is down, frozen, slow or
  refusing (see :func:`~policies.state.errors.is_unavailable`), and records it in
  :attr:`RedisState.health`.

While the backend is marked down, calls fail at once (no request waits out a timeout on a
frozen server) and a background probe makes a write (a key added and removed) every
``probe_interval_s``; the first write that goes through marks it up again, so recovery needs
no restart and no new client. A write, not a PING: a Redis at its ``maxmemory``
(noeviction) answers PING and reads and refuses every write, and was marked up at each
probe. A call sent before the backend was marked down and answered after does not mark it up
either (a read, or a release, answered by such a Redis). While up, an idle backend is PINGed
(:data:`HEARTBEAT_S`). Whether the server evicts keys (:mod:`policies.state.eviction`) is
read when the backend connects or answers again, and every
:data:`~policies.state.eviction.CHECK_INTERVAL_S` while it is up, by a task of its own that the
probe starts and never waits for: one read at a time, bounded by its own timeout, so a slow
or frozen ``INFO`` leaves the probe's schedule as it is (a probe that waited out the read
would mark a Redis frozen as the read began down a second later than one that did not).

Keys: ``<prefix>:{<group>}:<kind>:...``. Everything one script touches shares the ``{group}``
hash tag (a route's name, an idempotency key's digest...), so in a cluster each script runs
on one slot (https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/
#hash-tags).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from policies.secrets import secret_query_field, secret_query_name
from policies.state.errors import (
    BAD_RECORD,
    BadRecord,
    StateUnavailable,
    is_key_fault,
    is_unavailable,
    key_fault,
)
from policies.state.eviction import (
    CHECK_INTERVAL_S,
    READ_TIMEOUT_S,
    EvictionWatch,
    read_eviction,
)
from policies.state.notify import RedisNotifier

log = logging.getLogger("sluice.state")

T = TypeVar("T")

REDACTED = "<redacted>"
#: Connections a single server's pool opens at most; callers beyond wait up to the timeout.
MAX_CONNECTIONS = 64
#: How often a backend marked down is probed, seconds.
PROBE_INTERVAL_S = 0.5
#: An idle backend that is up is PINGed when nothing answered for this long, seconds.
HEARTBEAT_S = 1.0
#: How long a call past its deadline may still take its reply, seconds. When Sluice's own
#: loop runs late (a busy CPU, not a slow Redis), the deadline and the reply Redis sent in
#: time come due in the same loop turn; cancelling then throws the answer away, disconnects
#: (redis-py closes a connection cancelled mid-command), and marks a healthy Redis down.
LATE_GRACE_S = 0.005
#: The least of redis-py's own timeouts (:attr:`RedisState.backstop_s`), seconds.
BACKSTOP_S = 1.0
#: Bound on finding out what the URL names (and, for a cluster, reading its slot map), seconds;
#: at least this even when the per-call timeout is shorter.
CONNECT_TIMEOUT_S = 2.0


def redact_url(url: str) -> str:
    """``url`` with any password (in the userinfo, or a query field that carries a
    credential by its name or value, :func:`policies.secrets.secret_query_field`:
    ``password=``, ``api_key=``, ``q=sk-...``) replaced by ``<redacted>``; a lone userinfo
    without ``:`` is taken for a token and redacted too.

    >>> redact_url("redis://:s3cret@cache:6379/0")
    'redis://:<redacted>@cache:6379/0'
    """
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{hostport}" if sep else f"{REDACTED}@{hostport}"
    query = parts.query
    if query:
        fields = urllib.parse.parse_qsl(query, keep_blank_values=True)
        # Read decoded, written encoded again: a decoded ``%1b`` or ``%0a`` printed as it is
        # drove the operator's terminal (an ESC sequence, a forged line).
        query = "&".join(
            REDACTED if secret_query_name(name)
            else f"{_encoded(name)}="
                 f"{REDACTED if secret_query_field(name, value) else _encoded(value)}"
            for name, value in fields
        )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _encoded(text: str) -> str:
    """A query field's decoded name or value percent-encoded again, as a URL carries it."""
    return urllib.parse.quote(text, safe="/:@!$'()*,;~")


def hash_tag(group: str) -> str:
    """The text to put between ``{}`` for ``group``: itself when it cannot break the tag
    (no braces, not empty), else a digest of it."""
    if group and "{" not in group and "}" not in group:
        return group
    return hashlib.sha1(group.encode("utf-8", "surrogateescape")).hexdigest()[:20]


class Health:
    """Whether the state backend answers: what ``sluice_state_backend_up`` and ``/readyz`` show.

    Attributes:
        up: the last call (or probe) succeeded.
        known: some call or probe has had a result (``up`` is ``False`` before, unknown).
        last_error: why the last failed call failed (never holds a password), or ``None``;
            kept after recovery, as the last error seen.
        changed_at: ``time.time()`` of the last change between up and down.
        changed_monotonic: ``time.monotonic()`` of the same (what :meth:`down_for` measures
            from: a wall clock stepped back or forward does not stretch an outage).
        failures: calls that failed since the backend was last up.
        recovered_at: ``time.monotonic()`` of the last time it was up again after being
            down, or a connection connected again (a restart perhaps too fast to be marked
            down); ``None`` before either.
    """

    def __init__(self) -> None:
        self.up = False
        self.known = False
        self.last_error: str | None = None
        self.changed_at = time.time()
        self.changed_monotonic = time.monotonic()
        self.failures = 0
        self.recovered_at: float | None = None
        self._listeners: list[Callable[[bool, str | None], None]] = []
        self._reconnect_listeners: list[Callable[[], None]] = []

    def on_change(self, listener: Callable[[bool, str | None], None]) -> None:
        """Call ``listener(up, last_error)`` on every change between up and down, and on the
        first result (so an outage from the start is told too; read :attr:`known` before
        the call to tell a first answer from a recovery)."""
        self._listeners.append(listener)

    def on_reconnect(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` when a connection, connected before, connects again (a call
        found it broken and was answered on a new one, or the pool found it closed by the
        server), the backend perhaps never marked down: a server restarted that fast
        (``kill -9`` and back within the timeout, a pod replaced) may have lost every key,
        and nothing else tells it."""
        self._reconnect_listeners.append(listener)

    def reconnected(self) -> None:
        """Record a connection connecting again (see :meth:`on_reconnect`)."""
        self.recovered_at = time.monotonic()
        for listener in self._reconnect_listeners:
            listener()

    def ok(self) -> None:
        """Record a successful call."""
        if not self.up:
            self.up = True
            self.failures = 0
            self._changed()

    def fail(self, error: str) -> None:
        """Record a failed call and why."""
        self.last_error = error
        self.failures += 1
        if self.up or not self.known:
            self.up = False
            self._changed()

    def down_for(self) -> float:
        """Seconds the backend has been marked down (since it was created, if it never
        answered); 0 while it is up."""
        return 0.0 if self.up else time.monotonic() - self.changed_monotonic

    def as_dict(self) -> dict[str, object]:
        """JSON-ready view for ``/readyz`` detail."""
        return {"up": self.up, "last_error": self.last_error, "since": self.changed_at,
                "failures": self.failures}

    def _changed(self) -> None:
        # No log line of its own: the listeners say what the change means (proxy/runtime.py).
        self.changed_at = time.time()
        self.changed_monotonic = time.monotonic()
        if self.up and self.known:
            self.recovered_at = self.changed_monotonic
        for listener in self._listeners:
            listener(self.up, None if self.up else self.last_error)
        self.known = True


class Deadline:
    """``asyncio.timeout(timeout_s)`` whose expiry waits :data:`LATE_GRACE_S` more, once, so
    that a reply read in the turn the deadline passed in is taken rather than cancelled.

    Raises (on exit): TimeoutError, when the body ran past ``timeout_s`` plus the grace.
    """

    __slots__ = ("_handle", "_timeout", "_timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._timeout = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> Deadline:
        await self._timeout.__aenter__()
        loop = asyncio.get_running_loop()
        self._handle = loop.call_at(loop.time() + self._timeout_s, self._expire, loop)
        return self

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        # A timer, not call_soon: on asyncio's loop and on uvloop alike, the wake-up of a
        # task whose reply was read in this turn runs before the next turn's timers.
        self._timeout.reschedule(loop.time() + LATE_GRACE_S)

    async def __aexit__(self, *exc: Any) -> bool | None:
        if self._handle is not None:
            self._handle.cancel()
        return await self._timeout.__aexit__(*exc)


# Prepended to every script: ``num(v, what)`` and ``decoded(raw, what)`` read back a number or
# a JSON object that a script stored, and ``bad(what, why)`` fails the call for any other
# check: a BADRECORD error, a key fault (policies.state.errors) when the key holds something
# else. A bare tonumber() gave nil and the script failed with "attempt to perform arithmetic
# on a nil value", told apart from a bug in the script by nothing. ``what`` names the record;
# the value itself is never put in the error.
#
# ``float_field(v, what)`` and ``int_field(v, what)`` read a hash field the script will then
# change with HINCRBYFLOAT or HINCRBY (absent: 0), and fail unless Redis will take it: only
# plain decimals, finite and far from overflow (num() took " 5 " and "0x10", which HINCRBY
# refuses). ``whole(v)`` is int_field's test without the failure (a string only). A script
# that writes several keys reads every value it will write through these before its first
# write: Redis does not roll a script back, so a refusal midway left the writes before it,
# which a caller sending the call again applied again (a hostile review: a settle charged 28
# for a true 7 after four retries).
DECODE_LUA = f"""
local function bad(what, why)
  error({{err = '{BAD_RECORD} ' .. what .. ' ' .. why}})
end
local function num(v, what)
  local n = tonumber(v)
  if n == nil then bad(what, 'holds a non-number') end
  return n
end
local function plain_float(v)
  if type(v) ~= 'string' or #v > 64 or not string.find(v, '%d') then return nil end
  if not (string.find(v, '^%-?%d*%.?%d*$') or string.find(v, '^%-?%d*%.?%d*[eE][%-+]?%d+$'))
  then return nil end
  local n = tonumber(v)
  if n == nil or not (n > -1e300 and n < 1e300) then return nil end
  return n
end
local function float_field(v, what)
  if not v then return 0 end
  local n = plain_float(v)
  if n == nil then bad(what, 'holds a non-number') end
  return n
end
local function whole(v)
  return string.find(v, '^%-?%d+$') ~= nil and #v <= 18
end
local function int_field(v, what)
  if not v then return 0 end
  if not whole(v) then bad(what, 'holds a non-integer') end
  return tonumber(v)
end
local function decoded(raw, what)
  local ok, rec = pcall(cjson.decode, raw)
  if not ok or type(rec) ~= 'table' then bad(what, 'holds no JSON object') end
  return rec
end
"""

#: The labels of ``sluice_state_key_faults_total``: which kind of state a key fault was met
#: in (each :class:`Script` names one).
KEY_FAULT_KINDS = ("admission", "budget", "breaker", "deadletter", "idempotency", "lease",
                   "rate", "runs")
#: At most one WARNING per kind of state this often about key faults, seconds (each is
#: counted in ``sluice_state_key_faults_total`` whatever the log says).
KEY_FAULT_LOG_INTERVAL_S = 60.0


class Script:
    """A Lua script run with EVALSHA on the current client (``register_script``, which loads
    it again on NOSCRIPT after a restart or failover); :data:`DECODE_LUA` comes first.
    ``what``: the kind of state it works on (:data:`KEY_FAULT_KINDS`), its key faults'
    label (``None``: not one of Sluice's kinds of state, such as the health probe's; its
    key faults are not counted)."""

    __slots__ = ("_registered", "lua", "what")

    def __init__(self, lua: str, what: str | None = None) -> None:
        assert what is None or what in KEY_FAULT_KINDS, what
        self.lua = DECODE_LUA + lua
        self.what = what
        self._registered: tuple[Any, AsyncScript] | None = None

    def bind(self, client: Redis | RedisCluster) -> AsyncScript:
        registered = self._registered
        if registered is None or registered[0] is not client:
            registered = (client, client.register_script(self.lua))
            self._registered = registered
        return registered[1]


# KEYS: the probe's key. A write with commands Sluice's own scripts use (so an ACL that lets
# Sluice work lets the probe write), taken back in the same script: no key is left.
_WRITE_PROBE = Script("""
redis.call('ZADD', KEYS[1], 0, 'probe')
redis.call('ZREM', KEYS[1], 'probe')
return 1
""")


class RedisState:
    """One Redis (or Redis Cluster) connection with a key prefix, a timeout and a health.

    Args:
        url: ``redis://[user:password@]host:port[/db]`` or ``rediss://...``; a cluster node's
            address makes this a cluster client.
        prefix: the start of every key and channel name, e.g. ``sluice``.
        timeout_s: bound on every call, seconds (``state.timeout``).
        max_connections: connections opened at most (per node, for a cluster).
        probe_interval_s: how often a backend marked down is probed, seconds.
        eviction_check_s: how often the server's eviction policy and count are read while
            the backend is up, seconds (:attr:`eviction`).
    """

    def __init__(self, url: str, prefix: str, timeout_s: float, *,
                 max_connections: int = MAX_CONNECTIONS,
                 probe_interval_s: float = PROBE_INTERVAL_S,
                 eviction_check_s: float = CHECK_INTERVAL_S) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if "{" in prefix or "}" in prefix:
            raise ValueError("the key prefix may not contain '{' or '}' (hash tag delimiters)")
        self.url = url
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.probe_interval_s = probe_interval_s
        self.health = Health()
        #: Whether the servers evict keys, as last read: ``sluice_state_evicting_policy``
        #: and ``sluice_state_redis_evicted_keys_total``.
        self.eviction = EvictionWatch()
        self.eviction_check_s = eviction_check_s
        self.health.on_change(self._eviction_unknown)
        #: Key faults met, by kind of state (:data:`KEY_FAULT_KINDS`), since start:
        #: ``sluice_state_key_faults_total``.
        self.key_faults: dict[str, int] = dict.fromkeys(KEY_FAULT_KINDS, 0)
        self._key_fault_logged: dict[str, float] = {}
        #: ``True`` for a Redis Cluster, ``False`` for one server, ``None`` before detection.
        self.cluster: bool | None = None
        self._client: Redis | RedisCluster | None = None
        self._monitor: asyncio.Task[None] | None = None
        #: The eviction read in flight, or the last one (:meth:`_start_eviction_read`).
        self._eviction_read: asyncio.Task[None] | None = None
        self._closed = False
        self._answered_at = 0.0
        self.notifier = RedisNotifier(self)

    def __repr__(self) -> str:
        kind = {None: "undetected", True: "cluster", False: "single"}[self.cluster]
        return f"<RedisState {redact_url(self.url)} prefix={self.prefix!r} {kind}>"

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Find out what the URL names and connect; start the recovery probe.

        Never raises for an unreachable server: the backend is then marked down and the probe
        keeps trying, so Sluice can start (``on_unavailable`` applies) before Redis does.
        """
        with contextlib.suppress(StateUnavailable):
            await self.probe()
        # The first eviction read is awaited here, later ones run beside the probe: one left
        # running as calls start opened a second pooled connection whose first connect a
        # Redis restart could fail, so the restart, seen only as a connection connecting
        # again, went unnoticed and the leases it lost were not taken again (a regression
        # hunt). At most max(state.timeout, READ_TIMEOUT_S) more at start.
        await self.check_eviction()
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name="sluice-state-probe")

    async def close(self) -> None:
        """Stop the probe and the notifier, and close every connection."""
        self._closed = True
        for task in (self._monitor, self._eviction_read):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._monitor = self._eviction_read = None
        await self.notifier.close()
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
            if isinstance(client, Redis):
                await client.connection_pool.disconnect()

    async def probe(self) -> bool:
        """PING the backend (detecting it first if that has not happened yet); record the
        result in :attr:`health`.

        Raises:
            StateUnavailable: the backend did not answer.
        """
        try:
            if self._client is None:
                try:
                    async with asyncio.timeout(max(CONNECT_TIMEOUT_S, self.timeout_s)):
                        self._client = await self._connect()
                except (RedisError, ValueError) as exc:
                    # Refused while connecting: a database index out of range, a bad password,
                    # a cluster URL naming a database. Sluice serves on (state.on_unavailable)
                    # and keeps probing, so fixing Redis or its ACL needs no restart; a bad
                    # URL shows in the log and /readyz until it is corrected.
                    raise StateUnavailable(describe(exc)) from exc
            client = self._client
            async with Deadline(self.timeout_s):
                if self.health.up:
                    await client.ping()
                else:
                    # Marked down, a write must go through to mark it up: a Redis at its
                    # maxmemory (noeviction) or refusing writes (MISCONF, READONLY) answers
                    # PING and refuses every script that takes something, and was marked up
                    # at each probe and down at the next call, twice a second (a hostile
                    # review: "answers again: limits are shared" logged 7 times in 3 s).
                    await _WRITE_PROBE.bind(client)(keys=[self.key("probe")], args=[],
                                                    client=client)
        except Exception as exc:
            raise self._unavailable(exc) from exc
        self._answered_at = time.monotonic()
        self.health.ok()
        return True

    def _unavailable(self, exc: Exception, what: str | None = None) -> StateUnavailable:
        """Mark the backend down for ``exc`` and return the error to raise; an error that
        says nothing about availability (a bug, a bad script) is re-raised as it is. ``what``:
        the kind of state the call was on, for a key fault (:meth:`key_fault`)."""
        if isinstance(exc, StateUnavailable):  # refused while connecting (see probe)
            self.health.fail(exc.cause)
            return StateUnavailable(f"state backend unavailable: {exc.cause}",
                                    self.probe_interval_s, down_s=self.health.down_for())
        if is_key_fault(exc):  # that key only: the backend stays up for the others
            return self.key_fault(describe(exc), what)
        if not is_unavailable(exc):
            raise exc
        self.health.fail(describe(exc))
        return StateUnavailable(f"state backend unavailable: {describe(exc)}",
                                self.probe_interval_s, down_s=self.health.down_for())

    def key_fault(self, detail: str, what: str | None) -> StateUnavailable:
        """The error for a key fault met in a call on ``what`` (:data:`KEY_FAULT_KINDS`),
        counted, and logged at WARNING at most once per :data:`KEY_FAULT_LOG_INTERVAL_S` per
        kind: it is served as unavailable (``state.on_unavailable``) while the backend stays
        up, so nothing else says it. ``detail`` never holds the value found."""
        if what is not None:
            self.key_faults[what] += 1
            now = time.monotonic()
            logged = self._key_fault_logged.get(what)
            if logged is None or now - logged >= KEY_FAULT_LOG_INTERVAL_S:
                self._key_fault_logged[what] = now
                log.warning("%s state: a key under the prefix %r holds what Sluice does not "
                            "write there, served as state.on_unavailable says (%d such calls "
                            "so far; at most one such line a minute): %s", what, self.prefix,
                            self.key_faults[what], detail)
        return key_fault(detail)

    async def check_eviction(self) -> None:
        """Read whether the server evicts keys into :attr:`eviction` (two ``INFO`` calls,
        within the timeout or :data:`~policies.state.eviction.READ_TIMEOUT_S`, the longer),
        while the backend is up. Never raises, and never changes :attr:`health`: a read that
        fails leaves it unknown (:meth:`~policies.state.eviction.EvictionWatch.failed`). A
        read during which the backend was marked down (and perhaps up again) is dropped,
        whatever it found: its answer may be from before the outage, and kept it would fill
        the series the outage emptied for the rest of the outage, as no read is made while
        down; the read after the backend is up again says."""
        client, health = self._client, self.health
        if client is None or not health.up:
            return
        began = health.changed_monotonic
        try:
            async with Deadline(max(self.timeout_s, READ_TIMEOUT_S)):
                found = await read_eviction(client)
        except Exception as exc:
            if health.up and health.changed_monotonic == began:
                self.eviction.failed(exc, time.monotonic())
        else:
            if health.up and health.changed_monotonic == began:
                self.eviction.read(found, time.monotonic())

    def _eviction_unknown(self, up: bool, _error: str | None) -> None:
        """A :meth:`Health.on_change` listener: down, what the server does is unknown; up
        again, it is read at the probe task's next turn (the server may have been replaced)."""
        self.eviction.unknown()

    def _start_eviction_read(self) -> None:
        """Start :meth:`check_eviction` as a task of its own when a read is due, the backend
        is up and no read is in flight: a read never overlaps another, and nothing awaits it
        (the probe's schedule is the probe's alone)."""
        task = self._eviction_read
        if (self._closed or self._client is None or not self.health.up
                or (task is not None and not task.done())
                or not self.eviction.due(time.monotonic(), self.eviction_check_s)):
            return
        self._eviction_read = asyncio.create_task(self.check_eviction(),
                                                  name="sluice-state-eviction")

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.probe_interval_s)
            # While up, PING only when no call has succeeded lately: an idle replica still
            # notices an outage (its gauge and /readyz say so) before a request finds it.
            if not self.health.up or time.monotonic() - self._answered_at >= HEARTBEAT_S:
                try:
                    await self.probe()
                except StateUnavailable:
                    pass
                except Exception as exc:  # a bug, not Redis: say so, keep probing
                    self.health.fail(describe(exc))
                    log.error("state backend probe: %s", describe(exc))
            self._start_eviction_read()

    @property
    def backstop_s(self) -> float:
        """redis-py's own connect and pool-wait timeouts, seconds: a backstop only. Every call
        is bounded by :class:`Deadline`; redis-py's timeouts are plain asyncio timeouts, which
        would throw away a reply that arrived while the loop was busy (see
        :data:`LATE_GRACE_S`), so they must not fire first."""
        return max(BACKSTOP_S, 2 * self.timeout_s)

    async def _connect(self) -> Redis | RedisCluster:
        """A client for whatever the URL names (``INFO cluster``'s ``cluster_enabled``)."""
        no_retry = Retry(NoBackoff(), 0)
        backstop = self.backstop_s
        # socket_timeout=None (redis 8's default is 5 s): with one, redis-py writes each
        # command under asyncio.wait_for, which on Python 3.11 swallows a cancellation that
        # lands as the write completes (CPython gh-86296, fixed in 3.12): measured, every
        # cancel of a call in its first loop turns was lost, and a lease's renewal outlived
        # its release. Deadline bounds every call instead.
        pool = _WatchedPool.from_url(
            self.url, max_connections=self.max_connections, timeout=backstop,
            socket_timeout=None, socket_connect_timeout=backstop, retry=no_retry,
        )
        pool.on_reconnect = self.health.reconnected
        single = Redis(connection_pool=pool)
        try:
            info = await single.info("cluster")
        except BaseException:
            await single.aclose()
            await pool.disconnect()
            raise
        if not info.get("cluster_enabled"):
            self.cluster = False
            return single
        await single.aclose()
        await pool.disconnect()
        db = parse_url(self.url).get("db") or 0
        if int(db) != 0:
            raise ValueError(f"{redact_url(self.url)} names database {db}, but a Redis Cluster "
                             "has only database 0")
        cluster = RedisCluster.from_url(
            self.url, retry=Retry(NoBackoff(), 0), max_connections=self.max_connections,
            socket_timeout=None, socket_connect_timeout=backstop,  # see the single server's
        )
        try:
            await cluster.initialize()
        except BaseException:
            await cluster.aclose()
            raise
        self.cluster = True
        return cluster

    def node_pool(self) -> ConnectionPool:
        """A new connection pool to one node, for a pub/sub connection (a cluster propagates
        PUBLISH to every node, so any node hears every channel).

        Raises:
            StateUnavailable: the backend has not been reached yet.
        """
        client = self._client
        if client is None:
            raise StateUnavailable("state backend not connected yet")
        options = parse_url(self.url)
        if isinstance(client, RedisCluster):
            node = client.get_default_node()
            options.update(host=node.host, port=node.port, db=0)
        options.update(retry=Retry(NoBackoff(), 0), socket_connect_timeout=self.timeout_s,
                       socket_timeout=None)  # as in _connect: a write's timeout loses cancels
        return ConnectionPool(**options)

    # -- calls --------------------------------------------------------------------------------

    def key(self, group: str, *parts: str) -> str:
        """``<prefix>:{<group>}:<parts...>``: a key in ``group``'s hash slot."""
        return ":".join((self.prefix, "{" + hash_tag(group) + "}", *parts))

    async def run(self, op: Callable[[Redis | RedisCluster], Awaitable[Any]],
                  read: Callable[[Any], T] | None = None, *, what: str | None = None) -> T:
        """``await op(client)`` bounded by the timeout, with failures mapped, then its reply
        through ``read`` (the reply itself without). ``what``: the kind of state the call is
        on (:data:`KEY_FAULT_KINDS`), for its key faults (``None``: not counted).

        Raises:
            StateUnavailable: Redis is down, frozen, too slow or refusing; or it was marked
                down and its probe has not seen it back yet (raised at once); or a key the
                call touched holds what Sluice does not write there (``WRONGTYPE``, a script's
                ``BADRECORD``, or ``read`` raising
                :class:`~policies.state.errors.BadRecord` from a
                :mod:`policies.state.stored` decoder): that key only, the backend is not
                marked down, the fault counted and logged (:meth:`key_fault`). Anything else
                ``read`` raises is a bug and propagates as it is.
        """
        client = self._client
        monitored = self._monitor is not None and not self._monitor.done()
        if client is None or (monitored and not self.health.up):
            why = self.health.last_error or "not connected yet"
            raise StateUnavailable(f"state backend unavailable: {why}", self.probe_interval_s,
                                   maybe_applied=False, down_s=self.health.down_for())
        # The health's last change when this call was sent: a call that went out before the
        # backend was marked down and is answered after does not mark it up (a read or a
        # release answered by a Redis that refuses writes is no sign it takes them again;
        # the probe's write is).
        sent_at = self.health.changed_monotonic
        try:
            async with Deadline(self.timeout_s):
                try:
                    result = await op(client)
                except RedisConnectionError as exc:
                    if type(exc) is not RedisConnectionError or self._closed:
                        # Refused by a live server (auth, loading): a retry says the same.
                        # Closed: the pool must not open connections again.
                        raise
                    await _drop_idle(client)
                    result = await op(client)
                    reconnected = True
                else:
                    reconnected = False
        except Exception as exc:
            raise self._unavailable(exc, what) from exc
        self._answered_at = time.monotonic()
        health = self.health
        if health.up or not monitored or health.changed_monotonic == sent_at:
            health.ok()
        if reconnected:
            health.reconnected()
        if read is None:
            return result  # type: ignore[no-any-return]
        try:
            return read(result)
        except BadRecord as exc:
            raise self.key_fault(str(exc), what) from exc

    async def eval(self, script: Script, keys: list[str], args: list[Any],
                   read: Callable[[Any], T] | None = None) -> T:
        """Run ``script`` with ``keys`` and ``args`` in one round trip, its reply through
        ``read`` (see :meth:`run`)."""

        def call(client: Redis | RedisCluster) -> Awaitable[Any]:
            return script.bind(client)(keys=keys, args=args, client=client)

        return await self.run(call, read, what=script.what)


class _WatchedPool(BlockingConnectionPool):
    """A pool that calls ``on_reconnect()`` when one of its connections, connected before,
    connects again: the server closed it (a restart, say) or it broke. redis-py reconnects a
    pooled connection the server closed when it is next taken, silently, so no failed call
    tells :meth:`RedisState.run` (a hostile trial: 2 of 5 restarts back within 26-77 ms went
    unnoticed, the leases Redis lost counted again only at their renewal, 10 s later)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_reconnect: Callable[[], None] | None = None
        self._connected_before: set[int] = set()  # ids: connections allow no weak reference

    def make_connection(self) -> Any:
        connection = super().make_connection()
        connection.register_connect_callback(self._connected)
        return connection

    def _connected(self, connection: Any) -> None:
        key = id(connection)
        if key not in self._connected_before:
            self._connected_before.add(key)
        elif self.on_reconnect is not None:
            self.on_reconnect()


async def _drop_idle(client: Redis | RedisCluster) -> None:
    """Close a single server's idle pooled connections, which a restart has broken if it broke
    the one that just failed (a cluster client replaces a failed node's connections itself)."""
    if isinstance(client, Redis):
        with contextlib.suppress(Exception):  # closing a dead socket may complain; it is closed
            await client.connection_pool.disconnect(inuse_connections=False)


def describe(exc: BaseException) -> str:
    """A short description of a failure: its type and message (no URL, so no password)."""
    text = str(exc)
    if isinstance(exc, TimeoutError) and not text:
        return "timed out"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
