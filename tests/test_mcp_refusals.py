"""The MCP refusal shape docs/mcp.md recommends fails exactly one call on every official client.

Real clients in their own processes (``bench/mcp_clients/``) talk to a real server
(``tests/mcp_servers.py``) through ``bench.mcp_refusals.RefusingProxy``, which refuses every
``tools/call`` of ``send``. Each session has two slow calls in flight when ``send`` is refused,
then calls ``add``. All sessions run at once (one proxy each); the 2.x Python ones in this
process: 10 to 20 s on two busy cores, most of it the client processes' start.

The 2.x Python client always runs (the ``test`` extra installs it). The 1.x Python client runs
when ``.venv-mcp1`` exists, the TypeScript clients when ``node`` and ``.mcp-ts`` do (``.ci/run``
sets both up; ``bench/mcp_refusals.py`` says how by hand); otherwise those cases are skipped.
The whole matrix (every shape, both server modes) is ``python -m bench mcp_refusals``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import mcp  # noqa: F401
import pytest

# Imported here, not in the fixture's event loop: the import takes a second or two of CPU,
# which would stall the proxies that other sessions' calls go through.
import bench.mcp_clients.client  # noqa: F401
from bench.mcp_refusals import CLIENTS, RECOMMENDED, ClientSpec, RefusingProxy, Run, run_client
from tests.mcp_servers import McpServer, run_mcp_server

SLOW_S = 1.0
#: A call still unanswered after this is given up on (the 1.x client's lost calls).
CALL_TIMEOUT_S = 3.0

#: (client, shape) sessions the tests look at; they all run at once, before the first test.
SESSIONS = [(c.name, RECOMMENDED) for c in CLIENTS] + [("py-mcp1", "429-json")]


async def _run_all(server: McpServer, wanted: list[tuple[ClientSpec, str]]) -> list[Run]:
    proxies = [RefusingProxy(server.url) for _ in wanted]
    for proxy in proxies:
        await proxy.start()
    try:
        return await asyncio.gather(*(run_client(spec, proxy, server, shape, slow_s=SLOW_S,
                                                 call_timeout_s=CALL_TIMEOUT_S, in_process=True)
                                      for (spec, shape), proxy in zip(wanted, proxies,
                                                                      strict=True)))
    finally:
        for proxy in proxies:
            await proxy.stop()


@pytest.fixture(scope="module")
def sessions(
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Run | str]]:
    """``{(client, shape): Run}``, or the reason a client cannot run here."""
    specs = {c.name: c for c in CLIENTS}
    out: dict[tuple[str, str], Run | str] = {}
    wanted = []
    for name, shape in SESSIONS:
        missing = specs[name].available()
        if missing:
            out[name, shape] = missing
        else:
            wanted.append((specs[name], shape))
    count_file = tmp_path_factory.mktemp("mcp") / "sends.jsonl"
    with run_mcp_server("stateless", count_file=count_file) as server:
        runs = asyncio.run(_run_all(server, wanted))
    for (spec, shape), run in zip(wanted, runs, strict=True):
        out[spec.name, shape] = run
    yield out


def _run(sessions: dict[tuple[str, str], Run | str], client: str, shape: str) -> Run:
    run = sessions[client, shape]
    if isinstance(run, str):
        pytest.skip(f"{client}: {run}")
    return run


@pytest.mark.parametrize("client", [c.name for c in CLIENTS])
def test_recommended_refusal_fails_only_that_call(sessions: dict, client: str) -> None:
    run = _run(sessions, client, RECOMMENDED)
    assert run.one_call_failed(), run.effect()
    error = run.result["calls"]["refused"]["error"]
    assert error["code"] == 429
    assert error["data"] == {"reason": "rate_limited", "retryAfterMs": 1000}
    assert run.refused_posts == 1  # no client retries a refused call on its own
    assert run.sends_executed == 0


def test_mcp1_client_loses_the_session_on_an_http_error_status(sessions: dict) -> None:
    """Why the recommendation is HTTP 200: a 429 tears down a 1.x session, in-flight calls too."""
    run = _run(sessions, "py-mcp1", "429-json")
    calls = run.result["calls"]
    assert not run.one_call_failed()
    assert "HTTPStatusError" in str(run.result["session_error"])
    assert calls["slow_1"]["outcome"] != "ok" and calls["slow_2"]["outcome"] != "ok"
    assert calls.get("after", {}).get("outcome") != "ok"
