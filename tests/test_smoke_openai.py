"""The official openai SDK through Sluice: plain and streamed chat completions."""

from __future__ import annotations

import openai

from tests.conftest import route


async def test_plain_and_streamed_chat_completion(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("openai", upstream.url)]})
    client = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                                max_retries=0)
    reply = await client.chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "hello from fake"
    assert reply.usage.total_tokens == 16

    stream = await client.chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": "hi"}], stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "".join(f"tok{i} " for i in range(upstream.chunks))
    assert [r.path_qs for r in upstream.requests] == ["/v1/chat/completions"] * 2
    assert upstream.requests[0].headers["Authorization"] == "Bearer sk-test"
    await client.close()
