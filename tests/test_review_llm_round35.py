"""Hostile review, round 35, of the LLM paths through the official SDKs: each test failed on
the code it was written against."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator

import anthropic
import openai
import pytest
from aiohttp import web

from tests.conftest import completed_events, raw_request, route, serve_app
from tests.sse import anthropic_failing, sse

#: Budgets' clock: today 12:00 UTC, so no daily window rolls over mid-test.
NOON = {"SLUICE_TEST_NOW": str(int(time.time()) // 86400 * 86400 + 43200)}


def oai(sluice, tenant: str = "acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                              max_retries=0, default_headers={"X-Tenant-ID": tenant})


# -- 1. legacy Completions: each prompt of a list, and best_of, is billed its own output --

@pytest.mark.parametrize("shape", [
    {"prompt": [f"say {i}" for i in range(10)]},  # ten prompts, each up to max_tokens
    {"prompt": [[1, 2, 3]] * 10},  # ten prompts given as token ids
    {"prompt": "say it", "best_of": 10},  # ten completions generated, one returned
    {"prompt": ["a", "b"], "n": 5},  # two prompts, five choices each
], ids=["prompt-list", "token-prompt-list", "best_of", "prompts-times-n"])
async def test_completions_reserve_every_prompt_and_best_of_not_one_answer(
        upstream, start_sluice, shape) -> None:
    """OpenAI's ``/v1/completions`` takes a list of prompts and answers each with ``n``
    choices of up to ``max_tokens``; ``best_of`` generates that many server-side (billed) and
    returns ``n``. Sluice multiplied the cap by ``n`` only, so one call reserving 100 output
    tokens could bill 1,000: a 500-token budget let it through (then ran 500 over)."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, budget={"output_tokens": "500/day", "per": "tenant"})]},
        env=NOON)
    client = oai(sluice)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model="gpt-3.5-turbo-instruct", max_tokens=100,
                                        **shape)
    assert caught.value.code == "exceeds_limit"
    assert upstream.requests == []
    # One prompt of the same cap fits, as before.
    await client.completions.create(model="gpt-3.5-turbo-instruct", prompt="say it",
                                    max_tokens=100)
    assert len(upstream.requests) == 1
    await client.close()


# -- 2. a stream the upstream ends with an error event is charged what it used, not max_tokens --

_FAILING_STREAMS = {
    # Anthropic's overloaded_error after the answer began (HTTP 200, then an error event).
    "anthropic": anthropic_failing("overloaded_error", "Overloaded"),
    # The Responses API's error event.
    "responses": [
        sse({"type": "response.created", "sequence_number": 0, "response": {
            "id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress",
            "model": "gpt-x", "output": [], "usage": None}}, "response.created"),
        sse({"type": "response.output_text.delta", "sequence_number": 1, "item_id": "i",
             "output_index": 0, "content_index": 0, "delta": "hello there"},
            "response.output_text.delta"),
        sse({"type": "error", "sequence_number": 2, "code": "server_error",
             "message": "The server had an error", "param": None}, "error"),
    ],
    # A Chat Completions stream's error chunk, as the OpenAI SDK reads it.
    "chat": [
        sse({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-x",
             "choices": [{"index": 0, "delta": {"content": "hello there"},
                          "finish_reason": None}]}),
        sse({"error": {"message": "The server had an error", "type": "server_error"}}),
    ],
}


async def _failing_stream(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in _FAILING_STREAMS[request.headers["x-shape"]]:
        await response.write(event)
    await response.write_eof()
    return response


@pytest.mark.parametrize("shape", list(_FAILING_STREAMS))
async def test_a_stream_ended_by_an_error_event_is_charged_what_it_streamed(
        start_sluice, shape) -> None:
    """An upstream that gives up mid-stream says so in an error event (Anthropic's
    ``overloaded_error``, the Responses API's ``error``, a Chat chunk ``{"error": ...}``) and
    ends the stream cleanly. Sluice charged such a stream its whole reservation (5,000 output
    tokens for a few words, ``usage: reserved``, ignoring the 20 input tokens Anthropic
    reported), while the same stream cut by a reset is charged what it streamed: a tenant's
    budget drained by the provider's own overload errors."""
    app = web.Application()
    app.router.add_post("/{tail:.*}", _failing_stream)
    runner, port = await serve_app(app)
    try:
        protocol = "anthropic" if shape == "anthropic" else "openai"
        sluice = await start_sluice({"routes": [route(
            protocol, f"http://127.0.0.1:{port}", protocol=protocol,
            budget={"tokens": "100000/day", "per": "tenant"})]}, env=NOON)
        headers = {"X-Tenant-ID": "acme", "x-shape": shape}
        with pytest.raises(Exception):  # noqa: B017 - each SDK has its own error for it
            if shape == "anthropic":
                claude = anthropic.AsyncAnthropic(base_url=sluice.url + "/anthropic",
                                                  api_key="sk-ant-test", max_retries=0)
                async with claude.messages.stream(
                        model="claude-x", max_tokens=5000, extra_headers=headers,
                        messages=[{"role": "user", "content": "hi"}]) as stream:
                    async for _ in stream:
                        pass
                    await stream.get_final_message()
            else:
                client = oai(sluice)
                if shape == "responses":
                    stream = await client.responses.create(
                        model="gpt-x", input="hi", max_output_tokens=5000, stream=True,
                        extra_headers=headers)
                else:
                    stream = await client.chat.completions.create(
                        model="gpt-x", max_completion_tokens=5000, stream=True,
                        messages=[{"role": "user", "content": "hi"}], extra_headers=headers)
                async for event in stream:
                    if getattr(event, "type", None) == "error":
                        raise RuntimeError(event.message)
        [done] = await completed_events(sluice)
        assert done["usage"] == "estimated", done
        assert 1 <= done["output_tokens"] < 100, done
        if shape == "anthropic":
            assert done["input_tokens"] == 20  # as the upstream reported it
        await sluice.wait_metric("sluice_budget_reserved", 0, route=protocol, tenant="acme",
                                 unit="tokens")
        assert await sluice.metric("sluice_budget_remaining", route=protocol, tenant="acme",
                                   unit="tokens") == (
            100000 - done["input_tokens"] - done["output_tokens"])
    finally:
        await runner.cleanup()


async def _raw_chat(port: int, target: str) -> bytes:
    """A 5,000-token chat completion sent to ``POST target`` on a raw connection, as no
    client would spell it; Sluice's whole answer."""
    body = json.dumps({"model": "m", "max_tokens": 5000,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    return await raw_request(port, (
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)


# -- 3. a fragment in the request target skipped metering; the upstream got the metered path --

@pytest.mark.parametrize("target", ["/openai/v1/chat/completions#x",
                                    "/openai/v1/chat/completions#"])
async def test_a_fragment_in_the_target_is_refused_not_forwarded_unmetered(
        start_sluice, target) -> None:
    """``POST /openai/v1/chat/completions#x``: routing and metering read the target as sent
    (it does not end in ``/chat/completions``, so not metered), and the forwarded URL drops
    the fragment, so the upstream got ``POST /v1/chat/completions``: a 5,000-token call
    passed a 10-token daily budget (and any token rate) untouched. A fragment cannot stand in
    a request target (RFC 9112 §3.2), so it is refused, 400, and nothing is forwarded."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head.partition(b"\r\n")[0])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        sluice = await start_sluice({"routes": [route(
            "openai", f"http://127.0.0.1:{port}",
            budget={"tokens": "10/day", "per": "tenant"})]}, env=NOON)
        answer = await _raw_chat(sluice.port, target)
        assert seen == [], f"forwarded unmetered as {seen}"
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert b"X-Sluice-Reason: bad_request" in answer
    finally:
        server.close()


# -- 4. an encoded slash (%2F) in a metered path skipped metering on Starlette upstreams --

@contextlib.asynccontextmanager
async def _starlette_llm() -> AsyncIterator[tuple[int, list[str]]]:
    """An OpenAI- and Anthropic-shaped upstream on uvicorn + Starlette, the stack of vLLM,
    SGLang and the LiteLLM proxy (they route on the percent-decoded path): its port, and
    the raw paths its LLM handlers answered."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    served: list[str] = []

    async def llm(request: Request) -> JSONResponse:
        served.append(request.scope["raw_path"].decode())
        return JSONResponse({"id": "x", "object": "chat.completion", "choices": [],
                             "usage": {"prompt_tokens": 9, "completion_tokens": 4000,
                                       "input_tokens": 9, "output_tokens": 4000}})

    app = Starlette(routes=[Route("/v1/chat/completions", llm, methods=["POST"]),
                            Route("/v1/messages", llm, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield sock.getsockname()[1], served
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.mark.parametrize(("protocol", "target"), [
    ("openai", "/openai/v1/chat%2Fcompletions"),
    ("openai", "/openai/v1%2fchat%2Fcompletions"),
    ("anthropic", "/anthropic/v1%2Fmessages"),
])
async def test_an_encoded_slash_in_a_metered_path_is_never_served_unmetered(
        start_sluice, protocol, target) -> None:
    """``POST /openai/v1/chat%2Fcompletions``: Sluice left ``%2F`` encoded when it decided
    whether a call is metered (``policies.paths``: "data, not separators"), so the call was
    not metered; but uvicorn hands Starlette the decoded path and it routes
    ``/v1/chat/completions``: a 5,000-token call passed a 10-token daily budget and the
    upstream billed 4,000 output tokens that no budget, token rate or metric saw. It was
    metered then (400 ``exceeds_limit``); since a later review it is refused at the door
    (400 ``bad_request``), as its readings name chat and no endpoint (Express keeps
    ``%2F``): either way the upstream never serves it unmetered."""
    async with _starlette_llm() as (port, served):
        sluice = await start_sluice({"routes": [route(
            protocol, f"http://127.0.0.1:{port}", protocol=protocol,
            budget={"tokens": "10/day", "per": "tenant"})]}, env=NOON)
        answer = await _raw_chat(sluice.port, target)
        assert served == [], f"the upstream served it unmetered: {answer[:120]!r}"
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert b"X-Sluice-Reason: bad_request" in answer


# -- 5. Anthropic's OpenAI-compatible endpoint on an anthropic route went unmetered --

async def test_anthropics_openai_compatible_chat_endpoint_is_metered(upstream,
                                                                      start_sluice) -> None:
    """Anthropic serves the OpenAI SDK at ``/v1/chat/completions`` (its "OpenAI SDK
    compatibility", billed as any Claude call), but an ``anthropic`` route metered only
    ``/messages``: an agent pointing the OpenAI SDK at ``/anthropic/v1`` passed the route's
    budget with any ``max_tokens``, and its usage reached no metric or event."""
    sluice = await start_sluice({"routes": [route(
        "anthropic", upstream.url, protocol="anthropic",
        budget={"tokens": "1000/day", "per": "tenant"})]}, env=NOON)
    client = openai.AsyncOpenAI(base_url=sluice.url + "/anthropic/v1", api_key="sk-ant-test",
                                max_retries=0, default_headers={"X-Tenant-ID": "acme"})
    msg = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="claude-x", messages=msg, max_tokens=5000)
    assert caught.value.response.headers["X-Sluice-Reason"] == "exceeds_limit"
    assert upstream.requests == []
    await client.chat.completions.create(model="claude-x", messages=msg, max_tokens=50)
    [done] = await completed_events(sluice)
    assert (done["usage"], done["input_tokens"], done["output_tokens"]) == ("reported", 11, 5)
    await sluice.wait_metric("sluice_budget_reserved", 0, route="anthropic", tenant="acme",
                             unit="tokens")
    assert await sluice.metric("sluice_budget_remaining", route="anthropic", tenant="acme",
                               unit="tokens") == 1000 - 16
    await client.close()
