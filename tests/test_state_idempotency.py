"""Shared idempotency records and in-flight markers (policies.state.idempotency): memory, one
Redis, a Redis Cluster."""

from __future__ import annotations

import asyncio
import hashlib

from policies.state import StateBackends
from policies.state.connection import Script
from policies.state.idempotency import (
    CLAIMED,
    DONE,
    FAILED,
    FINISHED,
    IN_FLIGHT,
    SEEN,
    TOO_LARGE,
    Answer,
    wait_for_answer,
)
from tests.redis_servers import replica

FP = hashlib.sha256(b"POST /v1/chat {}").digest()
OTHER_FP = hashlib.sha256(b"POST /v1/chat {\"other\": 1}").digest()
KEY = "openai\0acme\0key-{1}|weird"  # keys may hold any character
ANSWER = Answer(DONE, FP, 200, "OK", (("content-type", "application/json"), ("x-ü", "é")),
                b'{"id": 1}\x00\xff')


async def test_the_first_request_claims_the_key_and_a_twin_sees_it_in_flight(
        backends: StateBackends):
    records = backends.idempotency
    assert await records.begin(KEY, "a", FP, 60) == (CLAIMED, None, b"", 0.0, "")
    twin = await records.begin(KEY, "b", FP, 60)
    assert (twin.state, twin.answer, twin.fingerprint, twin.owner) == (IN_FLIGHT, None, FP, "a")
    assert 59 < twin.ttl_s <= 60
    # The holder beginning again (a retry inside the same request) keeps the key.
    assert (await records.begin(KEY, "a", FP, 60)).state == CLAIMED
    assert await records.renew(KEY, "a", 60) is True
    assert await records.renew(KEY, "b", 60) is False


async def test_a_failure_is_given_only_to_those_that_waited_on_its_request(
        backends: StateBackends):
    """A request that failed (nothing kept) leaves its failure for the duplicates that waited
    on its marker, on any replica; a request arriving after it finds the key free."""
    records = backends.idempotency
    failure = Answer(DONE, FP, 503, "Service Unavailable", (("x-should-retry", "false"),),
                     b'{"error": "down"}')
    assert (await records.begin(KEY, "a", FP, 60)).state == CLAIMED
    assert (await records.begin(KEY, "b", FP, 60)).owner == "a"
    assert await records.finish(KEY, "a", Answer(SEEN, FP), 3600, failure=failure,
                                failure_s=60) is True
    async with replica(backends) as other:
        failed = await other.idempotency.begin(KEY, "b", FP, 60, waited_on="a")
        assert (failed.state, failed.answer) == (FAILED, failure)
        # Again (a waiter on another replica): the failure is not used up.
        assert (await other.idempotency.begin(KEY, "c", FP, 60, waited_on="a")).state == FAILED
    # A newcomer (or a waiter on another request) takes the key, as a retry; the waiters on
    # "a" still get its failure meanwhile.
    retry = await records.begin(KEY, "d", FP, 60, waited_on="x")
    assert (retry.state, retry.answer) == (CLAIMED, Answer(SEEN, FP))
    assert (await records.begin(KEY, "b", FP, 60, waited_on="a")).state == FAILED
    assert (await records.begin(KEY, "f", FP, 60)).owner == "d"
    # A failure is never left by a request that does not hold the key.
    await records.finish(KEY, "z", Answer(SEEN, FP), 3600, failure=failure, failure_s=60)
    await records.finish(KEY, "d", Answer(SEEN, FP), 3600)
    assert (await records.begin(KEY, "g", FP, 60, waited_on="z")).state == CLAIMED


async def test_a_stored_answer_is_returned_whole(backends: StateBackends):
    records = backends.idempotency
    await records.begin(KEY, "a", FP, 60)
    assert await records.finish(KEY, "a", ANSWER, 3600) is True
    done = await records.begin(KEY, "b", FP, 60)
    assert (done.state, done.answer) == (FINISHED, ANSWER)
    assert 3599 < done.ttl_s <= 3600
    assert await records.get(KEY) == ANSWER
    too_large = Answer(TOO_LARGE, FP, 200)
    await records.finish("other", "a", too_large, 60)
    assert (await records.begin("other", "b", FP, 60)).answer == too_large


async def test_a_serialized_request_is_never_answered_from_a_stored_answer(
        backends: StateBackends):
    """An empty fingerprint (``mode: serialize``, which replays nothing) claims a key whose
    answer was stored under ``dedup`` before a reload (a hostile trial: 422 for the same
    request, for the record's whole ttl), one at a time, and its end keeps that answer."""
    records = backends.idempotency
    await records.begin(KEY, "a", FP, 60)
    await records.finish(KEY, "a", ANSWER, 3600)
    claimed = await records.begin(KEY, "b", b"", 60)
    assert (claimed.state, claimed.answer) == (CLAIMED, ANSWER)  # a use before: a retry
    twin = await records.begin(KEY, "c", b"", 60)
    assert (twin.state, twin.fingerprint) == (IN_FLIGHT, b"")
    assert (await wait_for_answer(records, KEY, "c", b"", 60, 0.1)).state == IN_FLIGHT
    await records.finish(KEY, "b", Answer(SEEN, b""), 3600)
    assert (await wait_for_answer(records, KEY, "c", b"", 60, 1)).state == CLAIMED
    assert (await records.begin(KEY, "d", FP, 60)).state == IN_FLIGHT
    await records.finish(KEY, "c", Answer(SEEN, b""), 3600)
    back = await records.begin(KEY, "d", FP, 60)  # back in dedup: the answer replays
    assert (back.state, back.answer) == (FINISHED, ANSWER)


async def test_a_key_freed_without_an_answer_is_claimed_again_as_a_retry(
        backends: StateBackends):
    records = backends.idempotency
    await records.begin(KEY, "a", FP, 60)
    assert await records.finish(KEY, "a", Answer(SEEN, FP), 3600) is True
    retry = await records.begin(KEY, "b", FP, 60)
    assert (retry.state, retry.answer) == (CLAIMED, Answer(SEEN, FP))


async def test_a_late_finish_without_an_answer_never_replaces_an_answer(
        backends: StateBackends):
    records = backends.idempotency
    await records.begin(KEY, "a", FP, 0.2)
    await asyncio.sleep(0.25)  # a's marker lapsed (its replica stalled): b takes over
    assert (await records.begin(KEY, "b", FP, 60)).state == CLAIMED
    assert await records.finish(KEY, "b", ANSWER, 3600) is True
    assert await records.finish(KEY, "a", Answer(SEEN, FP), 3600) is False
    assert await records.get(KEY) == ANSWER


async def test_a_late_finish_with_an_answer_never_replaces_the_answer_stored_since(
        backends: StateBackends):
    """A replica frozen (SIGSTOP) longer than its marker's lease, with a call of the key in
    flight: a duplicate on another replica takes the key over, runs and stores its answer;
    the frozen one then thaws and finishes. A hostile trial (4 replicas, lease 4 s, frozen
    7 s) had that late answer replace the stored one: the duplicate's caller had been given
    answer c2, every later retry of the key was given c1."""
    records = backends.idempotency
    late = Answer(DONE, FP, 200, "OK", (), b'{"id": "late"}')
    await records.begin(KEY, "a", FP, 0.2)
    await asyncio.sleep(0.25)  # a's marker lapsed (its replica stalled): b takes over
    assert (await records.begin(KEY, "b", FP, 60)).state == CLAIMED
    assert await records.finish(KEY, "b", ANSWER, 3600) is True
    assert await records.finish(KEY, "a", late, 3600) is False
    assert await records.get(KEY) == ANSWER
    assert (await records.begin(KEY, "c", FP, 60)).answer == ANSWER


async def test_forward_mode_marks_a_key_seen_once(backends: StateBackends):
    records = backends.idempotency
    assert await records.seen(KEY, 60) is True
    assert await records.seen(KEY, 60) is False
    assert await records.get(KEY) == Answer(SEEN, b"")
    assert await records.get("never") is None


async def test_a_duplicate_on_another_replica_waits_for_the_answer(backends: StateBackends):
    async with replica(backends) as other:
        assert (await backends.idempotency.begin(KEY, "a", FP, 60)).state == CLAIMED
        # Asking again only every 600 s: only the finish's message can wake it in time.
        waiter = asyncio.create_task(
            wait_for_answer(other.idempotency, KEY, "b", FP, 60, timeout_s=600, poll_s=600))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        await backends.idempotency.finish(KEY, "a", ANSWER, 3600)
        done = await asyncio.wait_for(waiter, 30)
        assert (done.state, done.answer) == (FINISHED, ANSWER)


async def test_a_waiter_takes_over_a_key_left_without_an_answer(backends: StateBackends):
    records = backends.idempotency
    await records.begin(KEY, "a", FP, 60)
    waiter = asyncio.create_task(
        wait_for_answer(records, KEY, "b", FP, 60, timeout_s=5, poll_s=5))
    await asyncio.sleep(0.05)
    await records.finish(KEY, "a", Answer(SEEN, FP), 3600)
    handed = await asyncio.wait_for(waiter, 2)
    assert (handed.state, handed.answer) == (CLAIMED, Answer(SEEN, FP))
    assert (await records.begin(KEY, "c", FP, 60)).state == IN_FLIGHT  # b holds it now


async def test_waiting_ends_at_once_for_another_payload_and_at_the_timeout(
        backends: StateBackends):
    records = backends.idempotency
    await records.begin(KEY, "a", FP, 60)
    loop = asyncio.get_running_loop()
    # At once, not after 600 s.
    mismatch = await asyncio.wait_for(
        wait_for_answer(records, KEY, "b", OTHER_FP, 60, timeout_s=600, poll_s=600), 30)
    assert (mismatch.state, mismatch.fingerprint) == (IN_FLIGHT, FP)
    started = loop.time()
    late = await asyncio.wait_for(
        wait_for_answer(records, KEY, "b", FP, 60, timeout_s=0.3, poll_s=0.1), 30)
    assert late.state == IN_FLIGHT
    assert loop.time() - started >= 0.3


_WIPE = Script("return redis.call('DEL', KEYS[1], KEYS[2])")


async def _lose_everything(records: object) -> None:
    """What a Redis restarted empty, or flushed, does to one key: its marker and record gone
    (in memory, as if)."""
    if hasattr(records, "_flights"):
        records._flights.clear()
        records._records.clear()
    else:
        await records._state.eval(_WIPE, records._keys(KEY), [])


async def test_a_waiter_does_not_claim_a_marker_lost_before_it_would_lapse(
        backends: StateBackends):
    """A hostile trial: after a Redis restart or FLUSHALL, a duplicate already waiting found
    the key with no marker and claimed it, running the call a second time while the first
    still ran (10 of 10 keys), before the first's replica took its marker again. A request's
    end always leaves a record, so a key with neither, before the marker seen would lapse,
    was lost: the waiter waits on, for the holder's renewal to take it again."""
    records = backends.idempotency
    assert (await records.begin(KEY, "a", FP, 60)).state == CLAIMED
    seen = await records.begin(KEY, "b", FP, 60)
    assert seen.state == IN_FLIGHT
    await _lose_everything(records)
    waiting = asyncio.create_task(wait_for_answer(records, KEY, "b", FP, 60, 30,
                                                  poll_s=0.05, lapses_in_s=seen.ttl_s))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # polled five times: the key was not taken
    assert (await records.begin(KEY, "a", FP, 60)).state == CLAIMED  # the holder's renewal
    await asyncio.sleep(0.1)
    await records.finish(KEY, "a", ANSWER, 3600)
    done = await asyncio.wait_for(waiting, 5)
    assert (done.state, done.answer) == (FINISHED, ANSWER)
    # Once the marker seen would have lapsed, a lost key is free (its holder's replica is
    # gone too), and a key its holder freed is claimed at once.
    await records.begin("lost", "a", FP, 0.2)
    lapsing = await records.begin("lost", "b", FP, 0.2)
    assert lapsing.state == IN_FLIGHT
    assert (await wait_for_answer(records, "lost", "b", FP, 60, 5, poll_s=0.05,
                                  lapses_in_s=lapsing.ttl_s)).state == CLAIMED
    await records.finish("lost", "b", Answer(SEEN, b""), 60)
    assert (await records.begin("freed", "a", FP, 60)).state == CLAIMED
    assert (await records.finish("freed", "a", Answer(SEEN, b""), 60)) is True
    assert (await wait_for_answer(records, "freed", "b", FP, 60, 5,
                                  lapses_in_s=60)).state == CLAIMED
