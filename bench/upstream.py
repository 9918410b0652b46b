"""A minimal OpenAI-style upstream for the benchmarks: aiohttp + uvloop, one process.

Every POST answers 200 with the same small chat-completion JSON (``Content-Length`` set, so a
proxy may read it whole), after ``--delay`` seconds. With ``--slots N`` at most N requests are
served at once and the rest wait in its FIFO queue, unbounded, as a server with N workers
does; a caller that gives up (closes its connection) leaves the queue, or cuts its request
short. ``GET /_stats`` answers ``{"served", "inflight", "waiting"}``. By hand:

    python bench/upstream.py --port 9001 --delay 0.05 --slots 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvloop
from aiohttp import web

#: What the upstream answers: a chat completion of the size a short real answer has (~480 B).
COMPLETION = (
    b'{"id":"chatcmpl-bench0000000000000000000000000","object":"chat.completion",'
    b'"created":1760000000,"model":"gpt-4o-mini-2024-07-18","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"Hello! How can I help you today?",'
    b'"refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":19,"completion_tokens":9,"total_tokens":28,'
    b'"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},'
    b'"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,'
    b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},'
    b'"service_tier":"default","system_fingerprint":"fp_bench"}'
)


def build_app(delay_s: float, slots: int = 0) -> web.Application:
    """The upstream app; ``delay_s`` is the wait before each answer, seconds; ``slots`` the
    answers in progress at once (0: no limit)."""
    counts = {"served": 0, "inflight": 0, "waiting": 0}
    gate = asyncio.Semaphore(slots) if slots else None

    @contextlib.asynccontextmanager
    async def slot() -> AsyncIterator[None]:
        if gate is None:
            yield
            return
        counts["waiting"] += 1
        try:
            await gate.acquire()
        finally:
            counts["waiting"] -= 1
        try:
            yield
        finally:
            gate.release()

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        async with slot():
            counts["inflight"] += 1
            try:
                if delay_s:
                    await asyncio.sleep(delay_s)
            finally:
                counts["inflight"] -= 1
        counts["served"] += 1
        return web.Response(body=COMPLETION, content_type="application/json")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(counts)

    app = web.Application()
    app.router.add_get("/_stats", stats)
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument("--slots", type=int, default=0, help="answers at once (0: no limit)")
    args = parser.parse_args()
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    # backlog: the load generator opens all its connections at once. handler_cancellation: a
    # caller that leaves gives its place in the queue up.
    web.run_app(build_app(args.delay, args.slots), host="127.0.0.1", port=args.port,
                access_log=None, print=None, backlog=4096, shutdown_timeout=1.0,
                handler_cancellation=True, loop=loop)


if __name__ == "__main__":
    main()
