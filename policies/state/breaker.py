"""Circuit-breaker state shared by every replica: one state machine per route, in one place.

The machine of :mod:`policies.breaker` (Nygard's closed / open / half-open, with
Resilience4j's names and pybreaker's counters), kept where every replica reads and changes it
atomically, so that a breaker opened by one replica's failures refuses on all of them at
their next call, and half-open lets exactly one probe through across all of them:

* **closed** admits every attempt. A failure adds to the consecutive-failure count (a success
  resets it) and opens at ``fail_max``; when ``window_s`` is set, outcomes also go into a
  time window of one-second buckets, which opens once it holds ``min_calls`` outcomes of
  which at least ``rate`` failed (Resilience4j's TIME_BASED window).
* **open** refuses until ``open_until``; the first attempt after it moves to half-open.
* **half-open** admits one probe at a time: a *probe lease* (``SET NX PX probe_s``) that the
  probe's outcome removes. Its holder renews it while the probe runs (:meth:`~BreakerStates.
  renew`), so a probe longer than ``probe_s`` keeps it, and a probing replica that dies (or
  stops renewing) loses it ``probe_s`` after its last renewal at most. ``success_threshold``
  successful probes in a row close; a failed probe opens again, and so does a probe found
  failed after its success was recorded (:data:`PROBE_FAILED`), as long as the breaker is
  still in the epoch that success left it in.

Each transition bumps an *epoch*; an attempt's :class:`Ticket` carries the epoch it was
admitted in, and an outcome from an older epoch changes nothing (a closed-state failure that
lands after the breaker went half-open must not re-open it). Every transition is reported to
the one caller whose call made it (:attr:`Verdict.transition`), so each is put on the
timeline once. An upstream ``Retry-After`` seen while open can lengthen the open time
(``hint_s``), never shorten it. Time is the server's (``TIME``: milliseconds, and
microseconds for the run of failures below).

**Successes in closed state are batched on Redis** (:meth:`BreakerStates.defer`): a closed
breaker's successes are by far its most common outcome, and each would otherwise be a round
trip of its own, a third beside a metered call's admission and settle. A replica counts them
per breaker and epoch and delivers the count inside the next script it sends for that breaker
(a failure, a neutral outcome with a hint or a probe, a probe's outcome: the successes are
applied first, then the outcome), or in a flush at most ``FLUSH_S`` later.

*The consecutive-failure count* is kept in the order outcomes happened, not the order they
were delivered in: a batch carries the age of its latest success (this replica's monotonic
clock, microseconds; no replica's clock is compared with another's), the script places that
success at ``TIME`` minus the age on the server's clock, and the breaker keeps the server
times of its current run of failures (each failure is stamped with ``TIME`` by its own
script). A success resets only the failures recorded up to its time: the count after it is
the number recorded after it. So a success that happened before other replicas' failures
and was delivered after them leaves them standing (it used to wipe them: three replicas
each failing once after a success each stayed closed under ``fail_max: 3``, and opened only
at the fifth failure). What remains: the placed time is late by the delivery's delay (the
script's one-way trip, and a retry or script reload within ``state.timeout`` if one
happens), so a failure recorded within that delay after the success, on another replica,
is still reset by it; a failover to a server whose clock differs, or a step of the server's
clock, moves the times recorded before it by that much; outcomes that happen at once on
different replicas have no order but the server's (concurrent scripts).

*The failure-rate window* is what batching still delays: a batched success lands in the
window bucket of the second it is delivered in, at most ``FLUSH_S`` late, and for that long
the shared counts lack this replica's latest successes, so another replica's failure may see
a failure rate higher by the share of the window's last ``FLUSH_S`` (under 1 % of the default
30 s window at a steady pace): that error leans only towards opening. No success is lost (but
see below) and no failure or probe outcome waits, so a breaker opens no later than before
(save where a success is itself what trips the rate: that opening waits for the flush).
Recorded one by one, only the success that brings the window to ``min_calls`` can trip the
rate (every later one lowers it): the script checks the window as it stood at that success,
so a batch opens exactly where single records would have, up to the bucket placement.
Successes counted under an older epoch are dropped, as a stale ticket's outcome is; so are
those whose script Redis does not answer (the failures they would have reset stand, the rate
they would have lowered stays; never sent twice, though a script sent to a frozen server may
still run when it wakes). Probes and the half-open state are untouched: a batch is applied
only to a closed breaker in the epoch it was counted in.
Memory records every outcome at once, in the order they happen (one process, no round trip),
so none of this applies to it; its :meth:`~BreakerStates.defer` counts a closed-state success
there and then, in a few steps, whenever that success can change nothing but the counts (see
:class:`_Window`), and leaves the rest to ``record``.

Redis layout: ``<prefix>:{<group>}:breaker`` a hash (state, epoch, counters, open-until,
cause, and ``run``: the server times of the current run of consecutive failures, the latest
``min(failures, fail_max, 32)`` of them, microseconds, space-separated, oldest first: a
success older than all those kept, of a longer run, resets none of it),
``...:breaker:window`` a hash of per-second counts, ``...:breaker:probe`` the probe lease.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from policies.state.connection import RedisState, Script
from policies.state.stored import stored_text

#: Breaker states, numbered as the ``sluice_circuit_state`` gauge.
CLOSED, HALF_OPEN, OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", HALF_OPEN: "half-open", OPEN: "open"}
#: Outcomes, as :func:`policies.breaker.classify` numbers them.
SUCCESS, FAILURE, NEUTRAL = 0, 1, 2
#: The outcome of a half-open probe that failed after its success was recorded (its answer,
#: a stream, failed once under way: :meth:`policies.breaker.Breaker.record`), sent with a
#: ticket of the epoch that success left the breaker in: if the breaker is still in it and
#: has recorded no other success since (closed by that success, or half-open still), it
#: opens for ``reset_s`` with cause ``probe_failed``, as a failed probe opens it, whatever
#: its counts; closed, with a success since, it is one more failure (an upstream that
#: answered others well since is judged as any stream's failure judges it: a hostile review
#: saw a probe's stream cut by ``timeouts.total`` after 2,041 good ones reopen the breaker);
#: if it has moved on (an opening since, by anyone), it changes nothing, as any outcome of
#: an older epoch.
PROBE_FAILED = 3
#: Transitions (:attr:`Verdict.transition`).
OPENED, HALF_OPENED, CLOSED_AGAIN = "opened", "half_open", "closed"
#: Longest a success :meth:`BreakerStates.defer` took waits for its flush, seconds.
FLUSH_S = 0.25


class BreakerParams(NamedTuple):
    """A route's ``circuit_breaker`` block as plain values.

    Attributes:
        fail_max: consecutive failures that open.
        reset_s: how long it stays open, seconds.
        success_threshold: successful probes in a row that close.
        window_s: the failure-rate window, seconds, or ``None`` for none.
        rate: failure fraction over the window that opens (with ``window_s``).
        min_calls: outcomes the window needs before it can open.
        probe_s: how long the half-open probe's lease lasts unless its holder renews it,
            seconds (``state.lease``): past it, another replica may probe.
    """

    fail_max: int
    reset_s: float
    success_threshold: int = 1
    window_s: float | None = None
    rate: float = 1.0
    min_calls: int = 1
    probe_s: float = 5.0


class Ticket(NamedTuple):
    """Permission for one attempt: the epoch it was admitted in, and its probe token when it
    is the half-open probe (``None`` otherwise)."""

    epoch: int
    probe: str | None = None


class Admission(NamedTuple):
    """The answer of :meth:`BreakerStates.admit`.

    Attributes:
        allowed: the attempt may go upstream.
        ticket: pass to :meth:`BreakerStates.record` (when allowed).
        wait_s: when refused, seconds until open ends, or until the probe's lease lapses.
        state: CLOSED, HALF_OPEN or OPEN after this call.
        transition: ``half_open`` when this call moved the breaker there, else ``None``.
        cause: why it last opened (``fail_max``, ``failure_rate``, ``probe_failed``).
    """

    allowed: bool
    ticket: Ticket
    wait_s: float
    state: int
    transition: str | None
    cause: str


class Verdict(NamedTuple):
    """The answer of :meth:`BreakerStates.record`: the state after it, the transition this
    outcome caused (``opened``, ``closed``, or ``None``), why it last opened, and seconds until
    open ends (0 unless open)."""

    state: int
    transition: str | None
    cause: str
    open_for_s: float


class View(NamedTuple):
    """The breaker as it stands (:meth:`BreakerStates.view`): state, seconds until open
    ends, whether a probe holds the lease, why it last opened, and its epoch."""

    state: int
    open_for_s: float
    probing: bool
    cause: str
    epoch: int


class BreakerStates(Protocol):
    """Shared breakers, one per group (route). Every async method is at most one round trip;
    :meth:`defer` is none.

    Raises (every async method):
        StateUnavailable: the backend did not answer in time (Redis only).
    """

    #: True when :meth:`defer` keeps successes for a later :meth:`flush` (Redis); False when
    #: it applies them at once (memory).
    batched: bool

    async def admit(self, group: str, params: BreakerParams) -> Admission:
        """Permission for one attempt (moves open to half-open once its time is up, and
        makes this attempt the probe if the probe lease is free)."""
        ...

    async def record(self, group: str, ticket: Ticket, outcome: int, params: BreakerParams,
                     hint_s: float | None = None) -> Verdict:
        """Feed the outcome (SUCCESS, FAILURE, NEUTRAL, or :data:`PROBE_FAILED`) of the
        attempt ``ticket`` admitted; it frees the probe lease if it held it. ``hint_s``: the
        upstream asked for this long a pause (a 429/503 ``Retry-After``): an open breaker
        stays open at least that long. Successes :meth:`defer` counted for ``group`` are
        applied first, in the same call."""
        ...

    def defer(self, group: str, ticket: Ticket, outcome: int, params: BreakerParams) -> bool:
        """Count ``outcome`` here, without a round trip, when it is a success of an attempt
        admitted while closed (``ticket`` without a probe: such a success cannot change the
        state except through the window, see the module doc). Never suspends, never raises.

        Returns:
            True when taken. With :attr:`batched` (Redis) it is applied with ``group``'s next
            :meth:`record` or :meth:`flush`, and the caller makes sure :meth:`flush` runs
            within ``FLUSH_S`` seconds; without (memory) it is applied already, as
            :meth:`record` would have, which happens only where it changes nothing but the
            counts. False when the outcome must go through :meth:`record` (any other
            outcome; on memory also a success the window cannot take in those few steps:
            the first of a second or under new params, or one that might trip it, see
            :class:`_Window`).
        """
        ...

    async def flush(self, group: str, params: BreakerParams) -> Verdict | None:
        """Apply the successes :meth:`defer` counted for ``group`` (one round trip); ``None``
        when none are pending (no round trip). The verdict's transition can only be
        ``opened`` (by the window, see the module doc). Pending successes are gone once this
        is called, applied or not (the backend did not answer: they are dropped)."""
        ...

    async def view(self, group: str) -> View:
        """Read the breaker without changing it."""
        ...

    async def renew(self, group: str, ticket: Ticket, lease_s: float) -> bool:
        """Make the probe lease ``ticket`` holds last ``lease_s`` seconds from now.

        Returns:
            False when ``ticket`` does not hold it (any more): its outcome freed it, it
            lapsed, another probe took it since, or the breaker moved on. It is not taken
            again: the breaker's state may have changed meanwhile.
        """
        ...


def new_token() -> str:
    """A random probe token (64 bits, hex)."""
    return os.urandom(8).hex()


# -- memory -----------------------------------------------------------------------------------


class _Machine:
    __slots__ = ("cause", "closed", "epoch", "failures", "open_until", "probe", "state",
                 "successes", "window")

    def __init__(self) -> None:
        self.state = CLOSED
        self.epoch = 0
        #: The ticket of an attempt admitted in this epoch while closed; ``None`` while not
        #: closed. One comparison with it tells a current closed-state ticket (the same
        #: epoch, closed, no probe) from any other.
        self.closed: Ticket | None = Ticket(0)
        self.failures = 0
        #: Half-open: the probes' successes in a row; closed: 1 once a success was recorded
        #: in this epoch (:data:`PROBE_FAILED`), else 0.
        self.successes = 0
        self.open_until = 0  # ms
        self.cause = ""
        self.probe: tuple[str, int] | None = None  # token, lease expiry (ms)
        self.window = _Window()


class MemoryBreakerStates:
    """The breakers of one process (time from ``clock``, monotonic seconds, counted in whole
    milliseconds as Redis does); nothing suspends."""

    batched = False

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._machines: defaultdict[str, _Machine] = defaultdict(_Machine)

    async def admit(self, group: str, params: BreakerParams) -> Admission:
        m = self._machines[group]
        if m.closed is not None:  # closed
            return Admission(True, m.closed, 0.0, CLOSED, None, m.cause)
        now = int(self._clock() * 1000)
        transition = None
        if m.state == OPEN:
            if now < m.open_until:
                return Admission(False, Ticket(m.epoch), (m.open_until - now) / 1000, OPEN,
                                 None, m.cause)
            m.state, m.epoch, m.successes, m.probe = HALF_OPEN, m.epoch + 1, 0, None
            m.closed = None
            transition = HALF_OPENED
        if m.probe is not None and m.probe[1] > now:
            return Admission(False, Ticket(m.epoch), (m.probe[1] - now) / 1000, HALF_OPEN,
                             transition, m.cause)
        token = new_token()
        m.probe = (token, now + _ms(params.probe_s))
        return Admission(True, Ticket(m.epoch, token), 0.0, HALF_OPEN, transition, m.cause)

    async def record(self, group: str, ticket: Ticket, outcome: int, params: BreakerParams,
                     hint_s: float | None = None) -> Verdict:
        m = self._machines[group]
        now = int(self._clock() * 1000)
        transition = None
        if ticket.epoch == m.epoch:
            if ticket.probe is not None and m.probe is not None and m.probe[0] == ticket.probe:
                m.probe = None
            if outcome != NEUTRAL:
                failed = outcome != SUCCESS  # a FAILURE, or a PROBE_FAILED
                if m.state == CLOSED:
                    if failed:
                        m.failures += 1
                        if outcome == PROBE_FAILED and not m.successes:
                            # Closed by that probe, its epoch still, nothing good heard since.
                            transition = self._open(m, now, params, "probe_failed")
                        elif m.failures >= params.fail_max:
                            transition = self._open(m, now, params, "fail_max")
                    else:
                        m.failures, m.successes = 0, 1
                elif m.state == HALF_OPEN:
                    if failed:
                        transition = self._open(m, now, params, "probe_failed")
                    else:
                        m.successes += 1
                        if m.successes >= params.success_threshold:
                            m.state, m.epoch = CLOSED, m.epoch + 1
                            m.closed = Ticket(m.epoch)
                            m.failures = m.successes = 0
                            m.cause, m.probe, m.window = "", None, _Window()
                            transition = CLOSED_AGAIN
                if (transition is None and params.window_s
                        and _window_add(m.window, now // 1000, failed, params)
                        and m.state == CLOSED):
                    transition = self._open(m, now, params, "failure_rate")
        if hint_s and m.state == OPEN:
            m.open_until = max(m.open_until, now + _ms(hint_s))
        return Verdict(m.state, transition, m.cause,
                       max(m.open_until - now, 0) / 1000 if m.state == OPEN else 0.0)

    def defer(self, group: str, ticket: Ticket, outcome: int, params: BreakerParams) -> bool:
        # The request path's common case, a success admitted while closed, in the fewest
        # steps: what record() would do with it when it can only reset the failure count and
        # count in the window; the rest goes through record().
        m = self._machines[group]
        if outcome != SUCCESS or ticket != m.closed:
            return False
        window = m.window
        if params is window.params:
            # Still within the quiet second (it cannot be before it: the clock is monotonic).
            # In whole ms as record() counts them, without int(): for t >= 0, int(t) < q
            # exactly when t < q.
            if self._clock() * 1000 >= window.quiet_until:
                return False
            window.calls += 1  # into the quiet second's bucket at the next _window_add
        elif params.window_s:
            return False  # the first outcome these params count in the window
        m.failures, m.successes = 0, 1
        return True

    async def flush(self, group: str, params: BreakerParams) -> Verdict | None:
        return None

    async def renew(self, group: str, ticket: Ticket, lease_s: float) -> bool:
        m = self._machines.get(group)
        now = int(self._clock() * 1000)
        if m is None or m.probe is None or m.probe[0] != ticket.probe or m.probe[1] <= now:
            return False
        m.probe = (m.probe[0], now + _ms(lease_s))
        return True

    async def view(self, group: str) -> View:
        m = self._machines[group]
        now = int(self._clock() * 1000)
        probing = m.probe is not None and m.probe[1] > now
        return View(m.state, max(m.open_until - now, 0) / 1000 if m.state == OPEN else 0.0,
                    m.state == HALF_OPEN and probing, m.cause, m.epoch)

    @staticmethod
    def _open(m: _Machine, now: int, params: BreakerParams, cause: str) -> str:
        m.state, m.epoch, m.successes, m.probe = OPEN, m.epoch + 1, 0, None
        m.closed = None
        m.failures = 0
        m.open_until = now + _ms(params.reset_s)
        m.cause = cause
        return OPENED


class _Window:
    """The failure-rate window of one breaker: outcomes per second, and their totals kept as
    seconds come and go (so counting one is O(1), not a sum over the window).

    **Quiet seconds.** After counting an outcome in a second, :func:`_window_add` says whether
    a success later in that same second, under the same ``params``, can trip the window: it
    cannot while ``failures < rate * max(calls + 1, min_calls)`` (each further success only
    lowers the failure rate, and none is due to expire before the next second). Then
    ``quiet_until`` is the end of that second in milliseconds (else 0), and
    :meth:`MemoryBreakerStates.defer` counts such a success in ``calls`` alone; the next
    :func:`_window_add` moves what ``calls`` gained since it last ran (``calls - bucketed``)
    into that second's bucket before anything else.
    """

    __slots__ = ("bucketed", "calls", "current", "failures", "oldest", "params", "quiet_until",
                 "seconds")

    def __init__(self) -> None:
        self.seconds: dict[int, list[int]] = {}  # second -> [calls, failures]
        self.calls = 0
        self.failures = 0
        self.oldest = math.inf  # the earliest second held (a clock may step back)
        self.current = 0  # the second last counted in
        self.bucketed = 0  # ``calls`` when the last count ended: the rest is ``current``'s
        self.params: BreakerParams | None = None  # those of the last count
        self.quiet_until = 0  # ms: none yet


def _window_add(window: _Window, second: int, failed: bool, params: BreakerParams) -> bool:
    """Count one outcome in ``second``; True when the window trips."""
    seconds = window.seconds
    if window.calls != window.bucketed:  # successes counted while the second was quiet
        seconds[window.current][0] += window.calls - window.bucketed
    horizon = second - max(1, math.ceil(params.window_s or 1))
    if window.oldest <= horizon:  # some second has left the window
        for old in [s for s in seconds if s <= horizon]:
            calls, failures = seconds.pop(old)
            window.calls -= calls
            window.failures -= failures
        window.oldest = min(seconds, default=math.inf)
    bucket = seconds.get(second)
    if bucket is None:
        bucket = seconds[second] = [0, 0]
        window.oldest = min(window.oldest, second)
    bucket[0] += 1
    calls = window.calls = window.calls + 1
    if failed:
        bucket[1] += 1
        window.failures += 1
    tripped = calls >= params.min_calls and window.failures >= params.rate * calls
    window.current, window.bucketed, window.params = second, calls, params
    if tripped or window.failures >= params.rate * max(calls + 1, params.min_calls):
        window.quiet_until = 0
    else:  # a success in the rest of this second cannot trip it
        window.quiet_until = (second + 1) * 1000
    return tripped


# -- redis ------------------------------------------------------------------------------------

_READ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local v = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'failures', 'successes', 'until',
                     'cause', 'run')
local state, epoch = num(v[1] or '0', 'a breaker'), num(v[2] or '0', 'a breaker')
local failures, successes = num(v[3] or '0', 'a breaker'), num(v[4] or '0', 'a breaker')
local open_until, cause, run = num(v[5] or '0', 'a breaker'), v[6] or '', v[7] or ''
local function save()
  redis.call('HSET', KEYS[1], 'state', state, 'epoch', epoch, 'failures', failures,
             'successes', successes, 'until', string.format('%.0f', open_until),
             'cause', cause, 'run', run)
end
"""

# KEYS: breaker, probe lease. ARGV: token, probe ms.
# Returns {allowed, epoch, probe (0|1), wait ms, state, transition, cause}.
_ADMIT = Script(_READ + """
if state == 0 then return {1, epoch, 0, 0, 0, '', cause} end
local transition = ''
if state == 2 then
  if now < open_until then return {0, epoch, 0, open_until - now, 2, '', cause} end
  state, epoch, successes = 1, epoch + 1, 0
  redis.call('DEL', KEYS[2])
  save()
  transition = 'half_open'
end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {1, epoch, 1, 0, 1, transition, cause}
end
return {0, epoch, 0, math.max(redis.call('PTTL', KEYS[2]), 0), 1, transition, cause}
""", "breaker")

# KEYS: breaker, probe lease, window. ARGV: epoch, token ('' none), outcome (3: PROBE_FAILED,
# a failure that opens a closed breaker at once if it heard no success since), fail_max,
# success_threshold, reset ms, window s (0 none), rate, min_calls, hint ms (0 none), epoch of
# the deferred successes, how many (0 none), how long ago the latest of them was, us.
# Returns {state, transition, cause, open for ms}.
_RECORD = Script(_READ + """
local transition = ''
-- The window's counts are checked before the first write (Redis does not roll a script
-- back): a field HINCRBY refuses, midway, left the probe lease deleted and the state unsaved.
if tonumber(ARGV[7]) > 0 then
  local all = redis.call('HGETALL', KEYS[3])
  for i = 1, #all, 2 do
    if not string.find(all[i], '^[cf]%d+$') then bad("a breaker's window", 'names no second') end
    int_field(all[i + 1], "a breaker's window")
  end
end
-- 'run': the server times (us, oldest first) of the current run of consecutive failures,
-- the latest min(failures, fail_max, KEPT) of them: a success delivered late is late by
-- a flush (FLUSH_S) and a round trip, and more failures than KEPT in that time open the
-- breaker anyway; the list stays short whatever fail_max (a rate-only breaker sets it
-- huge), so each script reads and writes a few hundred bytes at most.
local KEPT = 32
local function times()
  local all, list = {}, {}
  for at in string.gmatch(run, '%d+') do all[#all + 1] = tonumber(at) end
  for i = math.max(1, #all - math.min(failures, KEPT) + 1), #all do
    list[#list + 1] = all[i]
  end
  return list
end
local function keep(list)
  local out = {}
  for i, at in ipairs(list) do out[i] = string.format('%.0f', at) end
  run = table.concat(out, ' ')
end
-- A success at server time 'at' (us) resets the failures recorded up to it, no later ones.
local function succeeded(at)
  local list, after = times(), {}
  for _, failed_at in ipairs(list) do
    if failed_at > at then after[#after + 1] = failed_at end
  end
  if #after < #list or failures <= #list then
    failures = #after
  end -- else older than every failure kept, of more than were kept: all count as after it
  successes = 1
  keep(after)
end
local function open(why)
  state, epoch, successes, failures, run = 2, epoch + 1, 0, 0, ''
  open_until = now + tonumber(ARGV[6])
  cause = why
  redis.call('DEL', KEYS[2])
  transition = 'opened'
end
local size, min_calls, rate = tonumber(ARGV[7]), tonumber(ARGV[9]), tonumber(ARGV[8])
local second = math.floor(now / 1000)
-- Count n outcomes, f of them failed, in this second's bucket; the window's calls and failures.
local function count(n, f)
  redis.call('HINCRBY', KEYS[3], 'c' .. second, n)
  if f > 0 then redis.call('HINCRBY', KEYS[3], 'f' .. second, f) end
  redis.call('PEXPIRE', KEYS[3], (size + 1) * 1000)
  local calls, fails = 0, 0
  local all = redis.call('HGETALL', KEYS[3])
  for i = 1, #all, 2 do
    local s = num(string.sub(all[i], 2), "a breaker's window")
    if s <= second - size then
      redis.call('HDEL', KEYS[3], all[i])
    elseif string.sub(all[i], 1, 1) == 'c' then
      calls = calls + num(all[i + 1], "a breaker's window")
    else
      fails = fails + num(all[i + 1], "a breaker's window")
    end
  end
  return calls, fails
end
-- Closed, 'successes' is 1 once a success was recorded in the epoch (outcome 3 needs none).
local batch = tonumber(ARGV[12])
if batch > 0 and tonumber(ARGV[11]) == epoch and state == 0 then
  -- The latest success of the batch, on this server's clock (late by the delivery's delay).
  succeeded(now_us - tonumber(ARGV[13]))
  if size > 0 then
    local calls, fails = count(batch, 0)
    -- One by one, only the success that first made calls >= min_calls could have tripped
    -- the rate (each later one lowers it): test the window as it stood at that one.
    local at = math.max(calls - batch + 1, min_calls)
    if at <= calls and fails >= rate * at then open('failure_rate') end
  end
  save()
end
if tonumber(ARGV[1]) == epoch then
  if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) == ARGV[2] then redis.call('DEL', KEYS[2]) end
  local outcome = tonumber(ARGV[3])
  if outcome ~= 2 then
    local failed = outcome ~= 0
    if state == 0 then
      if failed then
        local list, kept = times(), {}
        list[#list + 1] = now_us
        for i = math.max(1, #list - math.min(tonumber(ARGV[4]), KEPT) + 1), #list do
          kept[#kept + 1] = list[i]
        end
        keep(kept)
        failures = failures + 1
        if outcome == 3 and successes == 0 then
          open('probe_failed')
        elseif failures >= tonumber(ARGV[4]) then
          open('fail_max')
        end
      else
        succeeded(now_us)
      end
    elseif state == 1 then
      if failed then
        open('probe_failed')
      else
        successes = successes + 1
        if successes >= tonumber(ARGV[5]) then
          state, epoch, failures, successes, cause, run = 0, epoch + 1, 0, 0, '', ''
          redis.call('DEL', KEYS[2], KEYS[3])
          transition = 'closed'
        end
      end
    end
    if transition == '' and size > 0 then
      local f = 0
      if failed then f = 1 end
      local calls, fails = count(1, f)
      if state == 0 and calls >= min_calls and fails >= rate * calls then
        open('failure_rate')
      end
    end
  end
  save()
end
local hint = tonumber(ARGV[10])
if hint > 0 and state == 2 and now + hint > open_until then
  open_until = now + hint
  save()
end
local left = 0
if state == 2 then left = math.max(open_until - now, 0) end
return {state, transition, cause, left}
""", "breaker")

# KEYS: breaker, probe lease. Returns {state, open for ms, probing, cause, epoch}.
_VIEW = Script(_READ + """
local left = 0
if state == 2 then left = math.max(open_until - now, 0) end
local probing = 0
if state == 1 and redis.call('EXISTS', KEYS[2]) == 1 then probing = 1 end
return {state, left, probing, cause, epoch}
""", "breaker")


# KEYS: probe lease. ARGV: token, lease ms. Returns 1 if renewed, 0 if not the token's.
_RENEW = Script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
""", "breaker")


class RedisBreakerStates:
    """Breakers in Redis; one ``EVALSHA`` per call on the route's slot (none for a deferred
    success)."""

    batched = True

    def __init__(self, state: RedisState, clock: Callable[[], float] = time.monotonic) -> None:
        self._state = state
        self._clock = clock
        #: group -> (epoch, successes counted by :meth:`defer` and not yet sent, when the
        #: latest of them was counted: ``clock`` seconds).
        self._pending: dict[str, tuple[int, int, float]] = {}

    def _keys(self, group: str) -> list[str]:
        key = self._state.key
        return [key(group, "breaker"), key(group, "breaker", "probe"),
                key(group, "breaker", "window")]

    async def admit(self, group: str, params: BreakerParams) -> Admission:
        token = new_token()

        def read(reply: Sequence[Any]) -> Admission:
            allowed, epoch, probe, wait_ms, state, transition, cause = reply
            return Admission(bool(int(allowed)),
                             Ticket(int(epoch), token if int(probe) else None),
                             int(wait_ms) / 1000, int(state), transition.decode() or None,
                             stored_text(cause, _BREAKER))

        return await self._state.eval(_ADMIT, self._keys(group)[:2],
                                      [token, _ms(params.probe_s)], read)

    async def record(self, group: str, ticket: Ticket, outcome: int, params: BreakerParams,
                     hint_s: float | None = None) -> Verdict:
        return await self._send(group, ticket, outcome, params, hint_s,
                                self._pending.pop(group, None))

    def defer(self, group: str, ticket: Ticket, outcome: int, params: BreakerParams) -> bool:
        if outcome != SUCCESS or ticket.probe is not None:
            return False
        epoch, successes, _ = self._pending.get(group, (ticket.epoch, 0, 0.0))
        if ticket.epoch >= epoch:  # a newer epoch's make the older ones stale: drop them
            self._pending[group] = (ticket.epoch,
                                    successes + 1 if ticket.epoch == epoch else 1,
                                    self._clock())
        return True  # an older epoch's success is stale: dropped, as record would

    async def flush(self, group: str, params: BreakerParams) -> Verdict | None:
        batch = self._pending.pop(group, None)
        if batch is None:
            return None
        return await self._send(group, Ticket(batch[0]), NEUTRAL, params, None, batch)

    async def _send(self, group: str, ticket: Ticket, outcome: int, params: BreakerParams,
                    hint_s: float | None, batch: tuple[int, int, float] | None) -> Verdict:
        # The batch's latest success goes as its age, not a time: only this replica's clock
        # measures it, and the script places it on the server's (module doc).
        epoch, successes, at = batch or (0, 0, 0.0)
        age_us = max(int((self._clock() - at) * 1_000_000), 0) if successes else 0
        args: list[object] = [
            ticket.epoch, ticket.probe or "", outcome, params.fail_max,
            params.success_threshold, _ms(params.reset_s),
            math.ceil(params.window_s) if params.window_s else 0, repr(float(params.rate)),
            params.min_calls, _ms(hint_s) if hint_s else 0, epoch, successes, age_us]
        return await self._state.eval(_RECORD, self._keys(group), args, _verdict)

    async def renew(self, group: str, ticket: Ticket, lease_s: float) -> bool:
        return bool(await self._state.eval(_RENEW, [self._state.key(group, "breaker", "probe")],
                                           [ticket.probe or "", _ms(lease_s)]))

    async def view(self, group: str) -> View:
        return await self._state.eval(_VIEW, self._keys(group)[:2], [], _view)


#: What a key fault names a breaker's state (never its content).
_BREAKER = "a breaker"


def _verdict(reply: Sequence[Any]) -> Verdict:
    state, transition, cause, left_ms = reply
    return Verdict(int(state), transition.decode() or None, stored_text(cause, _BREAKER),
                   int(left_ms) / 1000)


def _view(reply: Sequence[Any]) -> View:
    state, left_ms, probing, cause, epoch = reply
    return View(int(state), int(left_ms) / 1000, bool(int(probing)),
                stored_text(cause, _BREAKER), int(epoch))


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)
