"""A stream the upstream ends with an error event (HTTP 200, a few events, then Anthropic's
``overloaded_error``, a Chat Completions ``{"error": ...}`` chunk, the Responses API's
``response.failed``) is a failure of the upstream, as a 5xx is: the route's breaker hears a
failure and the call's outcome is ``upstream_error`` (status 200, what the client saw). An
error event that names the request's own fault (``invalid_request_error``) is not one, as a
400 is not. Driven through the official SDKs, streaming, on routes that limit no tokens."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import NamedTuple

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from tests.conftest import completed_events, route, serve_app, wait_until
from tests.redis_servers import TEST_TIMEOUT_S, delete_prefix, require_redis
from tests.sse import anthropic_failing, sse

BREAKER = {"fail_max": 2, "reset_timeout": "60s"}


def _chat(error: dict | str) -> list[bytes]:
    return [
        sse({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-x",
             "choices": [{"index": 0, "delta": {"content": "hello there"},
                          "finish_reason": None}]}),
        sse({"error": error}),
    ]


def _responses_failed(code: str) -> list[bytes]:
    response = {"id": "resp_1", "object": "response", "created_at": 1, "model": "gpt-x",
                "output": [], "usage": None}
    return [
        sse({"type": "response.created", "sequence_number": 0,
             "response": dict(response, status="in_progress")}, "response.created"),
        sse({"type": "response.output_text.delta", "sequence_number": 1, "item_id": "i",
             "output_index": 0, "content_index": 0, "delta": "hello there"},
            "response.output_text.delta"),
        sse({"type": "response.failed", "sequence_number": 2, "response": dict(
            response, status="failed", error={"code": code, "message": "it failed"})},
            "response.failed"),
    ]


SHAPES = {
    "overloaded": anthropic_failing("overloaded_error"),
    "api_error": anthropic_failing("api_error"),
    "anthropic_invalid": anthropic_failing("invalid_request_error"),
    "chat_server": _chat({"message": "The server had an error", "type": "server_error",
                          "param": None, "code": None}),
    "chat_invalid": _chat({"message": "bad", "type": "invalid_request_error", "param": None,
                           "code": "context_length_exceeded"}),
    "responses_server": _responses_failed("server_error"),
    "anthropic_begun": anthropic_failing("overloaded_error")[:3],  # no error event
    "chat_quota": _chat({"message": "Rate limit reached", "type": "requests", "param": None,
                         "code": "rate_limit_exceeded"}),
    "chat_insufficient": _chat({"message": "You exceeded your quota",
                                "type": "insufficient_quota", "param": None,
                                "code": "insufficient_quota"}),
    "chat_error_string": _chat("upstream model crashed"),
    "anthropic_error_text": [*anthropic_failing("overloaded_error")[:3],
                             b"event: error\ndata: overloaded\n\n"],
    "anthropic_error_ping": [*anthropic_failing("overloaded_error")[:3],
                             sse({"type": "ping"}, "error")],
}


SEEN = web.AppKey("seen", list)


class Failing(NamedTuple):
    """The upstream: its URL, and the ``x-shape`` of every request that reached it."""

    url: str
    seen: list[str]


async def _streams(request: web.Request) -> web.StreamResponse:
    """Every answer: HTTP 200, chunked SSE, the events ``x-shape`` names, then a clean end."""
    await request.read()
    if status := request.headers.get("x-status"):  # a plain JSON answer of that status
        return web.json_response({"type": "error"}, status=int(status))
    request.app[SEEN].append(request.headers["x-shape"])
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in SHAPES[request.headers["x-shape"]]:
        await response.write(event)
    if request.headers.get("x-linger"):  # the stream stays open until Sluice closes it
        await asyncio.sleep(60)
    if request.headers.get("x-cut"):  # the upstream dies mid-answer: no end of the chunks
        assert request.transport is not None
        request.transport.abort()
        return response
    await response.write_eof()
    return response


@pytest.fixture
async def failing() -> AsyncIterator[Failing]:
    app = web.Application()
    seen: list[str] = []
    app[SEEN] = seen
    app.router.add_post("/{tail:.*}", _streams)
    # A lingering stream's handler ends when Sluice closes its connection.
    runner, port = await serve_app(app, handler_cancellation=True)
    yield Failing(f"http://127.0.0.1:{port}", seen)
    await runner.cleanup()


async def _claude(sluice, shape: str, headers: dict[str, str] | None = None) -> None:
    """One streamed message through the Anthropic SDK; raises what the SDK raises."""
    client = anthropic.AsyncAnthropic(base_url=sluice.url + "/anthropic",
                                      api_key="sk-ant-test", max_retries=0)
    try:
        async with client.messages.stream(
                model="claude-x", max_tokens=100,
                extra_headers={"x-shape": shape, **(headers or {})},
                messages=[{"role": "user", "content": "hi"}]) as stream:
            async for _ in stream:
                pass
    finally:
        await client.close()


async def _gpt(sluice, shape: str, headers: dict[str, str] | None = None) -> None:
    """One streamed chat completion (or Responses call) through the OpenAI SDK."""
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                max_retries=0)
    try:
        if shape.startswith("responses"):
            stream = await client.responses.create(
                model="gpt-x", input="hi", stream=True,
                extra_headers={"x-shape": shape, **(headers or {})})
        else:
            stream = await client.chat.completions.create(
                model="gpt-x", stream=True, messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-shape": shape, **(headers or {})})
        async for _ in stream:
            pass
    finally:
        await client.close()


def _refused_open(error: BaseException) -> bool:
    return (isinstance(error, (openai.APIStatusError, anthropic.APIStatusError))
            and error.status_code == 503
            and error.response.headers.get("X-Sluice-Reason") == "circuit_open")


async def _two_open_the_breaker(sluice, call, shape: str,
                                headers: dict[str, str] | None = None) -> None:
    """Two streams of ``shape`` through ``call`` (:func:`_claude`, :func:`_gpt`), each raised
    by the SDK on what the upstream sent and completed ``upstream_error`` with status 200,
    open a ``fail_max: 2`` breaker: the third call is refused ``circuit_open``."""
    for _ in range(2):
        with pytest.raises((openai.APIError, anthropic.APIError)) as caught:
            await call(sluice, shape, headers)
        assert not _refused_open(caught.value)
    done = await completed_events(sluice, 2)
    assert [(e["outcome"], e["status"]) for e in done] == [("upstream_error", 200)] * 2
    with pytest.raises((openai.APIError, anthropic.APIError)) as caught:
        await call(sluice, shape)
    assert _refused_open(caught.value)


async def test_anthropic_overloaded_mid_stream_opens_the_breaker(start_sluice, failing) -> None:
    """Two streams that end in ``overloaded_error`` / ``api_error`` (after message_start and
    some text) open a ``fail_max: 2`` breaker: the third call is refused ``circuit_open`` and
    never reaches the upstream. Each is completed ``upstream_error``, status 200. Before, the
    breaker heard two successes (the 200 status line) and stayed closed."""
    sluice = await start_sluice({"routes": [route(
        "anthropic", failing.url, protocol="anthropic", circuit_breaker=BREAKER)]})
    for shape in ("overloaded", "api_error"):
        with pytest.raises(anthropic.APIStatusError) as caught:
            await _claude(sluice, shape)
        assert not _refused_open(caught.value)  # the SDK read the upstream's error event
    done = await completed_events(sluice, 2)
    assert [(e["outcome"], e["status"]) for e in done] == [("upstream_error", 200)] * 2
    with pytest.raises(anthropic.APIStatusError) as caught:
        await _claude(sluice, "overloaded")
    assert _refused_open(caught.value)
    assert failing.seen == ["overloaded", "api_error"]
    assert await sluice.metric("sluice_requests_total", route="anthropic",
                               outcome="upstream_error") == 2


@pytest.mark.parametrize("shape", ["chat_server", "responses_server"])
async def test_openai_server_error_mid_stream_opens_the_breaker(start_sluice, failing,
                                                                shape) -> None:
    """The OpenAI shapes: a Chat Completions ``{"error": {"type": "server_error"}}`` chunk,
    a Responses ``response.failed`` with ``server_error``, on a plain ``openai`` route (no
    budget, no token rate): two such streams open the breaker; each is ``upstream_error``."""
    sluice = await start_sluice({"routes": [route("openai", failing.url,
                                                  circuit_breaker=BREAKER)]})
    for _ in range(2):
        try:
            await _gpt(sluice, shape)
        except openai.APIError as error:  # the Chat chunk raises; response.failed is an event
            assert not _refused_open(error)
    done = await completed_events(sluice, 2)
    assert [(e["outcome"], e["status"]) for e in done] == [("upstream_error", 200)] * 2
    with pytest.raises(openai.APIStatusError) as caught:
        await _gpt(sluice, shape)
    assert _refused_open(caught.value)
    assert len(failing.seen) == 2


@pytest.mark.parametrize("shape", ["chat_error_string", "anthropic_error_text",
                                   "anthropic_error_ping"])
async def test_error_events_the_sdks_raise_on_are_the_servers(start_sluice, failing,
                                                              shape) -> None:
    """Events the official SDKs raise on though they hold no error object: a Chat
    Completions chunk whose ``error`` is a string (the openai SDK raises on any ``error``
    not empty), an Anthropic ``event: error`` whose data is text or a ``ping`` (the anthropic
    SDK raises on any event named ``error``). Naming no side, they are the server's: two
    open a ``fail_max: 2`` breaker, each ``upstream_error``. Before, each was a ``2xx``."""
    protocol = "anthropic" if shape.startswith("anthropic") else "openai"
    call = _claude if protocol == "anthropic" else _gpt
    sluice = await start_sluice({"routes": [route(protocol, failing.url, protocol=protocol,
                                                  circuit_breaker=BREAKER)]})
    await _two_open_the_breaker(sluice, call, shape)
    assert failing.seen == [shape] * 2


@pytest.mark.parametrize("client_side, server_side", [
    ("anthropic_invalid", "overloaded"),
    ("chat_invalid", "chat_server"),
], ids=["anthropic", "openai"])
async def test_a_client_side_error_event_does_not_count(start_sluice, failing, client_side,
                                                        server_side) -> None:
    """An error event naming the request's fault (``invalid_request_error``) counts as a 400
    does: a success for the breaker, outcome ``2xx``. Server-side errors taking turns with
    it never make two failures in a row, so a ``fail_max: 2`` breaker stays closed; two in a
    row then open it."""
    protocol = "anthropic" if client_side.startswith("anthropic") else "openai"
    call = _claude if protocol == "anthropic" else _gpt
    sluice = await start_sluice({"routes": [route(protocol, failing.url, protocol=protocol,
                                                  circuit_breaker=BREAKER)]})
    shapes = [server_side, client_side, server_side, client_side, server_side, server_side]
    for shape in shapes:
        with pytest.raises((openai.APIError, anthropic.APIError)) as caught:
            await call(sluice, shape)
        assert not _refused_open(caught.value), shape
    done = await completed_events(sluice, len(shapes))
    assert [e["outcome"] for e in done] == [
        "2xx" if shape == client_side else "upstream_error" for shape in shapes]
    assert {e["status"] for e in done} == {200}
    with pytest.raises((openai.APIError, anthropic.APIError)) as caught:
        await call(sluice, server_side)
    assert _refused_open(caught.value)
    assert failing.seen == shapes


@pytest.mark.parametrize("protocol, shape", [("anthropic", "overloaded"),
                                             ("openai", "chat_server")])
async def test_the_sdk_closing_on_the_error_event_first_is_no_disconnect(
        start_sluice, failing, protocol, shape) -> None:
    """The SDKs raise on the error event and close the stream; an upstream that keeps its
    stream open after the event (or is slower to end it) leaves Sluice to see the caller go
    first. The error event was the answer's last message: the call is ``upstream_error``,
    not ``client_disconnected``, and the breaker hears the failure all the same."""
    call = _claude if protocol == "anthropic" else _gpt
    sluice = await start_sluice({"routes": [route(protocol, failing.url, protocol=protocol,
                                                  circuit_breaker=BREAKER)]})
    await _two_open_the_breaker(sluice, call, shape, {"x-linger": "1"})
    assert len(failing.seen) == 2


async def test_a_failed_stream_is_not_replayed_for_its_key(start_sluice, failing) -> None:
    """On a ``dedup`` route a stream the upstream failed mid-answer is kept for its key no
    more than a 5xx is: the retry with the same ``Idempotency-Key`` reaches the upstream
    again. Before, the ``overloaded`` stream was stored as a 2xx answer and the retry got
    the same error replayed, never reaching the (maybe recovered) upstream. A stream ended
    by the request's own error is replayed, as a 400 is."""
    sluice = await start_sluice({"routes": [route("openai", failing.url,
                                                  idempotency={"mode": "dedup"})]})
    for key, shape in (("k-1", "chat_server"), ("k-1", "chat_server"),
                       ("k-2", "chat_invalid"), ("k-2", "chat_invalid")):
        client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                    max_retries=0)
        with pytest.raises(openai.APIError):
            stream = await client.chat.completions.create(
                model="gpt-x", stream=True, messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-shape": shape, "Idempotency-Key": key})
            async for _ in stream:
                pass
        await client.close()
    assert failing.seen == ["chat_server", "chat_server", "chat_invalid"]


@pytest.mark.parametrize("shape", ["chat_quota", "chat_insufficient"])
@pytest.mark.parametrize("linger", [False, True], ids=["upstream_ends", "sdk_closes_first"])
async def test_a_rate_limited_stream_is_not_replayed_for_its_key(start_sluice, failing, shape,
                                                                 linger) -> None:
    """A stream ended by a rate-limit or quota error event is kept for its key no more than
    a 429 is: the retry with the same ``Idempotency-Key`` reaches the upstream again, whether
    the upstream ended the stream after the event or the SDK closed it first. Before, the
    first stream was stored as a 2xx answer and every retry got the rate limit replayed."""
    sluice = await start_sluice({"routes": [route("openai", failing.url,
                                                  idempotency={"mode": "dedup"})]})
    headers = {"Idempotency-Key": f"k-{shape}", **({"x-linger": "1"} if linger else {})}
    for _ in range(2):
        with pytest.raises(openai.APIError):
            await _gpt(sluice, shape, headers)
    assert failing.seen == [shape] * 2
    done = await completed_events(sluice, 2)
    assert [(e["outcome"], e["status"]) for e in done] == [("2xx", 200)] * 2


@pytest.mark.parametrize("event, side", [
    ({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
     "server"),
    ({"type": "error", "error": {"type": "api_error"}}, "server"),
    ({"type": "error", "error": {"type": "timeout_error"}}, "server"),
    ({"type": "error", "error": {"type": "invalid_request_error"}}, "client"),
    ({"type": "error", "error": {"type": "rate_limit_error"}}, "quota"),
    ({"error": {"type": "server_error", "code": None}}, "server"),
    ({"error": {"type": "invalid_request_error", "code": "context_length_exceeded"}},
     "client"),
    ({"error": {"type": "BadRequestError", "code": 400}}, "client"),  # vLLM's
    ({"error": {"type": "InternalServerError", "code": 500}}, "server"),
    ({"error": {"message": "no type at all"}}, "server"),
    ({"type": "error", "code": "server_error", "message": "x"}, "server"),  # Responses
    ({"type": "error", "code": "rate_limit_exceeded"}, "quota"),
    ({"type": "response.failed", "response": {"error": {"code": "invalid_prompt"}}},
     "client"),
    ({"type": "response.failed", "response": {"error": None}}, "server"),
    ({"error": {"message": "x", "type": "insufficient_quota", "code": "insufficient_quota"}},
     "quota"),
    ({"error": {"message": "x", "type": None, "code": "503"}}, "server"),
    ({"error": {"message": "x", "type": "invalid_request_error", "code": "429"}}, "quota"),
    ({"error": {"type": "BadRequestError", "status": "400"}}, "client"),
    ({"error": {"type": "x", "code": "\uff15\uff10\uff13"}}, "client"),  # fullwidth "503": a name
    ({"error": "upstream model crashed"}, "server"),
])
def test_which_error_events_are_the_upstreams(event: dict, side: str) -> None:
    from policies.usage import stream_error_side

    assert stream_error_side(event) == side


def test_the_meter_reads_the_first_error_event_and_response_failed_with_usage() -> None:
    """What the relay acts on: ``Meter.stream_error`` says the first error event's side,
    whether the event is a Responses ``response.failed`` carrying its usage (parsed for the
    usage, and still a failure) or an Anthropic ``error`` followed by another."""
    from multidict import CIMultiDict

    from policies.usage import MESSAGES, RESPONSES, Meter

    headers = CIMultiDict({"Content-Type": "text/event-stream"})
    failed = sse({"type": "response.failed", "sequence_number": 2, "response": {
        "id": "resp_1", "status": "failed", "error": {"code": "server_error", "message": "x"},
        "usage": {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}}},
        "response.failed")
    meter = Meter(RESPONSES, anthropic=False, strip_usage=False)
    meter.start(200, headers)
    for event in _responses_failed("server_error")[:2]:
        assert meter.chunk(event) == event
    assert meter.stream_error is None and not meter.failed
    assert meter.chunk(failed) == failed
    assert (meter.stream_error, meter.failed, meter.final) == ("server", True, True)
    assert (meter.usage.input_tokens, meter.usage.output_tokens) == (9, 4)

    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    meter.start(200, headers)
    stream = b"".join(anthropic_failing("overloaded_error")
                      + anthropic_failing("invalid_request_error")[3:])
    assert meter.chunk(stream) == stream
    assert meter.stream_error == "server"


@pytest.mark.parametrize("event, side", [
    (b"event: error\ndata: overloaded\n\n", "server"),
    (b"event: error\r\ndata: overloaded\r\n\r\n", "server"),  # a CRLF stream
    (b"id: 7\nevent:error\ndata: {\"type\": \"ping\"}\n\n", "server"),
    (b'event: error\ndata: {"error": {"type": "invalid_request_error"}}\n\n', "client"),
    (b'event: error\ndata: {"error": {"type": "rate_limit_error"}}\n\n', "quota"),
    (b'event: ping\ndata: {"type": "ping", "note": "error"}\n\n', None),
    (b'event: errors\ndata: not json\n\n', None),
])
def test_the_meter_reads_any_anthropic_event_named_error(event: bytes, side: str | None) -> None:
    """The anthropic SDK raises on every event named ``error``, whatever its data: the
    meter fails the stream on each, with the side its error object names, else the
    server's; an event named otherwise is read by its data."""
    from multidict import CIMultiDict

    from policies.usage import MESSAGES, Meter

    stream = b"".join(anthropic_failing("overloaded_error")[:3])
    if b"\r" in event:
        stream = stream.replace(b"\n", b"\r\n")
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    meter.start(200, CIMultiDict({"Content-Type": "text/event-stream"}))
    assert meter.chunk(stream + event) == stream + event
    assert (meter.stream_error, meter.failed) == (side, side is not None)
    assert meter.usage.input_tokens == 20


@pytest.mark.parametrize("kind, event, side", [
    ("chat", {"error": {"type": "server_error"},
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
     "server"),
    ("chat", {"error": {"type": "requests", "code": "rate_limit_exceeded"},
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
     "quota"),
    ("messages", {"type": "error", "error": {"type": "overloaded_error"},
                  "usage": {"output_tokens": 3}}, "server"),
    ("responses", {"type": "error", "code": "server_error",
                   "usage": {"input_tokens": 1, "output_tokens": 1}}, "server"),
], ids=["chat", "chat_quota", "messages", "responses"])
def test_an_error_event_carrying_usage_fails_the_stream(kind: str, event: dict,
                                                        side: str) -> None:
    """An error event that also reports usage is parsed for the usage, and read as the
    error event it is (the SDKs raise on it): before, it was taken for a usage event only
    and the stream counted as a success."""
    from multidict import CIMultiDict

    from policies.usage import CHAT, MESSAGES, RESPONSES, Meter

    endpoint = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}[kind]
    meter = Meter(endpoint, anthropic=kind == "messages", strip_usage=True)
    meter.start(200, CIMultiDict({"Content-Type": "text/event-stream"}))
    data = sse(event, "error" if kind == "messages" else None)
    assert meter.chunk(data) == data  # the SDK must see it: not stripped as a usage chunk
    assert (meter.stream_error, meter.failed) == (side, True)


async def test_a_stream_the_upstream_cuts_is_a_failure_too(start_sluice, failing) -> None:
    """A stream whose connection the upstream drops mid-answer (after HTTP 200 and some
    events, no error event) was completed ``upstream_error`` while its breaker heard a
    success, from the status line: an upstream dying mid-stream never opened it. Two such
    streams now open a ``fail_max: 2`` breaker, as two error events do."""
    sluice = await start_sluice({"routes": [route(
        "anthropic", failing.url, protocol="anthropic", circuit_breaker=BREAKER)]})
    await _two_open_the_breaker(sluice, _claude, "anthropic_begun", {"x-cut": "1"})
    assert failing.seen == ["anthropic_begun"] * 2


async def test_a_half_open_probe_that_streams_is_judged_by_its_status_line(
        start_sluice, failing) -> None:
    """The probe's verdict waited for its stream's end: a probe streaming slowly (here, never
    ending) held the breaker half-open, every other call refused ``circuit_open`` ("a probe
    is in flight") for as long as ``timeouts.total`` (a hostile review). The probe is judged
    by its status line, as before streams were: its 200 closes the breaker at once."""
    sluice = await start_sluice({"routes": [route(
        "anthropic", failing.url, protocol="anthropic",
        circuit_breaker={"fail_max": 2, "reset_timeout": "300ms"})]})
    url = sluice.url + "/anthropic/v1/messages"
    body = {"model": "claude-x", "max_tokens": 10, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        for _ in range(2):  # two 500s open the breaker
            async with session.post(url, json=body, headers={"x-status": "500"}) as r:
                assert r.status == 500
        async with session.post(url, json=body, headers={"x-status": "200"}) as r:
            assert r.headers["X-Sluice-Reason"] == "circuit_open"
        await asyncio.sleep(0.5)  # past reset_timeout: the next call is the probe
        async with session.post(url, json=body, headers={
                "x-shape": "anthropic_begun", "x-linger": "1"}) as probe:
            assert probe.status == 200
            await probe.content.readuntil(b"hello there")  # its stream is under way
            async with session.post(url, json=body, headers={"x-status": "200"}) as r:
                assert r.status == 200, r.headers.get("X-Sluice-Reason")


@pytest.fixture(params=["memory", "redis"])
def probe_state(request: pytest.FixtureRequest) -> Iterator[dict[str, object]]:
    """The route's state: this process's memory, or the shared Redis (``REDIS_URL``) under a
    key prefix of its own, deleted afterwards (skipped where no Redis answers, unless
    ``CI=true``)."""
    if request.param == "memory":
        yield {}
        return
    url = require_redis()
    prefix = f"probe-{uuid.uuid4().hex[:12]}"
    try:
        yield {"state": {"backend": "redis", "redis_url": url, "key_prefix": prefix,
                         "timeout": f"{int(TEST_TIMEOUT_S * 1000)}ms"}}
    finally:
        delete_prefix(url, prefix)


@pytest.mark.parametrize("fails", ["error_event", "cut"])
async def test_a_probe_whose_stream_fails_opens_the_breaker_again(
        start_sluice, failing, probe_state, fails) -> None:
    """An upstream that answers every stream 200, then fails it (an ``overloaded_error``
    event, or its connection dropped mid-answer): the half-open probe, judged by its status
    line, closed the breaker, and its stream's failure was heard by nobody, so every
    ``reset_timeout`` let ``fail_max`` more calls reach the failing upstream. The probe's
    stream failing now opens the breaker again at once, for another ``reset_timeout``: the
    next call is refused ``circuit_open`` and never reaches the upstream."""
    sluice = await start_sluice({**probe_state, "routes": [route(
        "anthropic", failing.url, protocol="anthropic",
        circuit_breaker={"fail_max": 2, "reset_timeout": "2s"})]})
    url = sluice.url + "/anthropic/v1/messages"
    body = {"model": "claude-x", "max_tokens": 10, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    failed = {"x-shape": "overloaded"} if fails == "error_event" else {
        "x-shape": "anthropic_begun", "x-cut": "1"}

    async def call(session: aiohttp.ClientSession) -> tuple[int, str | None]:
        async with session.post(url, json=body, headers=failed) as r:
            with contextlib.suppress(aiohttp.ClientPayloadError):  # a cut stream
                await r.read()
            return r.status, r.headers.get("X-Sluice-Reason")

    async with aiohttp.ClientSession() as session:
        assert [await call(session) for _ in range(2)] == [(200, None)] * 2
        await sluice.wait_metric("sluice_circuit_state", 2, route="anthropic")
        assert await call(session) == (503, "circuit_open")
        assert len(failing.seen) == 2
        await sluice.wait_metric("sluice_circuit_state", 1, route="anthropic")  # reset_timeout
        assert await call(session) == (200, None)  # the probe: its status line closes it...
        assert len(failing.seen) == 3
        # ... and its stream's failure opens it again, as a failed probe does.
        await sluice.wait_metric("sluice_circuit_state", 2, route="anthropic")
        assert await call(session) == (503, "circuit_open")
        assert await call(session) == (503, "circuit_open")
        assert len(failing.seen) == 3
        await sluice.wait_metric("sluice_circuit_state", 1, route="anthropic")
        assert await call(session) == (200, None)  # the next probe, one reset_timeout later
        assert len(failing.seen) == 4
        await sluice.wait_metric("sluice_circuit_state", 2, route="anthropic")
    # On Redis as on memory, though the cut stream's caller is cut too, during the record.
    await wait_until(lambda: len(_opened(sluice)) == 3, what="3 circuit_opened events")
    assert [e["cause"] for e in _opened(sluice)] == ["fail_max", "probe_failed", "probe_failed"]


def _opened(sluice) -> list[dict]:
    return [e for e in sluice.events() if e["event"] == "circuit_opened"]


async def test_every_breaker_the_probe_is_the_probe_of_opens_again(start_sluice,
                                                                   failing) -> None:
    """The route's breaker and the model's (``models:``), opened by the same two failed
    streams, let the same call through as their probe: its stream's failure opens both
    again, and the next call, refused, reaches nothing."""
    breaker = {"fail_max": 2, "reset_timeout": "2s"}
    sluice = await start_sluice({"routes": [route(
        "anthropic", failing.url, protocol="anthropic", circuit_breaker=breaker,
        models={"claude-x": {"circuit_breaker": breaker}})]})
    url = sluice.url + "/anthropic/v1/messages"
    body = {"model": "claude-x", "max_tokens": 10, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}

    async def call(session: aiohttp.ClientSession) -> tuple[int, str | None]:
        async with session.post(url, json=body, headers={"x-shape": "overloaded"}) as r:
            await r.read()
            return r.status, r.headers.get("X-Sluice-Reason")

    async def states(value: float) -> None:
        await sluice.wait_metric("sluice_circuit_state", value, route="anthropic")
        await sluice.wait_metric("sluice_operation_circuit_state", value, route="anthropic",
                                 operation="claude-x")

    async with aiohttp.ClientSession() as session:
        assert [await call(session) for _ in range(2)] == [(200, None)] * 2
        await states(2)
        await states(1)  # reset_timeout passed
        assert await call(session) == (200, None)  # the probe of both
        await states(2)
        assert await call(session) == (503, "circuit_open")
    assert len(failing.seen) == 3


@pytest.mark.parametrize("call", [_claude, _gpt], ids=["anthropic", "openai"])
async def test_a_probe_the_sdk_drops_on_its_error_event_opens_the_breaker_again(
        start_sluice, failing, call) -> None:
    """Through the official SDKs, which raise on the error event and close the stream
    there, perhaps before the upstream has ended it: the probe's failure is heard all the
    same (what the caller had seen included the event), and the next call is refused."""
    shape = "overloaded" if call is _claude else "chat_server"
    protocol = "anthropic" if call is _claude else "openai"
    sluice = await start_sluice({"routes": [route(
        protocol, failing.url, protocol=protocol,
        circuit_breaker={"fail_max": 2, "reset_timeout": "3s"})]})
    await _two_open_the_breaker(sluice, call, shape)  # (which waits for the event log)
    await sluice.wait_metric("sluice_circuit_state", 1, route=protocol)
    with pytest.raises((openai.APIError, anthropic.APIError)) as caught:
        await call(sluice, shape)  # the probe
    assert not _refused_open(caught.value)
    await sluice.wait_metric("sluice_circuit_state", 2, route=protocol)
    with pytest.raises((openai.APIError, anthropic.APIError)) as caught:
        await call(sluice, shape)
    assert _refused_open(caught.value)
    assert failing.seen == [shape] * 3
