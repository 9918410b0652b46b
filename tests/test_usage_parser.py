"""Usage parsing per protocol (policies/usage.py): request side, plain bodies, and SSE streams
fed in every possible split, since chunk boundaries are not event boundaries."""

from __future__ import annotations

import json
from unittest import mock

import orjson
import pytest
from multidict import CIMultiDict

from policies import usage
from policies.usage import (
    ATTACHMENT_TOKENS,
    BYTES_PER_TOKEN,
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    JSON_LIMIT_BYTES,
    MESSAGES,
    RESPONSES,
    SAMPLE_EVENTS,
    Endpoint,
    Meter,
    endpoint_for,
    endpoints_differ,
    read_request,
)


def sse(*payloads: dict | str, event_names: list[str] | None = None, crlf: bool = False
        ) -> bytes:
    out = b""
    for i, payload in enumerate(payloads):
        data = payload if isinstance(payload, str) else json.dumps(payload)
        head = f"event: {event_names[i]}\n" if event_names else ""
        out += f"{head}data: {data}\n\n".encode()
    return out.replace(b"\n", b"\r\n") if crlf else out


def chat_chunk(text: str) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
            "usage": None}


USAGE_CHUNK = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
               "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                         "prompt_tokens_details": {"cached_tokens": 2}}}
OPENAI_STREAM = sse(chat_chunk("Hello"), chat_chunk(" wor"), chat_chunk("ld"), USAGE_CHUNK,
                    "[DONE]")


def started(meter: Meter, content_type: str = "text/event-stream") -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict({"Content-Type": content_type,
                                              "Content-Length": "999"})
    meter.start(200, headers)
    return headers


def feed_in_pieces(meter: Meter, data: bytes, cuts: list[int]) -> bytes:
    out = b""
    last = 0
    for cut in [*cuts, len(data)]:
        out += meter.chunk(data[last:cut])
        last = cut
    return out + meter.finish()


def splits(data: bytes):
    """Every split in two, and every split into single bytes."""
    for i in range(1, len(data)):
        yield [i]
    yield list(range(1, len(data)))


def test_endpoints_by_protocol_and_path():
    assert endpoint_for("openai", "POST", "/v1/chat/completions?x=1") is CHAT
    assert endpoint_for("openai", "POST", "/v1/responses") is RESPONSES
    assert endpoint_for("openai", "GET", "/v1/responses") is None
    assert endpoint_for("openai", "POST", "/v1/files") is None
    assert endpoint_for("anthropic", "POST", "/v1/messages") is MESSAGES
    assert endpoint_for("anthropic", "POST", "/v1/messages/count_tokens") is None


@pytest.mark.parametrize(("protocol", "path", "endpoint"), [
    ("openai", "/v1/Chat/Completions", CHAT),
    ("openai", "/V1/CHAT/COMPLETIONS?x=1", CHAT),
    ("openai", "/v1/chat/completions;jsessionid=1", CHAT),
    ("openai", "/v1/chat;x=1/completions", CHAT),  # chat (Tomcat's reading), not completions
    ("openai", "/v1/Responses/", RESPONSES),
    ("openai", "/v1/embeddings;x", EMBEDDINGS),
    ("anthropic", "/v1/Messages", MESSAGES),
    ("anthropic", "/v1/messages;jsessionid=1", MESSAGES),
    ("anthropic", "/v1/Chat/Completions", CHAT),
    ("anthropic", "/v1/messages/Count_Tokens", None),
    ("anthropic", "/v1/messages/count_tokens;x=1", None),
])
def test_endpoints_are_read_as_case_folding_and_param_dropping_upstreams_route_them(
        protocol, path, endpoint):
    """Metering reads every spelling ``endpoints:`` patterns read (policies.paths.readings):
    Express and ASP.NET Core fold case, Tomcat and Spring drop ``;parameters``."""
    assert endpoint_for(protocol, "POST", path) is endpoint


@pytest.mark.parametrize(("protocol", "method", "path", "differ"), [
    ("openai", "POST", "/v1/responses;x=%2Fcompletions", True),  # responses | completions
    ("openai", "POST", "/v1/embeddings;x=%2Fchat%2Fcompletions", True),
    ("openai", "POST", "/v1/chat/completions;jsessionid=1", True),  # chat | none
    ("openai", "POST", "/v1/chat%2Fcompletions?x=1", True),
    ("openai", "POST", "/v1/chat;x=1/completions", True),  # chat | completions
    ("openai", "POST", "/v1/chat\\/completions", True),  # chat | completions: \\ is /
    ("openai", "POST", "/v1/responses\\completions", True),  # completions | responses
    ("anthropic", "POST", "/v1/messages/count_tokens;x=%2Fmessages", True),
    ("anthropic", "POST", "/v1/messages;jsessionid=1", True),
    ("openai", "POST", "/v1;v=1/chat/completions", False),  # chat in each
    ("openai", "POST", "/v1/chat/completion%73", False),
    ("openai", "POST", "/v1/files\\x", False),  # none in each
    ("openai", "POST", "/v1/files;x=%2Fy", False),  # none in each
    ("openai", "POST", "/v1/Chat/Completions", False),
    ("openai", "POST", "/v1/chat/completions?q=%2F;x", False),  # the query is not read
    ("openai", "GET", "/v1/responses;x=%2Fcompletions", False),  # a GET is not metered
    ("anthropic", "POST", "/v1/messages/count_tokens;x=1", False),
])
def test_endpoints_differ_when_the_readings_of_a_metered_post_name_different_ones(
        protocol, method, path, differ):
    assert endpoints_differ(protocol, method, path) is differ


def test_request_reads_cap_and_adds_usage_option_and_default_cap():
    body = orjson.dumps({"model": "gpt-x", "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]})
    cost = read_request(CHAT, body, default_cap=300, write_cap=True, stream_usage=True)
    sent = orjson.loads(cost.body)
    assert (cost.model, cost.stream, cost.output_cap, cost.strip_usage) == ("gpt-x", True, 300,
                                                                           True)
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["max_completion_tokens"] == 300
    assert cost.input_tokens == -(-len(body) // 3)

    asked = orjson.dumps({"model": "m", "stream": True, "max_tokens": 50,
                          "stream_options": {"include_usage": True}})
    cost = read_request(CHAT, asked, default_cap=300, write_cap=True, stream_usage=True)
    assert cost.body == asked  # nothing to add: forwarded byte for byte
    assert (cost.output_cap, cost.strip_usage) == (50, False)

    spliced = read_request(CHAT, b'{"model": "m", "stream": true}\n', 7, True, True)
    assert spliced.body == (b'{"model": "m", "stream": true,"max_completion_tokens":7,'
                            b'"stream_options":{"include_usage":true}}\n')
    rewritten = read_request(CHAT, b'{"stream": true, "stream_options": {"x": 1}}', 7, True,
                             True)
    assert orjson.loads(rewritten.body)["stream_options"] == {"x": 1, "include_usage": True}

    both = read_request(CHAT, b'{"max_completion_tokens": 0, "max_tokens": 10000}', 7, True,
                        True)
    assert both.output_cap == 10000  # an upstream may read either (a hostile trial: 0)
    assert read_request(CHAT, b'{"max_completion_tokens": 90, "max_tokens": 9}', 7, True,
                        True).output_cap == 90

    several = read_request(CHAT, b'{"model": "m", "n": 3, "max_tokens": 10}', None, True,
                           True)
    assert several.output_cap == 30  # each of the 3 choices may use the whole cap

    none = read_request(MESSAGES, b'{"model": "c", "messages": []}', None, True, True)
    assert none.output_cap is None
    with pytest.raises(ValueError):
        read_request(CHAT, b"not json", None, True, True)


def test_attachments_count_flat_not_by_size():
    image = "data:image/png;base64," + "A" * 400_000
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": image}}]}]})
    cost = read_request(CHAT, body, 100, False, True)
    assert ATTACHMENT_TOKENS < cost.input_tokens < ATTACHMENT_TOKENS + 100


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:text/plain;base64,{}"}},
    {"type": "file", "file": {"file_data": "data:application/pdf;base64,{}"}},
    {"type": "document", "source": {"type": "base64", "media_type": "text/plain",
                                    "data": "{}"}},
])
def test_an_attachment_read_as_text_counts_its_size_not_flat(part):
    # Found by a hostile trial: 1 MB of prompt sent as data:text/plain;base64 was reserved as
    # one flat attachment (1,600 tokens) and ran past a tenant's daily budget 12.5 times.
    payload = "QUJD" * 100_000  # 400,000 base64 characters: 300,000 bytes
    text = orjson.dumps(part).decode().replace("{}", payload)
    body = b'{"model":"m","messages":[{"role":"user","content":[' + text.encode() + b"]}]}"
    cost = read_request(CHAT, body, 100, False, True)
    assert cost.input_tokens >= 300_000 // BYTES_PER_TOKEN
    image = text.replace("text/plain", "image/png").replace("application/pdf", "image/png")
    body = b'{"model":"m","messages":[{"role":"user","content":[' + image.encode() + b"]}]}"
    assert read_request(CHAT, body, 100, False, True).input_tokens < ATTACHMENT_TOKENS + 100


@pytest.mark.parametrize("crlf", [False, True])
def test_openai_stream_any_split_reads_usage_and_passes_bytes(crlf):
    stream = OPENAI_STREAM.replace(b"\n", b"\r\n") if crlf else OPENAI_STREAM
    for cuts in splits(stream):
        meter = Meter(CHAT, anthropic=False, strip_usage=False)
        started(meter)
        assert feed_in_pieces(meter, stream, cuts) == stream
        assert meter.final and meter.complete
        assert (meter.usage.input_tokens, meter.usage.output_tokens,
                meter.usage.cache_read_tokens) == (7, 3, 2)


@pytest.mark.parametrize("strip", [False, True])
@pytest.mark.parametrize("crlf", [False, True])
def test_done_is_seen_once_the_done_event_has_passed_at_any_split(crlf, strip):
    """``Meter.done`` (the relay's sign that the caller has its whole answer) turns true with
    the chunk that ends the ``[DONE]`` event, not before, however the stream is cut."""
    stream = OPENAI_STREAM.replace(b"\n", b"\r\n") if crlf else OPENAI_STREAM
    ends_at = len(stream)  # the [DONE] event is the last
    for cuts in splits(stream):
        meter = Meter(CHAT, anthropic=False, strip_usage=strip)
        started(meter)
        last = 0
        for cut in [*cuts, len(stream)]:
            meter.chunk(stream[last:cut])
            last = cut
            assert meter.done is (cut == ends_at), (cuts, cut)
    unspaced = Meter(CHAT, anthropic=False, strip_usage=False)
    started(unspaced)
    unspaced.chunk(b"data:[DONE]\n\n")
    assert unspaced.done
    content = Meter(CHAT, anthropic=False, strip_usage=False)
    started(content)
    content.chunk(sse(chat_chunk("[DONE]")))  # the text of a content event is no end
    content.chunk(b'data:"[DONE]"\n\n')  # nor a JSON string (the SDK reads it as data)
    assert not content.done


@pytest.mark.parametrize("usage", [None, {"input_tokens": 9, "output_tokens": 4}])
@pytest.mark.parametrize("kind", ["messages", "responses"])
def test_done_is_each_apis_last_event_at_any_split(kind, usage):
    """``Meter.done`` is the Messages API's ``message_stop``, the Responses API's
    ``response.completed`` (with usage or not), at the chunk that ends it; before it the
    stream is :attr:`~policies.usage.Meter.cut_short` if it ends there."""
    if kind == "messages":
        names = ["message_start", "content_block_delta", "message_stop"]
        stream = sse({"type": "message_start", "message": {"usage": usage}},
                     {"type": "content_block_delta", "delta": {"type": "text_delta",
                                                               "text": "hi"}},
                     {"type": "message_stop"}, event_names=names)
        endpoint = MESSAGES
    else:
        names = ["response.created", "response.output_text.delta", "response.completed"]
        stream = sse({"type": "response.created", "response": {"usage": None}},
                     {"type": "response.output_text.delta", "delta": "hi"},
                     {"type": "response.completed", "response": {"usage": usage}},
                     event_names=names)
        endpoint = RESPONSES
    for cuts in splits(stream):
        meter = Meter(endpoint, anthropic=kind == "messages", strip_usage=False)
        started(meter)
        last = 0
        for cut in [*cuts, len(stream)]:
            meter.chunk(stream[last:cut])
            last = cut
            assert meter.done is (cut == len(stream)), (cuts, cut)
            assert meter.cut_short is (cut != len(stream))


def test_a_short_events_name_is_not_read_from_the_next_event():
    """A review: an event's name was looked for in the 64 bytes from its start, past its
    end: a ``ping`` (36 bytes) followed by a partial ``message_stop`` read as the last
    event, so a stream cut there was neither cut short nor undelivered."""
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter)
    meter.chunk(b'event: ping\ndata: {"type": "ping"}\n\nevent: message_stop\ndata: {"ty')
    meter.finish()  # the upstream ends the stream cleanly here
    assert not meter.done and meter.cut_short


@pytest.mark.parametrize("chunk, finished", [
    (b'{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}', False),
    (b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}', True),
    (b'{"choices":[{"index":0,"delta":{},"finish_reason": "length"}]}', True),
    (b'{"choices":[{"index":0,"delta":{"content":"\\"finish_reason\\":\\"x"},'
     b'"finish_reason":null}]}', False),
])
def test_a_chat_stream_is_over_at_a_finish_reason(chunk, finished):
    """Servers that never send ``data: [DONE]`` exist: a choice's ``finish_reason`` ends
    the answer as far as :attr:`Meter.cut_short` goes (a review); text that merely holds
    the words, escaped inside a string, does not."""
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter)
    meter.chunk(b"data: " + chunk + b"\n\n")
    meter.finish()
    assert meter.cut_short is not finished and not meter.done


def test_an_event_of_several_data_lines_is_read_after_other_events():
    """An event whose data spans several ``data:`` lines (joined, as WHATWG SSE says) was
    read with its offset in the chunk applied to the joined data: after another event in
    the same chunk, an Anthropic text delta counted nothing and a last event was missed."""
    delta = (b'event: content_block_delta\ndata: {"type": "content_block_delta",\n'
             b'data: "delta": {"type": "text_delta", "text": "' + b"x" * 40 + b'"}}\n\n')
    stop = b'event: message_stop\ndata: {"type":\ndata: "message_stop"}\n\n'
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter)
    meter.chunk(sse({"type": "ping"}, event_names=["ping"]) + delta + stop)
    assert meter.streamed_tokens == -(-40 // BYTES_PER_TOKEN)
    assert meter.done


@pytest.mark.parametrize("crlf", [False, True])
def test_strip_removes_only_the_usage_chunk_at_any_split(crlf):
    stream = sse(chat_chunk("Hello"), chat_chunk(" wor"), USAGE_CHUNK, "[DONE]", crlf=crlf)
    expected = sse(chat_chunk("Hello"), chat_chunk(" wor"), "[DONE]", crlf=crlf)
    for cuts in splits(stream):
        meter = Meter(CHAT, anthropic=False, strip_usage=True)
        headers = started(meter)
        assert "Content-Length" not in headers
        assert feed_in_pieces(meter, stream, cuts) == expected
        assert meter.final and meter.usage.output_tokens == 3


def test_strip_holds_back_only_an_incomplete_event():
    meter = Meter(CHAT, anthropic=False, strip_usage=True)
    started(meter)
    first = sse(chat_chunk("Hi"))
    assert meter.chunk(first + b'data: {"id": "c", "cho') == first
    assert meter.chunk(b'ices": []}\n\n') == b'data: {"id": "c", "choices": []}\n\n'


@pytest.mark.parametrize("crlf", [False, True])
def test_stripping_and_reading_hold_whatever_the_event_size(crlf):
    """An event over 4 MiB switched usage reading off for the rest of the stream, so the usage
    chunk Sluice had asked for reached a client that had not (``choices: []``)."""
    big = sse(chat_chunk("x" * (JSON_LIMIT_BYTES + 1)), crlf=crlf)
    before, after = sse(chat_chunk("a"), crlf=crlf), sse(USAGE_CHUNK, "[DONE]", crlf=crlf)
    stream = before + big + after
    expected = before + big + sse("[DONE]", crlf=crlf)
    end = len(before) + len(big)  # the big event's boundary: cut around and inside it
    for cuts in ([end - 3], [end - 2], [end - 1], [end], [end + 1], [len(before) + 10, end - 1],
                 [len(before) + 10, end + 5], [len(before) + JSON_LIMIT_BYTES + 20, end + 40],
                 list(range(4096, len(stream), 1 << 20))):
        meter = Meter(CHAT, anthropic=False, strip_usage=True)
        started(meter)
        assert feed_in_pieces(meter, stream, cuts) == expected, cuts
        assert meter.final, cuts
        assert (meter.usage.input_tokens, meter.usage.output_tokens) == (7, 3)


def test_usage_is_read_from_the_end_of_an_event_too_big_to_hold():
    """A Responses stream's ``response.completed`` event carries the whole output before its
    usage; an Anthropic stream, and a chunked JSON answer, put usage last too."""
    text = "y" * (JSON_LIMIT_BYTES + 100)
    usage = {"input_tokens": 9, "output_tokens": 40000,
             "input_tokens_details": {"cached_tokens": 3}}
    stream = sse({"type": "response.output_text.delta", "delta": "hey"},
                 {"type": "response.completed", "response": {
                     "output": [{"content": [{"text": text, "note": '"usage": {"x": 1}'}]}],
                     "usage": usage, "metadata": {}}},
                 event_names=["response.output_text.delta", "response.completed"])
    meter = Meter(RESPONSES, anthropic=False, strip_usage=False)
    started(meter)
    # Cut past the hold limit while the event is still incomplete, so it is read from its tail.
    assert feed_in_pieces(meter, stream, [100, 1 << 20, len(stream) - 100]) == stream
    assert (meter.usage.input_tokens, meter.usage.output_tokens,
            meter.usage.cache_read_tokens) == (9, 40000, 3)
    assert meter.final

    body = orjson.dumps({"id": "x", "content": [{"type": "text", "text": text}],
                         "usage": {"input_tokens": 3, "output_tokens": 9}})
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter, "application/json")
    assert feed_in_pieces(meter, body, list(range(1 << 16, len(body), 1 << 20))) == body
    assert meter.final and meter.usage.output_tokens == 9


def test_unchanged_chunks_are_the_same_objects():
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter)
    chunk = sse(chat_chunk("x"))
    assert meter.chunk(chunk) is chunk


def test_streamed_estimate_counts_text_at_least_one_per_event():
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter)
    meter.chunk(sse(chat_chunk("a"), chat_chunk("abcdefg"), chat_chunk("")))
    assert meter.streamed_tokens == 1 + 3
    assert not meter.final and not meter.complete


def test_long_streams_count_later_events_at_the_sample_mean_but_big_ones_by_their_text():
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter)
    for i in range(SAMPLE_EVENTS):
        meter.chunk(sse(chat_chunk("abcdef" if i % 2 else "abc")))  # 2 and 1 tokens
    assert meter.streamed_tokens == SAMPLE_EVENTS * 3 // 2
    for _ in range(10):
        meter.chunk(sse(chat_chunk("x")))
    assert meter.streamed_tokens == SAMPLE_EVENTS * 3 // 2 + 10 * 2  # mean 1.5, rounded up
    # A hostile trial: 3 KB tool arguments after one-character deltas were counted as the
    # sample's mean, 2 tokens each (a cut stream of ~15,000 tokens charged 40). An event
    # over twice the sample's mean size is parsed.
    for _ in range(20):
        meter.chunk(sse(chat_chunk("y" * 3000)))
    assert meter.streamed_tokens == SAMPLE_EVENTS * 3 // 2 + 10 * 2 + 20 * 1000

    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter)
    small = {"type": "content_block_delta", "index": 1,
             "delta": {"type": "input_json_delta", "partial_json": "{"}}
    big = {**small, "delta": {"type": "input_json_delta", "partial_json": "z" * 3000}}
    for _ in range(SAMPLE_EVENTS):
        meter.chunk(sse(small, event_names=["content_block_delta"]))
    for _ in range(20):
        meter.chunk(sse(big, event_names=["content_block_delta"]))
    assert meter.streamed_tokens == SAMPLE_EVENTS + 20 * 1000

    names = ["content_block_start", "content_block_delta", "ping"]
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter)
    for _ in range(SAMPLE_EVENTS + 4):
        meter.chunk(sse({"type": "content_block_start", "index": 0},
                        {"type": "content_block_delta", "delta": {"type": "text_delta",
                                                                  "text": "a b"}},
                        {"type": "ping"}, event_names=names))
    assert meter.streamed_tokens == SAMPLE_EVENTS + 4  # only the deltas count


def test_anthropic_stream_usage_is_cumulative():
    names = ["message_start", "content_block_delta", "message_delta", "message_stop"]
    stream = sse(
        {"type": "message_start", "message": {"usage": {
            "input_tokens": 5, "cache_read_input_tokens": 100,
            "cache_creation_input_tokens": 20, "output_tokens": 1}}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": "hello there"}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
         "usage": {"output_tokens": 42}},
        {"type": "message_stop"},
        event_names=names,
    )
    for cuts in splits(stream):
        meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
        started(meter)
        assert feed_in_pieces(meter, stream, cuts) == stream
        u = meter.usage
        assert (u.input_tokens, u.output_tokens, u.cache_read_tokens,
                u.cache_write_tokens) == (125, 42, 100, 20)
        assert meter.final


def test_responses_stream_reads_completed_event():
    stream = sse(
        {"type": "response.created", "response": {"usage": None}},
        {"type": "response.output_text.delta", "delta": "hey"},
        {"type": "response.completed", "response": {"usage": {
            "input_tokens": 9, "output_tokens": 4,
            "input_tokens_details": {"cached_tokens": 3}}}},
        event_names=["response.created", "response.output_text.delta", "response.completed"],
    )
    meter = Meter(RESPONSES, anthropic=False, strip_usage=False)
    started(meter)
    meter.chunk(stream)
    assert (meter.usage.input_tokens, meter.usage.output_tokens) == (9, 4)
    assert meter.final and meter.streamed_tokens == 1


def test_plain_json_body_and_error_body():
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter, "application/json")
    body = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    assert meter.body(body) == body
    assert meter.final and meter.usage.output_tokens == 4

    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    meter.start(400, CIMultiDict({"Content-Type": "application/json"}))
    meter.body(b'{"error": {"message": "bad"}}')
    assert meter.complete and not meter.final


def json_usage(body: bytes, endpoint: Endpoint = EMBEDDINGS) -> tuple[tuple[int, int], bool]:
    """What a meter reads of a JSON answer (an embeddings one by default: it needs no output
    count, so a bare ``prompt_tokens`` makes a report in the cases below)."""
    meter = Meter(endpoint, anthropic=False, strip_usage=False)
    started(meter, "application/json")
    assert meter.body(body) == body
    return (meter.usage.input_tokens, meter.usage.output_tokens), meter.final


@pytest.mark.parametrize(("body", "read"), [
    # The top-level member, whatever follows it, and only it.
    (b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2},"x":{"y":[1]}}',
     ((1, 2), True)),
    (b'{"usage":{"prompt_tokens":1},"tools":[{"parameters":{"usage":{"prompt_tokens":8}}}]}',
     ((1, 0), True)),
    (b'{"output":[{"usage":{"prompt_tokens":5}}],"usage":null}', ((0, 0), False)),
    (b'{"output":{"usage":{"prompt_tokens":5}}}', ((0, 0), False)),
    # The last of duplicate members, as a parse of the whole answer takes.
    (b'{"usage":{"prompt_tokens":1},"x":1,"usage":{"prompt_tokens":2}}', ((2, 0), True)),
    (b'{"usage":{"prompt_tokens":1},"usage":null}', ((0, 0), False)),
    # Keys and text that only look like the member.
    (b'{"usage":{"prompt_tokens":3},"x\\"usage":{"prompt_tokens":9}}', ((3, 0), True)),
    (b'{"usage":{"prompt_tokens":3},"text":"\\"usage\\":{\\"prompt_tokens\\":7}}"}',
     ((3, 0), True)),
    (b'{"a": 1, "usage": {"prompt_tokens": 4}}\n', ((4, 0), True)),
    (b'{\n  "usage":{"prompt_tokens":6}\n}', ((6, 0), True)),
    (b'["usage",{"usage":{"prompt_tokens":5}}]', ((0, 0), False)),
    # Not JSON: cut, read as nothing; not JSON before the member only, read all the same
    # (only the members from the last "usage" key on are parsed).
    (b'{"usage":{"prompt_tokens":5}', ((0, 0), False)),
    (b'{"id":"x",,"usage":{"prompt_tokens":5}}', ((5, 0), True)),
    # A usage object with no count under the protocol's names is no report (charged as an
    # answer without usage, not as one that used nothing).
    (b'{"choices":[],"usage":{}}', ((0, 0), False)),
    (b'{"choices":[],"usage":{"total_tokens":7}}', ((0, 0), False)),
    (b'{"choices":[],"usage":{"prompt_tokens":"3","completion_tokens":null}}',
     ((0, 0), False)),
    (b'{"choices":[],"usage":{"prompt_tokens":0,"completion_tokens":0}}', ((0, 0), True)),
    # A negative count is no report either: read as 0 and "reported", it made a call free
    # (found by a hostile trial).
    (b'{"choices":[],"usage":{"prompt_tokens":-1000000,"completion_tokens":-5}}',
     ((0, 0), False)),
    (b'{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":-5}}', ((7, 0), False)),
])
def test_json_answer_usage_is_its_top_level_member(body, read):
    assert json_usage(body) == read


@pytest.mark.parametrize(("endpoint", "usage", "final"), [
    (CHAT, b'{"prompt_tokens":11,"completion_tokens":5}', True),
    # An output count that is null or missing is no report: it charged the output as 0,
    # "reported" (found by a hostile trial; a 40-event stream's estimate was dropped).
    (CHAT, b'{"prompt_tokens":11,"completion_tokens":null}', False),
    (CHAT, b'{"prompt_tokens":11}', False),
    (COMPLETIONS, b'{"prompt_tokens":11}', False),
    (RESPONSES, b'{"input_tokens":11,"output_tokens":null}', False),
    (RESPONSES, b'{"input_tokens":11,"output_tokens":3}', True),
    (EMBEDDINGS, b'{"prompt_tokens":11,"total_tokens":11}', True),
])
def test_a_report_needs_both_counts_where_the_endpoint_has_output(endpoint, usage, final):
    body = b'{"choices":[],"usage":' + usage + b"}"
    assert json_usage(body, endpoint)[1] is final


def test_an_anthropic_stream_whose_output_count_is_null_is_no_report():
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter, "text/event-stream")
    for event in (
        {"type": "message_start", "message": {"usage": {"input_tokens": 9,
                                                        "output_tokens": 1}}},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hello"}},
        {"type": "message_delta", "usage": {"output_tokens": None}},
    ):
        meter.chunk(b"event: x\ndata: " + orjson.dumps(event) + b"\n\n")
    meter.finish()
    assert not meter.final and meter.streamed_tokens > 0
    # Its input count from message_start and an output count later make a report.
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter, "text/event-stream")
    for event in (
        {"type": "message_start", "message": {"usage": {"input_tokens": 9,
                                                        "output_tokens": 1}}},
        {"type": "message_delta", "usage": {"output_tokens": 12}},
    ):
        meter.chunk(b"event: x\ndata: " + orjson.dumps(event) + b"\n\n")
    meter.finish()
    assert meter.final and (meter.usage.input_tokens, meter.usage.output_tokens) == (9, 12)


def test_a_stream_with_bare_cr_line_endings_is_read_with_lf_endings():
    """Valid SSE, though no LLM API sends it: the meter waited for an LF that never came, so
    a stream whose usage chunk Sluice asked for was held whole until its end (a hostile
    trial). Its CRs are now passed on, and read, as LFs: the same line endings to an SSE
    reader, and the usage chunk the caller did not ask for is taken out as usual."""
    meter = Meter(CHAT, anthropic=False, strip_usage=True)
    started(meter, "text/event-stream")
    first = b'data: {"choices":[{"delta":{"content":"hi"}}]}\r\r'
    assert meter.chunk(first[:10]) == b""  # no line ended yet: held, as any partial line
    assert meter.chunk(first[10:]) == first.replace(b"\r", b"\n")
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\r\r'
    assert meter.chunk(usage + b"data: [DONE]\r\r") == b"data: [DONE]\n\n"
    assert meter.finish() == b""
    assert meter.complete and meter.final
    assert (meter.usage.input_tokens, meter.usage.output_tokens) == (3, 1)


def test_a_bare_cr_stream_whose_usage_stays_is_passed_on_byte_for_byte():
    """Read as LF, but passed on as it came when nothing is taken out of it: the fuzz test
    drew ``b"\\r\\x00"`` and got ``b"\\n\\x00"`` (a caller that asked for the usage chunk, or
    any text/event-stream answer, saw its bytes changed)."""
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter, "text/event-stream")
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\r\r'
    stream = b'data: {"choices":[{"delta":{"content":"hi"}}]}\r\r' + usage + b"data: [DONE]\r\r"
    assert feed_in_pieces(meter, stream, [10, 60, 80]) == stream
    assert meter.final and (meter.usage.input_tokens, meter.usage.output_tokens) == (3, 1)


def test_chunked_json_body_is_read_at_the_end():
    body = orjson.dumps({"id": "x", "usage": {"input_tokens": 3, "output_tokens": 9}})
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter, "application/json")
    assert feed_in_pieces(meter, body, [5, 17]) == body
    assert meter.final and meter.usage.output_tokens == 9


def test_compressed_answer_passes_untouched_and_unread():
    meter = Meter(CHAT, anthropic=False, strip_usage=True)
    headers = CIMultiDict({"Content-Type": "text/event-stream", "Content-Encoding": "gzip",
                           "Content-Length": "10"})
    meter.start(200, headers)
    assert headers["Content-Length"] == "10"
    assert meter.chunk(b"\x1f\x8bgarbage") == b"\x1f\x8bgarbage"
    assert not meter.final


@pytest.mark.parametrize("body", [
    b'{"max_tokens": "100000"}', b'{"max_tokens": 1e3}', b'{"max_tokens": -1}',
    b'{"max_completion_tokens": true}', b'{"max_tokens": 10, "n": 1e308}', b'{"n": 0}',
])
def test_a_cap_or_n_that_is_not_an_integer_is_refused_not_ignored(body):
    # Read as "no cap", the default would be reserved while a lenient upstream honours the
    # client's own value: the budget could be overshot.
    with pytest.raises(ValueError, match="must be a"):
        read_request(CHAT, body, default_cap=50, write_cap=True, stream_usage=True)


@pytest.mark.parametrize("usage", [{}, {"prompt_tokens": 3, "completion_tokens": 4}])
def test_an_anthropic_answer_without_its_own_counts_is_no_report(usage):
    for body in (orjson.dumps({"type": "message", "usage": usage}),):
        meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
        started(meter, "application/json")
        meter.body(body)
        assert not meter.final
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter, "text/event-stream")
    meter.chunk(b"event: message_delta\ndata: " + orjson.dumps(
        {"type": "message_delta", "usage": usage}) + b"\n\n")
    meter.finish()
    assert not meter.final


def test_a_negative_count_anywhere_in_a_stream_is_no_report():
    # Found by review: the negative message_start input count was dropped, and the later
    # message_delta's valid output count made the answer "reported": its input went free.
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter, "text/event-stream")
    meter.chunk(b"event: message_start\ndata: " + orjson.dumps(
        {"type": "message_start", "message": {"usage": {"input_tokens": -1000000}}}) + b"\n\n")
    meter.chunk(b"event: message_delta\ndata: " + orjson.dumps(
        {"type": "message_delta", "usage": {"output_tokens": 5}}) + b"\n\n")
    meter.finish()
    assert not meter.final


def test_a_stream_whose_usage_chunk_is_empty_is_no_report():
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter, "text/event-stream")
    meter.chunk(b'data: {"choices":[],"usage":{}}\n\ndata: [DONE]\n\n')
    meter.finish()
    assert not meter.final


@pytest.mark.parametrize("strip", [False, True])
@pytest.mark.parametrize("first", [True, False], ids=["first event", "later event"])
def test_a_long_event_in_small_chunks_is_searched_once_not_once_per_chunk(monkeypatch, strip,
                                                                           first):
    """An event held until its end was copied and searched whole again for every chunk that
    continued it: quadratic in its size (a 3 MB event in 1 KB chunks held the event loop for
    5 s; a 16 MB Responses event in 16 KB TLS records, 0.5 s). Chunks that do not end it are
    now only kept, and the event is read once it ends."""
    searched: list[int] = []

    def counting(original):
        def search(self: Meter, buf: bytes):
            searched.append(len(buf))
            return original(self, buf)
        return search

    monkeypatch.setattr(Meter, "_scan", counting(Meter._scan))
    monkeypatch.setattr(Meter, "_filter", counting(Meter._filter))
    long = sse(chat_chunk("x" * (JSON_LIMIT_BYTES // 4)))
    stream = (b"" if first else sse(chat_chunk("hi"))) + long + sse(USAGE_CHUNK, "[DONE]")
    meter = Meter(CHAT, anthropic=False, strip_usage=strip)
    started(meter)
    out = [meter.chunk(stream[at:at + 1024]) for at in range(0, len(stream), 1024)]
    out.append(meter.finish())
    kept = stream.replace(sse(USAGE_CHUNK), b"") if strip else stream
    assert b"".join(out) == kept
    assert (meter.usage.input_tokens, meter.usage.output_tokens, meter.final) == (7, 3, True)
    assert sum(searched) <= 2 * len(stream)


def _chat(delta: str, finish: str = "null", usage: bool = False) -> bytes:
    extra = ',"usage":{"prompt_tokens":3,"completion_tokens":1}' if usage else ""
    return (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
            b'"delta":{"content":"' + delta.encode() + b'"},"finish_reason":'
            + finish.encode() + b"}]" + extra.encode() + b"}\n\n")


def test_usage_in_every_chunk_does_not_end_the_answer():
    """A hostile trial and a review: vLLM's ``continuous_usage_stats`` sends usage in every
    chunk, and a usage read ended the answer, so a stream cut after two chunks was kept
    for its key and replayed. Only a finish (or the last event) ends it."""
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter)
    meter.chunk(_chat("a", usage=True) + _chat("b", usage=True))
    meter.finish()
    assert meter.cut_short
    whole = Meter(CHAT, anthropic=False, strip_usage=False)
    started(whole)
    whole.chunk(_chat("a", usage=True) + _chat("", '"stop"', usage=True))
    whole.finish()
    assert not whole.cut_short


def _usage_chunk(text: str | None, prompt: int, completion: int, finish: str | None = None
                 ) -> dict:
    """A chat chunk carrying a usage object: with a choice of ``text`` (a role chunk for
    ``""``), or none (``None``, OpenAI's last chunk)."""
    choices = [] if text is None else [{"index": 0, "delta": {"content": text},
                                        "finish_reason": finish}]
    return {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def _chat_meter(events: list, chunked: bool) -> Meter:
    """A Chat Completions stream's meter (its usage chunk kept) after ``events``: in 1 KiB
    reads of the whole stream (``chunked``), else an event a read."""
    stream = sse(*events)
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter)
    if chunked:
        feed_in_pieces(meter, stream, list(range(1024, len(stream), 1024)))
    else:
        for event in events:
            meter.chunk(sse(event))
        meter.finish()
    return meter

@pytest.mark.parametrize("chunked", [False, True], ids=["event-per-chunk", "1-KB-chunks"])
def test_usage_followed_by_content_is_no_final_count(chunked):
    """A hostile trial: a stream whose one usage object came in its first chunk
    (``completion_tokens: 0``), then 50 content chunks, was charged 0 output tokens as
    reported, whole or cut. Usage is final only if no content follows it outside a usage
    object: so that stream reports none (and settles as one without usage), while vLLM's
    ``continuous_usage_stats`` (usage in every chunk, the totals in the last) and OpenAI's
    usage chunk after the content stay final."""
    content = [chat_chunk(f"tok{i:02d} ") for i in range(50)]
    streams = {
        "usage first": ([_usage_chunk("", 11, 0), *content, "[DONE]"], False, (11, 0)),
        "usage first, one later": ([_usage_chunk("", 11, 0), *content,
                                    _usage_chunk(None, 11, 100), "[DONE]"], True, (11, 100)),
        "continuous": ([_usage_chunk("", 11, 0)]
                       + [_usage_chunk(f"tok{i:02d} ", 11, 2 * i + 2) for i in range(50)]
                       + [_usage_chunk("", 11, 100, "stop"), "[DONE]"], True, (11, 100)),
        "usage last": ([*content, _usage_chunk(None, 11, 100), "[DONE]"], True, (11, 100)),
    }
    for name, (events, final, counts) in streams.items():
        meter = _chat_meter(events, chunked)
        assert meter.final is final, name
        assert (meter.usage.input_tokens, meter.usage.output_tokens) == counts, name
        assert meter.streamed_tokens >= 50, name


@pytest.mark.parametrize("chunked", [False, True], ids=["event-per-chunk", "1-KB-chunks"])
def test_content_carrying_a_usage_object_that_is_no_count_ends_an_earlier_count(chunked):
    """A review: after a first chunk's usage (``{prompt 11, completion 0}``), content chunks
    each carrying a usage object that is no full count (``"usage": {}``, an input count
    alone, Groq's ``x_groq.usage``) kept that early count final, so 50 chunks of text were
    charged 0 output tokens as reported. Only a full count on the chunk that brings the
    text keeps the stream's usage final (vLLM's ``continuous_usage_stats``)."""
    content = [chat_chunk(f"tok{i:02d} ") for i in range(50)]
    for name, extra in (("empty", {"usage": {}}),
                        ("input only", {"usage": {"prompt_tokens": 11}}),
                        ("nested", {"usage": None, "x_groq": {"usage": {"queue_time": 0.1}}})):
        events = [_usage_chunk("", 11, 0), *({**c, **extra} for c in content), "[DONE]"]
        meter = _chat_meter(events, chunked)
        assert not meter.final, name
        assert meter.streamed_tokens >= 50, name


def test_an_empty_finish_reason_is_none():
    """A hostile trial: some servers send ``"finish_reason": ""`` on every chunk, and it
    ended the answer at the first one."""
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter)
    meter.chunk(_chat("a", '""') + _chat("b", ' ""'))
    meter.finish()
    assert meter.cut_short


def test_an_error_chunk_after_done_is_no_failure_of_a_chat_stream():
    """A hostile trial: a whole stream, then a stray error chunk after ``data: [DONE]``
    (which the openai SDK never reads) counted upstream_error: not kept, billed again, and
    two such answers opened the breaker."""
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter)
    meter.chunk(_chat("a", '"stop"') + b"data: [DONE]\n\n"
                + b'data: {"error":{"message":"boom","type":"server_error"}}\n\n')
    meter.finish()
    assert (meter.done, meter.failed, meter.stream_error, meter.cut_short) == (
        True, False, None, False)


def test_a_stream_is_known_by_its_content_type_in_any_case():
    """Media types are case-insensitive (RFC 9110 §8.3.1): a hostile trial's
    ``Text/Event-Stream`` answer was read as nothing, and its mid-stream error missed."""
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter, "Text/Event-Stream; charset=utf-8")
    meter.chunk(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"}}\n\n')
    meter.finish()
    assert meter.failed and meter.stream_error is not None


def test_a_json_answer_that_is_no_json_is_cut_short():
    """A hostile trial: a JSON answer whose body ended cleanly half way (an early last
    chunk, or a close) was kept for its key and replayed broken for the key's ttl."""
    whole = b'{"id":"c","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,' \
            b'"completion_tokens":1}}'
    for data, cut in ((whole, False), (whole[:30], True), (whole[:-1], True)):
        meter = Meter(CHAT, anthropic=False, strip_usage=False)
        started(meter, "application/json")
        meter.body(data)
        assert meter.cut_short is cut, data


def test_an_unterminated_message_delta_does_not_end_the_answer():
    """A review: an event the stream ended inside is discarded by an SSE client; its usage
    is read, but a ``message_delta`` so cut ends no answer, as a ``message_stop`` does not."""
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter)
    meter.chunk(b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
                b'"end_turn"},"usage":{"output_tokens":7}}')
    meter.finish()
    assert meter.cut_short and meter.usage.output_tokens == 7


@pytest.mark.parametrize("body, cut", [
    (b'{"choices":[{"logprob":NaN}],"usage":{"prompt_tokens":1,"completion_tokens":1}}', False),
    (b'{"usage":{"prompt_tokens":1,"completion_tokens":1},"choices":[{"logprob":NaN}]}', False),
    (b"", False),
    (b"OK", False),
    (b'\xef\xbb\xbf{"choices":[]}', False),
    (b'{"choices":[{"message":{"content":"hel', True),
])
def test_only_a_json_answer_cut_at_its_end_is_cut_short(body, cut):
    """A review: every body orjson refuses was judged cut short (a whole answer with NaN,
    which Python's json writes, depending on its keys' order; an empty 200; text labelled
    JSON), so none was kept and every retry ran again. Only a parse that ran out at the
    body's end is a cut."""
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter, "application/json")
    meter.body(body)
    assert meter.cut_short is cut


def test_an_anthropic_message_delta_without_usage_ends_the_answer():
    """A review: only a ``message_delta`` carrying usage reached the parse that ends the
    answer, so a server that sends it bare and then closes was judged cut short."""
    meter = Meter(MESSAGES, anthropic=True, strip_usage=False)
    started(meter)
    meter.chunk(b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
                b'"end_turn"}}\n\n')
    meter.finish()
    assert not meter.cut_short


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_json_answer_cut_within_text_that_is_not_ascii_is_cut_short(cut):
    """A review: orjson reports where a parse failed in characters, not bytes, and a body cut
    inside a character is no UTF-8 at all: an answer cut after any ``é`` or emoji was judged
    whole, kept and replayed broken."""
    whole = '{"choices":[{"message":{"content":"日本語 é 🙂"}}]}'.encode()
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter, "application/json")
    meter.body(whole[:-cut])
    assert meter.cut_short


def test_content_after_done_is_not_counted():
    """A review: content chunks after ``data: [DONE]``, which the openai SDK never reads,
    went into the output estimate charged when no usage came."""
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    started(meter)
    meter.chunk(_chat("a", '"stop"') + b"data: [DONE]\n\n" + _chat("x" * 400) * 3)
    meter.finish()
    assert meter.streamed_tokens == 1


def _streamed(kind, data: bytes, parse_all: bool = False) -> int:
    """streamed_tokens of a stream cut before its end; ``parse_all``: every event parsed."""
    with mock.patch.object(usage, "SAMPLE_EVENTS", 10**9 if parse_all else SAMPLE_EVENTS):
        meter = Meter(kind, anthropic=kind is MESSAGES, strip_usage=False)
        started(meter)
        meter.chunk(data)
        return meter.streamed_tokens


def test_big_later_events_without_text_count_as_parsed():
    """A review of a first cut, which counted every later event by its size: an Azure
    content filter's chunks (an empty delta and the filter's results) and a thinking block's
    signature (no text, and always past the sample) were charged as text, 33x over."""
    annotation = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [
        {"index": 0, "finish_reason": None, "delta": {},
         "content_filter_results": {k: {"filtered": False, "severity": "safe"} for k in (
             "hate", "self_harm", "sexual", "violence")}}]}
    events = [chat_chunk("word ") for _ in range(SAMPLE_EVENTS)]
    for _ in range(50):
        events += [chat_chunk("word "), chat_chunk("word "), annotation]
    data = sse(*events)
    assert _streamed(CHAT, data) == _streamed(CHAT, data, parse_all=True)

    def delta(body: dict) -> dict:
        return {"type": "content_block_delta", "index": 0, "delta": body}

    events = [delta({"type": "thinking_delta", "thinking": "Let me think. "})
              for _ in range(SAMPLE_EVENTS + 4)]
    events.append(delta({"type": "signature_delta", "signature": "EqQBCkYIARgCIkD" * 80}))
    data = sse(*events, event_names=["content_block_delta"] * len(events))
    assert _streamed(MESSAGES, data) == _streamed(MESSAGES, data, parse_all=True)
