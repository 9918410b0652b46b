"""One MCP client session, as ``bench/mcp_refusals.py`` drives it; works with ``mcp`` 1.x and 2.x.

    python client.py URL MODE SLOW_S [notify|plain] [CALL_TIMEOUT_S]

``MODE`` is ``legacy`` or ``auto`` (``mcp`` 2.x ``Client(mode=...)``; 1.x only speaks the
handshake era and ignores it). The session: two ``slow(SLOW_S)`` calls start, 0.3 s later
``send`` is called (the proxy refuses it), then, once both slow calls are over, ``add(1, 2)``
shows whether the session still works. ``run_session()`` does the same in the caller's process
and returns the object. With ``notify``, the session first calls the ``notify`` tool (a
notification on the GET stream). Each call has its own limit, 6 s unless given. Prints one JSON
object:
``{"client", "calls": {"slow_1", "slow_2", "refused", "after"}, "session_error", "elapsed_s"}``
where each call is ``{"outcome": "ok" | "raised" | "timeout" | "cancelled" | "pending", "at_s",
"error": {"type", "code", "message", "data"}}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from importlib.metadata import version
from typing import Any

DEFAULT_CALL_TIMEOUT_S = 6.0
MCP_VERSION = version("mcp")


def describe(exc: BaseException) -> dict[str, Any]:
    """The exception as a caller sees it: class, JSON-RPC code and data when it carries them."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [describe(e) for e in exc.exceptions]
        return {"type": type(exc).__name__, "message": str(exc)[:200], "leaves": leaves}
    error = getattr(exc, "error", None)
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "code": getattr(error, "code", None),
        "message": (getattr(error, "message", None) or str(exc))[:200],
        "data": getattr(error, "data", None),
    }


class Session:
    """One scripted session; ``calls`` fills in as the calls end."""

    def __init__(self, slow_s: float, notify: bool, call_timeout_s: float) -> None:
        self.slow_s, self.notify, self.call_timeout_s = slow_s, notify, call_timeout_s
        self.t0 = time.monotonic()
        self.calls: dict[str, dict[str, Any]] = {}
        self.tasks: list[asyncio.Task[None]] = []

    async def call(self, call_tool: Any, key: str, name: str, args: dict[str, Any]) -> None:
        self.calls[key] = {"outcome": "pending"}
        try:
            result = await asyncio.wait_for(call_tool(name, args), self.call_timeout_s)
        except TimeoutError:
            self.calls[key] = {"outcome": "timeout"}
        except asyncio.CancelledError:
            self.calls[key] = {"outcome": "cancelled"}
            raise
        except BaseException as exc:
            self.calls[key] = {"outcome": "raised", "error": describe(exc)}
        else:
            is_error = getattr(result, "is_error", getattr(result, "isError", None))
            self.calls[key] = {"outcome": "ok", "is_error": is_error}
        self.calls[key]["at_s"] = round(time.monotonic() - self.t0, 2)

    async def scenario(self, call_tool: Any) -> None:
        if self.notify:
            await self.call(call_tool, "notify", "notify", {})
        for key in ("slow_1", "slow_2"):
            self.tasks.append(asyncio.create_task(
                self.call(call_tool, key, "slow", {"seconds": self.slow_s})))
        await asyncio.sleep(0.3)
        await self.call(call_tool, "refused", "send", {"to": "alice", "body": "hello"})
        await asyncio.gather(*self.tasks)
        await self.call(call_tool, "after", "add", {"a": 1, "b": 2})

    async def connect_and_run(self, url: str, mode: str) -> None:
        if MCP_VERSION.startswith("1."):
            from mcp import ClientSession
            from mcp.client.streamable_http import streamablehttp_client

            async with (streamablehttp_client(url) as (read, write, _),
                        ClientSession(read, write) as s):
                await s.initialize()
                await self.scenario(s.call_tool)
        else:
            from mcp import Client

            async with Client(url, mode=mode) as c:
                await self.scenario(c.call_tool)


async def run_session(url: str, mode: str, slow_s: float, notify: bool = False,
                      call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> dict[str, Any]:
    """Run the scenario against ``url``; the object ``main()`` prints."""
    session = Session(slow_s, notify, call_timeout_s)
    session_error = None
    try:
        await session.connect_and_run(url, mode)
    except BaseException as exc:  # the session itself failed: record how, then the calls' fate
        session_error = describe(exc)
    if session.tasks:
        await asyncio.wait(session.tasks, timeout=call_timeout_s)
    return {
        "client": f"python mcp {MCP_VERSION}" + (f" mode={mode}" if MCP_VERSION[0] != "1" else ""),
        "calls": session.calls,
        "session_error": session_error,
        "elapsed_s": round(time.monotonic() - session.t0, 2),
    }


def main() -> None:
    url, mode, slow_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    timeout = float(sys.argv[5]) if len(sys.argv) > 5 else DEFAULT_CALL_TIMEOUT_S
    result = asyncio.run(run_session(url, mode, slow_s, sys.argv[4:5] == ["notify"], timeout))
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
