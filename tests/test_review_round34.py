"""Hostile review of round 34's changes (eb42e72..e7244a9): each test failed on the code it
was written against and passes since its fix. Two findings are documented rather than fixed
and have no test here: records stored before credentials were bound (docs/idempotency.md)
and an upstream that honours the key charged for each unanswered attempt (README)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from policies.config import IdempotencyConfig
from policies.deadletter import redact_path
from policies.idempotency import Idempotency
from policies.reasons import Reason
from policies.state import redact_url
from proxy.redact import redact
from tests.conftest import completed_events, route
from tests.test_retry_charges import (
    ok_upstream,
    post_up_for_attempt_two,
    raw_chat,
    retried_chat,
)

CHAT = "/openai/v1/chat/completions"


# -- 1. idempotency: credentials bound only when sent as Authorization / x-api-key / api-key --


# Not Cookie, which the review listed too: a load balancer's cookie changing between a call
# and its retry would split them under a derived key (policies.idempotency.NOT_CREDENTIALS).
@pytest.mark.parametrize("header", ["x-goog-api-key", "Ocp-Apim-Subscription-Key",
                                    "X-Auth-Token"])
async def test_a_callers_key_is_not_replayed_to_other_credentials_in_any_credential_header(
        header: str) -> None:
    """The change binds a caller-sent key to "the caller's credentials", but reads only
    ``Authorization``, ``x-api-key`` and ``api-key``. Sluice forwards every other header,
    and policies/secrets.py itself names ``key``/``cookie``/``token``/``auth`` headers as
    credentials (Gemini's ``x-goog-api-key``, Azure APIM's ``Ocp-Apim-Subscription-Key``,
    an MCP server's session ``Cookie`` or ``X-Auth-Token``). A caller with other
    credentials there, or none, who learns the key is given the first caller's answer."""
    policy = Idempotency(IdempotencyConfig(), "r")

    def sent(**credentials: str) -> CIMultiDictProxy[str]:
        return CIMultiDictProxy(CIMultiDict({"Idempotency-Key": "k", **credentials}))

    owner = await policy.claim("POST", "/p", sent(**{header: "alice-secret"}), "t", b"1")
    assert owner.rejected is None and owner.replay is None
    owner.capture.begin(200, "OK", CIMultiDict({"Content-Type": "application/json"}))
    owner.capture.feed(b'{"alice": "private"}')
    owner.finish("2xx")
    for other in ({header: "mallory-secret"}, {}):
        claim = await policy.claim("POST", "/p", sent(**other), "t", b"1")
        assert claim.replay is None, (
            f"{header}: another caller ({other}) was replayed alice's answer "
            f"{claim.replay.body!r}")
        assert claim.rejected is not None
        assert claim.rejected.reason is Reason.IDEMPOTENCY_MISMATCH


async def test_a_callers_key_is_not_replayed_end_to_end_to_another_gemini_key(
        upstream, start_sluice) -> None:
    """The same through a running Sluice: a route to an upstream that authenticates by
    ``x-goog-api-key``; Mallory (another key) sends Alice's Idempotency-Key and payload and is
    answered Alice's stored completion without the upstream ever checking Mallory's key."""
    sluice = await start_sluice({"routes": [route(
        "g", upstream.url, protocol="http", idempotency={"mode": "dedup"})]})
    async with aiohttp.ClientSession() as s:
        async with s.post(sluice.url + "/g/v1/x", data=b'{"q": 1}',
                          headers={"Idempotency-Key": "k-goog-1",
                                   "x-goog-api-key": "AIza-alice",
                                   "Content-Type": "application/json"}) as r:
            assert r.status == 200
            first = await r.read()
        async with s.post(sluice.url + "/g/v1/x", data=b'{"q": 1}',
                          headers={"Idempotency-Key": "k-goog-1",
                                   "x-goog-api-key": "AIza-mallory",
                                   "Content-Type": "application/json"}) as r:
            status, replayed, body = r.status, r.headers.get("Idempotent-Replayed"), \
                await r.read()
    assert upstream.executed == 1
    assert (status, replayed) != (200, "true"), (
        f"Mallory's key was answered Alice's stored answer: {body!r} (first {first!r})")


# -- 2. redaction of query fields by value --------------------------------------------------


def test_a_search_query_that_begins_with_an_auth_scheme_word_is_kept_in_a_dead_letter() -> None:
    """``SECRET_VALUE`` now also reads query values, and it takes ``basic ``, ``token ``,
    ``digest `` and ``bearer `` (any case) at the start of a value for an Authorization
    header. Ordinary search text (``?q=basic+python+tutorial``, ``?q=token+limits``,
    ``?q=Digest+of+news``) is then dropped from the stored path, and ``sluice dlq replay``
    sends the request without it (there is no way to give a query field back): a different
    request is replayed."""
    for path in ("/v1/search?q=basic+python+tutorial&page=2",
                 "/v1/search?q=token+limits+explained&page=2",
                 "/v1/search?q=Digest%20of%20news&page=2"):
        assert redact_path(path) == (path, []), redact_path(path)


def test_a_credential_sent_as_a_bare_query_field_is_redacted() -> None:
    """A query field without ``=`` (``?sk-proj-...``, as some webhook and tool URLs carry a
    token) is a value with no name: neither rule reads it, so it stays in dead letters,
    ``redact_url`` (Redis/upstream URLs printed) and the admin views."""
    secret = "sk-proj-HOSTILE1"
    stored, removed = redact_path(f"/v1/x?{secret}&page=2")
    assert secret not in stored, (stored, removed)
    assert secret not in redact_url(f"https://h.example/x?{secret}&page=2")
    assert secret not in json.dumps(redact({"upstream": f"https://h.example/x?{secret}"}))
    assert secret not in json.dumps(redact({"error": f"see https://h/x?a=1&{secret} now"}))


# -- 3. retries charged past the budget's limit ---------------------------------------------


async def test_retried_attempts_are_held_within_the_budget(start_sluice) -> None:
    """Every unanswered attempt is charged its whole reservation (the upstream may have
    billed it), and each attempt after the first was sent without being admitted by the
    budget: with a 1,000-token daily budget and a ~530-token reservation, three timed-out
    attempts charged 3 reservations in one admitted call. The review asked for the limit to
    hold; round 34 only reported it (``over_reservation_tokens``). Now each retry after an
    unanswered attempt holds a reservation of its own: on 1,200 tokens, attempt 2 fits (two
    reservations held), attempt 3 does not, and retrying ends there within the budget."""
    seen: list[int] = []

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        seen.append(1)
        await asyncio.sleep(2.0)  # runs (and bills) after Sluice stopped waiting
        return web.json_response({"choices": [], "usage": {"prompt_tokens": 7,
                                                            "completion_tokens": 500}})

    limit = 1200
    async with retried_chat(start_sluice, chat,
                            {"attempts": 3, "per_try_timeout": "300ms",
                             "backoff": {"base": "10ms", "max": "20ms"}, "on": ["timeout"]},
                            f"{limit}/day") as sluice:
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 500}
        async with aiohttp.ClientSession() as s, s.post(
                sluice.url + CHAT, json=body, headers={"X-Tenant-ID": "acme"}) as r:
            await r.read()
            assert r.headers["X-Sluice-Reason"] == "upstream_timeout"
        done = await completed_events(sluice)
        charged = done[0]["input_tokens"] + done[0]["output_tokens"]
        assert (len(seen), done[0]["unanswered_attempts"], done[0]["usage"]) == (
            2, 1, "reserved")
        assert 1000 < charged <= limit  # two reservations, both held before they were sent
        assert "over_reservation_tokens" not in done[0], done[0]
        await sluice.wait_metric("sluice_budget_reserved", 0, route="openai", tenant="acme",
                                 unit="tokens")
        remaining = await sluice.metric("sluice_budget_remaining", route="openai",
                                        tenant="acme", unit="tokens")
        assert remaining == limit - charged


# -- 5. test infrastructure: ports below the ephemeral range --------------------------------


@pytest.mark.parametrize("floor", [1024, 10000])
def test_free_ports_works_when_the_ephemeral_range_starts_low(monkeypatch, floor: int) -> None:
    """``free_ports`` takes ``ephemeral_floor() - 10000`` as its top for every port, with or
    without a cluster bus; with ``ip_local_port_range`` starting at 1024 (a common tuning
    for hosts with many connections) or 10000 the span is empty and every fixture that
    needs a port (``free_port``, ``start_sluice``, ``RedisServer``) dies with
    ``ValueError: empty range for randrange()`` instead of falling back to ``bind(0)``."""
    import tests.ports

    monkeypatch.setattr(tests.ports, "ephemeral_floor", lambda: floor)
    [port] = tests.ports.free_ports(1)
    assert 0 < port < 65536


# -- 6. a stream's timed-out attempt, the caller gone in the back-off -----------------------


async def test_a_timed_out_stream_attempt_is_charged_its_reservation_if_its_caller_left_in_back_off(
        start_sluice) -> None:
    """Attempt 1 is sent and cut by ``per_try_timeout`` (the upstream may run it to the end
    and bill it: "a timeout before the answer ... the whole reservation"); the caller leaves
    during the back-off, so no attempt 2 is sent. A non-streamed call is charged its
    reservation (input estimate + 500; the same test with ``"stream": false`` passes). A
    streamed one is charged its input estimate + 1 output token ("estimated"): ``Charge._used``
    hands the timed-out attempt to ``_unreported`` with the *call's* outcome,
    ``client_disconnected``, whose stream branch assumes the caller cut a stream being
    relayed; nothing was relayed and the caller left after the attempt was over. Had the
    caller waited for a 503 on attempt 2, the same attempt would be charged input + 500
    (``unanswered_attempts``)."""
    seen: list[str] = []  # the message of each attempt that reached the upstream

    async def chat(request: web.Request) -> web.Response:
        seen.append((await request.json())["messages"][0]["content"])
        await asyncio.sleep(2.0)  # generates (and bills) after Sluice stopped waiting
        return web.json_response({"choices": []})

    async with retried_chat(start_sluice, chat,
                            {"attempts": 2, "per_try_timeout": "300ms",
                             "backoff": {"base": "30s", "max": "30s"}, "on": ["timeout"]},
                            "100000/day") as sluice:
        # The back-off is full jitter, uniform(0, 30 s): a wait too short to leave in
        # (about one in thirty) sends attempt 2 first; then the case is tried again.
        for trial in range(3):
            message = f"hi {trial}"
            writer = await raw_chat(sluice, {"model": "gpt-test", "stream": True,
                                             "max_tokens": 500,
                                             "messages": [{"role": "user",
                                                           "content": message}]})
            deadline = time.monotonic() + 20
            while not (retried := [e for e in sluice.events()
                                   if e.get("event") == "retried"][trial:]):
                assert time.monotonic() < deadline, "attempt 1 did not time out"
                await asyncio.sleep(0.02)
            writer.close()  # in the back-off: attempt 1 is over, attempt 2 not sent
            if retried[0]["wait_s"] >= 1.0:
                break
        done = [e for e in await completed_events(sluice, count=trial + 1)
                if e["request_id"] == retried[0]["request_id"]]
        assert seen.count(message) == 1
        event = done[0]
        assert event["outcome"] == "client_disconnected"
        # The reservation: the input estimate and max_tokens.
        assert (event["usage"], event["output_tokens"]) == ("reserved", 500), (
            f"charged {event['input_tokens']} + {event['output_tokens']} tokens "
            f"({event['usage']}) for an attempt that timed out upstream")


async def test_a_replayed_dead_letter_keeps_a_search_query_that_begins_with_basic(
        upstream, start_sluice, tmp_path) -> None:
    """End to end: ``GET /h/v1/search?q=basic+python+tutorial&page=2`` fails (503, retried,
    dead-lettered); ``sluice dlq replay`` then sends ``/v1/search?page=2``: the search terms
    were taken for an ``Authorization: Basic`` value and dropped, and the replay, which has no
    way to give a query field back, silently sends another request."""
    from tests.test_dlq_replay import FAST_BACKOFF, cli, outcome

    sluice = await start_sluice({"dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
                                 "routes": [route(
                                     "h", upstream.url, protocol="http", idempotent=True,
                                     retry={"attempts": 2, "backoff": FAST_BACKOFF,
                                            "on": [503]})]})
    upstream.status = 503
    async with aiohttp.ClientSession() as s, s.get(
            sluice.url + "/h/v1/search?q=basic+python+tutorial&page=2") as r:
        await r.read()
        letter = r.headers["X-Sluice-Dead-Letter"]
    upstream.status = 200
    sent_before = len(upstream.requests)
    code, _, err = await outcome(await cli("dlq", "replay", letter, "--config",
                                             str(sluice.config_path)))
    assert code == 0, err
    assert len(upstream.requests) == sent_before + 1
    assert upstream.requests[-1].raw_path == "/v1/search?q=basic+python+tutorial&page=2", (
        f"the replay sent {upstream.requests[-1].raw_path}")


# -- 7. cost_per_second for an attempt that never connected ---------------------------------


async def test_an_attempt_with_no_connection_is_not_charged_upstream_seconds(
        start_sluice) -> None:
    """Round 34 made ``CostCharge`` count "only attempts that may have reached the upstream
    (one refused a connection costs nothing)", but only for ``cost_per_call``: the seconds an
    attempt spent waiting for a connection it never got (``timeouts.connect``; the request
    never left, ``proxy.forward.left``) still count in ``Call.upstream_seconds`` and are
    charged ``cost_per_second``. Attempt 1 waits 4 s for a connection on a listener whose
    backlog is full, attempt 2 is answered at once: the call is charged for the 4 s."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(0)
    port = holder.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the accept queue: later SYNs are dropped, connects hang
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(filler)

    runner = await ok_upstream()
    try:
        sluice = await start_sluice({"routes": [route(
            "h", f"http://127.0.0.1:{port}", protocol="http", idempotent=True,
            timeouts={"connect": "4s"},
            retry={"attempts": 2, "backoff": {"base": "10ms", "max": "20ms"},
                   "on": ["connect_error", "timeout"]},
            budget={"usd": "100/day", "per": "tenant"},
            endpoints={"POST /v1/x": {"cost_per_second": 1.0}})]})
        def free() -> None:
            for sock in (*fillers, holder):
                sock.close()

        attempt_1 = await post_up_for_attempt_two(sluice, runner, port, free)
        done = await completed_events(sluice)
        # A connect timeout is retried as "timeout" (Reason.UPSTREAM_TIMEOUT), never sent.
        assert attempt_1["after"] == "timeout", attempt_1
        # Attempt 1 never left; its 4 s wait for a connection is no upstream time.
        assert done[0]["operation_cost_usd"] < 4.0, (
            f"charged {done[0]['operation_cost_usd']} USD at 1 USD per upstream second")
    finally:
        for sock in (*fillers, holder):
            sock.close()
        await runner.cleanup()


# -- 9. an MCP call's mismatch by credentials -----------------------------------------------


async def test_an_mcp_calls_credential_mismatch_says_credentials() -> None:
    """An MCP call with a caller-sent Idempotency-Key, repeated by a caller with other
    credentials, is refused 422 (round 34), but the detail is the MCP one: "other params, or
    ... another protocol generation ...; to run it again, change an argument or send an
    Idempotency-Key of its own". Nothing differs in the params or the generation: the caller
    is told to look for a difference that is not there, and the one that is (its
    credentials) is not named, as the non-MCP detail names it."""
    import hashlib

    policy = Idempotency(IdempotencyConfig(), "r", mcp_calls=True)
    fingerprint = hashlib.sha256(b"tools/call my_inbox {}").digest()

    def sent(token: str) -> CIMultiDictProxy[str]:
        return CIMultiDictProxy(CIMultiDict({"Idempotency-Key": "k-mcp",
                                             "Authorization": f"Bearer {token}"}))

    owner = await policy.claim("POST", "/mcp", sent("alice"), "t", b"{}",
                               fingerprint=fingerprint, call_key=fingerprint, mcp_id=1)
    assert owner.rejected is None
    other = await policy.claim("POST", "/mcp", sent("mallory"), "t", b"{}",
                               fingerprint=fingerprint, call_key=fingerprint, mcp_id=1)
    owner.finish("5xx")
    assert other.rejected is not None
    assert other.rejected.reason is Reason.IDEMPOTENCY_MISMATCH
    assert "credentials" in other.rejected.detail, other.rejected.detail
