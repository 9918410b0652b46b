"""Streams pass through as they arrive and byte for byte, and a caller that stops reading one
cannot hold it open past the route's timeouts.

The fake upstream's ``stream_hold`` stops each stream after its first content event, so the
test can see that the client already holds that event while the upstream has not finished.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from tests.conftest import route, serve_app, wait_until
from tests.fakeupstream import RawUpstream

MESSAGES = [{"role": "user", "content": "hi"}]
EXPECTED_TEXT = "".join(f"tok{i} " for i in range(5))


async def test_openai_first_chunk_arrives_before_the_upstream_finishes(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("openai", upstream.url, "openai")]})
    upstream.stream_hold = asyncio.Event()
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                max_retries=0)
    stream = await client.chat.completions.create(model="gpt-test", messages=MESSAGES,
                                                  stream=True)
    first = await anext(aiter(stream))
    assert first.choices[0].delta.content == "tok0 "
    assert upstream.inflight == 1 and upstream.completed == 0  # the upstream is mid-stream
    upstream.stream_hold.set()
    rest = [c.choices[0].delta.content async for c in stream if c.choices]
    assert "tok0 " + "".join(rest) == EXPECTED_TEXT
    assert upstream.completed == 1
    await client.close()


async def test_anthropic_first_delta_arrives_before_the_upstream_finishes(upstream,
                                                                          start_sluice):
    sluice = await start_sluice({"routes": [route("anthropic", upstream.url, "anthropic")]})
    upstream.stream_hold = asyncio.Event()
    client = anthropic.AsyncAnthropic(base_url=sluice.url + "/anthropic", api_key="sk-ant-test",
                                      max_retries=0)
    stream = await client.messages.create(model="claude-test", max_tokens=64,
                                          messages=MESSAGES, stream=True)
    events = aiter(stream)
    kinds = []
    while not kinds or kinds[-1] != "content_block_delta":
        kinds.append((await anext(events)).type)
    assert kinds == ["message_start", "content_block_start", "content_block_delta"]
    assert upstream.inflight == 1 and upstream.completed == 0
    upstream.stream_hold.set()
    rest = [event.type async for event in events]
    assert rest[-1] == "message_stop"
    assert upstream.completed == 1
    await client.close()


async def test_streamed_and_plain_answers_are_byte_identical_to_direct(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("openai", upstream.url, "openai"),
                                            route("anthropic", upstream.url, "anthropic")]})
    cases = [
        ("/openai", "/v1/chat/completions", {"model": "m", "messages": MESSAGES, "stream": True,
                                             "stream_options": {"include_usage": True}}),
        ("/openai", "/v1/chat/completions", {"model": "m", "messages": MESSAGES}),
        ("/anthropic", "/v1/messages", {"model": "c", "max_tokens": 8, "messages": MESSAGES,
                                        "stream": True}),
        ("/anthropic", "/v1/messages", {"model": "c", "max_tokens": 8, "messages": MESSAGES}),
    ]
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        for prefix, path, payload in cases:
            async with session.post(upstream.url + path, json=payload) as r:
                direct = await r.read()
                direct_type = r.headers["Content-Type"]
            async with session.post(sluice.url + prefix + path, json=payload) as r:
                assert r.status == 200
                assert r.headers["Content-Type"] == direct_type
                assert await r.read() == direct


async def test_a_caller_that_stops_reading_a_stream_is_cut_at_the_total_timeout(start_sluice):
    """A caller that kept its connection open and stopped reading a fast stream held its
    slot, its budget reservation and the upstream's stream past ``timeouts.total`` for as long
    as it kept the connection (the upstream's timer runs only while its answer is read, and
    nothing bounded a write waiting on the caller): a hostile trial's, still held minutes
    later. It is cut at ``timeouts.total`` as a caller that left, and charged what streamed."""
    event = "data: " + json.dumps({
        "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "y" * 1000}, "finish_reason": None}],
    }) + "\n\n"
    burst = event.encode() * 64
    ended = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:  # as fast as the reader takes it, until Sluice closes the stream
                await response.write(burst)
        except ConnectionError:
            return response
        finally:
            ended.set()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", endless)
    runner, port = await serve_app(app)
    writer = None
    try:
        sluice = await start_sluice({"routes": [route(
            "openai", f"http://127.0.0.1:{port}", "openai", timeouts={"total": "1s"},
            concurrency={"limit": 1},
            budget={"output_tokens": "1000000/day", "per": "tenant"})]})
        body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True,
                           "max_tokens": 100}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", sluice.port)
        writer.write(b"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nX-Tenant-ID: acme\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        # ... and nothing more is read: the connection stays open, its buffers fill.
        await sluice.wait_metric("sluice_inflight_requests", 0, timeout=30, route="openai")
        assert await sluice.metric("sluice_budget_reserved", route="openai", tenant="acme",
                                   unit="output_tokens") == 0
        await asyncio.wait_for(ended.wait(), 10)  # the upstream's stream was closed
        await wait_until(lambda: any(e["event"] == "completed" for e in sluice.events()),
                         what="the completed event")
        [done] = [e for e in sluice.events() if e["event"] == "completed"]
        assert (done["outcome"], done["status"], done["usage"]) == (
            "client_disconnected", 200, "estimated")
        assert 1 <= done["output_tokens"] <= 100
        assert "took too little of its streamed answer" in sluice.stderr()
    finally:
        if writer is not None:
            writer.close()
        await runner.cleanup()


async def test_a_close_delimited_stream_the_upstream_resets_is_cut_not_stored(start_sluice):
    """An answer without Content-Length or chunked framing ends when its connection closes,
    and aiohttp reads a reset (an abortive close: the upstream died mid-answer) as that end
    too: the truncated stream reached the caller with a clean end, was charged as complete
    and was stored for its key, every retry getting it replayed. A reset is now a cut."""
    event = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
             b'"choices":[{"index":0,"delta":{"content":"hello"}}]}\n\n')
    seen = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.partition(b":")[2]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        seen.append(head)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n" + event * 3)
        await writer.drain()
        await asyncio.sleep(0.1)
        # Closed with SO_LINGER 0: a reset, not a FIN (the end of a close-delimited answer).
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                   struct.pack("ii", 1, 0))
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        sluice = await start_sluice({"routes": [route(
            "openai", f"http://127.0.0.1:{port}", "openai", idempotency={"mode": "dedup"},
            budget={"output_tokens": "1000000/day", "per": "tenant"})]})
        payload = {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 100}
        headers = {"Idempotency-Key": "reset-mid-stream"}
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(sluice.url + "/openai/v1/chat/completions",
                                        json=payload, headers=headers) as r:
                    assert r.status == 200 and "Idempotent-Replayed" not in r.headers
                    received = bytearray()
                    try:
                        async for chunk in r.content.iter_any():
                            received += chunk
                        ended = "cleanly"
                    except aiohttp.ClientPayloadError:
                        ended = "cut"
                    assert (ended, bytes(received)) == ("cut", event * 3)
        assert len(seen) == 2  # nothing was stored: the retry went upstream
        await wait_until(lambda: len([e for e in sluice.events()
                                      if e["event"] == "completed"]) == 2,
                         what="both completed events")
        done = [e for e in sluice.events() if e["event"] == "completed"]
        assert {(e["outcome"], e["usage"]) for e in done} == {("upstream_error", "estimated")}
    finally:
        server.close()
        await server.wait_closed()


_CHAT_EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
               b'"choices":[{"index":0,"delta":{"content":"hello"}}]}\n\n')
_MESSAGES_EVENT = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                   b'"delta":{"type":"text_delta","text":"hello"}}\n\n')
_RESPONSES_EVENT = (b'event: response.output_text.delta\ndata: {"type":'
                    b'"response.output_text.delta","delta":"hello"}\n\n')
#: (protocol, path, a content event, the stream's last event as its API defines it)
_STREAM_ENDS = {
    "chat": ("openai", "/v1/chat/completions", _CHAT_EVENT, b"data: [DONE]\n\n"),
    "messages": ("anthropic", "/v1/messages", _MESSAGES_EVENT,
                 b'event: message_stop\ndata: {"type":"message_stop"}\n\n'),
    "responses": ("openai", "/v1/responses", _RESPONSES_EVENT,
                  b'event: response.completed\ndata: {"type":"response.completed","response":'
                  b'{"id":"r","status":"completed","usage":null}}\n\n'),
}


async def _sent_twice(start_sluice, protocol: str, path: str, payload: dict, body: bytes,
                      framing: str, key: str) -> tuple[int, list[str | None]]:
    """Send ``payload`` twice under the idempotency key ``key`` through a ``dedup`` route to
    an upstream that answers every request with the SSE ``body`` (framed by a
    ``Content-Length``, or ``chunked`` with its last chunk): how many requests reached the
    upstream, and each answer's ``Idempotent-Replayed``."""
    framed = (b"Content-Length: %d\r\n\r\n%s" % (len(body), body) if framing == "length"
              else b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
              % (len(body), body))
    upstream = await RawUpstream(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + framed).start()
    try:
        sluice = await start_sluice({"routes": [route(
            "llm", upstream.url, protocol, idempotency={"mode": "dedup"})]})
        replayed = []
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(sluice.url + "/llm" + path, json=payload,
                                        headers={"Idempotency-Key": key}) as r:
                    assert (r.status, await r.read()) == (200, body)
                    replayed.append(r.headers.get("Idempotent-Replayed"))
        return len(upstream.requests), replayed
    finally:
        await upstream.stop()


@pytest.mark.parametrize("framing", ["chunked", "length"])
@pytest.mark.parametrize("ended", [True, False], ids=["with_last_event", "without"])
@pytest.mark.parametrize("api", sorted(_STREAM_ENDS))
async def test_a_stream_ended_cleanly_before_its_last_event_is_not_replayed(
        start_sluice, api, ended, framing):
    """A stream an upstream ends cleanly (its chunked framing's last chunk, or its
    Content-Length reached) before the API's last event (a proxy in front of it giving up
    mid-answer) reaches the caller as an end the SDKs raise nothing on; it was kept for its
    idempotency key, and every retry with the key got the part replayed for the key's ttl.
    Now only a stream whose answer ended is kept: without it the retry goes upstream. One
    rule for both framings (a review: the buffered path kept it)."""
    protocol, path, event, last = _STREAM_ENDS[api]
    payload = {"model": "m", "stream": True, "max_tokens": 100}
    payload["input" if api == "responses" else "messages"] = MESSAGES
    sent = await _sent_twice(start_sluice, protocol, path, payload,
                             event * 3 + (last if ended else b""), framing,
                             f"clean-end-{api}-{ended}-{framing}")
    assert sent == ((1, [None, "true"]) if ended else (2, [None, None]))


def _chat_chunk(delta: bytes, finish: bytes = b"null") -> bytes:
    return (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":' + delta + b',"finish_reason":' + finish
            + b"}]}\n\n")


@pytest.mark.parametrize("framing", ["chunked", "length"])
async def test_a_whole_chat_stream_without_done_is_replayed(start_sluice, framing):
    """A review: servers that never send ``data: [DONE]`` exist (older llama.cpp,
    text-generation-inference, mistral.rs); a stream of theirs whose choice has its
    ``finish_reason`` (here with spaces, as some write JSON) is a whole answer, kept for
    its key, whatever its framing."""
    body = (_chat_chunk(b'{"role":"assistant","content":"hello"}')
            + _chat_chunk(b"{}", b' "stop"').replace(b'"finish_reason":', b'"finish_reason" :'))
    payload = {"model": "m", "stream": True, "max_tokens": 100, "messages": MESSAGES}
    assert await _sent_twice(start_sluice, "openai", "/v1/chat/completions", payload, body,
                             framing, f"whole-{framing}") == (1, [None, "true"])
