"""``bench/upstream.py``, the offline provider the README points routes at, through the SDKs.

Seen (new-user trial): it answered every POST as an OpenAI chat completion, so the anthropic
SDK behind Sluice's ``anthropic`` route parsed ``content=None`` and Sluice charged the whole
reservation (``usage: reserved``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import anthropic
import openai

from bench.upstream import build_app
from tests.conftest import completed_events, route, serve_app

MESSAGES = [{"role": "user", "content": "hi"}]
TEXT = "Hello! How can I help you today?"


async def test_the_anthropic_and_openai_sdks_parse_its_answers_plain_and_streamed(
        start_sluice):
    runner, port = await serve_app(build_app(0.0))
    try:
        upstream = f"http://127.0.0.1:{port}"
        sluice = await start_sluice({"routes": [route("anthropic", upstream, "anthropic"),
                                                route("openai", upstream, "openai")]})
        ant = anthropic.AsyncAnthropic(base_url=sluice.url + "/anthropic",
                                       api_key="sk-ant-offline", max_retries=0)
        message = await ant.messages.create(model="claude-haiku-4-5", max_tokens=64,
                                            messages=MESSAGES)
        assert [(block.type, block.text) for block in message.content] == [("text", TEXT)]
        assert (message.role, message.stop_reason) == ("assistant", "end_turn")
        assert (message.usage.input_tokens, message.usage.output_tokens) == (19, 9)
        async with ant.messages.stream(model="claude-haiku-4-5", max_tokens=64,
                                       messages=MESSAGES) as stream:
            assert "".join([t async for t in stream.text_stream]) == TEXT
            streamed = await stream.get_final_message()
        assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (19, 9)
        await ant.close()

        oai = openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-offline",
                                 max_retries=0)
        completion = await oai.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
        assert completion.choices[0].message.content == TEXT
        chunks = [c async for c in await oai.chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES, stream=True,
            stream_options={"include_usage": True})]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9
        await oai.close()

        events = await completed_events(sluice, 4)
        assert [(e["route"], e["input_tokens"], e["output_tokens"], e["usage"])
                for e in events] == [("anthropic", 19, 9, "reported")] * 2 + [
                    ("openai", 19, 9, "reported")] * 2
    finally:
        await runner.cleanup()


async def test_its_delay_holds_back_both_shapes():
    runner, port = await serve_app(build_app(0.2))
    try:
        async with aiohttp.ClientSession() as session:
            for path, field in (("/v1/messages", "content"), ("/v1/chat/completions",
                                                              "choices")):
                started = time.monotonic()
                async with session.post(f"http://127.0.0.1:{port}{path}",
                                        json={"messages": MESSAGES}) as r:
                    answer = await r.json()
                assert time.monotonic() - started >= 0.19, path
                assert r.status == 200 and field in answer, answer
    finally:
        await runner.cleanup()


def test_a_port_taken_is_said_in_one_line() -> None:
    """A new user's trial: with the port taken it died with a 15-line traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "bench/upstream.py", "--port", str(port)],
                              capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).parent.parent)
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith(f"upstream.py: cannot listen on 127.0.0.1:{port} (")
    assert line.endswith("address already in use); pick another --port")
