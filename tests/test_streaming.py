"""Streams pass through as they arrive and byte for byte.

The fake upstream's ``stream_hold`` stops each stream after its first content event, so the
test can see that the client already holds that event while the upstream has not finished.
"""

from __future__ import annotations

import asyncio

import aiohttp
import anthropic
import openai

from tests.conftest import route

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
