"""An MCP server on the official Python SDK 1.x (FastMCP; run it with ``.venv-mcp1``) with one
tool, ``send_after``: it waits ``seconds``, then records its side effect (a line in the count
file); cancelled while it waits, it records the cancel instead (``<count>.cancels``).

Usage: ``python mcp1_cancel_server.py session|stateless COUNT_FILE [json]``; prints
``PORT <n>`` once it listens on 127.0.0.1."""

import asyncio
import json
import socket
import sys
from pathlib import Path


def main() -> None:
    import uvicorn
    from mcp.server.fastmcp import FastMCP

    mode, count = sys.argv[1], Path(sys.argv[2])
    json_response = len(sys.argv) > 3 and sys.argv[3] == "json"
    server = FastMCP("cancels", stateless_http=(mode == "stateless"),
                     json_response=json_response)
    cancels = count.with_suffix(".cancels")

    @server.tool()
    async def send_after(to: str, seconds: float = 2.0) -> str:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            with cancels.open("a") as f:
                f.write(to + "\n")
            raise
        with count.open("a") as f:
            f.write(json.dumps({"to": to}) + "\n")
        return f"sent #{sum(1 for _ in count.read_text().splitlines())}"

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(server.streamable_http_app(), log_level="warning",
                                       lifespan="on"))

    async def run() -> None:
        async def announce() -> None:
            while not uv.started:
                await asyncio.sleep(0.01)
            print(f"PORT {sock.getsockname()[1]}", flush=True)

        announcing = asyncio.ensure_future(announce())
        await uv.serve(sockets=[sock])
        announcing.cancel()

    asyncio.run(run())


if __name__ == "__main__":
    main()
