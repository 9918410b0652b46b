"""``rate.tokens`` end to end: requests weighted by their reserved tokens, 429
``token_rate_limited`` with an honest Retry-After, 400 for a request that can never fit."""

from __future__ import annotations

import gzip
import json

import aiohttp
import openai
import pytest

from tests.conftest import route

MSG = [{"role": "user", "content": "hi"}]


async def test_token_rate_weighs_reserved_tokens(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, rate={"tokens": "1000/h"},
        usage={"default_max_tokens": 400, "write_max_tokens": False})]})
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                max_retries=0)
    for _ in range(2):  # ~420 reserved each (400 output + the estimated input)
        await client.chat.completions.create(model="gpt-test", messages=MSG)
    assert b"max_completion_tokens" not in upstream.requests[0].body  # not written in
    with pytest.raises(openai.RateLimitError) as limited:
        await client.chat.completions.create(model="gpt-test", messages=MSG)
    headers = limited.value.response.headers
    assert limited.value.code == "token_rate_limited"
    assert headers["RateLimit-Policy"] == '"tokens";q=1000;w=3600'
    # r: the tokens left now, under this request's ~420 (it was always 0, read as "spent")
    left = int(headers["RateLimit"].split(";r=")[1].split(";")[0])
    assert 100 < left < 420, headers["RateLimit"]
    # the bucket drains 1000 tokens an hour; ~260 more must drain: about 15 minutes
    assert 600 < int(headers["Retry-After"]) < 1200
    assert headers["x-should-retry"] == "false"
    # a smaller request still fits: the limit is in tokens, not requests
    await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=50)
    with pytest.raises(openai.BadRequestError) as never:
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=5000)
    assert never.value.code == "exceeds_limit"
    assert never.value.response.headers["x-should-retry"] == "false"
    assert len(upstream.requests) == 3
    await client.close()


async def test_a_compressed_request_body_is_refused_with_a_reason_where_tokens_are_limited(
        upstream, start_sluice):
    """A gzip body on a token-limited route is a 400 naming the coding (it cannot be read to
    reserve its tokens), not "the body is not JSON"; it never reaches the upstream."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, rate={"tokens": "100000/h"})]})
    body = gzip.compress(json.dumps({"model": "m", "messages": MSG, "max_tokens": 5}).encode())
    async with aiohttp.ClientSession() as session, session.post(
            sluice.url + "/openai/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as r:
        answer = await r.json()
        assert (r.status, r.headers["X-Sluice-Reason"]) == (400, "bad_request")
    assert "compressed (Content-Encoding: gzip); send it uncompressed" in (
        answer["error"]["message"])
    assert upstream.requests == []
