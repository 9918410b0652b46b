"""A hostile review (round 35b) of three changes: retries holding budget, admission bounded
by the caller's deadline, and MCP calls closed early for polling held until their response
is resumed. Each case failed before its fix.

1. A call held for its polled answer whose client then closes its session (``DELETE``) was
   held on, with its slot, its key and its place in flight, until its ``timeouts.total``
   (600 s when none is set): nothing can resume its answer once the session is gone (the
   server answers a GET of it 404), so a tool limited to one call at a time refused every
   other session's call ``queue_full`` for ten minutes. It now ends when its session is
   closed, ``client_disconnected``.
"""

from __future__ import annotations

import aiohttp

from tests import mcp_servers
from tests.conftest import wait_until
from tests.test_review_mcp_round35 import _closed_for_polling, _completed

mcp_server_factory = mcp_servers.mcp_server_factory


async def test_a_polled_call_ends_when_its_session_is_closed(mcp_server_factory,
                                                             start_sluice):
    """Before: after the DELETE, ``sluice_polled_calls`` stayed 1 and the next session's
    ``poll`` was refused ``queue_full`` (held until the default 600 s bound)."""
    server = mcp_server_factory("session", resumable=True)
    sluice = await start_sluice({"routes": [{
        "name": "tools", "path_prefix": "/tools/", "upstream": server.base_url,
        "protocol": "mcp", "tools": {"poll": {"concurrency": {"limit": 1, "queue": 0}}}}]})
    url = sluice.url + "/tools/mcp"
    async with aiohttp.ClientSession() as http:
        headers = await mcp_servers.raw_session(http, url)
        await _closed_for_polling(http, url, headers, mcp_servers.tool_call(2, "poll",
                                                                            seconds=10))
        await sluice.wait_metric("sluice_polled_calls", 1)
        async with http.delete(url, headers=headers) as r:
            assert r.status < 300, r.status
        await sluice.wait_metric("sluice_polled_calls", 0, timeout=5)
        await sluice.wait_metric("sluice_inflight_requests", 0, route="tools")
        await wait_until(lambda: _completed(sluice, "poll"), what="the call's end")
        [ended] = _completed(sluice, "poll")
        assert ended["outcome"] == "client_disconnected", ended
        # Its slot is free: another session's call is sent, not refused queue_full.
        other = await mcp_servers.raw_session(http, url)
        await _closed_for_polling(http, url, other, mcp_servers.tool_call(3, "poll",
                                                                          seconds=0.1))
