"""The idempotency MemoryStore's bookkeeping under random puts, reads, expiries and resizes
(hypothesis): its charged bytes are its records' and its owners', both bounds hold after
every put and resize, every owner holding records has one live heap entry at its share, and
no owner without records is kept."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.idempotency_store import DONE, OWNER_OVERHEAD_BYTES, SEEN, MemoryStore, Record

OWNERS = ["a", "b", "c", None]  # None: a key that is no tuple, owned by no one in particular
KEYS = [f"k{i}" for i in range(6)]


def _key(owner: str | None, name: str) -> object:
    return name if owner is None else (owner, name)


def _consistent(store: MemoryStore, bounded: bool) -> None:
    held: dict[object, list[object]] = {}
    for key in store._records:
        held.setdefault(key[0] if type(key) is tuple else None, []).append(key)
    assert store.bytes == sum(r.size for r in store._records.values()) + (
        len(held) * OWNER_OVERHEAD_BYTES)
    assert set(store._owned) == set(held)
    for owner, keys in held.items():
        owned = store._owned[owner]
        assert set(owned.keys) == set(keys)
        assert owned.bytes == sum(store._records[k].size for k in keys)
        live = [e for e in store._heap if e[2] == owner and e[1] == owned.order]
        assert len(live) == 1 and -live[0][0] == store._share(owned)
    if bounded:
        assert len(store) <= store.max_entries and store.bytes <= store.max_bytes


_OPS = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(OWNERS), st.sampled_from(KEYS),
              st.integers(0, 3000), st.booleans()),
    st.tuples(st.just("get"), st.sampled_from(OWNERS), st.sampled_from(KEYS)),
    st.tuples(st.just("tick"), st.floats(0, 40)),
    st.tuples(st.just("resize"), st.integers(1, 8), st.integers(1, 12_000), st.floats(1, 100)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 8), st.integers(500, 12_000), st.lists(_OPS, max_size=80))
def test_random_operations_keep_the_stores_bookkeeping(max_entries, max_bytes, ops):
    now = [0.0]
    store = MemoryStore(max_entries, max_bytes, ttl_s=60, clock=lambda: now[0])
    for op in ops:
        if op[0] == "put":
            _, owner, name, body, seen = op
            record = (Record(SEEN, b"f" * 32) if seen
                      else Record(DONE, b"f" * 32, 200, "OK", body=b"x" * body))
            store.put(_key(owner, name), record)
            _consistent(store, bounded=True)
        elif op[0] == "get":
            store.get(_key(op[1], op[2]))
            _consistent(store, bounded=False)
        elif op[0] == "tick":
            now[0] += op[1]
        else:
            store.resize(op[1], op[2], op[3])
            _consistent(store, bounded=True)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 5)), max_size=400))
def test_many_owners_keep_it_through_the_heaps_rebuilds(ops):
    store = MemoryStore(30, 40_000, ttl_s=60)
    for owner, name in ops:
        store.put((f"t{owner}", f"k{name}"), Record(DONE, b"f" * 32, body=b"x" * (owner * 37)))
        _consistent(store, bounded=True)
