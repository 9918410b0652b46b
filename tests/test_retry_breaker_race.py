"""A retry the breaker refuses because it opened during the back-off (found by the storm demo)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.conftest import route

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}


async def test_breaker_opening_during_backoff_answers_circuit_open(upstream, start_sluice,
                                                                    tmp_path):
    # Every answer is a 503 asking for a 300 ms wait. Request A fails first and waits to
    # retry; request B fails 50 ms later, which opens the breaker (fail_max 2), so A's retry
    # is refused by the breaker after A's own failed answer was already let go.
    upstream.status = 503
    upstream.error_headers = {"retry-after-ms": "300"}
    sluice = await start_sluice({
        "dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
        "routes": [route("openai", upstream.url,
                         circuit_breaker={"fail_max": 2, "reset_timeout": "30s"},
                         retry={"attempts": 3, "backoff": {"base": "10ms", "max": "50ms"}})],
    })
    url = sluice.url + "/openai" + CHAT

    async def post(key: str, delay: str) -> tuple[int, aiohttp.typedefs.LooseHeaders]:
        async with aiohttp.ClientSession() as session, session.post(
            url, json=BODY, headers={"Idempotency-Key": key, "x-fake-delay": delay}
        ) as r:
            await r.read()
            return r.status, r.headers

    (status_a, headers_a), (status_b, headers_b) = await asyncio.gather(
        post("key-a", "0"), post("key-b", "0.05"))

    assert status_a == 503
    assert headers_a["X-Sluice-Reason"] == "circuit_open"
    assert headers_a["x-should-retry"] == "false"
    assert "X-Sluice-Dead-Letter" in headers_a
    assert status_b == 503 and headers_b["x-should-retry"] == "false"
    assert len(upstream.requests) == 2  # A's retry never reached the upstream
    assert "proxy error" not in sluice.stderr()
