"""Unit tests of the idempotency store, key parsing, the policy's waiting and hand-over, and
the config checks (the end-to-end behaviour is in test_idempotency.py)."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import tracemalloc

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from policies.config import IdempotencyConfig
from policies.idempotency import (
    FRESH_KEYS_PER_READ,
    Capture,
    Continuations,
    Idempotency,
    fresh_key,
    parse_key,
    replay_response,
)
from policies.idempotency_store import (
    DONE,
    HEADER_OVERHEAD_BYTES,
    OWNER_OVERHEAD_BYTES,
    RECORD_OVERHEAD_BYTES,
    SEEN,
    TOO_LARGE,
    MemoryStore,
    Record,
)
from policies.pipeline import Call
from policies.reasons import Reason
from proxy.config import ConfigError, parse_config

MiB = 1024 * 1024


def answer(body_len: int, fingerprint: bytes = b"f" * 32) -> Record:
    """A stored answer shaped like a real one: four headers, as an LLM API sends at least."""
    capture = Capture(MiB)
    capture.begin(200, "OK", CIMultiDict([
        ("Content-Type", "application/json"),
        ("Date", "Tue, 25 Aug 2026 10:00:00 GMT"),
        ("x-request-id", "req_" + os.urandom(12).hex()),
        ("openai-processing-ms", "412"),
    ]))
    capture.feed(os.urandom(body_len))
    return capture.record(fingerprint)


def _mixed(i: int) -> Record:
    return Record(SEEN, os.urandom(32)) if i % 3 == 0 else answer(100 + i % 1500)


@pytest.mark.parametrize(("max_entries", "max_bytes"), [(10_000, 64 * MiB), (100_000, 4 * MiB)])
def test_100k_distinct_keys_stay_within_the_caps(max_entries, max_bytes):
    store = MemoryStore(max_entries, max_bytes, ttl_s=86400)
    for i in range(100_000):
        store.put(("tenant-a", f"key-{i}"), _mixed(i))
        assert len(store) <= max_entries and store.bytes <= max_bytes
    # Full, not emptied by an over-eager eviction: one more record would not have fit.
    assert len(store) == max_entries or store.bytes > max_bytes - answer(1600).size
    assert store.get(("tenant-a", "key-99999")) is not None
    assert store.get(("tenant-a", "key-0")) is None


def test_charged_bytes_cover_the_memory_records_hold():
    """So max_bytes bounds real memory, not only an estimate of it."""
    store = MemoryStore(max_entries=100_000, max_bytes=1024 * MiB, ttl_s=86400)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(10_000):
            store.put(("tenant-a", f"key-{i}-{os.urandom(8).hex()}"), _mixed(i))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(store) == 10_000
    assert held <= store.bytes, (held, store.bytes)


async def test_100k_keys_through_the_policy_leave_no_flights():
    policy = Idempotency(IdempotencyConfig(max_entries=5_000, max_bytes=8 * MiB), "r")
    for i in range(100_000):
        headers = CIMultiDictProxy(CIMultiDict({"Idempotency-Key": f"k{i}"}))
        claim = await policy.claim("POST", "/v1/x", headers, "t", b"{}")
        assert claim.capture is not None and claim.new_unit
        _answer(claim, b'{"ok":true}')
        claim.finish("2xx")
    assert len(policy.store) == 5_000 and policy.store.bytes <= 8 * MiB
    assert policy.in_flight == 0 and policy.waiting == 0


def test_records_expire_after_ttl_and_lru_order_is_by_use():
    now = [0.0]
    store = MemoryStore(max_entries=2, max_bytes=MiB, ttl_s=60, clock=lambda: now[0])
    store.put("a", answer(10))
    store.put("b", answer(10))
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put("c", answer(10))
    assert store.get("b") is None and store.get("a") is not None
    now[0] = 59.9
    assert store.ttl_left(store.get("c")) == pytest.approx(0.1)
    now[0] = 60.0
    assert store.get("a") is None and store.get("c") is None
    assert len(store) == 0 and store.bytes == 0


def test_a_record_is_discarded_only_while_it_is_the_keys_own():
    """What the policy keeps here while an answer's write to Redis is under way is dropped
    once it ends, with its owner's bookkeeping, but not a record stored for the key since."""
    store = MemoryStore(max_entries=10, max_bytes=MiB, ttl_s=60)
    kept = answer(10)
    store.put(("acme", "k"), kept)
    store.discard(("acme", "k"), answer(10))  # another record: kept stays
    assert store.get(("acme", "k")) is kept
    store.discard(("acme", "k"), kept)
    assert store.get(("acme", "k")) is None and len(store) == 0 and store.bytes == 0
    since = answer(10)
    store.put(("acme", "k"), since)
    store.discard(("acme", "k"), kept)
    assert store.get(("acme", "k")) is since


def test_a_resized_store_keeps_what_fits_and_each_records_expiry():
    now = [0.0]
    store = MemoryStore(max_entries=3, max_bytes=MiB, ttl_s=60, clock=lambda: now[0])
    for key in "abc":
        store.put(key, answer(10))
    store.resize(max_entries=2, max_bytes=MiB, ttl_s=120)  # a reload
    assert store.get("a") is None and len(store) == 2  # the oldest went
    store.put("d", answer(10))  # under the new ttl
    now[0] = 60.0
    assert store.get("c") is None and store.get("d") is not None


@pytest.mark.parametrize("bound", ["bytes", "entries"])
def test_a_tenants_records_go_only_once_no_other_tenant_holds_more(bound):
    """A hostile trial: one LRU pool for every tenant let team-b's keyed calls push out
    team-a's stored answer (70 calls with 1 MB answers), and team-a's retry ran again. The
    owner holding the most loses its least recently used record."""
    big = answer(100_000)
    limits = ({"max_entries": 1000, "max_bytes": 5 * big.size + 2 * OWNER_OVERHEAD_BYTES}
              if bound == "bytes" else {"max_entries": 5, "max_bytes": MiB * 64})
    store = MemoryStore(ttl_s=60, **limits)
    store.put(("team-a", "pay-1"), answer(100_000))
    for i in range(70):
        store.put(("team-b", f"k-{i}"), answer(100_000))
    assert store.get(("team-a", "pay-1")) is not None
    assert [store.get(("team-b", f"k-{i}")) is not None for i in range(66, 70)] == [True] * 4
    assert store.get(("team-b", "k-65")) is None and len(store) == 5
    # Once team-a holds the most, its own least recently used record goes first.
    for i in range(4):
        store.put(("team-a", f"pay-{i + 2}"), answer(100_000))
    assert store.get(("team-a", "pay-1")) is None and store.get(("team-a", "pay-2")) is None
    assert store.get(("team-b", "k-69")) is not None
    assert store.bytes == sum(r.size for r in store._records.values()) + (
        2 * OWNER_OVERHEAD_BYTES)


def test_charged_bytes_cover_the_memory_records_of_many_tenants_hold():
    """A review: each owner's bookkeeping (its LRU of keys, its heap entries) was charged
    nothing, so with 10,000 tenants of one small record each the store held more than
    max_bytes said (666 B a record over the 512 charged). Records allocated first, so only
    the store's own allocations are traced."""
    tenants = [f"tenant-{i}" for i in range(10_000)]
    keys = [f"key-{os.urandom(8).hex()}" for _ in range(10_000)]
    records = [Record(SEEN, os.urandom(32)) for _ in range(10_000)]
    store = MemoryStore(max_entries=100_000, max_bytes=1024 * MiB, ttl_s=86400)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for tenant, key, record in zip(tenants, keys, records, strict=True):
            store.put((tenant, key), record)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # The records' own objects exist already: what is traced is the bookkeeping, which
    # their overhead and their owners' must cover.
    bookkeeping = store.bytes - sum(r.size - RECORD_OVERHEAD_BYTES for r in records)
    assert held <= bookkeeping, (held, bookkeeping)


def test_a_record_that_fits_is_not_evicted_by_its_own_put():
    """A review: four tenants hold one 100 kB answer each, a fifth stores a 250 kB one that
    fits; it held the most bytes, so its answer, just stored, was the one dropped (its
    retry, a payment, ran again). The next owner's record goes instead."""
    one = answer(100_000).size
    store = MemoryStore(max_entries=1000, max_bytes=5 * one + 5 * OWNER_OVERHEAD_BYTES,
                        ttl_s=60)
    for tenant in "abcd":
        store.put((tenant, "k"), answer(100_000))
    store.put(("e", "pay"), answer(250_000))
    assert store.get(("e", "pay")) is not None
    assert sum(store.get((t, "k")) is not None for t in "abcd") == 2  # two had to go
    store.put(("e", "pay-2"), answer(250_000))  # now e holds the most: its oldest goes
    assert store.get(("e", "pay")) is None and store.get(("e", "pay-2")) is not None


def test_a_flood_of_small_records_does_not_push_out_anothers_answer_under_the_entries_bound():
    """A review: ranked by bytes alone, past ``max_entries`` (the bound that binds with the
    defaults: 10,000 records of ~512 B are 5 MiB of 64) tenant b's one 100 kB answer went to
    tenant a's flood of records. An owner's share is its larger part of either bound."""
    store = MemoryStore(max_entries=100, max_bytes=64 * MiB, ttl_s=86400)
    store.put(("b", "pay-1"), answer(100_000))
    for i in range(150):
        store.put(("a", f"k-{i}"), Record(SEEN, b"f" * 32))
    assert store.get(("b", "pay-1")) is not None and len(store) == 100


async def test_an_answer_the_store_cannot_hold_is_kept_as_a_fact():
    """A review: the store refused a record whose size and its owner's bookkeeping passed
    max_bytes, while the policy kept the fact (TOO_LARGE) only past max_bytes: an answer
    in between was kept as neither, and the key's next request ran the work again."""
    policy = Idempotency(IdempotencyConfig(max_bytes=4096, max_replay_bytes=4096), "r")
    headers = CIMultiDictProxy(CIMultiDict({"Idempotency-Key": "k"}))
    first = await policy.claim("POST", "/p", headers, "t", b"1")
    assert first.capture is not None
    first.capture.begin(200, "OK", CIMultiDict({"Content-Type": "application/json"}))
    # A record of 4096 - 384 bytes: within max_bytes, not with its owner's bookkeeping.
    header = HEADER_OVERHEAD_BYTES + len("Content-Type") + len("application/json")
    first.capture.feed(b"x" * (4096 - OWNER_OVERHEAD_BYTES // 2 - RECORD_OVERHEAD_BYTES
                               - header))
    first.finish("2xx")
    again = await policy.claim("POST", "/p", headers, "t", b"1")
    assert again.rejected is not None and again.rejected.reason is Reason.IDEMPOTENCY_CONFLICT
    assert not again.new_unit


def test_a_record_larger_than_the_store_is_not_kept():
    store = MemoryStore(max_entries=10, max_bytes=2000 + OWNER_OVERHEAD_BYTES, ttl_s=60)
    store.put("small", answer(10))
    store.put("huge", answer(5000))
    assert store.get("huge") is None and store.get("small") is not None


def test_capture_keeps_bodies_up_to_the_limit_only():
    capture = Capture(limit=10)
    capture.begin(200, "OK", CIMultiDict({"Set-Cookie": "s=1", "Content-Length": "12",
                                          "Content-Type": "text/event-stream"}))
    capture.feed(b"data: 1\n\n")
    record = capture.record(b"f")
    assert (record.kind, record.body) == (DONE, b"data: 1\n\n")
    assert record.headers == (("Content-Type", "text/event-stream"),)
    capture.feed(b"data: 2\n\n")
    assert capture.chunks == [] and capture.record(b"f").kind == TOO_LARGE

    # A failure is never kept, but its waiting twins are given it whole, within the limit.
    failed = Capture(limit=10)
    failed.begin(503, "Service Unavailable", CIMultiDict({"Content-Length": "1"}))
    failed.feed(b"x")
    assert not failed.storable and failed.answer(b"f", "5xx") is None
    shared = failed.failure(b"f", "5xx")
    assert shared is not None
    assert (shared.status, shared.headers, shared.body) == (503, (), b"x")
    assert failed.failure(b"f", "upstream_error") is None  # relayed, then cut short
    failed.feed(b"y" * 10)
    assert failed.chunks == [] and failed.failure(b"f", "5xx") is None


@pytest.mark.parametrize(("raw", "key"), [
    ("abc-123", "abc-123"),
    ('"abc-123"', "abc-123"),
    ('  "with space" ', "with space"),
    ('"q\\"uote\\\\d"', 'q"uote\\d'),
    ("k" * 255, "k" * 255),
    ("Zm9v+/=:;", "Zm9v+/=:;"),
])
def test_keys_quoted_or_bare(raw, key):
    assert parse_key(raw) == key


@pytest.mark.parametrize(("raw", "problem"), [
    ("", "visible ASCII"),
    ('""', "empty"),
    ("k" * 256, "longer than 255"),
    ('"' + "k" * 256 + '"', "longer than 255"),
    ("a b", "visible ASCII"),
    ("a,b", "visible ASCII"),
    ('"open', "RFC 8941"),
    ('"bad\\n"', "RFC 8941"),
    ('"tab\there"', "RFC 8941"),
    ("caf\u00e9", "visible ASCII"),
])
def test_invalid_keys_say_why(raw, problem):
    with pytest.raises(ValueError, match=problem):
        parse_key(raw)


def _headers(key: str) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict({"Idempotency-Key": key}))


def _answer(claim, body: bytes, status: int = 200, reason: str = "OK") -> None:
    """The upstream's JSON answer to ``claim``'s call, as its capture sees it."""
    claim.capture.begin(status, reason, CIMultiDict({"Content-Type": "application/json"}))
    claim.capture.feed(body)


async def _waiting(policy: Idempotency, count: int) -> None:
    while policy.waiting < count:
        await asyncio.sleep(0)


async def test_waiters_get_the_stored_answer():
    policy = Idempotency(IdempotencyConfig(), "r")
    owner = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    waiters = [asyncio.create_task(policy.claim("POST", "/p", _headers("k"), "t", b"1"))
               for _ in range(3)]
    await _waiting(policy, 3)
    _answer(owner, b'{"id":1}', 201, "Created")
    owner.finish("2xx")
    for claim in await asyncio.gather(*waiters):
        assert claim.replay.status == 201 and claim.replay.body == b'{"id":1}'
        assert not claim.new_unit
    assert policy.in_flight == 0 and policy.waiting == 0


async def test_an_answer_within_max_replay_bytes_the_store_cannot_hold_still_ends_the_key():
    # max_replay_bytes may equal max_bytes, but a record is charged its body plus its headers
    # and overhead: an answer just under max_replay_bytes was then not stored at all, and the
    # next duplicate ran the work again (a hostile trial). Its waiters get it, later
    # duplicates are refused as for an answer over max_replay_bytes.
    policy = Idempotency(IdempotencyConfig(max_bytes=4096, max_replay_bytes=4096), "r")
    owner = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    waiter = asyncio.create_task(policy.claim("POST", "/p", _headers("k"), "t", b"1"))
    await _waiting(policy, 1)
    owner.capture.begin(200, "OK", CIMultiDict({"Content-Type": "application/json"}))
    owner.capture.feed(b"x" * 4000)
    owner.finish("2xx")
    assert (await waiter).replay.body == b"x" * 4000
    later = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    assert later.rejected is not None and not later.holds
    assert later.rejected.reason is Reason.IDEMPOTENCY_CONFLICT


async def test_a_reload_from_dedup_to_serialize_runs_each_request_one_at_a_time():
    """A hostile trial: after a reload from ``dedup`` to ``serialize`` the same request with
    the same key was refused 422 ``idempotency_mismatch`` for the stored answer's whole
    ttl (serialize has no fingerprint to match). Serialize replays nothing: a stored answer
    is kept for a return to dedup, and a call still running from before the reload hands
    the key to its waiters in turn rather than its answer."""
    policy = Idempotency(IdempotencyConfig(), "r")
    stored = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    _answer(stored, b'{"id":1}')
    stored.finish("2xx")
    running = await policy.claim("POST", "/p", _headers("j"), "t", b"1")
    policy.reconfigure(IdempotencyConfig(mode="serialize"))

    again = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    assert again.rejected is None and again.replay is None and not again.new_unit
    again.finish("2xx")

    waiters = [asyncio.create_task(policy.claim("POST", "/p", _headers("j"), "t", b"1"))
               for _ in range(2)]
    await _waiting(policy, 2)
    _answer(running, b'{"id":2}')
    running.finish("2xx")  # its answer is kept, the key goes to the first waiter
    first = await asyncio.wait_for(waiters[0], 5)
    assert first.rejected is None and first.replay is None and not waiters[1].done()
    first.finish("2xx")
    second = await asyncio.wait_for(waiters[1], 5)
    assert second.rejected is None and second.replay is None
    second.finish("2xx")
    assert policy.in_flight == 0 and policy.waiting == 0

    policy.reconfigure(IdempotencyConfig())  # back to dedup: the answers kept replay
    assert (await policy.claim("POST", "/p", _headers("k"), "t", b"1")).replay.body == b'{"id":1}'
    assert (await policy.claim("POST", "/p", _headers("j"), "t", b"1")).replay.body == b'{"id":2}'


async def test_waiters_given_an_answer_just_before_a_reload_to_serialize_replay_it():
    """A review: the answer of the call they waited for (under dedup) reached the waiters,
    and a reload to serialize landed before they resumed; each then ran, at once, and the
    second's end raised ``KeyError`` (the first's had dropped its flight)."""
    policy = Idempotency(IdempotencyConfig(), "r")
    running = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    waiters = [asyncio.create_task(policy.claim("POST", "/p", _headers("k"), "t", b"1"))
               for _ in range(2)]
    await _waiting(policy, 2)
    _answer(running, b'{"id":1}')
    running.finish("2xx")
    policy.reconfigure(IdempotencyConfig(mode="serialize"))  # before the waiters resume
    for claim in await asyncio.gather(*waiters):
        assert claim.replay.body == b'{"id":1}' and not claim.holds
    assert policy.in_flight == 0 and policy.waiting == 0


async def test_after_a_reload_to_dedup_a_serialized_call_leaves_no_answer_that_refuses():
    """A review, the reverse of the reload above: a serialized call (no fingerprint) handed
    the key after a reload to dedup stored its answer with no fingerprint, and the same
    request was refused 422 for the answer's ttl. And a dedup newcomer meeting a serialized
    call still in flight waits for it rather than being told its payload differs."""
    policy = Idempotency(IdempotencyConfig(mode="serialize"), "r")
    running = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    waiter = asyncio.create_task(policy.claim("POST", "/p", _headers("k"), "t", b"1"))
    await _waiting(policy, 1)
    policy.reconfigure(IdempotencyConfig())
    newcomer = asyncio.create_task(policy.claim("POST", "/p", _headers("k"), "t", b"1"))
    await _waiting(policy, 2)
    running.finish("2xx")  # serialized: nothing kept, the key goes to the first waiter
    handed = await asyncio.wait_for(waiter, 5)
    assert handed.rejected is None and handed.replay is None and handed.capture is None
    handed.finish("2xx")
    last = await asyncio.wait_for(newcomer, 5)  # it runs in turn, and its answer is kept
    assert last.rejected is None and last.replay is None and last.capture is not None
    _answer(last, b'{"id":3}')
    last.finish("2xx")
    again = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    assert again.rejected is None and again.replay.body == b'{"id":3}'


async def test_a_key_handed_to_a_leaving_waiter_passes_to_the_next():
    policy = Idempotency(IdempotencyConfig(), "r")
    owner = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    first = asyncio.create_task(policy.claim("POST", "/p", _headers("k"), "t", b"1"))
    await _waiting(policy, 1)
    second = asyncio.create_task(policy.claim("POST", "/p", _headers("k"), "t", b"1"))
    await _waiting(policy, 2)
    owner.finish("upstream_error")  # the key is handed to the first waiter ...
    first.cancel()  # ... whose caller leaves before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    claim = await asyncio.wait_for(second, 5)
    assert claim.replay is None and claim.rejected is None and claim.capture is not None
    claim.finish("client_disconnected")
    assert policy.in_flight == 0 and policy.waiting == 0
    # Every use so far failed, so the next request runs, recognised as a retry.
    again = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    assert again.replay is None and not again.new_unit


async def test_a_waiter_that_leaves_is_forgotten():
    policy = Idempotency(IdempotencyConfig(), "r")
    owner = await policy.claim("POST", "/p", _headers("k"), "t", b"1")
    waiter = asyncio.create_task(policy.claim("POST", "/p", _headers("k"), "t", b"1"))
    await _waiting(policy, 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert policy.waiting == 0
    owner.finish("rejected")
    assert policy.in_flight == 0


async def test_finish_is_idempotent_and_keys_are_scoped_by_tenant():
    policy = Idempotency(IdempotencyConfig(), "r")
    owner = await policy.claim("POST", "/p", _headers("k"), "t1", b"1")
    other = await policy.claim("POST", "/p", _headers("k"), "t2", b"1")
    assert owner.new_unit and other.new_unit and policy.in_flight == 2
    owner.finish("rejected")
    owner.finish("rejected")
    other.finish("rejected")
    assert policy.in_flight == 0


@pytest.mark.parametrize(("block", "problem"), [
    ("{mode: forward, on_in_flight: reject}", "on_in_flight has no effect in mode forward"),
    ("{mode: serialize, max_replay_bytes: 10}", "max_replay_bytes has no effect"),
    ("{max_replay_bytes: 20000, max_bytes: 10000}", "exceeds max_bytes"),
    ("{max_bytes: 1000}", "should be 4096 or more"),
    ("{derive_from: [X-Run-ID, x-run-id]}", "names a header twice"),
    ("{derive_from: ['X Run']}", "not an HTTP header name"),
    ("{ttl: 24}", "not a duration"),
    ("{mode: on}", "'on' is a boolean to YAML 1.1 readers"),
    ("{max_entries: 0}", "0 should be more than 0"),
    ("{on_inflight: wait}", "unknown key"),
])
def test_config_problems_are_reported(block, problem):
    text = ("routes:\n  - {name: r, path_prefix: /r/, upstream: 'http://u', idempotency: "
            f"{block}}}\n")
    with pytest.raises(ConfigError, match=problem) as info:
        parse_config(text, "c.yaml")
    assert info.value.problems[0].startswith("c.yaml:2: routes[0].idempotency")


def test_off_accepts_any_keys_and_defaults_are_documented_values():
    text = ("routes:\n  - {name: r, path_prefix: /r/, upstream: 'http://u',\n"
            "     idempotency: {mode: off, on_in_flight: reject}}\n")
    assert parse_config(text).routes[0].idempotency.mode == "off"
    config = IdempotencyConfig()
    assert (config.mode, config.ttl, config.on_in_flight, config.max_replay_bytes) == (
        "dedup", 86400.0, "wait", MiB)


async def test_mcp_call_key_fingerprint_and_replay_under_the_new_id() -> None:
    """MCP calls (issue 11): the key and fingerprint come from tool + arguments, never the
    JSON-RPC id; the answer is stored once its response is in, even if the client left
    before the rest; a replay carries the new request's id."""
    import orjson
    from multidict import CIMultiDict, CIMultiDictProxy

    from policies.config import IdempotencyConfig
    from policies.idempotency import Idempotency, Replay
    from policies.pipeline import Call, Outcome

    policy = Idempotency(IdempotencyConfig(), "tools", mcp_calls=True)

    def call(rid: object, to: str) -> Call:
        body = orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                             "params": {"name": "send", "arguments": {"to": to}}})
        return Call(request_id="r", route="tools", method="POST", path="/tools/mcp",
                    headers=CIMultiDictProxy(CIMultiDict()), body=body, tenant="t")

    first = call(1, "a")
    claim = await policy.admit(first)
    assert claim is not None and first.idempotency_key.startswith("sluice-t-")
    first.capture.begin(200, "OK", CIMultiDict({"Content-Type": "text/event-stream"}))
    first.capture.feed(b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/'
                       b'progress","params":{"progressToken":1,"progress":1}}\n\n')
    first.capture.feed(b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/'
                       b'message","params":{"level":"info","data":"sending"}}\n\n')
    first.capture.feed(b'event: message\ndata: {"jsonrpc":"2.0","id":1,"result":{"content":'
                       b'[{"type":"text","text":"sent #1"}]}}\n\nevent: message\ndata: {"jso')
    claim.release(Outcome("client_disconnected", reached=True, status=200))

    again = call("second", "a")
    with pytest.raises(Replay) as replay:
        await policy.admit(again)
    body = replay.value.record.body
    assert b'"id":"second"' in body and b'"id":1' not in body
    assert body.endswith(b'"sent #1"}]}}\n\n')  # cut after the response's event
    assert b"notifications/message" in body  # what came before the response stays,
    assert b"notifications/progress" not in body  # but the first call's progress
    assert again.idempotency_key == first.idempotency_key
    other = call(3, "b")  # other arguments: another call
    assert await policy.admit(other) is not None
    assert other.idempotency_key != first.idempotency_key


async def test_admit_picks_the_key_by_the_headers_sent() -> None:
    """The caller's key (any case of the name), a derived one only with every derive_from
    header, else a fresh one that nothing holds; an SDK's retry is no new unit either way."""
    from policies.pipeline import Call
    from policies.retry import is_client_retry

    policy = Idempotency(IdempotencyConfig(derive_from=["X-Run-ID", "X-Step-ID"]), "r")

    async def admit(headers: dict[str, str], method: str = "POST") -> tuple[Call, object]:
        sent = CIMultiDictProxy(CIMultiDict(headers))
        call = Call(request_id="q", route="r", method=method, path="/v1/x", headers=sent,
                    body=b"{}", tenant="t", client_retry=is_client_retry(sent))
        return call, await policy.admit(call)

    caller, held = await admit({"idempotency-key": "mine"})
    assert (caller.idempotency_key, caller.upstream_key) == ("mine", None) and held
    derived, held = await admit({"X-Run-ID": "run", "x-step-id": "1"})
    assert re.fullmatch(r"sluice-d-[0-9a-f]{32}", derived.idempotency_key) and held
    assert derived.upstream_key == f'"{derived.idempotency_key}"' and derived.new_unit
    for partial in ({}, {"X-Run-ID": "run"}, {"X-Step-ID": "1"}):
        fresh, held = await admit(partial)
        assert re.fullmatch(r"sluice-[0-9a-f]{32}", fresh.idempotency_key)
        assert fresh.upstream_key == f'"{fresh.idempotency_key}"' and fresh.new_unit
        assert held is None and fresh.capture is None
    retried, held = await admit({"x-stainless-retry-count": "1"})
    assert retried.idempotency_key.startswith("sluice-") and not retried.new_unit
    safe, held = await admit({}, method="GET")
    assert (safe.idempotency_key, safe.upstream_key, held) == (None, None, None)
    assert policy.in_flight == 2 and len(policy.store) == 0  # the caller's and the derived


def test_fresh_keys_are_distinct_and_well_formed_across_refills():
    keys = [fresh_key() for _ in range(3 * FRESH_KEYS_PER_READ + 5)]
    assert len(set(keys)) == len(keys)
    assert all(re.fullmatch(r"sluice-[0-9a-f]{32}", key) for key in keys)


def test_a_forked_child_does_not_repeat_its_parents_fresh_keys():
    fresh_key()  # the pool is filled: the parent has keys ready to hand out
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next key, to the parent
        os.close(read)
        os.write(write, fresh_key().encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child_key = pipe.read().decode()
    os.waitpid(pid, 0)
    assert re.fullmatch(r"sluice-[0-9a-f]{32}", child_key)
    assert child_key not in {fresh_key() for _ in range(FRESH_KEYS_PER_READ)}


async def test_an_input_required_answer_is_not_kept_so_the_continuation_runs() -> None:
    """MRTR (2026-07-28): a call answered ``input_required`` is not over; its client sends it
    again with ``inputResponses``. Under the call's own key (``derive_from``, as the docs
    advise for naming one call, or an ``Idempotency-Key``) the stored ``input_required``
    answer made that continuation a different payload under a used key: 422, and the call
    could never complete (a hostile trial). docs/mcp.md says it is not stored."""
    import orjson

    from policies.pipeline import Call

    policy = Idempotency(IdempotencyConfig(derive_from=["X-Run-ID", "X-Step-ID"]), "tools",
                         mcp_calls=True)
    headers = CIMultiDictProxy(CIMultiDict({"X-Run-ID": "r1", "X-Step-ID": "s1",
                                            "MCP-Protocol-Version": "2026-07-28",
                                            "Mcp-Method": "tools/call", "Mcp-Name": "book"}))

    def call(rid: int, **more: object) -> Call:
        body = orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                             "params": {"name": "book", "arguments": {"seat": "1A"}, **more}})
        return Call(request_id="r", route="tools", method="POST", path="/tools/mcp",
                    headers=headers, body=body, tenant="t")

    first = call(1)
    claim = await policy.admit(first)
    assert claim is not None
    first.capture.begin(200, "OK", CIMultiDict({"Content-Type": "application/json"}))
    first.capture.feed(orjson.dumps({"jsonrpc": "2.0", "id": 1, "result": {
        "resultType": "input_required", "requestState": "abc",
        "inputRequests": {"ok": {"method": "elicitation/create", "params": {}}}}}))
    claim.finish("2xx")
    continuation = call(2, inputResponses={"ok": {"action": "accept"}}, requestState="abc")
    held = await policy.admit(continuation)  # 422 idempotency_mismatch before
    assert held is not None and continuation.idempotency_key == first.idempotency_key
    held.finish("2xx")


def _tool_call(tool: str, arguments: dict, headers: dict[str, str]) -> Call:
    """An MCP ``tools/call`` of ``tool`` with ``arguments`` (JSON-RPC id 1) on route
    ``tools``, sent with ``headers``."""
    import orjson

    body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                         "params": {"name": tool, "arguments": arguments}})
    return Call(request_id="r", route="tools", method="POST", path="/tools/mcp",
                headers=CIMultiDictProxy(CIMultiDict(headers)), body=body, tenant="t",
                rpc_id=1)


async def test_an_mcp_calls_mismatch_says_how_to_run_it_again() -> None:
    """Another call under a used key is refused 422; the message says why and what to do
    (a new user read the why and guessed the rest)."""
    from policies.reasons import Rejected

    policy = Idempotency(IdempotencyConfig(), "tools", mcp_calls=True)

    def call(seat: str, token: str = "a") -> Call:
        return _tool_call("book", {"seat": seat},
                          {"Idempotency-Key": "k-1", "Authorization": f"Bearer {token}"})

    claim = await policy.admit(call("1A"))
    assert claim is not None
    # Another call, or the same one from other credentials (the caller's key is its own).
    for other in (call("2B"), call("1A", token="b")):
        with pytest.raises(Rejected) as refused:
            await policy.admit(other)
        assert refused.value.reason is Reason.IDEMPOTENCY_MISMATCH
        assert "other credentials" in refused.value.detail
        assert refused.value.detail.endswith(
            "to run it again, change an argument or send an Idempotency-Key of its own")
    claim.finish("2xx")


async def test_a_callers_key_replays_only_to_the_same_credentials() -> None:
    # A new user's trial: with self-declared tenants, a request with another API key, or
    # none, sending a key it had learnt was given the first caller's stored completion.
    policy = Idempotency(IdempotencyConfig(), "r")

    def sent(**credentials: str) -> CIMultiDictProxy[str]:
        return CIMultiDictProxy(CIMultiDict({"Idempotency-Key": "k", **credentials}))

    alice = {"Authorization": "Bearer alice-key"}
    owner = await policy.claim("POST", "/p", sent(**alice), "t", b"1")
    twin = await policy.claim("POST", "/p", sent(Authorization="Bearer mallory"), "t", b"1")
    assert twin.rejected is not None and twin.rejected.reason is Reason.IDEMPOTENCY_MISMATCH
    assert "other credentials" in twin.rejected.detail
    _answer(owner, b'{"secret": 1}')
    owner.finish("2xx")
    for other in ({"Authorization": "Bearer mallory"}, {"x-api-key": "alice-key"}, {}):
        claim = await policy.claim("POST", "/p", sent(**other), "t", b"1")
        assert claim.replay is None, other
        assert claim.rejected is not None and claim.rejected.reason is Reason.IDEMPOTENCY_MISMATCH
    again = await policy.claim("POST", "/p", sent(**alice), "t", b"1")
    assert again.replay is not None and again.replay.body == b'{"secret": 1}'
    assert policy.in_flight == 0


async def test_a_cookie_changing_between_a_call_and_its_retry_keeps_the_key() -> None:
    # A stickiness cookie a load balancer rotates is no credential of the caller's: read as
    # one, a tool call's retry would get another derived key and run its side effect twice.
    from policies.idempotency import Replay

    policy = Idempotency(IdempotencyConfig(), "tools", mcp_calls=True)

    def call(cookie: str) -> Call:
        return _tool_call("send", {"to": "a"},
                          {"Authorization": "Bearer t", "Cookie": f"AWSALB={cookie}"})

    first = await policy.admit(call("one"))
    assert first is not None
    _answer(first, b'{"jsonrpc": "2.0", "id": 1, "result": {"content": []}}')
    first.finish("2xx")
    with pytest.raises(Replay) as replayed:  # the stored answer, not a second run
        await policy.admit(call("two"))
    assert replayed.value.record.status == 200


async def test_a_derived_keys_mismatch_names_the_headers_it_was_made_from() -> None:
    """The same X-Run-ID and X-Step-ID with another body: 422, whose message spoke of "this
    Idempotency-Key", which the caller never sent (a new user's trial, round 35). It names
    the headers the key was derived from, and how to run the request again."""
    from policies.pipeline import Call
    from policies.reasons import Rejected

    policy = Idempotency(IdempotencyConfig(derive_from=["X-Run-ID", "X-Step-ID"]), "r")

    def call(body: bytes) -> Call:
        sent = CIMultiDictProxy(CIMultiDict({"X-Run-ID": "run", "X-Step-ID": "1"}))
        return Call(request_id="q", route="r", method="POST", path="/v1/x", headers=sent,
                    body=body, tenant="t")

    held = await policy.admit(call(b'{"a": 1}'))
    assert held is not None
    with pytest.raises(Rejected) as refused:
        await policy.admit(call(b'{"a": 2}'))
    assert refused.value.reason is Reason.IDEMPOTENCY_MISMATCH
    assert refused.value.detail.startswith(
        "Sluice derived it from this request's X-Run-ID, X-Step-ID; it was used")
    assert "Idempotency-Key of its own" in refused.value.detail


def test_a_record_stored_before_a_header_was_left_out_replays_without_it():
    """``Mcp-Session-Id`` joined the headers a replay leaves out when answers are captured;
    a record an earlier release stored (on Redis, for up to its ``ttl``) still held the
    first caller's session id, and replayed it to another session (a review)."""
    record = Record(DONE, os.urandom(32), 200, "OK", (
        ("Content-Type", "text/event-stream"), ("Mcp-Session-Id", "first-callers-session"),
        ("Set-Cookie", "a=b"), ("X-Upstream", "kept")), b"data: {}\n\n")
    replayed = replay_response(record)
    assert "Mcp-Session-Id" not in replayed.headers
    assert "Set-Cookie" not in replayed.headers
    assert replayed.headers["X-Upstream"] == "kept"
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert (replayed.status, replayed.body) == (200, b"data: {}\n\n")


def test_a_policy_without_backends_takes_the_default_lease_in_seconds() -> None:
    # StateBackends is a slotted dataclass: its lease_s read on the class was the field's
    # descriptor, not 5.0 (found while compiling the path with mypyc).
    policy = Idempotency(IdempotencyConfig(), "r")
    assert policy._lease_s == 5.0


def test_one_tenants_rounds_evict_only_its_own_continuation_notes() -> None:
    """MRTR continuation notes: a tenant at its share (``per_tenant``) makes room from its own
    oldest, so another tenant's flood of rounds leaves this tenant's note in place (before:
    4,096 shared notes, one tenant's 4,200 rounds evicted everyone's, and a retried
    continuation ran its tool again); the global bound still holds across tenants."""
    notes = Continuations(max_entries=8, per_tenant=4)
    notes.note("A", "a-0", b"A's round")
    for i in range(100):
        notes.note("C", f"c-{i}", b"C's round %d" % i)
    assert notes.find("A", "a-0") == b"A's round"
    assert [i for i in range(100) if notes.find("C", f"c-{i}") is not None] == [96, 97, 98, 99]
    assert notes.find("C", "a-0") is None  # by tenant
    for i in range(4):
        notes.note("B", f"b-{i}", b"B's")
    assert notes.find("A", "a-0") is None  # 9 notes: the oldest of all went
    assert all(notes.find("B", f"b-{i}") == b"B's" for i in range(4))
    assert notes.find("C", "c-96") is not None
    notes.note("B", "b-0", b"B's again")  # noted again: moved, not counted twice
    assert notes.find("B", "b-0") == b"B's again" and notes.find("B", "b-1") == b"B's"
