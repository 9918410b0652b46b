"""The fixture server of tests/mcp_servers.py, and policies/mcp.py on its real answers."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from policies.mcp import AnswerTracker, Outcome, answer_outcome, parse_post, rewrite_id
from tests.mcp_servers import McpServer, mcp_server_factory, mcp_stateless  # noqa: F401

HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
           "MCP-Protocol-Version": "2025-11-25"}


async def tool_call(server: McpServer, rpc_id: int, tool: str,
                    **arguments: Any) -> tuple[bytes, str]:
    """One raw ``tools/call`` POST (no session: the stateless server takes it as it is)."""
    body = orjson.dumps({"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
                         "params": {"name": tool, "arguments": arguments}})
    assert parse_post(body).tool == tool
    async with aiohttp.ClientSession() as s, s.post(server.url, data=body,
                                                    headers=HEADERS) as r:
        assert r.status == 200
        return await r.read(), r.headers["Content-Type"]


async def test_sse_answers_of_the_real_server(mcp_stateless: McpServer) -> None:  # noqa: F811
    answer, content_type = await tool_call(mcp_stateless, 11, "add", a=2, b=3)
    assert content_type.startswith("text/event-stream")
    tracker = AnswerTracker(content_type, 11)
    outcomes = [tracker.feed(answer[i:i + 5]) for i in range(0, len(answer), 5)]
    assert outcomes[-1] == Outcome() and tracker.complete_at == len(answer)
    replay = rewrite_id(answer, content_type, 11, "retry-1")
    assert answer_outcome(replay, content_type, "retry-1") == Outcome()
    assert answer_outcome(replay, content_type, 11) is None
    assert b'"text":"5"' in replay

    failed, _ = await tool_call(mcp_stateless, 12, "fail", message="no")
    assert answer_outcome(failed, content_type, 12) == Outcome(is_error_result=True)
    unknown, _ = await tool_call(mcp_stateless, 13, "no_such_tool")
    assert answer_outcome(unknown, content_type, 13).tool_failure


async def test_json_answers_and_the_send_count(mcp_server_factory) -> None:  # noqa: F811
    server = mcp_server_factory("stateless", json_response=True)
    for n in (1, 2):
        answer, content_type = await tool_call(server, n, "send", to=f"user{n}", body="hi")
        assert content_type.startswith("application/json")
        assert answer_outcome(answer, content_type, n) == Outcome()
    assert server.sends() == 2
    assert server.sent() == [{"to": "user1", "body": "hi"}, {"to": "user2", "body": "hi"}]
    count, content_type = await tool_call(server, 3, "sends")
    assert orjson.loads(count)["result"]["structuredContent"] == {"result": 2}
    server.reset_sends()
    assert server.sends() == 0
