"""A security trial's findings: each test failed on the code it was written against."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import raw_request, route

#: Budgets' clock: today 12:00 UTC, so no daily window rolls over mid-test.
NOON = {"SLUICE_TEST_NOW": str(int(time.time()) // 86400 * 86400 + 43200)}


# -- 1. metering read the path case-sensitively and with its ;parameters --

@pytest.mark.parametrize(("protocol", "target"), [
    ("openai", "/openai/V1/Chat/Completions"),
    ("openai", "/openai/v1/Chat/Completions"),
    ("openai", "/openai/v1/chat/completions;jsessionid=1"),
    ("openai", "/openai/v1;v=1/chat/completions"),
    ("anthropic", "/anthropic/v1/Messages"),
    ("anthropic", "/anthropic/v1/messages;jsessionid=1"),
])
async def test_a_path_spelled_as_case_folding_or_param_dropping_upstreams_route_is_metered(
        upstream, start_sluice, protocol, target) -> None:
    """Express and ASP.NET Core route ``/v1/Chat/Completions``, Tomcat and Spring
    ``/v1/chat/completions;jsessionid=1``, as the chat endpoint, and ``endpoints:`` patterns
    read them so (policies.paths), but metering compared the path as sent: a 5,000-token
    call passed a 1,000-token daily budget unmetered (no reservation, no charge)."""
    sluice = await start_sluice({"routes": [route(
        protocol, upstream.url, protocol=protocol,
        budget={"tokens": "1000/day", "per": "tenant"})]}, env=NOON)
    body = json.dumps({"model": "m", "max_tokens": 5000,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    answer = await raw_request(sluice.port, (
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Tenant-ID: acme\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body)
    assert upstream.requests == [], f"served unmetered: {answer[:120]!r}"
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"X-Sluice-Reason: exceeds_limit" in answer
