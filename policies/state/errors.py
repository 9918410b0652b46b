"""The one error the state layer raises for a backend that cannot answer, and how it is told.

Callers on the request path catch :class:`StateUnavailable` and apply the configured
``state.on_unavailable`` (``local``: enforce this replica's share of each limit in memory;
``reject``: 503 ``state_unavailable``). A key under the prefix that another program wrote (of
another type, or of the right type with content Sluice cannot read) is a *key fault*: its
calls raise :class:`StateUnavailable` too, the backend staying up for every other key.
Anything else a state call raises is a bug (a Lua error in one of our scripts, a wrong
argument) and is left to propagate.
"""

from __future__ import annotations

import redis.exceptions as rx

#: The error code our Lua scripts raise when a stored value is not what Sluice writes there
#: (``connection.DECODE_LUA``).
BAD_RECORD = "BADRECORD"

# Replies Redis sends when it is up but will not run our script now. Redis starts every error
# reply with its code (RESP "simple errors"); redis-py turns the codes it knows into the
# exception classes below and leaves the others (BUSY, MISCONF...) as the reply's first word.
# Inside a script the failed command's code is kept (Redis 7), so an OOM write is seen too.
_UNAVAILABLE_CODES = frozenset({
    "BUSY",        # another script runs past lua-time-limit
    "LOADING",     # loading its dataset after a restart
    "READONLY",    # a replica (failover in progress)
    "OOM",         # maxmemory reached under a noeviction policy
    "MISCONF",     # refusing writes after a failed RDB save
    "MASTERDOWN",  # a replica that lost its master
    "CLUSTERDOWN", "TRYAGAIN",  # cluster resharding or lacking slot coverage
    "NOPERM", "NOAUTH", "WRONGPASS",  # ACL or password refusal
    "NOSCRIPT",    # still missing after redis-py's one SCRIPT LOAD (scripts disabled)
    "NOREPLICAS",
})
# Replies about one key, not the server: a key under state.key_prefix holds another type
# (another program writes there, or a prefix is shared), or holds the right type with content
# our scripts cannot read (BADRECORD, raised by connection.DECODE_LUA). The calls on that key
# cannot be served, but the backend is up for every other key.
_KEY_CODES = frozenset({"WRONGTYPE", BAD_RECORD})
# The same about a value: HINCRBY or HINCRBYFLOAT on a field holding a non-number (redis-py
# strips the ERR code, which every command error shares, and leaves this message).
_KEY_MESSAGES = ("hash value is not an integer", "hash value is not a float")

# Client-side failures: the server is down, frozen, unreachable, or the pool is exhausted.
_UNAVAILABLE_TYPES: tuple[type[BaseException], ...] = (
    rx.ConnectionError,        # refused, reset, auth, MaxConnectionsError, BusyLoadingError
    rx.TimeoutError,           # socket timeout
    TimeoutError,              # our asyncio.timeout() cap (asyncio.TimeoutError is this one)
    rx.ClusterError,           # cluster-level failures (ClusterDownError, MasterDownError)
    rx.RedisClusterException,  # no node reachable, slot not covered
    rx.OutOfMemoryError,
    rx.ReadOnlyError,
    rx.NoPermissionError,
    rx.TryAgainError,
    rx.NoScriptError,
    OSError,                   # a socket error redis-py did not wrap
)


#: Longest wait a refusal for an outage tells a caller, seconds (:attr:`StateUnavailable.hint`):
#: well under the 60 s the SDKs honour, and a recovery is used within this long.
OUTAGE_HINT_MAX_S = 10.0


def outage_hint(probe_s: float, down_s: float) -> float:
    """The wait to tell a caller refused because the backend is down, seconds: the time it has
    been down so far (``down_s``), at least ``probe_s`` (until its next probe) and at most
    :data:`OUTAGE_HINT_MAX_S`.

    An outage that has lasted ``d`` seconds is not likely to end in the next half second
    (the longer it has lasted, the longer it tends to go on), and a caller told ``d`` each
    time doubles its wait at every retry, as exponential backoff would. Told the probe
    interval whatever the outage's length, an SDK with 5 retries gave up after 2.6 s of a
    4 s outage its own backoff would have outlasted."""
    return min(OUTAGE_HINT_MAX_S, max(probe_s, down_s))


class StateUnavailable(Exception):
    """The shared state backend did not answer within ``state.timeout``, or refused to.

    Attributes:
        cause: a short description of the failure (the URL's password never appears in it).
        retry_after: seconds until the backend is worth trying again, if known.
        maybe_applied: the call was sent, so a frozen or slow server may still run it later
            (its outcome is unknown); ``False`` when it was refused before anything was sent
            (the backend was already marked down).
        down_s: how long the backend had been marked down when this was raised, seconds.
        key_fault: a key the call touched holds what Sluice does not write there
            (:func:`key_fault`); sending the call again changes nothing until someone
            repairs or deletes that key, so it is never kept to be sent again
            (:class:`policies.redelivery.Redeliveries`).
    """

    def __init__(self, cause: str, retry_after: float | None = None,
                 maybe_applied: bool = True, down_s: float = 0.0,
                 key_fault: bool = False) -> None:
        super().__init__(cause)
        self.cause = cause
        self.retry_after = retry_after
        self.maybe_applied = maybe_applied
        self.down_s = down_s
        self.key_fault = key_fault

    @property
    def hint(self) -> float | None:
        """The wait to tell a caller refused for this, seconds (:func:`outage_hint` of
        ``retry_after`` and ``down_s``); ``None`` when ``retry_after`` is. ``retry_after``
        itself stays the probe interval: Sluice's own retries (a lease release, an
        idempotency record's write) follow the probe, not this."""
        if self.retry_after is None:
            return None
        return outage_hint(self.retry_after, self.down_s)


class BadRecord(Exception):
    """A value Redis stored under the prefix is not what Sluice writes there (text in a
    number's field, a record missing a field): raised by :mod:`policies.state.stored`'s
    decoders only, so that a reply's ``read`` turns exactly this into a key fault and lets
    any other exception (a bug in the read itself) propagate. Its message names the
    record, never its value."""


def _code(reply: rx.ResponseError) -> str:
    """The code an error reply starts with (``BUSY``, ``WRONGTYPE``...), upper case."""
    return str(reply).split(" ", 1)[0].upper()


def is_key_fault(exc: BaseException) -> bool:
    """True when ``exc`` says one key cannot be used (:data:`_KEY_CODES`,
    :data:`_KEY_MESSAGES`), the backend being up: the call fails as unavailable, but the
    backend is not marked down."""
    return isinstance(exc, rx.ResponseError) and (
        _code(exc) in _KEY_CODES or str(exc).startswith(_KEY_MESSAGES))


def key_fault(detail: str) -> StateUnavailable:
    """The error for a call on a key another program wrote (:func:`is_key_fault`, or a reply
    Sluice could not read: :class:`BadRecord`); ``detail`` says what was found, never the
    value itself (it may hold anything).

    Scripts that write check every value they will write over before their first write,
    so a key fault raised in a script left nothing half done (Redis does not roll a script
    back); one raised reading a reply came after the script ran. Either way the call is
    not worth sending again until the key is repaired (``key_fault``)."""
    return StateUnavailable("a key under the state prefix cannot be used (another program "
                            f"writing there?): {detail}", key_fault=True)


def is_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` means the backend cannot serve now (as opposed to a bug in a call)."""
    if isinstance(exc, _UNAVAILABLE_TYPES):
        return True
    if isinstance(exc, rx.ResponseError):
        if _code(exc) in _UNAVAILABLE_CODES:
            return True
        # A server with EVALSHA renamed away (rename-command) refuses every script; redis-py
        # strips the "ERR " code from such replies.
        return str(exc).lower().startswith("unknown command")
    return False
