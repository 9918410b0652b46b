"""Where idempotency records live: a small synchronous interface and its in-memory backend.

A record is what Sluice remembers about one idempotency key (scoped by tenant, per route):

* ``SEEN``: the key was used and no outcome was stored (the request was refused before the
  upstream, failed transiently, its caller left, or the route only forwards or serializes).
  A later request with the key is then recognised as a retry, not a new unit of work.
* ``DONE``: the upstream's answer, stored for replay (status, reason, headers, body).
* ``TOO_LARGE``: the upstream answered, but the body exceeded ``max_replay_bytes``, so only
  the fact is kept: a duplicate must not execute again, and cannot be replayed either.

:class:`MemoryStore` bounds itself by entry count and by bytes (least recently used first)
and expires records ``ttl`` seconds after they were written (Stripe prunes keys once they are
24 h old; the IETF draft lets the resource publish its own expiry). The interface is
synchronous so the request path never suspends on it; a shared backend (Redis) would put a
local cache in front of it or change the interface, and would also need the in-flight
coordination that :mod:`policies.idempotency` keeps per process.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

SEEN = 0
DONE = 1
TOO_LARGE = 2

#: Bytes charged per record on top of its body and header text: the record, its key and
#: fingerprint and the store's own bookkeeping (~430 B traced on CPython 3.11), and each
#: header's tuple and string objects (~290 B). tests/test_idempotency_unit.py checks with
#: tracemalloc that the charge covers what the records really hold, so max_bytes is a bound.
RECORD_OVERHEAD_BYTES = 512
HEADER_OVERHEAD_BYTES = 320
#: Bytes charged per owner (tenant) holding records: its LRU of keys and its heap entries
#: (~700 B traced with 10,000 tenants of one record each), so that many tenants of a record
#: each stay within max_bytes too.
OWNER_OVERHEAD_BYTES = 768


class Record:
    """What is remembered about one key.

    Attributes:
        kind: ``SEEN``, ``DONE`` or ``TOO_LARGE`` (see the module docstring).
        fingerprint: SHA-256 of the request's method, path and body (32 bytes).
        status, reason, headers, body: the stored answer (``DONE``; ``status`` also for
            ``TOO_LARGE``); ``headers`` is a tuple of ``(name, value)`` pairs.
        size: bytes charged against the store's ``max_bytes``.
        expires_at: the store's clock reading after which the record is gone, seconds.
    """

    __slots__ = ("body", "expires_at", "fingerprint", "headers", "kind", "reason", "size",
                 "status")

    def __init__(self, kind: int, fingerprint: bytes, status: int = 0, reason: str = "",
                 headers: tuple[tuple[str, str], ...] = (), body: bytes = b"") -> None:
        self.kind = kind
        self.fingerprint = fingerprint
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        self.size = RECORD_OVERHEAD_BYTES + len(body) + sum(
            HEADER_OVERHEAD_BYTES + len(n) + len(v) for n, v in headers)
        self.expires_at = 0.0


class ResultStore(Protocol):
    """The interface the idempotency policy uses; every call returns without suspending."""

    #: Bytes charged for the records held (for the ``sluice_idempotency_store_bytes`` gauge).
    bytes: int

    def __len__(self) -> int:
        """Records held."""
        ...

    def get(self, key: Hashable) -> Record | None:
        """The live record for ``key``, or ``None`` (never stored, expired or evicted)."""
        ...

    def put(self, key: Hashable, record: Record) -> None:
        """Store ``record`` for ``key`` (replacing any), expiring ``ttl`` seconds from now."""
        ...

    def ttl_left(self, record: Record) -> float:
        """Seconds until ``record`` expires (0 if it has)."""
        ...

    def discard(self, key: Hashable, record: Record) -> None:
        """Forget ``key``'s record if it is still ``record`` (not one stored since)."""
        ...


class MemoryStore:
    """Records bounded by ``max_entries`` and ``max_bytes``, with a TTL; past a bound the
    owner holding the largest share loses its least recently used record.

    A key that is a tuple is owned by its first item (the policy's keys are ``(tenant,
    key)``); any other key by no one in particular. One least-recently-used pool for every
    tenant let one tenant's traffic push out another's answers (a hostile trial: 70 keyed
    calls with 1 MB answers from team-b, and team-a's retry of a payment ran again): now a
    tenant's records go only once no other tenant holds more. An owner's share is the larger
    of its part of ``max_bytes`` and of ``max_entries`` (its dominant share: ranked by bytes
    alone, a flood of small records under the entries bound pushed out another's one big
    answer, a review). The owner with the largest is found on a heap (entries made stale by
    later changes skipped as they come up, the heap rebuilt when they outnumber the owners,
    or the bounds change), not by a look at each owner (a review: 393 us a put with 10,000
    tenants). A record just stored is not what its own put evicts: a 250 kB answer of a
    tenant holding nothing else was dropped at once.

    Args:
        max_entries: records kept at most.
        max_bytes: sum of the records' ``size`` kept at most, with each owner's bookkeeping
            (:data:`OWNER_OVERHEAD_BYTES`), bytes.
        ttl_s: a record's lifetime from when it was written, seconds.
        clock: monotonic seconds (a test passes a fake one).
    """

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.bytes = 0
        self._clock = clock
        self._records: dict[Hashable, Record] = {}
        self._owned: dict[Hashable, _Owned] = {}
        #: ``(-share, order, owner)`` per change of an owner's records; stale ones skipped.
        self._heap: list[tuple[float, int, Hashable]] = []
        self._order = 0

    def __len__(self) -> int:
        return len(self._records)

    def resize(self, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        """Adopt new bounds (a reload): records go as :meth:`put` lets them go until both
        hold; the records kept keep their expiry, and ``ttl_s`` applies to the records
        written from now."""
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._rebuild()
        self._evict(None)

    def fits(self, record: Record) -> bool:
        """Whether ``record`` can be kept at all (with its owner's bookkeeping): one that
        cannot is not stored by :meth:`put`, and the policy keeps the fact instead."""
        return record.size + OWNER_OVERHEAD_BYTES <= self.max_bytes

    def get(self, key: Hashable) -> Record | None:
        record = self._records.get(key)
        if record is None:
            return None
        if record.expires_at <= self._clock():
            self._drop(key)
            return None
        self._owned[_owner(key)].keys.move_to_end(key)
        return record

    def ttl_left(self, record: Record) -> float:
        return max(record.expires_at - self._clock(), 0.0)

    def discard(self, key: Hashable, record: Record) -> None:
        if self._records.get(key) is record:
            self._drop(key)

    def put(self, key: Hashable, record: Record) -> None:
        if key in self._records:
            self._drop(key)
        if not self.fits(record):
            return  # the policy keeps a record of the fact instead (``fits``)
        record.expires_at = self._clock() + self.ttl_s
        self._records[key] = record
        owner = _owner(key)
        owned = self._owned.get(owner)
        if owned is None:
            owned = self._owned[owner] = _Owned()
            self.bytes += OWNER_OVERHEAD_BYTES
        owned.keys[key] = None
        owned.bytes += record.size
        self.bytes += record.size
        self._ranked(owner, owned)
        self._evict(key)

    def _drop(self, key: Hashable) -> None:
        record = self._records.pop(key)
        owner = _owner(key)
        owned = self._owned[owner]
        del owned.keys[key]
        owned.bytes -= record.size
        self.bytes -= record.size
        if owned.keys:
            self._ranked(owner, owned)
        else:
            del self._owned[owner]
            self.bytes -= OWNER_OVERHEAD_BYTES

    def _share(self, owned: _Owned) -> float:
        """``owned``'s dominant share of the store: the larger of its bytes' part of
        ``max_bytes`` and its records' part of ``max_entries``."""
        return max((owned.bytes + OWNER_OVERHEAD_BYTES) / self.max_bytes,
                   len(owned.keys) / self.max_entries)

    def _ranked(self, owner: Hashable, owned: _Owned) -> None:
        """Put ``owner`` on the heap at its share now (its earlier entries go stale)."""
        if len(self._heap) > 2 * len(self._owned) + 64:  # mostly stale
            self._rebuild()
        self._order += 1
        owned.order = self._order
        heapq.heappush(self._heap, (-self._share(owned), self._order, owner))

    def _rebuild(self) -> None:
        """The heap anew: one live entry per owner, at its share under the bounds now."""
        self._heap = [(-self._share(o), o.order, name) for name, o in self._owned.items()]
        heapq.heapify(self._heap)

    def _evict(self, stored: Hashable | None) -> None:
        """Drop records until both bounds hold (see the class docstring)."""
        while len(self._records) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(self._victim(stored))

    def _victim(self, stored: Hashable | None) -> Hashable:
        """The least recently used key of the owner holding the largest share; not ``stored``
        (the record its put has just stored) while another owner holds one. The owner it is
        taken from is ranked anew by :meth:`_drop`."""
        heap = self._heap
        spared = None
        while heap:
            entry = heapq.heappop(heap)
            owned = self._owned.get(entry[2])
            if owned is None or owned.order != entry[1]:
                continue  # stale
            oldest = next(iter(owned.keys))
            if oldest != stored:
                if spared is not None:
                    heapq.heappush(heap, spared)
                return oldest
            spared = entry  # the stored record is its owner's only one: the next owner's
        assert spared is not None  # every owner holding records has a live entry
        return stored


class _Owned:
    """One owner's keys in a :class:`MemoryStore`, least recently used first, the bytes of
    its records, and the order of its live heap entry."""

    __slots__ = ("bytes", "keys", "order")

    def __init__(self) -> None:
        self.keys: OrderedDict[Hashable, None] = OrderedDict()
        self.bytes = 0
        self.order = 0


def _owner(key: Hashable) -> Hashable:
    """Who owns ``key`` (:class:`MemoryStore`): a tuple's first item."""
    return key[0] if type(key) is tuple else None
