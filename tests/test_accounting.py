"""The accounting step in process (policies/accounting.py): which calls it meters, what it
leaves on the call, and the ``completed`` event's fields its release writes."""

from __future__ import annotations

import gzip
import time

import aiohttp
import orjson
import pytest
import yaml
from multidict import CIMultiDict

from policies import accounting
from policies.accounting import Accounting, Charge
from policies.budget import Budgets
from policies.pipeline import Call, Outcome
from policies.rate import RateLimiter
from policies.reasons import Rejected
from policies.state import StateBackends, memory_backends
from proxy.config import parse_config
from tests.conftest import route as route_config

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 16})
ANSWER = orjson.dumps({"id": "c", "choices": [],
                       "usage": {"prompt_tokens": 7, "completion_tokens": 3}})


def make_accounting(**policies: object) -> Accounting:
    config = parse_config(yaml.safe_dump({"routes": [{
        "name": "openai", "path_prefix": "/openai/", "upstream": "http://127.0.0.1:1",
        "protocol": "openai", **policies}]}), "<test>")
    (route,) = config.routes
    rate = (RateLimiter(route.rate, memory_backends(), "openai", route.protocol)
            if route.rate else None)
    return Accounting(route, {}, rate, None, "X-Run-ID")


def make_call(path: str = "/openai/v1/chat/completions", body: bytes = BODY,
              method: str = "POST") -> Call:
    return Call(request_id="r", route="openai", method=method, path=path, headers={},
                body=body, tenant="t")


def answer(charge: Charge, body: bytes = ANSWER, status: int = 200) -> None:
    charge.start(status, CIMultiDict({"Content-Type": "application/json"}))
    assert charge.body(body) == body


def budgeted(backends: StateBackends) -> Accounting:
    """The accounting of a route with a daily token budget per tenant on ``backends``."""
    config = parse_config(yaml.safe_dump({"routes": [{
        "name": "openai", "path_prefix": "/openai/", "upstream": "http://127.0.0.1:1",
        "protocol": "openai", "budget": {"tokens": "1000000/day", "per": "tenant"}}]}),
        "<test>")
    (route,) = config.routes
    budgets = Budgets(route.budget, {}, backends, time.time, "openai")
    return Accounting(route, {}, None, budgets, "X-Run-ID")


async def settled(charge: Charge, outcome: Outcome) -> float:
    """Release ``charge`` with ``outcome``; the tokens its budget counter then says were
    spent, read from the ledger (Redis itself on a shared one)."""
    budgets = charge._acct.budgets
    assert budgets is not None and charge.reservation is not None
    (claim,) = charge.reservation.claims
    charge.release(outcome)
    await budgets.background.wait()
    ((spent, held),) = await budgets.backends.ledger.levels("openai", [claim.key])
    assert held == 0
    return spent


def stream_started(charge: Charge) -> None:
    charge.start(200, CIMultiDict({"Content-Type": "text/event-stream"}))


def responses_event(name: str, payload: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(
        {"type": name, **payload}) + b"\n\n"


async def test_metered_calls_are_posts_to_the_protocols_endpoints_whatever_the_query():
    acct = make_accounting(rate={"requests": "600/min"})
    for path in ("/openai/v1/chat/completions", "/openai/v1/chat/completions?x=1",
                 "/openai/v1/chat/completions/"):
        call = make_call(path)
        charge = await acct.admit(call)
        assert charge is not None and call.meter is charge  # the charge is the meter
        assert call.cost == float(charge.cost.input_tokens + 16)
        assert charge.units is None and charge.reservation is None  # no token limits
    for method, path in (("GET", "/openai/v1/chat/completions"),
                         ("POST", "/openai/v1/files")):
        call = make_call(path, method=method)
        assert await acct.admit(call) is None
        assert call.meter is None and call.cost is None


async def test_endpoints_kept_per_path_stay_right_past_the_bound(monkeypatch):
    monkeypatch.setattr(accounting, "ENDPOINTS_KEPT", 4)
    acct = make_accounting()
    for i in range(10):
        metered = await acct.admit(make_call(f"/openai/v1/chat/completions?i={i}"))
        assert metered is not None
        assert await acct.admit(make_call(f"/openai/v1/files?i={i}")) is None
        assert len(acct._endpoints) <= 4
    assert await acct.admit(make_call("/openai/v1/files?i=9", method="GET")) is None


@pytest.mark.parametrize("body", [b"not json", b"[1]", b'{"max_tokens": "16"}',
                                  b'{"n": 0, "max_tokens": 1}'])
async def test_unreadable_calls_pass_unmetered_without_token_limits(body):
    call = make_call(body=body)
    assert await make_accounting().admit(call) is None
    assert call.meter is None and call.body == body and call.cost is None


async def test_unreadable_calls_are_refused_with_token_limits():
    acct = make_accounting(rate={"tokens": "100000/min"},
                           usage={"default_max_tokens": 100})
    with pytest.raises(Rejected) as refused:
        await acct.admit(make_call(body=b"not json"))
    assert refused.value.reason.status == 400
    charge = await acct.admit(make_call())
    assert charge is not None and charge.units is not None  # its tokens were taken
    charge.release(Outcome("2xx", True, 200))


async def test_a_bad_cap_is_shown_as_the_caller_wrote_it(upstream, start_sluice):
    """Seen (new-user trial): "max_tokens must be a non-negative integer, not True" for a JSON
    true, and "not 1e+23" for 100000000000000000000000 (orjson reads an integer past 64 bits
    as a float)."""
    sluice = await start_sluice({"routes": [route_config(
        "openai", upstream.url, "openai", rate={"tokens": "100000/min"},
        usage={"default_max_tokens": 100})]})
    start = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
    async with aiohttp.ClientSession() as session:
        for member, shown in ((b'"max_tokens": true', "max_tokens must be a non-negative "
                               "integer, not true"),
                              (b'"max_tokens": 100000000000000000000000', "max_tokens must be "
                               "a non-negative integer, not 100000000000000000000000"),
                              (b'"max_tokens": 5, "n": null', None),
                              (b'"max_tokens": 5, "n": 1.0E+30',
                               "n must be a positive integer, not 1.0E+30"),
                              (b'"max_tokens": -7.5', "max_tokens must be a non-negative "
                               "integer, not -7.5")):
            async with session.post(sluice.url + "/openai/v1/chat/completions",
                                    data=start + member + b"}",
                                    headers={"Content-Type": "application/json"}) as r:
                if shown is None:  # null is no n at all
                    assert r.status == 200
                    continue
                assert (r.status, r.headers["X-Sluice-Reason"]) == (400, "bad_request")
                message = (await r.json())["error"]["message"]
                assert f"({shown}; this route limits tokens" in message, message


async def test_a_call_with_no_cap_is_told_every_field_that_caps_it(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route_config(
        "openai", upstream.url, "openai", rate={"tokens": "100000/min"})]})
    async with aiohttp.ClientSession() as session:
        async with session.post(sluice.url + "/openai/v1/chat/completions",
                                json={"model": "m", "messages": [{"role": "user",
                                                                  "content": "hi"}]}) as r:
            assert (r.status, r.headers["X-Sluice-Reason"]) == (400, "bad_request")
            message = (await r.json())["error"]["message"]
    assert "set max_completion_tokens or max_tokens: this route limits tokens" in message


async def test_a_compressed_body_is_unreadable_whatever_it_holds():
    """A body sent with ``Content-Encoding: gzip`` (or ``br``, even over plain JSON bytes)
    is not read as JSON: it passes unmetered and untouched where no token limit applies, and
    is refused, naming the coding, where one does."""
    for coding, body in (("gzip", gzip.compress(BODY)), ("BR", BODY)):
        call = Call(request_id="r", route="openai", method="POST",
                    path="/openai/v1/chat/completions",
                    headers=CIMultiDict({"content-encoding": coding}), body=body, tenant="t")
        assert await make_accounting(usage={"default_max_tokens": 100}).admit(call) is None
        assert call.meter is None and call.body == body
        limited = make_accounting(rate={"tokens": "100000/min"})
        with pytest.raises(Rejected) as refused:
            await limited.admit(call)
        assert refused.value.reason.status == 400
        assert f"compressed (Content-Encoding: {coding})" in refused.value.detail
    identity = make_call()
    identity.headers = CIMultiDict({"Content-Encoding": "identity"})
    charge = await make_accounting(rate={"tokens": "100000/min"}).admit(identity)
    assert charge is not None and charge.units is not None
    charge.release(Outcome("2xx", True, 200))


async def test_release_writes_the_completed_fields_once():
    acct = make_accounting()
    call = make_call()
    charge = await acct.admit(call)
    answer(charge)
    charge.release(Outcome("2xx", True, 200))
    assert call.charged == {"model": "m", "input_tokens": 7, "output_tokens": 3,
                            "cost_usd": None, "usage": "reported"}
    charge.release(Outcome("5xx", True, 500))  # a second release does nothing
    assert call.charged["usage"] == "reported"


async def test_release_without_a_count():
    acct = make_accounting()
    call = make_call()
    charge = await acct.admit(call)
    answer(charge, b'{"id": "c"}')  # complete, no usage: the whole reservation
    charge.release(Outcome("2xx", True, 200))
    assert call.charged is not None
    assert (call.charged["input_tokens"], call.charged["output_tokens"],
            call.charged["usage"]) == (charge.cost.input_tokens, 16, "reserved")

    call = make_call()
    charge = await acct.admit(call)
    answer(charge, b'{"error": {}}', status=400)  # an error answered in full: not billed
    charge.release(Outcome("4xx", True, 400))
    assert (call.charged["input_tokens"], call.charged["usage"]) == (0, "none")

    call = make_call()
    charge = await acct.admit(call)
    charge.start(500, CIMultiDict({"Content-Type": "application/json"}))
    charge.chunk(b'{"error": {"mess')  # an error cut short: billed no more than a whole one
    charge.release(Outcome("upstream_error", True, 500))
    assert (call.charged["input_tokens"], call.charged["usage"]) == (0, "none")

    call = make_call()
    charge = await acct.admit(call)
    charge.release(Outcome("upstream_error", False))  # never reached the upstream
    assert (call.charged["output_tokens"], call.charged["usage"]) == (0, "none")

    call = make_call()
    charge = await acct.admit(call)
    charge.release(Outcome("rejected", False, 429))  # refused by a later step: no fields
    assert call.charged is None


@pytest.mark.parametrize("backends", ["memory", "redis"], indirect=True)
async def test_a_background_stream_left_or_cut_is_charged_its_reservation(backends):
    """A hostile trial: a Responses stream with ``"background": true`` runs on at the
    provider when its caller leaves (the answer is fetched later by GET, unmetered), and is
    billed whole; left after ``response.created``, three were charged 117 tokens for
    12,033 billed. A background stream without its final usage is charged its
    reservation, whoever cut it; one that ran to its usage is charged as reported; a
    foreground one cut is charged what it streamed."""
    acct = budgeted(backends)
    created = responses_event("response.created", {"response": {
        "id": "r1", "status": "queued", "background": True, "usage": None}})
    delta = responses_event("response.output_text.delta", {"delta": "tok "})
    completed = responses_event("response.completed", {"response": {
        "id": "r1", "status": "completed",
        "usage": {"input_tokens": 11, "output_tokens": 40}}})
    for tenant, (background, label, events, expected) in enumerate((
            (True, "client_disconnected", created + delta, "reserved"),
            (True, "upstream_error", created + delta, "reserved"),
            (True, "2xx", created + delta + completed, "reported"),
            (False, "client_disconnected", created + delta, "estimated"))):
        call = make_call("/openai/v1/responses", orjson.dumps({
            "model": "m", "input": "write a lot", "max_output_tokens": 4000, "stream": True,
            "background": background}))
        call.tenant = str(tenant)  # a counter of its own
        charge = await acct.admit(call)
        assert charge is not None
        stream_started(charge)
        assert charge.chunk(events) == events
        if label == "2xx":
            charge.finish()
        spent = await settled(charge, Outcome(label, True, 200))
        assert call.charged is not None
        assert call.charged["usage"] == expected, (background, label)
        worst = charge.cost.input_tokens + 4000
        assert spent == {"reserved": worst, "reported": 51,
                         "estimated": charge.cost.input_tokens + 2}[expected]


def chat_event(payload: dict) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk",
                                     **payload}) + b"\n\n"


@pytest.mark.parametrize("backends", ["memory", "redis"], indirect=True)
async def test_usage_in_a_streams_first_chunk_does_not_make_its_content_free(backends):
    """A hostile trial: usage ``{prompt 11, completion 0}`` in a stream's first chunk, then
    50 content chunks and ``[DONE]``, was charged 0 output tokens as reported, and so when
    the upstream cut it after 20. As the README says of a stream without final usage: the
    whole one is charged its reservation, the cut one what it streamed."""
    acct = budgeted(backends)
    first = chat_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}],
                        "usage": {"prompt_tokens": 11, "completion_tokens": 0}})
    content = [chat_event({"choices": [{"index": 0, "delta": {"content": f"tok{i:02d} "},
                                        "finish_reason": None}]}) for i in range(50)]
    last = chat_event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    body = orjson.dumps({"model": "m", "max_tokens": 300, "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]})
    for tenant, (events, label) in enumerate((
            ([first, *content, last, b"data: [DONE]\n\n"], "2xx"),
            ([first, *content[:20]], "upstream_error"))):
        call, charge, spent = await _streamed(acct, tenant, body, events, label,
                                              finished=label == "2xx")
        if label == "2xx":
            assert (call.charged["output_tokens"], call.charged["usage"]) == (300, "reserved")
            assert spent == charge.cost.input_tokens + 300
        else:
            assert call.charged["usage"] == "estimated"
            assert (call.charged["input_tokens"], call.charged["output_tokens"]) == (11, 40)
            assert spent == 51


#: A stream's role chunk (no text), a chunk of text, and a reasoning call streamed: the
#: streams the tests of what a stream ended early is charged send.
ROLE = chat_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None}]})
TEXT = chat_event({"choices": [{"index": 0, "delta": {"content": "forty-two"},
                                "finish_reason": None}]})
THINKING = orjson.dumps({"model": "o3", "max_completion_tokens": 8000, "stream": True,
                         "messages": [{"role": "user", "content": "think hard"}]})


async def _streamed(acct: Accounting, tenant: int, body: bytes, events: list[bytes],
                    label: str, finished: bool = False) -> tuple[Call, Charge, float]:
    """One streamed call of ``tenant`` whose upstream sent ``events`` (and its stream's clean
    end, when ``finished``) before it ended as ``label``: the call, its charge and what it
    spent."""
    call = make_call(body=body)
    call.tenant = str(tenant)
    charge = await acct.admit(call)
    assert charge is not None
    stream_started(charge)
    for event in events:
        charge.chunk(event)
    if finished:
        charge.finish()
    spent = await settled(charge, Outcome(label, True, 200))
    assert call.charged is not None
    return call, charge, spent


@pytest.mark.parametrize("backends", ["memory", "redis"], indirect=True)
async def test_a_stream_left_before_any_content_is_charged_its_reservation(backends):
    """A hostile trial: a reasoning model's stream sends its role chunk, then thinks
    silently (billed, never streamed); the SDK's read timeout left five such streams, each
    charged its input and 1 output token, while a call not streamed whose caller leaves is
    charged its reservation. A stream ended from this side (caller gone, run cancelled,
    drain) before any content is charged as that call; one that streamed content, or that
    its upstream cut, is charged what it streamed."""
    acct = budgeted(backends)
    for tenant, (events, label, expected) in enumerate((
            ([ROLE], "client_disconnected", "reserved"),
            ([ROLE], "run_cancelled", "reserved"),
            ([ROLE], "drain_cut", "reserved"),
            ([ROLE, TEXT], "client_disconnected", "estimated"),
            ([ROLE], "upstream_error", "estimated"))):
        call, charge, spent = await _streamed(acct, tenant, THINKING, events, label)
        assert call.charged["usage"] == expected, label
        output = 8000 if expected == "reserved" else max(1, charge.streamed_tokens)
        assert call.charged["output_tokens"] == output, label
        assert spent == charge.cost.input_tokens + output, label


@pytest.mark.parametrize("backends", ["memory", "redis"], indirect=True)
async def test_usage_in_a_first_chunk_is_no_count_of_a_stream_left_before_content(backends):
    """A review: a stream whose first chunk carried its usage (``{prompt 11, completion
    0}``, read as final) and whose caller then left before any content was charged 0 output
    tokens as reported, while one without that usage is charged its reservation (the
    upstream works on unseen). Such a count is trusted only once content followed it or the
    answer ended; one after content, its caller leaving before ``[DONE]``, still stands."""
    acct = budgeted(backends)
    first = chat_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}],
                        "usage": {"prompt_tokens": 11, "completion_tokens": 0}})
    text = chat_event({"choices": [{"index": 0, "delta": {"content": "forty-two"},
                                    "finish_reason": "stop"}]})
    last = chat_event({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}})
    body = orjson.dumps({"model": "m", "max_tokens": 300, "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]})
    for tenant, (events, label, expected, output) in enumerate((
            ([first], "client_disconnected", "reserved", 300),
            ([first], "run_cancelled", "reserved", 300),
            ([first], "drain_cut", "reserved", 300),
            ([text, last], "client_disconnected", "reported", 3))):
        call, charge, spent = await _streamed(acct, tenant, body, events, label)
        assert (call.charged["usage"], call.charged["output_tokens"]) == (expected, output), label
        input_tokens = charge.cost.input_tokens if expected == "reserved" else 11
        assert spent == input_tokens + output, label


@pytest.mark.parametrize("backends", ["memory", "redis"], indirect=True)
async def test_a_stream_its_total_timeout_cut_before_any_content_is_charged_its_reservation(
        backends):
    """A review: ``timeouts.total`` cut a reasoning model's stream after its role chunk
    (thinking silently, billed) and charged its input and 1 output token: Sluice's own
    timer ended it while its upstream worked on, as a caller leaving does, so it is charged
    its reservation, with or without a first chunk's usage. One that streamed content
    before the cut is charged what it streamed, as is one its upstream cut."""
    acct = budgeted(backends)
    counted = chat_event({"choices": [{"index": 0, "delta": {"role": "assistant"},
                                       "finish_reason": None}],
                          "usage": {"prompt_tokens": 11, "completion_tokens": 0}})
    for tenant, (events, label, expected) in enumerate((
            ([ROLE], "upstream_timeout", "reserved"),
            ([counted], "upstream_timeout", "reserved"),
            ([ROLE, TEXT], "upstream_timeout", "estimated"),
            ([ROLE], "upstream_error", "estimated"))):
        call, charge, spent = await _streamed(acct, tenant, THINKING, events, label)
        assert call.charged["usage"] == expected, (tenant, label)
        output = 8000 if expected == "reserved" else max(1, charge.streamed_tokens)
        assert call.charged["output_tokens"] == output, (tenant, label)
        assert spent == charge.cost.input_tokens + output, (tenant, label)


@pytest.mark.parametrize("backends", ["memory", "redis"], indirect=True)
async def test_a_background_that_is_no_boolean_is_refused_where_tokens_are_limited(backends):
    """A review: ``"background": "true"`` (a string, which a lax upstream such as vLLM runs
    in the background) was read as not background, so its stream, left, was charged what it
    streamed. As for a cap sent as a string: refused 400 on a route that limits tokens,
    passed unmetered on one that does not; ``null`` is no background."""
    acct = budgeted(backends)

    def responses(background: object) -> Call:
        return make_call("/openai/v1/responses", orjson.dumps({
            "model": "m", "input": "hi", "max_output_tokens": 400, "stream": True,
            "background": background}))

    for sent in ("true", 1, {}):
        with pytest.raises(Rejected) as refused:
            await acct.admit(responses(sent))
        assert refused.value.reason.status == 400
        assert "background must be true or false" in refused.value.detail, sent
        call = responses(sent)
        assert await make_accounting(usage={"default_max_tokens": 100}).admit(call) is None
        assert call.meter is None
    for tenant, (sent, background) in enumerate(((True, True), (False, False),
                                                 (None, False))):
        call = responses(sent)
        call.tenant = str(tenant)
        charge = await acct.admit(call)
        assert charge is not None and charge.cost.background is background, sent
        assert await settled(charge, Outcome("rejected", False, 429)) == 0
