"""A fake OpenAI- and Anthropic-compatible upstream that records what reaches it.

It runs in the test's own event loop on 127.0.0.1 and a free port. Behaviour is set on the
object (``delay``, ``chunk_delay``, ``statuses``, ``hold``, ``stream_usage``) or per request
with headers (``x-fake-delay``, ``x-fake-status``, ``x-fake-tokens``, ``x-fake-chunk-delay``,
``x-fake-usage``, ``x-fake-cut-after``: drop the connection after N events of a stream,
``x-fake-chunked: 1``: send a JSON answer chunked, without Content-Length); what arrived is
kept in ``requests`` and the live and peak concurrency in ``inflight`` / ``peak_inflight``.

Usage it reports: ``prompt_tokens`` input tokens and ``completion_tokens`` output tokens, or
with ``x-fake-tokens: N``, N output tokens; a stream then has N content events of one token
each (``tok0 ``, ``tok1 `` ...). OpenAI streams send the usage chunk only when asked
(``stream_options.include_usage``) and ``stream_usage`` is on; ``x-fake-usage: 0`` leaves usage
out of any answer (an upstream that does not report it).

Endpoints:
    POST /v1/chat/completions   OpenAI chat completion, plain or SSE (``"stream": true``)
    POST /v1/responses          OpenAI Responses API, plain or SSE
    POST /v1/messages           Anthropic message, plain or SSE
    anything else               echoes method, path, query, headers and body length as JSON
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Seen:
    """One request as the upstream received it."""

    method: str
    path_qs: str
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class FakeUpstream:
    delay: float = 0.0  # seconds before the response headers
    chunk_delay: float = 0.01  # seconds between SSE events
    chunks: int = 5  # content events in a stream
    statuses: list[int] = field(default_factory=list)  # next answers' statuses, consumed FIFO
    prompt_tokens: int = 11
    completion_tokens: int = 5
    stream_usage: bool = True  # honour stream_options.include_usage
    hold: asyncio.Event | None = None  # when set, requests wait for it before answering
    requests: list[Seen] = field(default_factory=list)
    inflight: int = 0
    peak_inflight: int = 0
    completed: int = 0
    cancelled: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeUpstream:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_post("/v1/messages", self._anthropic)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_route("*", "/{tail:.*}", self._echo)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- plumbing -------------------------------------------------------------------------------

    async def _enter(self, request: web.Request) -> tuple[bytes, int | None]:
        body = await request.read()
        self.requests.append(
            Seen(request.method, request.path_qs, dict(request.headers), body, time.monotonic())
        )
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        delay = float(request.headers.get("x-fake-delay", self.delay))
        if self.hold is not None:
            await self.hold.wait()
        if delay:
            await asyncio.sleep(delay)
        status = request.headers.get("x-fake-status")
        if status is None and self.statuses:
            return body, self.statuses.pop(0)
        return body, int(status) if status else None

    def _leave(self, cancelled: bool) -> None:
        self.inflight -= 1
        if cancelled:
            self.cancelled += 1
        else:
            self.completed += 1

    async def _guard(self, request: web.Request, answer) -> web.StreamResponse:
        cancelled = False
        try:
            body, status = await self._enter(request)
            if status is not None and status >= 400:
                return web.json_response(
                    {"error": {"message": f"fake upstream status {status}", "type": "fake",
                               "code": None}},
                    status=status,
                )
            return await answer(request, body)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self._leave(cancelled)

    # -- endpoints ----------------------------------------------------------------------------

    async def _echo(self, request: web.Request) -> web.StreamResponse:
        async def answer(req: web.Request, body: bytes) -> web.StreamResponse:
            return web.json_response(
                {"method": req.method, "path_qs": req.path_qs, "headers": dict(req.headers),
                 "body_len": len(body)}
            )

        return await self._guard(request, answer)

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        return await self._guard(request, self._openai_answer)

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        return await self._guard(request, self._anthropic_answer)

    async def _json(self, request: web.Request, answer: dict) -> web.StreamResponse:
        if request.headers.get("x-fake-chunked") != "1":
            return web.json_response(answer)
        data = json.dumps(answer).encode()
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(data[: len(data) // 2])
        await asyncio.sleep(0.01)
        await response.write(data[len(data) // 2:])
        await response.write_eof()
        return response

    def _shape(self, request: web.Request) -> tuple[int, int, float, bool]:
        """(content events, output tokens, seconds between events, report usage)."""
        tokens = request.headers.get("x-fake-tokens")
        events = int(tokens) if tokens else self.chunks
        output = int(tokens) if tokens else self.completion_tokens
        gap = float(request.headers.get("x-fake-chunk-delay", self.chunk_delay))
        return events, output, gap, request.headers.get("x-fake-usage") != "0"

    async def _openai_answer(self, request: web.Request, body: bytes) -> web.StreamResponse:
        payload = json.loads(body or b"{}")
        model = payload.get("model", "gpt-test")
        events, output, gap, report = self._shape(request)
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": output,
            "total_tokens": self.prompt_tokens + output,
        }
        if not payload.get("stream"):
            answer = {
                "id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": model,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "hello from fake"}}],
            }
            if report:
                answer["usage"] = usage
            return await self._json(request, answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        cut_after = int(request.headers.get("x-fake-cut-after", -1))
        for i in range(events):
            if i == cut_after:
                assert request.transport is not None
                request.transport.close()  # the upstream dies mid-answer
                return response
            chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1,
                     "model": model,
                     "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                                  "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(gap)
        asked = (payload.get("stream_options") or {}).get("include_usage")
        if asked and self.stream_usage and report:
            tail = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1,
                    "model": model, "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(tail)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._guard(request, self._responses_answer)

    async def _responses_answer(self, request: web.Request, body: bytes) -> web.StreamResponse:
        payload = json.loads(body or b"{}")
        events, output, gap, report = self._shape(request)
        text = "".join(f"tok{i} " for i in range(events))
        result = {
            "id": "resp_fake", "object": "response", "created_at": 1, "status": "completed",
            "model": payload.get("model", "gpt-test"),
            "output": [{"type": "message", "id": "msg_fake", "status": "completed",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": output,
                      "total_tokens": self.prompt_tokens + output,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}} if report else None,
        }
        if not payload.get("stream"):
            return await self._json(request, result)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sequence = 0

        async def event(name: str, data: dict) -> None:
            nonlocal sequence
            data = {"type": name, "sequence_number": sequence, **data}
            sequence += 1
            await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

        await event("response.created",
                    {"response": dict(result, status="in_progress", output=[], usage=None)})
        for i in range(events):
            await event("response.output_text.delta", {"item_id": "msg_fake",
                                                       "output_index": 0, "content_index": 0,
                                                       "delta": f"tok{i} "})
            await asyncio.sleep(gap)
        await event("response.completed", {"response": result})
        await response.write_eof()
        return response

    async def _anthropic_answer(self, request: web.Request, body: bytes) -> web.StreamResponse:
        payload = json.loads(body or b"{}")
        model = payload.get("model", "claude-test")
        events, output, gap, report = self._shape(request)
        message = {
            "id": "msg_fake", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": "hello from fake"}],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": output},
        }
        if not report:
            del message["usage"]
        if not payload.get("stream"):
            return await self._json(request, message)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def event(name: str, data: dict) -> None:
            await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

        start = dict(message, content=[], stop_reason=None)
        if report:
            start["usage"] = {"input_tokens": self.prompt_tokens, "output_tokens": 1}
        await event("message_start", {"type": "message_start", "message": start})
        await event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})
        for i in range(events):
            await event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "text_delta",
                                                          "text": f"tok{i} "}})
            await asyncio.sleep(gap)
        await event("content_block_stop", {"type": "content_block_stop", "index": 0})
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
        if report:
            delta["usage"] = {"output_tokens": output}
        await event("message_delta", delta)
        await event("message_stop", {"type": "message_stop"})
        await response.write_eof()
        return response
