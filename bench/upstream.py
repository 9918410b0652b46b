"""A minimal OpenAI-style upstream for the benchmarks: aiohttp 3.14 + uvloop, one process.

Every POST answers 200 with the same small chat-completion JSON (``Content-Length`` set, so a
proxy may read it whole), after ``--delay`` seconds. Run by ``bench/overhead.py``; by hand:

    python bench/upstream.py --port 9001 --delay 0.05
"""

from __future__ import annotations

import argparse
import asyncio

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


def build_app(delay_s: float) -> web.Application:
    """The upstream app; ``delay_s`` is the wait before each answer, seconds."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        if delay_s:
            await asyncio.sleep(delay_s)
        return web.Response(body=COMPLETION, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    args = parser.parse_args()
    # backlog: the load generator opens all its connections at once.
    web.run_app(build_app(args.delay), host="127.0.0.1", port=args.port, access_log=None,
                print=None, backlog=1024, shutdown_timeout=1.0, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
