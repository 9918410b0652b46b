"""Unit tests of the breaker, retry and dead-letter building blocks (no subprocess)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import orjson
import pytest

from policies import breaker as brk
from policies.config import CircuitBreakerConfig, RetryConfig
from policies.deadletter import Attempt, DeadLetter, DeadLetterFile, redact, redact_path
from policies.reasons import SDK_RETRY_AFTER_CAP_S, Reason, Rejected
from policies.retry import (
    RetryBudget,
    RetryPolicy,
    is_client_retry,
    retry_is_safe,
    upstream_retry_after,
)
from policies.state import memory_backends
from policies.state.breaker import MemoryBreakerStates
from proxy.events import EventLog
from proxy.rejections import rejection_headers


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(brk.time, "monotonic", c)
    return c


def make_breaker(clock: Clock, **config: object) -> tuple[brk.Breaker, EventLog]:
    """A breaker on this process's memory state, whose time is ``clock``."""
    events = EventLog(None)
    backends = memory_backends()
    backends.breakers = MemoryBreakerStates(clock)
    return brk.Breaker(CircuitBreakerConfig(**config), "r", events.emit_system,
                       backends), events


async def fail(breaker: brk.Breaker, outcome: int = brk.FAILURE, status: int | None = None,
               hint: float | None = None) -> None:
    """One attempt with ``outcome``."""
    await breaker.record(await breaker.attempt(), outcome, status, hint)


def emitted(events: EventLog) -> list[str]:
    return [orjson.loads(line)["event"] for line in events.lines().splitlines()]


def test_retry_is_safe_follows_rfc9110() -> None:
    for method in ("GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"):
        assert retry_is_safe(method, sent=True)
    for method in ("POST", "PATCH"):
        assert not retry_is_safe(method, sent=True)
        assert retry_is_safe(method, sent=False)  # never left: nothing to apply twice
        assert retry_is_safe(method, sent=True, callers_key=True)
        assert retry_is_safe(method, sent=True, upstream_dedups=True)
        assert retry_is_safe(method, sent=True, declared_idempotent=True)


def test_client_retry_counts() -> None:
    """x-stainless-retry-count > 0 is an SDK's own retry; anything but decimal digits is none,
    and no value raises (int() refuses "²", which isdigit() takes, and over 4300 digits)."""
    def retry(count: str) -> bool:
        return is_client_retry({"x-stainless-retry-count": count})

    assert not is_client_retry({})
    assert [retry(c) for c in ("0", "00", "1", "01", "12", "\u0663")] == [
        False, False, True, True, True, True]  # U+0663: the Arabic-Indic digit three
    for junk in ("", "-1", "+1", " 1", "1.0", "one", "\u00b2", "\u0660"):  # ², Arabic zero
        assert not retry(junk)
    assert retry("1" * 5000) and not retry("0" * 5000)


def test_upstream_retry_after_forms() -> None:
    assert upstream_retry_after({"retry-after-ms": "1500", "Retry-After": "9"}) == 1.5
    assert upstream_retry_after({"Retry-After": "7"}) == 7.0
    assert upstream_retry_after({"Retry-After": "0.5"}) == 0.5
    future = datetime.now(UTC) + timedelta(seconds=30)
    assert 27 < upstream_retry_after({"Retry-After": format_datetime(future, usegmt=True)}) <= 30
    assert upstream_retry_after({"Retry-After": "soon"}) is None
    assert upstream_retry_after({"Retry-After": "nan"}) is None
    assert upstream_retry_after({"retry-after-ms": "junk"}) is None
    assert upstream_retry_after({}) is None


def test_backoff_is_full_jitter_and_hints_are_capped() -> None:
    policy = RetryPolicy(RetryConfig.model_validate(
        {"backoff": {"base": "100ms", "max": "300ms"}, "max_retry_after": "10s"}))
    for n, cap in ((0, 0.1), (1, 0.2), (2, 0.3), (5, 0.3)):
        waits = [policy.wait(n, None) for _ in range(200)]
        assert all(0 <= w < cap for w in waits)
        assert max(waits) > cap / 2  # jitter spreads over the whole range
    assert 4.0 <= policy.wait(0, 4.0) <= 5.0  # the upstream's wait, never shorter
    assert policy.wait(0, 11.0) is None  # longer than max_retry_after: stop retrying


def test_retry_budget_ratio_with_floor() -> None:
    budget = RetryBudget(0.2, 3)
    assert [budget.try_acquire(active=10) for _ in range(4)] == [True, True, True, False]
    budget.release()
    assert budget.try_acquire(active=10)
    assert [budget.try_acquire(active=30) for _ in range(4)] == [True, True, True, False]
    budget.hold()  # an SDK's own retry is counted even over budget
    assert budget.in_flight == 7


def test_classify_outcomes() -> None:
    assert brk.classify(200, {}) == brk.SUCCESS
    for status in (400, 401, 404, 409, 413, 422):
        assert brk.classify(status, {}) == brk.SUCCESS
    assert brk.classify(429, {}) == brk.FAILURE
    assert brk.classify(429, {"retry-after": "3"}) == brk.NEUTRAL
    assert brk.classify(429, {"x-ratelimit-reset-requests": "1s"}) == brk.NEUTRAL
    for status in (500, 502, 503, 504, 529):
        assert brk.classify(status, {}) == brk.FAILURE


async def test_consecutive_failures_open_then_one_probe_closes(clock: Clock) -> None:
    breaker, events = make_breaker(clock, fail_max=3, reset_timeout="10s")
    for _ in range(2):
        await fail(breaker)
    await fail(breaker, brk.SUCCESS)  # a success resets the consecutive count
    for _ in range(3):
        await fail(breaker)
    assert breaker.current == "open" and breaker.state_value() == 2
    with pytest.raises(Rejected) as info:
        await breaker.attempt()
    # Retry-After: the time to half-open, plus a spread of up to one reset_timeout.
    assert info.value.reason is Reason.CIRCUIT_OPEN and 10.0 <= info.value.retry_after <= 20.0
    assert breaker.blocked_for() == 10.0
    clock.now += 4
    with pytest.raises(Rejected) as info:
        breaker.check()
    assert 6.0 <= info.value.retry_after <= 16.0
    spread = set()
    for _ in range(50):
        with pytest.raises(Rejected) as info:
            breaker.check()
        spread.add(round(info.value.retry_after, 1))
    assert len(spread) > 10  # refused callers are not all sent back at the same instant

    clock.now += 6
    breaker.check()  # due: check() passes but takes nothing
    probe = await breaker.attempt()
    assert breaker.current == "half-open"
    with pytest.raises(Rejected) as info:
        await breaker.attempt()  # exactly one probe
    assert 1.0 <= info.value.retry_after / brk.PROBE_RETRY_AFTER_S <= 2.0
    await breaker.record(probe, brk.SUCCESS)
    assert breaker.current == "closed" and breaker.state_value() == 0
    assert emitted(events) == ["circuit_opened", "circuit_half_open", "circuit_closed"]


async def test_cancelled_probe_is_neutral_and_failed_probe_reopens(clock: Clock) -> None:
    breaker, _ = make_breaker(clock, fail_max=1, reset_timeout="5s", success_threshold=2)
    await fail(breaker)
    clock.now += 5
    probe = await breaker.attempt()
    breaker.release(probe)  # the caller went away: no verdict, the next caller probes
    await asyncio.sleep(0)  # the lease is given back in the background
    assert breaker.current == "half-open"
    probe = await breaker.attempt()
    await breaker.record(probe, brk.SUCCESS)
    assert breaker.current == "half-open"  # success_threshold 2: one more probe needed
    await fail(breaker)
    assert breaker.current == "open" and breaker.blocked_for() == 5.0


async def test_a_released_probe_lets_the_next_call_through_the_check(clock: Clock) -> None:
    """Seen: on memory, a probe whose caller left kept the view half-open with a probe in
    flight, so the pipeline's check() refused every later call: the breaker never probed
    again and refused 503 for good."""
    breaker, events = make_breaker(clock, fail_max=1, reset_timeout="5s")
    await fail(breaker)
    clock.now += 5
    breaker.release(await breaker.attempt())  # the probe's caller went away
    await asyncio.sleep(0)  # the lease is given back in the background
    clock.now += 60
    breaker.check()  # not refused: the next caller may probe
    await breaker.record(await breaker.attempt(), brk.SUCCESS)
    assert breaker.current == "closed"
    assert emitted(events) == ["circuit_opened", "circuit_half_open", "circuit_closed"]


async def test_stale_outcomes_are_dropped(clock: Clock) -> None:
    breaker, _ = make_breaker(clock, fail_max=2, reset_timeout="5s")
    early = [await breaker.attempt() for _ in range(4)]  # four attempts admitted while closed
    await breaker.record(early[0], brk.FAILURE)
    await breaker.record(early[1], brk.FAILURE)
    assert breaker.current == "open"
    clock.now += 5
    probe = await breaker.attempt()
    await breaker.record(early[2], brk.FAILURE)  # lands after the state moved on: ignored
    assert breaker.current == "half-open"
    await breaker.record(probe, brk.SUCCESS)
    # From an older epoch: does not count toward fail_max.
    await breaker.record(early[3], brk.FAILURE)
    await fail(breaker)
    assert breaker.current == "closed"


async def test_upstream_retry_after_extends_never_shortens(clock: Clock) -> None:
    breaker, _ = make_breaker(clock, fail_max=1, reset_timeout="10s")
    first = await breaker.attempt()
    await breaker.record(first, brk.FAILURE, 503, 1.0)
    assert breaker.blocked_for() == 10.0  # a shorter hint does not shorten
    await breaker.record(first, brk.FAILURE, 503, 45.0)  # a late answer's hint still counts
    assert breaker.blocked_for() == 45.0
    await breaker.record(first, brk.FAILURE, 500, 90.0)  # only 429 and 503 carry the hint
    await breaker.record(first, brk.FAILURE, 429, 10_000.0)
    assert breaker.blocked_for() == brk.MAX_OPEN_HINT_S


async def test_failure_rate_window(clock: Clock) -> None:
    breaker, events = make_breaker(clock, fail_max=100, rate=0.5, window="10s", min_calls=4)
    for outcome in (brk.FAILURE, brk.FAILURE, brk.FAILURE):
        await fail(breaker, outcome)
    assert breaker.current == "closed"  # below min_calls: never trips
    clock.now += 11  # those fall out of the window
    for outcome in (brk.SUCCESS, brk.FAILURE, brk.SUCCESS):
        await fail(breaker, outcome)
    assert breaker.current == "closed"
    await fail(breaker)  # 2 of 4 = 50 %: trips (>=)
    assert breaker.current == "open"
    assert "failure_rate" in events.lines().splitlines()[-1].decode()


async def test_neutral_outcome_does_not_reset_the_count(clock: Clock) -> None:
    breaker, _ = make_breaker(clock, fail_max=2)
    await fail(breaker)
    breaker.release(await breaker.attempt())  # a cancelled attempt
    await fail(breaker, brk.NEUTRAL, 429, 3.0)  # a quota answer
    await fail(breaker)
    assert breaker.current == "open"


def test_credential_query_parameters_are_not_stored() -> None:
    assert redact_path("/v1/models/m:generate?key=SECRET&alt=sse") == (
        "/v1/models/m:generate?alt=sse", ["?key"])
    assert redact_path("/v1/x?api_key=a&sig=b") == ("/v1/x", ["?api_key", "?sig"])
    assert redact_path("/v1/x?y=1") == ("/v1/x?y=1", [])
    assert redact_path("/v1/x") == ("/v1/x", [])


def test_query_parameters_with_credential_values_are_not_stored_whatever_their_name() -> None:
    # Found by a hostile trial: ?k=sk-... and ?q=AIza... were kept in dead letters while the
    # same value in a header was redacted. Neutral names (k=) go by value; a value read
    # percent-decoded; plain values stay, "sk" and a Bearer-less "token" too.
    assert redact_path("/v1/x?k=sk-proj-abc&q=AIzaXYZ&page=2") == (
        "/v1/x?page=2", ["?k", "?q"])
    assert redact_path("/v1/x?code=ghp_abc&state=s1") == ("/v1/x?state=s1", ["?code"])
    assert redact_path("/v1/x?a=Bearer%20t0k3n-2f9a1c&b=eyJhbGciOi.e30.sig&c=sk%2Dx") == (
        "/v1/x", ["?a", "?b", "?c"])
    assert redact_path("/v1/x?q=sketch&lang=en&n=token") == (
        "/v1/x?q=sketch&lang=en&n=token", [])


def test_query_fields_go_by_whole_words_of_their_names() -> None:
    # A new user's trial: by fragment, author=, keyword=, max_tokens= and monkey= were
    # dropped from a dead letter (and its replay) as credentials.
    kept = "/v1/x?author=bob&keyword=x&max_tokens=5&monkey=banana&country_code=SK&state=s"
    assert redact_path(kept) == (kept, [])
    secret = ("/v1/x?apiKey=a&access_token=b&X-Amz-Signature=c&X-Amz-Security-Token=d"
              "&client_secret=e&pw=f&refreshtoken=g&page=2")
    assert redact_path(secret) == ("/v1/x?page=2", [
        "?apiKey", "?access_token", "?X-Amz-Signature", "?X-Amz-Security-Token",
        "?client_secret", "?pw", "?refreshtoken"])


def test_an_oauth_code_and_a_bearer_header_of_any_name_are_not_stored() -> None:
    # A security trial: ?code= (an OAuth authorization code: it buys a token) and
    # X-Upstream-Bearer were kept in a dead letter; codes of data stay.
    assert redact_path("/cb?code=SplxlOBeZQQYbYS6WxSbIA&state=xyz&languageCode=sk") == (
        "/cb?state=xyz&languageCode=sk", ["?code"])
    assert redact_path("/v1/x?device_code=d&authorization_code=a") == (
        "/v1/x", ["?device_code", "?authorization_code"])
    kept, removed = redact([("X-Upstream-Bearer", "plain-value"), ("X-Trace", "t")])
    assert (kept, removed) == ([("X-Trace", "t")], ["X-Upstream-Bearer"])


@pytest.mark.parametrize("field", [
    "promo_code=SUMMER", "coupon_code=X", "code_interpreter=true", "areaCode=212",
    "iso_code=FR", "product_code=A1", "airport_code=SFO", "source_code=1",
    "code_challenge=E9Melhoa2Owv", "code_challenge_method=S256", "zipCode=1",
    "error_code=E1", "status_code=404", "country_code=SK", "languageCode=sk", "codes=1"])
def test_data_fields_named_with_the_word_code_are_kept(field: str) -> None:
    # A review: "code" as a word of a field's name dropped promo_code, code_interpreter,
    # areaCode, PKCE's public code_challenge... from dead letters, so a replay sent another
    # request. A field named code, or one of a short list, is a credential; not the word.
    assert redact_path("/v1/x?" + field) == ("/v1/x?" + field, [])


@pytest.mark.parametrize("name", [
    "code", "Code", "auth_code", "authCode", "authorization_code", "device_code",
    "verification_code", "otp_code", "passcode", "authcode", "pass-code"])
def test_one_time_codes_that_buy_a_token_are_not_stored(name: str) -> None:
    assert redact_path(f"/cb?{name}=SplxlOBeZQQ&state=s") == ("/cb?state=s", [f"?{name}"])


def test_slovak_language_tags_are_no_credential() -> None:
    # The OpenAI key prefix "sk-" is also Slovak's language tag: by value alone, ?hl=sk-SK
    # was dropped from a dead letter (and from its replay), and Accept-Language with it.
    assert redact_path("/v1/x?hl=sk-SK&k=sk-a") == ("/v1/x?hl=sk-SK", ["?k"])
    kept, removed = redact([("Accept-Language", "sk-SK,sk;q=0.9,en;q=0.8"),
                            ("X-Note", "sk-SKx9"), ("X-Other", "sk-ab-live")])
    assert kept == [("Accept-Language", "sk-SK,sk;q=0.9,en;q=0.8")] and len(removed) == 2


def test_credentials_by_any_header_name_or_by_their_value_are_not_stored() -> None:
    # Found by a hostile trial: Azure's Ocp-Apim-Subscription-Key and other vendors' key
    # headers, and a Bearer value under a name of no note, were stored in clear.
    headers = [("Ocp-Apim-Subscription-Key", "azure-key"), ("X-Credential", "c"),
               ("X-Access-Key", "a"), ("X-Private-Key", "p"), ("Mcp-Session-Id", "s"),
               ("X-Upstream-Creds", "Bearer sk-HSECRET"), ("X-Note", "sk-live-123"),
               ("Idempotency-Key", "key-1"), ("X-Trace", "keep me"),
               ("Keep-Alive", "timeout=5")]
    kept, removed = redact(headers)
    assert kept == [("Idempotency-Key", "key-1"), ("X-Trace", "keep me"),
                    ("Keep-Alive", "timeout=5")]
    assert len(removed) == 7


def test_credentials_in_lower_case_schemes_short_names_and_tokens_are_not_stored() -> None:
    # Found by a second hostile trial: a scheme in lower case (RFC 9110: case-insensitive),
    # a header named X-Pass, a Google API key and a bare JWT were stored in clear.
    headers = [("X-Upstream", "bearer abc"), ("X-Pass", "hunter2"), ("X-Db-Pwd", "pw"),
               ("X-Google", "AIzaSyA-0123456789"), ("X-Id", "eyJhbGciOiJIUzI1NiJ9.eyJ9.sig"),
               ("X-Passenger-Count", "3"), ("X-Trace", "eyJ not a token")]
    kept, removed = redact(headers)
    assert kept == [("X-Passenger-Count", "3"), ("X-Trace", "eyJ not a token")]
    assert len(removed) == 5


def test_redact_and_store_roundtrip(tmp_path) -> None:
    kept, removed = redact([
        ("Authorization", "Bearer sk-secret"), ("x-api-key", "k"), ("Cookie", "a=b"),
        ("Idempotency-Key", "key-1"), ("Content-Type", "application/json"),
        ("X-Auth-Token", "t"),
    ])
    assert removed == ["Authorization", "x-api-key", "Cookie", "X-Auth-Token"]
    assert kept == [("Idempotency-Key", "key-1"), ("Content-Type", "application/json")]

    store = DeadLetterFile(str(tmp_path / "dlq.sqlite"))
    letter_id = store.add(DeadLetter(
        route="r", tenant="t", run=None, idempotency_key="key-1", request_id="q",
        method="POST", path="/v1/x?y=1", headers=kept, redacted=removed, body=b"\xff\x00",
        body_size=2, attempts=[Attempt(time.time(), 503, None, 0.01),
                               Attempt(time.time(), None, "timeout", 1.0)],
        reason="attempts_exhausted",
    )).id
    back = store.get(letter_id)
    assert back is not None and back.body == b"\xff\x00" and back.headers == kept
    assert back.as_dict()["body"] == {"base64": "/wA="}
    assert [a.error for a in back.attempts] == [None, "timeout"]
    store.add_replay(letter_id, 200, None, 0.1)
    assert store.list()[0]["last_replay"] == 200
    assert store.depth() == {"r": 1}
    assert store.purge() == 1 and store.list() == []
    store.close()


async def test_the_spread_never_carries_a_wait_within_the_sdk_cap_past_it(clock: Clock) -> None:
    # reset_timeout 40 s: a probe due in 40 s, spread by up to 40 s more, told callers up to
    # 78.5 s and x-should-retry: false on half the refusals, so they abandoned work a retry
    # at about 40 s would have served.
    breaker, _ = make_breaker(clock, fail_max=1, reset_timeout="40s")
    first = await breaker.attempt()
    await breaker.record(first, brk.FAILURE)
    assert breaker.blocked_for() == 40.0
    waits = []
    for _ in range(200):
        with pytest.raises(Rejected) as info:
            breaker.check()
        waits.append(info.value.retry_after)
        assert rejection_headers(info.value)["x-should-retry"] == "true"
    assert all(40.0 <= wait <= SDK_RETRY_AFTER_CAP_S for wait in waits)
    assert len({round(wait, 1) for wait in waits}) > 10  # still spread, up to the cap
    # A probe due past the cap (the upstream asked for 90 s) is told as it is: not now.
    await breaker.record(first, brk.FAILURE, 503, 90.0)
    with pytest.raises(Rejected) as info:
        breaker.check()
    assert info.value.retry_after >= 90.0
    assert rejection_headers(info.value)["x-should-retry"] == "false"
