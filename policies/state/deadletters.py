"""Dead letters in a Redis Stream, readable by ``sluice dlq`` from any replica.

The records are :class:`policies.deadletter.DeadLetter` (same fields as the SQLite store's
rows: route, tenant, run, idempotency key, request id, method, path, kept headers, the names
of redacted ones, body and original size, attempts, reason, time), and ids are integers as
there, so ``sluice dlq show 12`` means the same with either store. Secrets are removed before
a letter gets here (:func:`policies.deadletter.redact`), and bodies are cut by the queue.

Redis layout (one hash tag, ``{dlq}``, so every script touches one slot):

* ``<prefix>:{dlq}:letters``: the stream (https://redis.io/docs/latest/develop/data-types/
  streams/). Entry ``n`` has the stream id ``0-n``: the stream keeps its entries in id order,
  and ``n`` comes from ``INCR`` on ``...:seq``, which a purge leaves alone so ids never repeat
  (as SQLite's AUTOINCREMENT);
* ``...:replays:<n>``: a list of JSON replay results of letter ``n``;
* ``...:claim:<n>``: the token of the replay of letter ``n`` being sent now (``SET PX``, so
  the hold of a command killed mid-replay lapses);
* ``...:depth``: letters per route (for the depth gauge without scanning the stream);
* ``...:tenant:<tenant>``: a sorted set of the ids of the tenant's letters (scored by id), so
  a write finds the tenant's oldest when it holds more than its share
  (``dead_letter.max_records_per_tenant``) without scanning the stream; written with the
  letter, an id taken off as its letter is dropped, deleted or purged (an emptied set is
  gone). Letters written before it was kept are in none: they count in ``max_records`` only;
* ``...:purging``: the letters a purge is deleting, moved out of the stream at once (their
  replays and claims deleted in bounded scripts, then it goes too).

Nothing here is on the request path except :meth:`DeadLetterStore.add` (one script call, which
also drops the tenant's oldest letters beyond its share, ``dead_letter.max_records_per_tenant``,
then the oldest beyond ``dead_letter.max_records``, their replays and holds too).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import orjson

from policies.deadletter import (
    ANSWERED,
    BUSY,
    CLAIMED,
    MAX_DROP_BYTES_PER_ADD,
    MAX_DROPS_PER_ADD,
    MIN_DROPS_PER_ADD,
    MISSING,
    UNREADABLE,
    Added,
    Attempt,
    DeadLetter,
    ReplayClaim,
    answered,
    last_replay,
    replay_record,
)
from policies.state.connection import RedisState, Script
from policies.state.errors import BadRecord
from policies.state.stored import built, stored_int, stored_text

#: What a key fault names a letter (never its content), and the stream's depth.
_LETTER = "a dead letter"
_DEPTH = "the dead letters' depth"
#: Stream fields of a summary (``list``): enough for a table, never the body.
_SUMMARY_FIELDS = ("created_at", "route", "tenant", "method", "path", "attempts", "reason")
#: Entry bytes one ``list`` script reads before it stops (the command reads on in more):
#: reading 100 letters of 1 MiB in one script held Redis 356 ms (a trial).
LIST_BYTES_PER_SCRIPT = 1 << 20
#: Letters whose replays and claims one script of a ``purge`` deletes at most (and about
#: ``LIST_BYTES_PER_SCRIPT`` of their entries read).
FORGET_PER_SCRIPT = 1000


class DeadLetterStore(Protocol):
    """Where dead letters are kept.

    Raises (every method):
        StateUnavailable: the backend did not answer in time (Redis only).
    """

    async def add(self, letter: DeadLetter, max_records: int | None = None,
                  max_per_tenant: int | None = None) -> Added:
        """Store ``letter`` (as given; ``id`` and ``replays`` are ignored) and, with
        ``max_per_tenant``, drop the oldest letters of its tenant beyond it, then with
        ``max_records`` the oldest letters beyond that (their replays and replay holds too),
        in one step; returns the new id and what was dropped."""
        ...

    async def get(self, letter_id: int) -> DeadLetter | None:
        """The whole letter with its replays, or ``None``."""
        ...

    async def list(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest ``limit`` letters as summaries, oldest first: ``id``, ``created_at``,
        ``route``, ``tenant``, ``method``, ``path``, ``attempts`` (a count), ``reason``,
        ``last_replay`` (the last replay's error, else its status; ``None``: none;
        ``"unreadable"``: its record cannot be read) and ``unreadable_replay`` (what is
        wrong with that record, else ``None``)."""
        ...

    async def claim_replay(self, letter_id: int, token: str, hold_s: float,
                           again: bool = False) -> ReplayClaim:
        """Hold ``letter_id`` for one replay (``token``: the replay's own, random) for at
        most ``hold_s`` seconds, atomically, unless another replay holds it or, without
        ``again``, an earlier replay was answered (:func:`policies.deadletter.answered`; so
        two commands replaying one letter at once never both send it)."""
        ...

    async def add_replay(self, letter_id: int, status: int | None, error: str | None,
                         duration_s: float, token: str | None = None) -> bool:
        """Record a replay of ``letter_id`` and end the hold of ``token``; ``False`` if there
        is no such letter."""
        ...

    async def delete(self, letter_id: int) -> bool:
        """Remove one letter and its replays; ``False`` if there was none."""
        ...

    async def purge(self) -> int:
        """Remove every letter and replay; returns how many letters there were."""
        ...

    async def depth(self) -> dict[str, int]:
        """Letters per route."""
        ...


def _summary(letter_id: int, fields: dict[str, Any], last: dict[str, Any] | None
             ) -> dict[str, Any]:
    replay, unreadable = last_replay(last)
    return {"id": letter_id, "created_at": fields["created_at"], "route": fields["route"],
            "tenant": fields["tenant"], "method": fields["method"], "path": fields["path"],
            "attempts": fields["attempts"], "reason": fields["reason"], "last_replay": replay,
            "unreadable_replay": unreadable}


def _replay(status: int | None, error: str | None, duration_s: float) -> dict[str, Any]:
    return {"at": time.time(), "status": status, "error": error, "duration_s": duration_s}


# -- memory -----------------------------------------------------------------------------------


class MemoryDeadLetterStore:
    """Letters in a dict, for tests and the memory backend's parity (the embedded default
    store stays the SQLite file of :mod:`policies.deadletter`)."""

    def __init__(self) -> None:
        self._letters: dict[int, DeadLetter] = {}
        self._claims: dict[int, tuple[str, float]] = {}  # token, until (monotonic)
        #: Each tenant's letter ids, oldest first (dicts as ordered sets).
        self._tenants: dict[str, dict[int, None]] = {}
        self._next = 0

    async def add(self, letter: DeadLetter, max_records: int | None = None,
                  max_per_tenant: int | None = None) -> Added:
        self._next += 1
        copy = DeadLetter(**{**_as_kwargs(letter), "id": self._next, "replays": []})
        self._letters[self._next] = copy
        # ids only grow: insertion order is age
        own = self._tenants.setdefault(letter.tenant, {})
        own[self._next] = None
        # As the other stores: MAX_DROPS_PER_ADD letters a write in all (no bytes counted).
        budget = MAX_DROPS_PER_ADD
        tenant_dropped: dict[str, int] = {}
        while max_per_tenant is not None and len(own) > max_per_tenant and budget > 0:
            budget -= 1
            route = self._drop(next(iter(own)))
            tenant_dropped[route] = tenant_dropped.get(route, 0) + 1
        dropped: dict[str, int] = {}
        while max_records is not None and len(self._letters) > max_records and budget > 0:
            budget -= 1
            route = self._drop(next(iter(self._letters)))
            dropped[route] = dropped.get(route, 0) + 1
        return Added(self._next, dropped, tenant_dropped)

    def _drop(self, letter_id: int) -> str:
        """Forget letter ``letter_id`` (its replays and hold with it); returns its route."""
        gone = self._letters.pop(letter_id)
        self._claims.pop(letter_id, None)
        own = self._tenants[gone.tenant]
        del own[letter_id]
        if not own:
            del self._tenants[gone.tenant]
        return gone.route

    async def get(self, letter_id: int) -> DeadLetter | None:
        letter = self._letters.get(letter_id)
        if letter is None:
            return None
        return DeadLetter(**{**_as_kwargs(letter), "replays": list(letter.replays)})

    async def list(self, limit: int = 100) -> list[dict[str, Any]]:
        newest = sorted(self._letters)[-limit:] if limit > 0 else []
        out = []
        for letter_id in newest:
            letter = self._letters[letter_id]
            fields = {"created_at": letter.created_at, "route": letter.route,
                      "tenant": letter.tenant, "method": letter.method, "path": letter.path,
                      "attempts": len(letter.attempts), "reason": letter.reason}
            out.append(_summary(letter_id, fields,
                                letter.replays[-1] if letter.replays else None))
        return out

    async def claim_replay(self, letter_id: int, token: str, hold_s: float,
                           again: bool = False) -> ReplayClaim:
        letter = self._letters.get(letter_id)
        if letter is None:
            return ReplayClaim(MISSING)
        now = time.monotonic()
        held = self._claims.get(letter_id)
        if held is not None and held[1] > now:
            return ReplayClaim(BUSY, left_s=held[1] - now)
        done = None if again else answered(letter.replays)
        if done is not None:
            return ReplayClaim(ANSWERED, dict(done))
        self._claims[letter_id] = (token, now + hold_s)
        return ReplayClaim(CLAIMED)

    async def add_replay(self, letter_id: int, status: int | None, error: str | None,
                         duration_s: float, token: str | None = None) -> bool:
        letter = self._letters.get(letter_id)
        if letter is None:
            return False
        letter.replays.append(_replay(status, error, duration_s))
        if token is not None and self._claims.get(letter_id, ("",))[0] == token:
            del self._claims[letter_id]
        return True

    async def delete(self, letter_id: int) -> bool:
        if letter_id not in self._letters:
            self._claims.pop(letter_id, None)
            return False
        self._drop(letter_id)
        return True

    async def purge(self) -> int:
        count = len(self._letters)
        self._letters.clear()
        self._claims.clear()
        self._tenants.clear()
        return count

    async def depth(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for letter in self._letters.values():
            counts[letter.route] = counts.get(letter.route, 0) + 1
        return counts


def _as_kwargs(letter: DeadLetter) -> dict[str, Any]:
    return {
        "route": letter.route, "tenant": letter.tenant, "run": letter.run,
        "idempotency_key": letter.idempotency_key, "key_origin": letter.key_origin,
        "request_id": letter.request_id,
        "method": letter.method, "path": letter.path, "headers": list(letter.headers),
        "redacted": list(letter.redacted), "body": letter.body, "body_size": letter.body_size,
        "attempts": list(letter.attempts), "reason": letter.reason,
        "created_at": letter.created_at, "id": letter.id, "replays": list(letter.replays),
    }


# -- redis ------------------------------------------------------------------------------------

# KEYS: stream, seq, depth, the letter's tenant's ids. ARGV: route, most letters kept (0: no
# bound), most letters dropped, replay list key prefix, claim key prefix, tenant ids key
# prefix, most letters of a tenant kept (0: no bound), bytes of letters dropped after which
# to stop, fewest letters dropped before that stops it (policies.deadletter's
# MAX_DROPS_PER_ADD, MAX_DROP_BYTES_PER_ADD, MIN_DROPS_PER_ADD), then field, value pairs.
# Returns {the new id, {the route of each letter dropped for the store's bound}, {the route
# of each of the tenant's letters dropped for its share}}. The replay, claim and other
# tenants' id keys of a dropped letter are named here, not in KEYS (as in _PURGE): they
# share the {dlq} slot of the stream.
_ADD = Script("""
-- Everything written is checked before the first write (Redis does not roll a script back):
-- the sequence is an integer INCR takes ("1.5", " 5 " and "1e3" passed tonumber() and then
-- failed INCR with an unclassified error), the stream a stream, the depths integers, the
-- tenant's ids a sorted set. Its members are read after the writes: one that is no id
-- (another program's) is taken off there, not read as one.
int_field(redis.call('GET', KEYS[2]), "the dead letters' sequence")
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'stream' and kind ~= 'none' then bad("the dead letters' stream", 'is no stream') end
local depths = redis.call('HGETALL', KEYS[3])
for i = 2, #depths, 2 do int_field(depths[i], "the dead letters' depth") end
kind = redis.call('TYPE', KEYS[4])['ok']
if kind ~= 'zset' and kind ~= 'none' then bad("a tenant's dead letters", 'is no sorted set') end
local id = redis.call('INCR', KEYS[2])
local args = {'XADD', KEYS[1], '0-' .. id}
for i = 10, #ARGV do args[#args + 1] = ARGV[i] end
local added = redis.call(unpack(args))
redis.call('ZADD', KEYS[4], id, string.sub(added, 3))
redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
local read = 0
-- Deletes entry e (its depth, replays, claim, and its place among its tenant's ids unless
-- popped from there already); returns its route, or nil if it has none.
local function drop(e, popped)
  local fields, route, tenant = e[2], nil, nil
  for i = 1, #fields, 2 do
    read = read + #fields[i + 1]
    if fields[i] == 'route' and not route then route = fields[i + 1] end
    if fields[i] == 'tenant' and not tenant then tenant = fields[i + 1] end
  end
  if route and redis.call('HINCRBY', KEYS[3], route, -1) <= 0 then
    redis.call('HDEL', KEYS[3], route)
  end
  local n = string.sub(e[1], 3)
  -- Skipped if it holds what Sluice does not write there: this script cannot fail now.
  if tenant and not popped and redis.call('TYPE', ARGV[6] .. tenant)['ok'] == 'zset' then
    redis.call('ZREM', ARGV[6] .. tenant, n)
  end
  redis.call('XDEL', KEYS[1], e[1])
  redis.call('DEL', ARGV[4] .. n, ARGV[5] .. n)
  return route
end
local budget = tonumber(ARGV[3])
local most_read, fewest = tonumber(ARGV[8]), tonumber(ARGV[9])
-- The tenant's share first: its own oldest letters go. One at a time, up to ARGV[3] of them
-- or ARGV[8] bytes (at least ARGV[9] letters, as below); an id whose letter is gone (a purge
-- under way walks it), or a member that is no id, is only taken off: XRANGE '0-abc' failed
-- the script after the letter was written, its caller told it was lost (a review).
local own = {}
local share = tonumber(ARGV[7])
local k = 0
while share > 0 and k < budget and redis.call('ZCARD', KEYS[4]) > share do
  if read >= most_read and k >= fewest then break end
  k = k + 1
  local n = redis.call('ZPOPMIN', KEYS[4])[1]
  local e = whole(n) and tonumber(n) > 0
    and redis.call('XRANGE', KEYS[1], '0-' .. n, '0-' .. n)[1]
  local route = e and drop(e, true)
  if route then own[#own + 1] = route end
end
budget = budget - k
local dropped = {}
local keep = tonumber(ARGV[2])
local over = redis.call('XLEN', KEYS[1]) - keep
if keep > 0 and over > 0 then
  -- One entry at a time, up to what is left of ARGV[3] or ARGV[8] bytes read in all: a
  -- read copies bodies too.
  for j = 1, math.min(over, budget) do
    -- At least ARGV[9] in all (the tenant's pass's too, never past ARGV[3]): one letter of
    -- 1 MiB a write, against the one added, never shrank the stream to a lowered bound (a
    -- review).
    if read >= most_read and k + j > fewest then break end
    local e = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
    if not e then break end
    local route = drop(e, false)
    if route then dropped[#dropped + 1] = route end
  end
end
return {id, dropped, own}
""", "deadletter")

# KEYS: stream, the letter's replays. ARGV: stream id. Returns {} or {fields, replays}.
_GET = Script("""
local e = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #e == 0 then return {} end
return {e[1][2], redis.call('LRANGE', KEYS[2], 0, -1)}
""", "deadletter")

# KEYS: stream. ARGV: count, replay list key prefix, newest stream id to read ('+' for the
# newest), bytes read after which to stop, then the summary field names. Returns newest
# first: {{stream id, {field values in ARGV order}, {last replay} or {}}...}, fewer than
# count once the bytes are read (the caller reads on below the last): a stream read has
# to copy whole entries, bodies included, and a script holds Redis while it runs.
_LIST = Script("""
local wanted = {}
for i = 5, #ARGV do wanted[ARGV[i]] = i - 4 end
local out, start, read, most = {}, ARGV[3], 0, tonumber(ARGV[4])
while #out < tonumber(ARGV[1]) and read < most do
  local page = redis.call('XREVRANGE', KEYS[1], start, '-', 'COUNT', 1)
  if #page == 0 then break end
  local e = page[1]
  local values = {}
  for i = 5, #ARGV do values[i - 4] = '' end
  for i = 1, #e[2], 2 do
    read = read + #e[2][i + 1]
    local at = wanted[e[2][i]]
    if at then values[at] = e[2][i + 1] end
  end
  local n = tonumber(string.sub(e[1], 3))
  local last = redis.call('LINDEX', ARGV[2] .. n, -1)
  out[#out + 1] = {e[1], values, last and {last} or {}}
  if n <= 1 then break end
  start = '0-' .. (n - 1)
end
return out
""", "deadletter")

# KEYS: stream, the letter's replays, its claim. ARGV: stream id, token, hold (ms), again
# ('1' or '0'). Returns {'missing'}, {'busy', ms left} or {'claimed', {replay JSON...}}: the
# hold taken and, without again, the letter's replays read in the same step. The caller
# decides whether one was answered, as the other stores do (policies.deadletter.answered,
# on the replays as `dlq show` reads them), and gives the hold back if so (_RELEASE). Not
# decided here: Lua's cjson takes what orjson refuses (a hex number, NaN, bytes that are not
# UTF-8, text after a NUL), so a replay `dlq show` calls unreadable, so possibly sent, would
# be read as a failed one and sent again without --again.
_CLAIM_REPLAY = Script("""
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return {'missing'} end
local left = redis.call('PTTL', KEYS[3])
if left > 0 then return {'busy', left} end
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
if ARGV[4] == '1' then return {'claimed', {}} end
return {'claimed', redis.call('LRANGE', KEYS[2], 0, -1)}
""", "deadletter")

# KEYS: a letter's claim. ARGV: token. Ends that token's hold (no other's).
_RELEASE = Script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
""", "deadletter")

# KEYS: stream, the letter's replays, its claim. ARGV: stream id, replay JSON, token or ''.
_ADD_REPLAY = Script("""
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[2])
if ARGV[3] ~= '' and redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
return 1
""", "deadletter")

# KEYS: stream, the letter's replays, depth, its claim. ARGV: stream id, tenant ids key prefix
# (its tenant's key is named here, not in KEYS, as in _ADD: its tenant is read here).
_DELETE = Script("""
local e = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #e == 0 then return 0 end
local fields = e[1][2]
for i = 1, #fields, 2 do
  if fields[i] == 'route' then
    if redis.call('HINCRBY', KEYS[3], fields[i + 1], -1) <= 0 then
      redis.call('HDEL', KEYS[3], fields[i + 1])
    end
  elseif fields[i] == 'tenant'
      and redis.call('TYPE', ARGV[2] .. fields[i + 1])['ok'] == 'zset' then
    redis.call('ZREM', ARGV[2] .. fields[i + 1], string.sub(ARGV[1], 3))
  end
end
redis.call('XDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2], KEYS[4])
return 1
""", "deadletter")

# KEYS: stream, depth, the purge's stream. Returns how many letters there were, moved
# to the purge's stream at once (RENAME: O(1)), the depth unlinked; -1 when a purge cut
# earlier left its stream (walk that first). Moved, the letters are gone for every command
# (a replay finds none, records none); new letters start a new stream. A purge that read
# every letter in one script held Redis 0.5-1.4 s, and every replica took it for down (a
# trial); one that walked the letters in place let an answered letter be replayed again
# and left replays recorded meanwhile, and could walk for ever behind new letters (a review).
_PURGE = Script("""
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local count = redis.call('XLEN', KEYS[1])
if count > 0 then redis.call('RENAME', KEYS[1], KEYS[3]) end
redis.call('UNLINK', KEYS[2])
return count
""", "deadletter")

# KEYS: the purge's stream. ARGV: replay list key prefix, claim key prefix, n after which
# to walk, most letters, bytes read after which to stop, tenant ids key prefix. The replays
# and claims of the letters walked are deleted, and their ids taken off their tenants' (all
# named here, not in KEYS, as in _ADD: one {dlq} slot; new letters' ids stay). Returns
# {the last n walked (ARGV[3] if none), 1 if no letter is left after it: the stream then
# unlinked}. Walking entries, not ids, costs what the letters are (a review: deleting by
# id span took 3,000 scripts for 2 letters 3M ids apart).
_FORGET = Script("""
local n, read = tonumber(ARGV[3]), 0
for _ = 1, tonumber(ARGV[4]) do
  local e = redis.call('XRANGE', KEYS[1], '0-' .. (n + 1), '+', 'COUNT', 1)[1]
  if not e then
    redis.call('UNLINK', KEYS[1])
    return {n, 1}
  end
  n = tonumber(string.sub(e[1], 3))
  redis.call('DEL', ARGV[1] .. n, ARGV[2] .. n)
  for i = 1, #e[2], 2 do
    read = read + #e[2][i + 1]
    if e[2][i] == 'tenant' and redis.call('TYPE', ARGV[6] .. e[2][i + 1])['ok'] == 'zset' then
      redis.call('ZREM', ARGV[6] .. e[2][i + 1], string.sub(e[1], 3))
    end
  end
  if read >= tonumber(ARGV[5]) then break end
end
return {n, 0}
""", "deadletter")


class RedisDeadLetterStore:
    """Dead letters in a Redis Stream (see the module docstring)."""

    def __init__(self, state: RedisState) -> None:
        self._state = state
        self._stream = state.key("dlq", "letters")
        self._seq = state.key("dlq", "seq")
        self._depth = state.key("dlq", "depth")
        #: Where a purge moves the letters it is deleting (one purge at a time, so a cut
        #: one's letters are found and walked by the next).
        self._purging = state.key("dlq", "purging")
        self._replays = state.key("dlq", "replays") + ":"
        self._claims = state.key("dlq", "claim") + ":"
        self._tenants = state.key("dlq", "tenant") + ":"

    async def add(self, letter: DeadLetter, max_records: int | None = None,
                  max_per_tenant: int | None = None) -> Added:
        fields: list[object] = [
            "created_at", repr(letter.created_at), "route", letter.route,
            "tenant", letter.tenant, "request_id", letter.request_id,
            "method", letter.method, "path", letter.path,
            "headers", orjson.dumps(letter.headers), "redacted", orjson.dumps(letter.redacted),
            "body", letter.body, "body_size", letter.body_size,
            "attempts", orjson.dumps([a.as_dict() for a in letter.attempts]),
            "reason", letter.reason,
        ]
        if letter.run is not None:
            fields += ["run", letter.run]
        if letter.idempotency_key is not None:
            fields += ["idempotency_key", letter.idempotency_key]
        if letter.key_origin is not None:  # absent from letters written before it was kept
            fields += ["key_origin", letter.key_origin]
        return await self._state.eval(
            _ADD, [self._stream, self._seq, self._depth, self._tenants + letter.tenant],
            [letter.route, max_records or 0, MAX_DROPS_PER_ADD, self._replays, self._claims,
             self._tenants, max_per_tenant or 0, MAX_DROP_BYTES_PER_ADD, MIN_DROPS_PER_ADD,
             *fields], _added)

    async def get(self, letter_id: int) -> DeadLetter | None:
        return await self._state.eval(_GET, [self._stream, self._replays + str(letter_id)],
                                      [f"0-{letter_id}"], lambda reply: _letter(letter_id, reply))

    async def list(self, limit: int = 100) -> list[dict[str, Any]]:
        # In scripts reading about LIST_BYTES_PER_SCRIPT each, each from below the last: no
        # letter is listed twice, but one written or dropped between two of them may be
        # missed or shown though gone (a list is no snapshot while letters are written).
        out: list[dict[str, Any]] = []
        start = "+"
        while len(out) < limit:
            page = await self._state.eval(
                _LIST, [self._stream],
                [limit - len(out), self._replays, start, LIST_BYTES_PER_SCRIPT,
                 *_SUMMARY_FIELDS], _summaries)
            if not page:
                break
            out.extend(page)
            n = page[-1]["id"]
            if n <= 1:
                break
            start = f"0-{n - 1}"
        return out[::-1]

    async def claim_replay(self, letter_id: int, token: str, hold_s: float,
                           again: bool = False) -> ReplayClaim:
        claim = self._claims + str(letter_id)
        state, *rest = await self._state.eval(
            _CLAIM_REPLAY, [self._stream, self._replays + str(letter_id), claim],
            [f"0-{letter_id}", token, max(1, round(hold_s * 1000)), "1" if again else "0"])
        if state == BUSY.encode():
            return ReplayClaim(BUSY, left_s=int(rest[0]) / 1000)
        if state != CLAIMED.encode():
            return ReplayClaim(MISSING)
        # Held while this decides: no other claim reads these replays meanwhile, and one
        # that comes now is told it is busy for that round trip.
        done = answered(_stored_replay(raw) for raw in rest[0])
        if done is None:
            return ReplayClaim(CLAIMED)
        await self._state.eval(_RELEASE, [claim], [token])
        return ReplayClaim(ANSWERED, done)

    async def add_replay(self, letter_id: int, status: int | None, error: str | None,
                         duration_s: float, token: str | None = None) -> bool:
        return bool(await self._state.eval(
            _ADD_REPLAY,
            [self._stream, self._replays + str(letter_id), self._claims + str(letter_id)],
            [f"0-{letter_id}", orjson.dumps(_replay(status, error, duration_s)), token or ""]))

    async def delete(self, letter_id: int) -> bool:
        return bool(await self._state.eval(
            _DELETE, [self._stream, self._replays + str(letter_id), self._depth,
                      self._claims + str(letter_id)],
            [f"0-{letter_id}", self._tenants]))

    async def purge(self) -> int:
        while True:
            count = int(await self._state.eval(
                _PURGE, [self._stream, self._depth, self._purging], []))
            walked, done = 0, count == 0
            while not done:  # the moved letters' replays and claims, then their stream
                walked, done = await self._state.eval(
                    _FORGET, [self._purging],
                    [self._replays, self._claims, walked, FORGET_PER_SCRIPT,
                     LIST_BYTES_PER_SCRIPT, self._tenants])
            if count >= 0:  # else a cut purge's letters were walked: now this one's
                return count

    async def depth(self) -> dict[str, int]:
        async def read(client: Any) -> dict[bytes, bytes]:
            return await client.hgetall(self._depth)

        return await self._state.run(
            read, lambda counts: {stored_text(route, _DEPTH): stored_int(n, _DEPTH)
                                  for route, n in counts.items()}, what="deadletter")


def _added(reply: list[Any]) -> Added:
    """``_ADD``'s reply read: the new id, and the routes of the letters it dropped for the
    store's bound and for the tenant's share."""
    new_id, routes, own = reply
    return Added(int(new_id), _by_route(routes), _by_route(own))


def _by_route(routes: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for raw in routes:
        route = stored_text(raw, _LETTER)
        counts[route] = counts.get(route, 0) + 1
    return counts


def _letter(letter_id: int, reply: list[Any]) -> DeadLetter | None:
    """``_GET``'s reply read: the letter, or ``None`` when it is gone."""
    if not reply:
        return None
    return built(_LETTER, _stored_letter, letter_id, *reply)


def _stored_letter(letter_id: int, flat: list[bytes], replays: list[bytes]) -> DeadLetter:
    """The letter a stream entry's fields and its replays' JSON hold (decoding only:
    :func:`_letter` makes its failure a key fault)."""
    fields = {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}
    text = {name: value.decode() for name, value in fields.items() if name != "body"}
    return DeadLetter(
        id=letter_id, created_at=float(text["created_at"]), route=text["route"],
        tenant=text["tenant"], run=text.get("run"),
        idempotency_key=text.get("idempotency_key"), key_origin=text.get("key_origin"),
        request_id=text["request_id"],
        method=text["method"], path=text["path"],
        headers=[(n, v) for n, v in orjson.loads(text["headers"])],
        redacted=orjson.loads(text["redacted"]), body=bytes(fields["body"]),
        body_size=int(text["body_size"]),
        attempts=[Attempt(**a) for a in orjson.loads(text["attempts"])],
        reason=text["reason"], replays=[_stored_replay(r) for r in replays],
    )


def _summaries(page: list[Any]) -> list[dict[str, Any]]:
    """One ``_LIST`` page read: the summaries, newest first (as the page). A letter Sluice
    cannot read is listed as such, by its id, rather than failing the whole list (a hostile
    trial: one bad entry hid every letter, and did not say which to delete)."""
    out = []
    for row in page:
        try:
            out.append(built(_LETTER, _stored_summary, *row))
        except BadRecord:
            letter_id = built(_LETTER, _letter_id, row[0])
            out.append({"id": letter_id, "created_at": 0.0, "route": "?", "tenant": "?",
                        "method": "?", "path": "?", "attempts": 0,
                        "reason": f"unreadable (sluice dlq delete {letter_id})",
                        "last_replay": None, "unreadable_replay": None})
    return out


def _letter_id(stream_id: bytes) -> int:
    """A letter's id from its stream id (``0-ID``)."""
    return int(stream_id.decode().partition("-")[2])


def _stored_summary(stream_id: bytes, values: list[bytes], last: list[bytes]
                    ) -> dict[str, Any]:
    """One letter's summary from its stream id, fields and last replay's JSON (a list of
    one; empty: none) (decoding only: :func:`_summaries` makes its failure a key fault; a
    replay that cannot be read is said so in the summary, :func:`_stored_replay`)."""
    fields: dict[str, Any] = {name: value.decode()
                              for name, value in zip(_SUMMARY_FIELDS, values, strict=True)}
    fields["created_at"] = float(fields["created_at"])
    fields["attempts"] = len(orjson.loads(fields["attempts"]))
    letter_id = _letter_id(stream_id)
    return _summary(letter_id, fields, _stored_replay(last[0]) if last else None)


def _stored_replay(raw: bytes) -> dict[str, Any]:
    """A replay from its stored JSON (:func:`policies.deadletter.replay_record`: one that is
    not a record as Sluice writes one is ``{UNREADABLE: what is wrong}``, never a failure of
    its letter's read)."""
    try:
        fields = orjson.loads(raw)
    except orjson.JSONDecodeError:  # UTF-8 that is not, too
        return {UNREADABLE: "it is not JSON"}
    return replay_record(fields)
