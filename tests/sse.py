"""Server-sent events as LLM upstreams stream them, for fake upstreams in the tests."""

from __future__ import annotations

import json


def sse(obj: dict, event: str | None = None) -> bytes:
    """One event: ``data:`` the JSON of ``obj``, after an ``event:`` line when named."""
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(obj) + "\n\n").encode()


def anthropic_failing(error_type: str, message: str = "it failed") -> list[bytes]:
    """An Anthropic Messages stream that begins an answer, then ends with an error event of
    ``error_type`` (``overloaded_error``, ``invalid_request_error``...) after HTTP 200."""
    return [
        sse({"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 20, "output_tokens": 1}}}, "message_start"),
        sse({"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}}, "content_block_start"),
        sse({"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": "hello there"}}, "content_block_delta"),
        sse({"type": "error", "error": {"type": error_type, "message": message}}, "error"),
    ]
