"""Attachments in the input estimate (policies/usage.py): which parts are reserved at the flat
image rate, which as text, end to end through a budget and unit by unit."""

from __future__ import annotations

import base64
import os

import aiohttp
import orjson
import pytest

from policies.usage import (
    ATTACHMENT_TOKENS,
    BYTES_PER_TOKEN,
    CHAT,
    EMBEDDINGS,
    MESSAGES,
    RESPONSES,
    Endpoint,
    estimate_input_tokens,
)
from tests.conftest import route

CHAT_PATH = "/openai/v1/chat/completions"


async def test_text_dressed_as_a_data_image_url_is_reserved_as_text(upstream, start_sluice):
    """Hostile trial, round 34: a ``text`` part starting ``data:image/png;base64,`` was
    reserved at the flat image rate (1,610 tokens for 120,000 characters the upstream bills
    as 40,000), so a caller could pass its budget by far with calls at once."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, budget={"tokens": "20000/day", "per": "tenant"})]})
    payload = base64.b64encode(os.urandom(90_000)).decode()  # 120,000 characters

    async def send(tenant: str, text: str) -> tuple[int, str | None]:
        body = {"model": "gpt-test", "max_tokens": 10, "messages": [
            {"role": "user", "content": [{"type": "text", "text": text}]}]}
        async with aiohttp.ClientSession() as s, s.post(
                sluice.url + CHAT_PATH, json=body, headers={"X-Tenant-ID": tenant}) as r:
            await r.read()
            return r.status, r.headers.get("X-Sluice-Reason")

    assert await send("plain", payload) == (400, "exceeds_limit")
    assert await send("dressed", "data:image/png;base64," + payload) == (400, "exceeds_limit")


async def test_an_image_by_url_is_reserved_as_an_image(upstream, start_sluice):
    """Hostile trial, round 34: an image given by URL was reserved as the bytes of its URL,
    so four of them (6,400 tokens' worth at the flat rate) fitted a 2,000-token budget."""
    def image(n: int) -> dict:
        return {"type": "image_url", "image_url": {"url": f"https://example.com/{n}.png",
                                                   "detail": "high"}}

    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, budget={"tokens": "2000/day", "per": "tenant"})]})
    inline = {"model": "gpt-test", "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000}}
        for _ in range(4)]}]}
    linked = {"model": "gpt-test", "max_tokens": 10, "messages": [{"role": "user", "content": [
        image(n) for n in range(4)]}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(sluice.url + CHAT_PATH, json=inline,
                          headers={"X-Tenant-ID": "a"}) as r:
            await r.read()
            assert (r.status, r.headers.get("X-Sluice-Reason")) == (400, "exceeds_limit")
        async with s.post(sluice.url + CHAT_PATH, json=linked,
                          headers={"X-Tenant-ID": "b"}) as r:
            await r.read()
            assert (r.status, r.headers.get("X-Sluice-Reason")) == (400, "exceeds_limit"), (
                r.status, r.headers.get("X-Sluice-Budget-Remaining"))


# -- the estimate, unit by unit ----------------------------------------------------------------

URL = "https://example.com/cat.png"
#: 120,000 base64 characters (90,000 bytes decoded).
B64 = base64.b64encode(bytes(range(256)) * 351 + bytes(144)).decode()
IMAGE = "data:image/png;base64," + B64


def estimate(endpoint: Endpoint, body: dict) -> tuple[int, bytes]:
    """The estimate of ``body`` as sent, and the bytes sent."""
    raw = orjson.dumps(body)
    return estimate_input_tokens(endpoint, raw, orjson.loads(raw)), raw


def as_text(size: int) -> int:
    """Tokens of ``size`` bytes counted as text."""
    return max(1, -(-size // BYTES_PER_TOKEN))


def chat(*parts: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}


def responses(*parts: dict) -> dict:
    return {"model": "m", "input": [{"role": "user", "content": list(parts)}]}


def claude(*parts: dict) -> dict:
    return {"model": "c", "max_tokens": 10, "messages": [{"role": "user",
                                                          "content": list(parts)}]}


@pytest.mark.parametrize("endpoint, body", [
    (CHAT, chat({"type": "text", "text": IMAGE})),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": IMAGE}]}),
    (RESPONSES, responses({"type": "input_text", "text": IMAGE})),
    (RESPONSES, {"model": "m", "input": IMAGE}),
    (MESSAGES, claude({"type": "text", "text": IMAGE})),
    (MESSAGES, {"model": "c", "max_tokens": 10, "messages": [{"role": "user",
                                                               "content": IMAGE}]}),
], ids=["chat-text-part", "chat-string", "responses-text-part", "responses-string",
        "anthropic-text-part", "anthropic-string"])
def test_a_data_image_url_outside_an_image_part_counts_as_text(endpoint, body):
    # Found by a hostile trial: the flat image rate went to any string that looked like a
    # data:image URL, wherever it was; the upstream bills a text part as text.
    tokens, raw = estimate(endpoint, body)
    assert tokens == as_text(len(raw)) > 40_000


@pytest.mark.parametrize("endpoint, body", [
    # tool_use input and a tool's schema are rendered into the prompt as text
    (MESSAGES, claude({"type": "tool_use", "id": "t", "name": "see", "input": {
        "type": "image", "source": {"type": "base64", "media_type": "image/png",
                                    "data": B64}}})),
    (CHAT, {**chat({"type": "text", "text": "hi"}), "tools": [{"type": "function", "function": {
        "name": "see", "parameters": {"type": "object", "default": {
            "type": "image_url", "image_url": {"url": IMAGE}}}}}]}),
    (EMBEDDINGS, {"model": "e", "input": [{"type": "image_url", "image_url": {"url": IMAGE}}]}),
    # not a URL an upstream fetches, nor inline data: the bytes of a string
    (CHAT, chat({"type": "image_url", "image_url": {"url": B64}})),
], ids=["anthropic-tool-input", "chat-tool-schema", "embeddings", "chat-not-a-url"])
def test_an_image_shaped_object_where_no_image_is_read_counts_as_text(endpoint, body):
    tokens, raw = estimate(endpoint, body)
    assert tokens == as_text(len(raw)) > 40_000


@pytest.mark.parametrize("endpoint, body, reference", [
    (CHAT, chat({"type": "image_url", "image_url": {"url": URL, "detail": "high"}}), URL),
    (CHAT, chat({"type": "file", "file": {"file_id": "file-abc123"}}), "file-abc123"),
    (RESPONSES, responses({"type": "input_image", "image_url": URL, "detail": "auto"}), URL),
    (RESPONSES, responses({"type": "input_image", "file_id": "file-abc123"}), "file-abc123"),
    (RESPONSES, responses({"type": "input_file", "file_url": URL + ".pdf"}), URL + ".pdf"),
    (RESPONSES, {"model": "m", "input": [{"type": "function_call_output", "call_id": "c",
                                          "output": [{"type": "input_image", "image_url": URL}]}]},
     URL),
    (RESPONSES, {"model": "m", "input": [{"type": "computer_call_output", "call_id": "c",
                                          "output": {"type": "computer_screenshot",
                                                     "image_url": URL}}]}, URL),
    (MESSAGES, claude({"type": "image", "source": {"type": "url", "url": URL}}), URL),
    (MESSAGES, claude({"type": "document", "source": {"type": "url", "url": URL + ".pdf"}}),
     URL + ".pdf"),
    (MESSAGES, claude({"type": "image", "source": {"type": "file", "file_id": "file_01"}}),
     "file_01"),
    (MESSAGES, claude({"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": URL}}]}), URL),
], ids=["chat-image-url", "chat-file-id", "responses-image-url", "responses-image-id",
        "responses-file-url", "responses-tool-output", "responses-screenshot",
        "anthropic-image-url", "anthropic-document-url", "anthropic-image-file",
        "anthropic-tool-result"])
def test_an_attachment_by_reference_counts_as_one_attachment(endpoint, body, reference):
    # Found by a hostile trial: an image by URL was reserved as the bytes of its URL (four
    # fitted a 2,000-token budget); the upstream bills it as the image it fetches.
    tokens, raw = estimate(endpoint, body)
    assert tokens == as_text(len(raw) - len(reference)) + ATTACHMENT_TOKENS


@pytest.mark.parametrize("endpoint, body, payload", [
    (CHAT, chat({"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": IMAGE}}), IMAGE),
    (CHAT, chat({"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}), B64),
    (CHAT, chat({"type": "file", "file": {"file_data": IMAGE}}), IMAGE),
    (RESPONSES, responses({"type": "input_image", "image_url": IMAGE}), IMAGE),
    (MESSAGES, claude({"type": "image", "source": {"type": "base64",
                                                   "media_type": "image/png", "data": B64}}),
     B64),
], ids=["chat-image", "chat-audio", "chat-file", "responses-image", "anthropic-image"])
def test_an_inline_image_or_audio_counts_as_one_attachment(endpoint, body, payload):
    tokens, raw = estimate(endpoint, body)
    assert tokens == as_text(len(raw) - len(payload)) + ATTACHMENT_TOKENS


@pytest.mark.parametrize("endpoint, body, payload", [
    (CHAT, chat({"type": "file", "file": {"file_data": "data:application/pdf;base64," + B64}}),
     "data:application/pdf;base64," + B64),
    (RESPONSES, responses({"type": "input_file", "file_data": B64}), B64),
    (MESSAGES, claude({"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": B64}}), B64),
], ids=["chat-file", "responses-file", "anthropic-document"])
def test_an_inline_file_counts_its_decoded_size(endpoint, body, payload):
    tokens, raw = estimate(endpoint, body)
    decoded = len(payload) * 3 // 4
    assert tokens == as_text(len(raw) - len(payload)) + as_text(decoded)


def test_only_the_payload_of_an_attachment_part_leaves_the_text_count():
    # Text beside the URL in an image part stays text, whatever the upstream does with it.
    tokens, raw = estimate(CHAT, chat({"type": "image_url", "image_url": {"url": URL},
                                       "text": B64}))
    assert tokens == as_text(len(raw) - len(URL)) + ATTACHMENT_TOKENS > 40_000


def test_an_anthropic_text_document_counts_as_text():
    tokens, raw = estimate(MESSAGES, claude({"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": B64}}))
    assert tokens == as_text(len(raw))
