"""A fake OpenAI- and Anthropic-compatible upstream that records what reaches it.

It runs in the test's own event loop on 127.0.0.1 and a free port. Behaviour is set on the
object (``delay``, ``chunk_delay``, ``statuses``, ``status``, ``fail_first``,
``error_headers``, ``hold``, ``stream_usage``) or per request with headers (``x-fake-delay``,
``x-fake-status``, ``x-fake-tokens``, ``x-fake-chunk-delay``, ``x-fake-usage`` (``empty``:
a JSON answer's usage is ``{}``), ``x-fake-cut-after``: drop the connection after N events of
a stream, ``x-fake-chunked: 1``: send a JSON answer chunked, without Content-Length); what
arrived is kept in ``requests`` and the live and peak concurrency in ``inflight`` /
``peak_inflight``; ``executed`` counts the requests it answered with success, i.e. the side
effects a tool would have performed.

Usage it reports: ``prompt_tokens`` input tokens and ``completion_tokens`` output tokens, or
with ``x-fake-tokens: N``, N output tokens; a stream then has N content events of one token
each (``tok0 ``, ``tok1 `` ...). OpenAI streams send the usage chunk only when asked
(``stream_options.include_usage``) and ``stream_usage`` is on; ``x-fake-usage: 0`` leaves usage
out of any answer (an upstream that does not report it).

Endpoints:
    POST /v1/chat/completions   OpenAI chat completion, plain or SSE (``"stream": true``)
    POST /v1/responses          OpenAI Responses API, plain or SSE
    POST /v1/messages           Anthropic message, plain or SSE
    GET  /gzip                  ``GZIP_BODY`` with ``Content-Encoding: gzip``; ``?stream``
                                sends it chunked, in 16-byte writes
    anything else               echoes method, path, query, headers and body length as JSON

``stream_hold``, when set to an event, stops a stream after its first content event until the
event is set, so a test can look at what the client has received while the stream is open.

:class:`RawUpstream` answers every request with fixed bytes, for responses an aiohttp server
would not write (hop-by-hop headers of the test's choosing, malformed status lines).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from dataclasses import dataclass, field

from aiohttp import web

#: The bytes ``GET /gzip`` sends, already compressed (mtime fixed so they never change).
GZIP_BODY = gzip.compress(b'{"compressed": true, "pad": "' + b"z" * 2000 + b'"}', mtime=0)

#: The position of a request in ``FakeUpstream.requests`` (0-based), set on arrival.
SEQ = web.RequestKey("fake_seq", int)


@dataclass
class Seen:
    """One request as the upstream received it."""

    method: str
    path_qs: str
    headers: dict[str, str]
    body: bytes
    at: float
    raw_path: str = ""  # the request target exactly as sent, before any decoding


@dataclass
class FakeUpstream:
    delay: float = 0.0  # seconds before the response headers
    chunk_delay: float = 0.01  # seconds between SSE events
    chunks: int = 5  # content events in a stream
    statuses: list[int] = field(default_factory=list)  # next answers' statuses, consumed FIFO
    status: int | None = None  # every answer's status once ``statuses`` is used up
    fail_first: int | None = None  # status of the first request of each Idempotency-Key, at once
    error_headers: dict[str, str] = field(default_factory=dict)  # added to answers >= 400
    prompt_tokens: int = 11
    completion_tokens: int = 5
    stream_usage: bool = True  # honour stream_options.include_usage
    hold: asyncio.Event | None = None  # when set, requests wait for it before answering
    stream_hold: asyncio.Event | None = None  # when set, streams wait for it after one event
    done_linger: float = 0.0  # seconds an OpenAI stream stays open after its [DONE]
    requests: list[Seen] = field(default_factory=list)
    inflight: int = 0
    peak_inflight: int = 0
    completed: int = 0
    executed: int = 0
    cancelled: int = 0
    keys_seen: set[str] = field(default_factory=set)
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeUpstream:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_post("/v1/messages", self._anthropic)
        app.router.add_get("/gzip", self._gzip)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_route("*", "/{tail:.*}", self._echo)
        # auto_decompress off: ``requests`` keeps bodies exactly as they arrived.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     auto_decompress=False)
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
        request[SEQ] = len(self.requests)
        self.requests.append(
            Seen(request.method, request.path_qs, dict(request.headers), body, time.monotonic(),
                 request.raw_path)
        )
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        key = request.headers.get("Idempotency-Key")
        if self.fail_first is not None and key is not None and key not in self.keys_seen:
            self.keys_seen.add(key)  # answered at once: hold and delay apply to later attempts
            return body, self.fail_first
        delay = float(request.headers.get("x-fake-delay", self.delay))
        if self.hold is not None:
            await self.hold.wait()
        if delay:
            await asyncio.sleep(delay)
        status = request.headers.get("x-fake-status")
        if status is None and self.statuses:
            return body, self.statuses.pop(0)
        if status is None:
            return body, self.status
        return body, int(status)

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
                    headers=self.error_headers,
                )
            response = await answer(request, body)
            self.executed += 1
            return response
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
                 "body_len": len(body), "seq": req[SEQ]}
            )

        return await self._guard(request, answer)

    async def _gzip(self, request: web.Request) -> web.StreamResponse:
        async def answer(req: web.Request, body: bytes) -> web.StreamResponse:
            headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
            if "stream" not in req.query:
                return web.Response(body=GZIP_BODY, headers=headers)
            response = web.StreamResponse(headers=headers)  # chunked, no Content-Length
            await response.prepare(req)
            for start in range(0, len(GZIP_BODY), 16):
                await response.write(GZIP_BODY[start:start + 16])
            await response.write_eof()
            return response

        return await self._guard(request, answer)

    async def _stream_pause(self, index: int) -> None:
        if index == 0 and self.stream_hold is not None:
            await self.stream_hold.wait()

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
        return events, output, gap, request.headers.get("x-fake-usage") not in ("0", "empty")

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
            elif request.headers.get("x-fake-usage") == "empty":
                answer["usage"] = {}
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
            await self._stream_pause(i)
            await asyncio.sleep(gap)
        asked = (payload.get("stream_options") or {}).get("include_usage")
        if asked and self.stream_usage and report:
            tail = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1,
                    "model": model, "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(tail)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        if self.done_linger:
            await asyncio.sleep(self.done_linger)
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
            await self._stream_pause(i)
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


class RawUpstream:
    """A TCP server that reads one HTTP/1.1 request per connection and answers ``response``.

    The request head and body (by ``Content-Length``) are kept in ``requests`` as raw bytes;
    the connection is closed after each answer.
    """

    def __init__(self, response: bytes) -> None:
        self.response = response
        self.requests: list[bytes] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            self.requests.append(head + body)
            writer.write(self.response)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
