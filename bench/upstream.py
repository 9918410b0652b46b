"""A minimal OpenAI- and Anthropic-style upstream for the benchmarks: aiohttp + uvloop, one process.

Every request answers 200 after ``--delay`` seconds: a POST to a path ending in
``/v1/messages`` with the same small Anthropic message, any other with the same small OpenAI
chat completion, usage included in both (``Content-Length`` set, so a proxy may read it
whole). A request whose JSON body has ``"stream": true`` gets the same answer as a short SSE
stream in its provider's format instead: OpenAI chat chunks (and a usage chunk when
``stream_options.include_usage`` is true) ending ``data: [DONE]``; Anthropic's
``message_start`` ... ``message_stop`` events, usage in ``message_start`` and
``message_delta``. With ``--slots N`` at most N requests are served at once and the rest wait
in its FIFO queue, unbounded, as a server with N workers does; a caller that gives up (closes
its connection) leaves the queue, or cuts its request short. ``GET /_stats`` answers
``{"served", "inflight", "waiting"}``. By hand:

    python bench/upstream.py --port 9001 --delay 0.05 --slots 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
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

#: What it answers a POST to ``.../v1/messages``: an Anthropic message with the same text and
#: token counts.
MESSAGE = (
    b'{"id":"msg_bench000000000000000000000","type":"message","role":"assistant",'
    b'"model":"claude-haiku-4-5-20251001","content":[{"type":"text",'
    b'"text":"Hello! How can I help you today?"}],"stop_reason":"end_turn",'
    b'"stop_sequence":null,"usage":{"input_tokens":19,"cache_creation_input_tokens":0,'
    b'"cache_read_input_tokens":0,"output_tokens":9}}'
)
_TEXT = ("Hello!", " How can I help you today?")


def _chat_chunks(include_usage: bool) -> list[bytes]:
    """:data:`COMPLETION` as OpenAI's ``chat.completion.chunk`` SSE events."""
    done = json.loads(COMPLETION)
    head = {k: done[k] for k in ("id", "created", "model", "service_tier",
                                 "system_fingerprint")}
    head["object"] = "chat.completion.chunk"

    def chunk(delta: dict, finish: str | None = None, **extra: object) -> bytes:
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        return b"data: " + json.dumps({**head, "choices": choices, **extra}).encode() + b"\n\n"

    events = [chunk({"role": "assistant", "content": "", "refusal": None})]
    events += [chunk({"content": piece}) for piece in _TEXT]
    events.append(chunk({}, "stop"))
    if include_usage:
        events.append(b"data: " + json.dumps({**head, "choices": [],
                                              "usage": done["usage"]}).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def _message_events() -> list[bytes]:
    """:data:`MESSAGE` as Anthropic's Messages SSE events."""
    done = json.loads(MESSAGE)
    start = {**done, "content": [], "stop_reason": None,
             "usage": {**done["usage"], "output_tokens": 1}}
    events: list[tuple[str, dict]] = [
        ("message_start", {"message": start}),
        ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        *(("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}})
          for piece in _TEXT),
        ("content_block_stop", {"index": 0}),
        ("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": done["usage"]["output_tokens"]}}),
        ("message_stop", {}),
    ]
    return [f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()
            for name, data in events]


#: The streamed answers, by what was asked: an Anthropic message, an OpenAI chat completion
#: with the usage chunk (``stream_options.include_usage``), one without.
STREAMS = {"messages": _message_events(), "chat+usage": _chat_chunks(True),
           "chat": _chat_chunks(False)}


def _streamed(path: str, body: bytes) -> str | None:
    """Which of :data:`STREAMS` a request asks for, or ``None`` for a plain answer."""
    if b'"stream"' not in body:  # the benchmarks' requests: no JSON parse on their path
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict) or payload.get("stream") is not True:
        return None
    if path.endswith("/v1/messages"):
        return "messages"
    options = payload.get("stream_options")
    usage = isinstance(options, dict) and options.get("include_usage") is True
    return "chat+usage" if usage else "chat"


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

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with slot():
            counts["inflight"] += 1
            try:
                if delay_s:
                    await asyncio.sleep(delay_s)
            finally:
                counts["inflight"] -= 1
        stream = _streamed(request.path, body) if request.method == "POST" else None
        if stream is None:
            anthropic = request.method == "POST" and request.path.endswith("/v1/messages")
            counts["served"] += 1
            return web.Response(body=MESSAGE if anthropic else COMPLETION,
                                content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in STREAMS[stream]:
            await response.write(event)
        await response.write_eof()
        counts["served"] += 1
        return response

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
    try:
        web.run_app(build_app(args.delay, args.slots), host="127.0.0.1", port=args.port,
                    access_log=None, print=None, backlog=4096, shutdown_timeout=1.0,
                    handler_cancellation=True, loop=loop)
    except OSError as exc:  # the README sends new users here: one line, as `sluice serve` says
        sys.exit(f"upstream.py: cannot listen on 127.0.0.1:{args.port} ({exc.strerror}); "
                 "pick another --port")


if __name__ == "__main__":
    main()
