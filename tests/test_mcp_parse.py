"""policies/mcp.py: reading MCP POSTs and answers, fingerprints, id rewriting, refusals."""

from __future__ import annotations

import base64

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from policies.mcp import (
    AnswerTracker,
    HeaderMismatch,
    InvalidMcpRequest,
    McpPost,
    Outcome,
    UnusableAnswer,
    accepts_sse,
    allows_batch,
    answer_outcome,
    check_headers,
    continuation_of,
    decode_header_value,
    fingerprint,
    is_modern,
    parse_post,
    refusal,
    resumes,
    rewrite_id,
    traffic,
)


def rpc(method: str | None = None, rpc_id: object = 1, **params: object) -> bytes:
    doc: dict[str, object] = {"jsonrpc": "2.0"}
    if method is not None:
        doc["method"] = method
        if params:
            doc["params"] = params
    if rpc_id is not ...:
        doc["id"] = rpc_id
    return orjson.dumps(doc)


def call(tool: str = "send", rpc_id: object = 1, **arguments: object) -> bytes:
    return rpc("tools/call", rpc_id, name=tool, arguments=arguments)


def one(body: bytes, version: str | None = None):
    post = parse_post(body, version)
    assert not post.batch and len(post.messages) == 1
    return post.messages[0]


# -- parse_post --------------------------------------------------------------------------------


def test_a_tool_call_gives_method_id_tool_and_arguments() -> None:
    post = parse_post(call("send", 7, to="alice", n=2))
    message = post.messages[0]
    assert (message.kind, message.method, message.id) == ("request", "tools/call", 7)
    assert post.tool == message.tool == message.target == "send"
    assert message.arguments == {"to": "alice", "n": 2}
    assert post.request is message


def test_string_ids_and_absent_arguments() -> None:
    message = one(rpc("tools/call", "abc", name="add"))
    assert message.id == "abc"
    assert message.arguments == {}


def test_other_named_methods_have_a_target_but_no_tool() -> None:
    read = one(rpc("resources/read", 2, uri="file:///a.txt"))
    assert (read.target, read.tool) == ("file:///a.txt", None)
    prompt = one(rpc("prompts/get", 3, name="greet", arguments={"who": "x"}))
    assert (prompt.target, prompt.arguments) == ("greet", {"who": "x"})
    assert one(rpc("tools/list", 4)).target is None


def test_notifications_and_responses() -> None:
    note = one(rpc("notifications/initialized", ...))
    assert (note.kind, note.id) == ("notification", None)
    result = one(b'{"jsonrpc": "2.0", "id": 5, "result": {}}')
    assert (result.kind, result.method, result.id) == ("response", None, 5)
    unreadable = one(b'{"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": "x"}}')
    assert unreadable.kind == "response" and unreadable.id is None
    post = parse_post(rpc("notifications/initialized", ...))
    assert post.request is None and post.tool is None


@pytest.mark.parametrize("body", [
    b"",
    b"not json",
    b"\xff\xfe{}",
    b'"a string"',
    b"42",
    b"{}",
    b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}',
    b'{"id": 1, "method": "ping"}',
    b'{"jsonrpc": "2.0", "id": 1, "method": ""}',
    b'{"jsonrpc": "2.0", "id": 1, "method": 5}',
    b'{"jsonrpc": "2.0", "id": null, "method": "ping"}',
    b'{"jsonrpc": "2.0", "id": true, "method": "ping"}',
    b'{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}',
    b'{"jsonrpc": "2.0", "id": 123456789012345678901234567890, "method": "ping"}',
    b'{"jsonrpc": "2.0", "id": [1], "method": "ping"}',
    b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": [1, 2]}',
    b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call"}',
    b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": 3}}',
    b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call",'
    b' "params": {"name": "a", "arguments": [1]}}',
    b'{"jsonrpc": "2.0", "id": 1}',
    b'{"jsonrpc": "2.0", "id": 1, "result": {}, "error": {}}',
    b'{"jsonrpc": "2.0", "id": null, "result": {}}',
])
def test_malformed_bodies_are_invalid_requests(body: bytes) -> None:
    with pytest.raises(InvalidMcpRequest) as err:
        parse_post(body)
    assert isinstance(err.value, ValueError) and err.value.detail


def test_batches_only_at_2025_03_26_or_without_a_version() -> None:
    body = b"[" + call("a", 1) + b"," + rpc("notifications/initialized", ...) + b"]"
    for version in (None, "2025-03-26"):
        post = parse_post(body, version)
        assert post.batch and [m.kind for m in post.messages] == ["request", "notification"]
        assert post.request is None and post.tool is None
    for version in ("2025-06-18", "2025-11-25", "2026-07-28"):
        with pytest.raises(InvalidMcpRequest, match="batch"):
            parse_post(body, version)
    with pytest.raises(InvalidMcpRequest, match="empty"):
        parse_post(b"[]")
    assert allows_batch(None) and not allows_batch("2025-06-18")


def test_is_modern() -> None:
    assert is_modern("2026-07-28") and is_modern("2027-01-01")
    assert not is_modern("2025-11-25") and not is_modern(None) and not is_modern("latest")


# -- traffic -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "expected"), [
    (rpc("initialize", 1, protocolVersion="2025-11-25"), "control"),
    (rpc("server/discover", 1), "control"),
    (rpc("ping", 1), "control"),
    (rpc("notifications/initialized", ...), "control"),
    (rpc("notifications/cancelled", ..., requestId=3), "control"),
    (rpc("tools/list", 1), "control"),
    (rpc("resources/templates/list", 1), "control"),
    (rpc("prompts/list", 1, cursor="x"), "control"),
    (b'{"jsonrpc": "2.0", "id": 0, "result": {"action": "accept"}}', "control"),
    (b'{"jsonrpc": "2.0", "id": 0, "error": {"code": -1, "message": "no"}}', "control"),
    (call("send"), "call"),
    (rpc("resources/read", 1, uri="file:///x"), "call"),
    (rpc("prompts/get", 1, name="p"), "call"),
    (rpc("completion/complete", 1), "control"),
    (rpc("logging/setLevel", 1, level="debug"), "control"),
    (rpc("resources/subscribe", 1, uri="file:///x"), "control"),
    (rpc("resources/unsubscribe", 1, uri="file:///x"), "control"),
    (rpc("tasks/get", 1, taskId="t1"), "control"),
    (rpc("tasks/result", 1, taskId="t1"), "control"),
    (rpc("tasks/cancel", 1, taskId="t1"), "control"),
    (rpc("sampling/unknownThing", 1), "call"),  # a method not known here may be work
    (rpc("subscriptions/listen", 1), "stream"),
])
def test_traffic_of_a_post(body: bytes, expected: str) -> None:
    assert traffic("POST", parse_post(body)) == expected


@pytest.mark.parametrize(("body", "expected"), [
    (rpc("notifications/cancelled", ..., requestId=3, reason="timed out"), 3),
    (rpc("notifications/cancelled", ..., requestId="3"), "3"),  # as sent: not the number 3
    (rpc("notifications/cancelled", ...), None),  # names nothing
    (rpc("notifications/cancelled", ..., requestId=True), None),  # no id
    (rpc("notifications/cancelled", ..., requestId=None), None),
    (rpc("notifications/cancelled", 4, requestId=3), None),  # a request of that name
    (rpc("notifications/progress", ..., requestId=3), None),
    (call("send"), None),
    (b"[" + rpc("notifications/cancelled", ..., requestId=3) + b"]", None),  # a batch
])
def test_the_request_a_cancel_names(body: bytes, expected: object) -> None:
    cancels = parse_post(body).cancels
    assert cancels == expected and type(cancels) is type(expected)


@pytest.mark.parametrize(("body", "expected"), [
    (rpc("initialize", 1), "initialize"),
    (rpc("notifications/initialized", ...), "notifications/initialized"),
    (call("send"), "tools/call"),
    (orjson.dumps({"jsonrpc": "2.0", "id": 1, "result": {}}), None),  # a response
    (b"[" + rpc("ping", 1) + b"]", None),  # a batch: no one method
])
def test_the_method_a_post_names(body: bytes, expected: str | None) -> None:
    assert parse_post(body).method == expected


def test_traffic_without_a_body() -> None:
    assert traffic("GET") == "stream"  # the session's stream, or a resumption (Last-Event-ID)
    assert traffic("delete") == "control"
    assert traffic("OPTIONS") == "control"
    with pytest.raises(TypeError):
        traffic("POST")


def test_a_get_with_last_event_id_resumes() -> None:
    assert resumes("GET", CIMultiDict({"last-event-id": "2:3"}))
    assert not resumes("GET", CIMultiDict({"Last-Event-ID": ""}))  # the session's stream
    assert not resumes("GET", CIMultiDict())
    assert not resumes("POST", CIMultiDict({"Last-Event-ID": "2:3"}))


def test_a_batch_is_a_call_when_any_member_is() -> None:
    control = b"[" + rpc("ping", 1) + b"," + rpc("tools/list", 2) + b"]"
    mixed = b"[" + rpc("ping", 1) + b"," + call("send", 2) + b"]"
    assert traffic("POST", parse_post(control)) == "control"
    assert traffic("POST", parse_post(mixed)) == "call"


# -- check_headers -----------------------------------------------------------------------------


def b64(text: str) -> str:
    return "=?base64?" + base64.b64encode(text.encode()).decode() + "?="


def test_agreeing_headers_pass() -> None:
    post = parse_post(call("send"))
    check_headers(post, {"Mcp-Method": "tools/call", "Mcp-Name": "send"})
    check_headers(post, CIMultiDict({"mcp-method": "tools/call", "MCP-NAME": "send"}))
    check_headers(post, {"mcp-method": "tools/call", "mcp-name": b64("send")})
    check_headers(post, {})  # absent headers are not checked unless required


def test_a_header_that_disagrees_with_the_body_is_a_mismatch() -> None:
    post = parse_post(call("send"))
    with pytest.raises(HeaderMismatch) as err:
        check_headers(post, {"Mcp-Method": "tools/call", "Mcp-Name": "add"})
    assert (err.value.header, err.value.header_value, err.value.body_value) == (
        "Mcp-Name", "add", "send")
    assert isinstance(err.value, InvalidMcpRequest)
    with pytest.raises(HeaderMismatch, match="Mcp-Method"):
        check_headers(post, {"Mcp-Method": "tools/list"})
    with pytest.raises(HeaderMismatch, match="Mcp-Name"):
        check_headers(post, {"Mcp-Name": b64("add")})
    with pytest.raises(HeaderMismatch, match="Mcp-Name"):  # a name on a method without one
        check_headers(parse_post(rpc("tools/list", 1)), {"Mcp-Name": "send"})
    with pytest.raises(HeaderMismatch, match="Mcp-Method"):  # a method on a response
        check_headers(parse_post(b'{"jsonrpc":"2.0","id":1,"result":{}}'),
                      {"Mcp-Method": "tools/call"})


def test_a_non_ascii_name_travels_base64_encoded() -> None:
    post = parse_post(rpc("tools/call", 1, name="grüßen"))
    check_headers(post, {"Mcp-Name": b64("grüßen")})
    # A plain value that looks like the sentinel must itself be encoded by the client.
    literal = parse_post(rpc("tools/call", 1, name="=?base64?x?="))
    check_headers(literal, {"Mcp-Name": b64("=?base64?x?=")})


@pytest.mark.parametrize("value", ["=?base64?***?=", "=?base64?" + base64.b64encode(
    b"\xff\xfe").decode() + "?="])
def test_an_undecodable_sentinel_is_a_mismatch(value: str) -> None:
    with pytest.raises(HeaderMismatch):
        decode_header_value(value)


def test_required_headers_for_2026_clients() -> None:
    post = parse_post(call("send"))
    with pytest.raises(HeaderMismatch, match="Mcp-Method"):
        check_headers(post, {"Mcp-Name": "send"}, require=True)
    with pytest.raises(HeaderMismatch, match="Mcp-Name"):
        check_headers(post, {"Mcp-Method": "tools/call"}, require=True)
    check_headers(parse_post(rpc("tools/list", 1)), {"Mcp-Method": "tools/list"}, require=True)
    check_headers(parse_post(rpc("notifications/x", ...)), {}, require=True)


def test_protocol_version_header_must_match_the_body_meta() -> None:
    body = rpc("tools/call", 1, name="a",
               _meta={"io.modelcontextprotocol/protocolVersion": "2026-07-28"})
    check_headers(parse_post(body), {"MCP-Protocol-Version": "2026-07-28"})
    with pytest.raises(HeaderMismatch, match="MCP-Protocol-Version"):
        check_headers(parse_post(body), {"mcp-protocol-version": "2025-11-25"})


def test_a_batch_carries_no_method_or_name_header() -> None:
    post = parse_post(b"[" + rpc("ping", 1) + b"]")
    check_headers(post, {})
    with pytest.raises(HeaderMismatch):
        check_headers(post, {"Mcp-Method": "ping"})


# -- fingerprint -------------------------------------------------------------------------------


def fp(body: bytes, headers: dict[str, str] | None = None, names: tuple[str, ...] = ()) -> str:
    return fingerprint(one(body), headers, names)


def test_the_fingerprint_ignores_the_id_key_order_and_meta() -> None:
    first = fp(rpc("tools/call", 1, name="send", arguments={"to": "a", "cc": ["b", {"y": 1,
                                                                                  "x": 2}]}))
    again = fp(rpc("tools/call", "other-id", arguments={"cc": ["b", {"x": 2, "y": 1}], "to": "a"},
                   name="send", _meta={"progressToken": 99}))
    assert first == again and len(first) == 64 and int(first, 16) >= 0


@pytest.mark.parametrize("other", [
    call("send", 1, to="b"),           # another argument value
    call("send", 1, to="a", x=None),   # another argument
    call("sendx", 1, to="a"),          # another tool
    call("send", 1, to=["a"]),         # another type
    rpc("tools/call", 1, name="send", arguments={"to": "a"}, requestState="s1"),
    rpc("tools/call", 1, name="send", arguments={"to": "a"},
        inputResponses={"q": {"action": "accept"}}),
    rpc("prompts/get", 1, name="send", arguments={"to": "a"}),  # another method
])
def test_the_fingerprint_covers_what_makes_another_call(other: bytes) -> None:
    assert fp(call("send", 1, to="a")) != fp(other)


@pytest.mark.parametrize("first, other", [
    (rpc("tools/call", 1, name="send", arguments={"to": "a"}),
     rpc("tools/call", 1, name="send", arguments={"to": "a"}, task={"ttl": 60000})),
    (rpc("tasks/get", 1, taskId="t-1"), rpc("tasks/get", 1, taskId="t-2")),
    (rpc("logging/setLevel", 1, level="debug"), rpc("logging/setLevel", 1, level="error")),
    (rpc("completion/complete", 1, ref={"type": "ref/prompt", "name": "p"},
         argument={"name": "a", "value": "x"}),
     rpc("completion/complete", 1, ref={"type": "ref/prompt", "name": "p"},
         argument={"name": "a", "value": "y"})),
    (rpc("resources/read", 1, uri="file:///a"), rpc("resources/read", 1, uri="file:///b")),
])
def test_the_fingerprint_covers_every_param_but_meta(first: bytes, other: bytes) -> None:
    """A hostile trial (2026-12-06): only the method, a name and the MRTR members counted, so
    two tasks' polls, or a call and the same call asked for as a task, shared one."""
    assert fp(first) != fp(other)


def test_a_fingerprint_made_before_every_param_counted_is_unchanged() -> None:
    """Answers stored under an earlier release's fingerprint still replay: a request with
    no params besides those that counted then keeps its fingerprint (values computed with
    the release before 2026-12-06)."""
    assert fp(rpc("tools/call", 9, name="send", arguments={"to": "a"},
                  _meta={"progressToken": 1})) == (
        "73d718337e8368c22083a1efb578882ca7f6eba5e9634dc19afdf5c9235ef540")
    assert fp(rpc("resources/read", 9, uri="file:///x")) == (
        "55597ac0ac0ec3bbc0fc56b972dda0516dcf0e992bc445eb04d2c8b0eec5dbcb")


def test_a_continuation_stands_on_the_round_it_continues_not_its_sealed_state() -> None:
    """An MRTR continuation whose ``requestState`` Sluice saw made counts by that round
    (``after``, :func:`continuation_of`: the round's fingerprint and what it asked), so two
    continuations of one call match though the SDK seals each state with a random nonce;
    other rounds, other questions, other answers differ; a state not seen counts as itself."""
    def continuation(state: str) -> bytes:
        return rpc("tools/call", 5, name="send", arguments={"to": "a"},
                   inputResponses={"ask": {"action": "accept", "content": {"ok": True}}},
                   requestState=state)

    asked = answer_outcome(orjson.dumps({"jsonrpc": "2.0", "id": 1, "result": {
        "resultType": "input_required", "requestState": "sealed-1",
        "inputRequests": {"ask": {"method": "elicitation/create"}}}}), "application/json", 1)
    assert asked is not None and asked.request_state == "sealed-1"
    after = continuation_of(b"r" * 32, asked)
    assert fingerprint(one(continuation("sealed-1")), after=after) == fingerprint(
        one(continuation("sealed-2")), after=after)
    assert fingerprint(one(continuation("sealed-1")), after=after) != fingerprint(
        one(continuation("sealed-1")), after=continuation_of(b"s" * 32, asked))
    other_question = Outcome(input_required=True, request_state="x", asked=b"q")
    assert continuation_of(b"r" * 32, other_question) != after
    assert fp(continuation("sealed-1")) != fp(continuation("sealed-2"))


def test_chosen_headers_count_and_others_do_not() -> None:
    body = call("send", 1, to="a")
    base = fp(body, {"X-Run-ID": "r1", "X-Noise": "1"}, ("x-run-id",))
    assert base == fp(body, {"x-run-id": "r1", "X-Noise": "2"}, ("X-Run-ID",))
    assert base == fingerprint(one(body), CIMultiDict({"X-RUN-ID": "r1"}), ["x-run-id"])
    assert base != fp(body, {"X-Run-ID": "r2"}, ("x-run-id",))
    assert fp(body, {}, ("x-run-id",)) != fp(body, {"x-run-id": ""}, ("x-run-id",))
    assert fp(body) == fp(body, {"X-Run-ID": "r1"})  # a header nobody chose


# -- answers -----------------------------------------------------------------------------------

#: What the official server (mcp 2.x, an event store) sent for a tools/call with id 2.
SERVER_SSE = (b'id: 2:2\r\ndata: \r\n\r\nid: 2:3\r\nevent: message\r\ndata: {"jsonrpc":"2.0",'
              b'"id":2,"result":{"content":[{"text":"3","type":"text"}],"isError":false,'
              b'"structuredContent":{"result":3}}}\r\n\r\n')

PROGRESS = b'{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}'
SERVER_REQUEST = b'{"jsonrpc":"2.0","id":2,"method":"sampling/createMessage","params":{}}'


def sse(*events: bytes, eol: bytes = b"\n") -> bytes:
    return b"".join(b"event: message" + eol + b"data: " + e + eol + eol for e in events)


def test_rewrite_id_in_a_json_answer() -> None:
    answer = b'{"jsonrpc": "2.0", "id": 1, "result": {"content": [], "isError": false}}'
    out = rewrite_id(answer, "application/json", 1, 41)
    assert orjson.loads(out) == {**orjson.loads(answer), "id": 41}
    assert orjson.loads(rewrite_id(answer, None, 1, "s"))["id"] == "s"


def test_rewrite_id_in_a_batch_answer_touches_only_that_response() -> None:
    answer = b'[{"jsonrpc":"2.0","id":1,"result":{}},{"jsonrpc":"2.0","id":2,"result":{}}]'
    assert [d["id"] for d in orjson.loads(rewrite_id(answer, "application/json", 2, 9))] == [1, 9]


def test_rewrite_id_in_the_servers_sse_answer() -> None:
    out = rewrite_id(SERVER_SSE, "text/event-stream; charset=utf-8", 2, 77)
    assert out == SERVER_SSE.replace(b'"id":2,', b'"id":77,')
    assert answer_outcome(out, "text/event-stream", 77) == Outcome()


def test_rewrite_id_in_sse_keeps_every_other_byte() -> None:
    # A server request with the same id (its own id space), then the response over two data
    # lines, CR line ends, a comment.
    answer = (b": keep-alive\r" + sse(PROGRESS, SERVER_REQUEST, eol=b"\r")
              + b'id: 9\rdata: {"jsonrpc":"2.0",\rdata: "id":2,"result":{}}\r\r')
    out = rewrite_id(answer, "text/event-stream", 2, "new")
    head = b": keep-alive\r" + sse(PROGRESS, SERVER_REQUEST, eol=b"\r")
    assert out.startswith(head)
    assert out[len(head):] == b'id: 9\rdata: {"jsonrpc":"2.0","id":"new","result":{}}\r\r'


@pytest.mark.parametrize(("answer", "content_type"), [
    (b'{"jsonrpc":"2.0","id":3,"result":{}}', "application/json"),  # another request's id
    (b'{"jsonrpc":"2.0","id":"2","result":{}}', "application/json"),  # "2" is not 2
    (b"not json", "application/json"),
    (sse(PROGRESS), "text/event-stream"),
    (sse(SERVER_REQUEST), "text/event-stream"),  # a request, not the response
    (b'data: {"jsonrpc":"2.0","id":2,"result":{}}\n', "text/event-stream"),  # never ended
])
def test_an_answer_without_the_response_cannot_be_rewritten(answer: bytes,
                                                            content_type: str) -> None:
    with pytest.raises(UnusableAnswer):
        rewrite_id(answer, content_type, 2, 5)


def test_tracker_sees_the_response_once_its_event_ends_whatever_the_chunks() -> None:
    answer = b": hi\r\n" + sse(PROGRESS, SERVER_REQUEST, eol=b"\r\n") + SERVER_SSE
    for size in (1, 2, 3, 7, len(answer)):
        tracker = AnswerTracker("text/event-stream", 2)
        outcomes = [tracker.feed(answer[i:i + size]) for i in range(0, len(answer), size)]
        assert outcomes[-1] == Outcome()
        assert outcomes[:-1] == [None] * (len(outcomes) - 1)  # not before its last byte
        assert tracker.complete_at == len(answer)


def test_tracker_complete_at_ends_at_the_response_event() -> None:
    answer = SERVER_SSE + sse(PROGRESS)  # anything after the response is not part of it
    tracker = AnswerTracker("text/event-stream", 2)
    assert tracker.feed(answer) == Outcome()
    assert tracker.complete_at == len(SERVER_SSE)


def test_tracker_needs_the_blank_line_that_ends_the_event() -> None:
    tracker = AnswerTracker("text/event-stream", 2)
    assert tracker.feed(SERVER_SSE[:-2]) is None  # the event is not over yet
    assert tracker.finish() is None               # and a stream cut here never dispatches it
    tracker = AnswerTracker("text/event-stream", 2)
    tracker.feed(SERVER_SSE[:-1])                 # "...\r\n\r": maybe half of a CRLF
    assert tracker.outcome is None
    assert tracker.finish() == Outcome()          # the stream ended: the CR ends the line


def test_a_json_answer_is_complete_at_its_end() -> None:
    body = b'{"jsonrpc":"2.0","id":2,"result":{"isError":true,"content":[]}}'
    tracker = AnswerTracker("application/json", 2)
    assert tracker.feed(body[:10]) is None and tracker.feed(body[10:]) is None
    assert tracker.finish() == Outcome(is_error_result=True)
    assert tracker.complete_at == len(body)
    assert answer_outcome(body[:-1], "application/json", 2) is None
    assert answer_outcome(body, "application/json", 3) is None


@pytest.mark.parametrize(("response", "outcome", "failure"), [
    ({"result": {"content": [], "isError": False}}, Outcome(), False),
    ({"result": {"content": [], "isError": True}}, Outcome(is_error_result=True), True),
    ({"result": {"isError": "yes"}}, Outcome(), False),
    ({"error": {"code": -32602, "message": "bad"}}, Outcome(error_code=-32602), False),
    ({"error": {"code": -32603, "message": "boom"}}, Outcome(error_code=-32603), True),
    ({"error": {"code": 429, "message": "slow down"}}, Outcome(error_code=429), True),
    ({"error": {"code": "x", "message": "odd"}}, Outcome(error_code=-32603), True),
    ({"result": {"resultType": "input_required", "requestState": "s"}},
     Outcome(input_required=True), False),
    ({"error": {"code": -32800, "message": "Request cancelled"}},
     Outcome(error_code=-32800, cancelled=True), False),
    ({"error": {"code": 0, "message": "Request cancelled"}},
     Outcome(error_code=0, cancelled=True), False),
    ({"error": {"code": 0, "message": "other"}}, Outcome(error_code=0), True),
])
def test_outcomes_and_tool_failures(response: dict, outcome: Outcome, failure: bool) -> None:
    doc = orjson.dumps({"jsonrpc": "2.0", "id": 4, **response})
    for content_type, answer in (("application/json", doc), ("text/event-stream", sse(doc))):
        got = answer_outcome(answer, content_type, 4)
        assert got == outcome and got.tool_failure is failure


def test_an_error_without_id_answers_a_json_request() -> None:
    body = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"parse error"}}'
    assert answer_outcome(body, "application/json", 1) == Outcome(error_code=-32700)


# -- refusal -----------------------------------------------------------------------------------


def test_refusal_body() -> None:
    body = orjson.loads(refusal(7, 429, "rate limited", reason="rate_limited",
                                retry_after_ms=1500, policy="tools.send"))
    assert body == {"jsonrpc": "2.0", "id": 7, "error": {
        "code": 429, "message": "rate limited",
        "data": {"reason": "rate_limited", "retryAfterMs": 1500, "policy": "tools.send"}}}
    assert orjson.loads(refusal(None, 503, "busy", reason="queue_full"))["id"] is None
    assert answer_outcome(refusal("a", 503, "busy", reason="x"), "application/json", "a") == \
        Outcome(error_code=503)
    with pytest.raises(ValueError, match="reserve"):
        refusal(1, -32001, "no", reason="x")


# -- fuzzing: only the documented errors, whatever the input ------------------------------------

VERSIONS = st.sampled_from([None, "2025-03-26", "2025-11-25", "2026-07-28", "garbage"])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["jsonrpc", "id", "method", "params", "name", "arguments", "result",
                         "error", "uri", "_meta", "code", "x"]), inner, max_size=5),
    max_leaves=10)
MESSAGE = st.fixed_dictionaries(
    {"jsonrpc": st.sampled_from(["2.0", "2.0", "1.0"])},
    optional={"id": JSON | st.integers() | st.text(max_size=4),
              "method": st.sampled_from(["tools/call", "tools/list", "ping", "resources/read",
                                         "notifications/x", ""]) | JSON,
              "params": st.fixed_dictionaries({}, optional={
                  "name": st.text(max_size=6) | JSON, "arguments": JSON, "uri": JSON,
                  "_meta": JSON}) | JSON,
              "result": JSON, "error": JSON})
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _post_ok(post: McpPost) -> None:
    for message in post.messages:
        fingerprint(message, {"x": "1"}, ["x"])
        assert message.traffic in ("control", "stream", "call")
    traffic("POST", post)
    try:
        check_headers(post, {"Mcp-Method": "tools/call", "Mcp-Name": "=?base64?eA==?="})
    except HeaderMismatch:
        pass


@FUZZ
@given(st.binary(max_size=200), VERSIONS)
def test_parse_post_on_any_bytes_raises_only_invalid_request(body: bytes,
                                                             version: str | None) -> None:
    try:
        post = parse_post(body, version)
    except InvalidMcpRequest:
        return
    _post_ok(post)


@settings(FUZZ, max_examples=150)
@given(MESSAGE | st.lists(MESSAGE, max_size=3) | JSON, VERSIONS)
def test_parse_post_on_json_shaped_input_raises_only_invalid_request(
        doc: object, version: str | None) -> None:
    try:
        body = orjson.dumps(doc)
    except TypeError:  # an integer past 64 bits: not something a client can send either
        return
    try:
        post = parse_post(body, version)
    except InvalidMcpRequest:
        return
    _post_ok(post)


@FUZZ
@given(st.binary(max_size=300), st.sampled_from(["text/event-stream", "application/json", None]),
       st.integers(1, 50))
def test_answers_on_any_bytes(answer: bytes, content_type: str | None, size: int) -> None:
    tracker = AnswerTracker(content_type, 2)
    for i in range(0, len(answer), size):
        tracker.feed(answer[i:i + size])
    tracker.finish()
    try:
        rewrite_id(answer, content_type, 2, 3)
    except UnusableAnswer:
        pass


_PIECES = [b"data: ", b"data:", b'{"jsonrpc":"2.0","id":2,"result":{}}', PROGRESS,
           SERVER_REQUEST, b"id: 7", b"event: message", b": keep-alive", b"\n", b"\r\n",
           b"\r", b"\n\n", b"x" * 40]


@FUZZ
@given(st.lists(st.sampled_from(_PIECES), max_size=30),
       st.sampled_from(["text/event-stream", "application/json"]),
       st.lists(st.integers(0, 2000), max_size=12))
# A chunk after a lone CR (held: maybe half a CRLF) ends the line it closes, here the
# blank line that dispatches the response, even when the chunk has no line end of its own.
@example([b"data: ", _PIECES[2], b"\n", b"\r", b"x" * 40], "text/event-stream", [44])
# The response's event ends a chunk, and an event follows: between_events, which callers
# read only before the response, was True chunked and False whole (bytes past the response
# are not read, so it tells nothing then).
@example([b"data: ", _PIECES[2], b"\n\n", b"\n", b"data:", _PIECES[2]], "text/event-stream",
         [1, 21, 36, 44])
def test_the_tracker_reads_any_chunking_as_it_reads_the_whole(pieces: list[bytes],
                                                              content_type: str,
                                                              cuts: list[int]) -> None:
    """Fed in chunks (held aside while a line goes on, joined once: 64 MB in 16 KB chunks
    was quadratic), the tracker sees at every chunk what one fed everything so far at once
    sees, and finishes the same."""
    answer = b"".join(pieces)
    bounds = sorted({c % (len(answer) + 1) for c in cuts} | {len(answer)})
    chunked, start = AnswerTracker(content_type, 2), 0
    for end in bounds:
        got = chunked.feed(answer[start:end])
        whole = AnswerTracker(content_type, 2)
        assert got == whole.feed(answer[:end])
        assert (chunked.complete_at, chunked.last_event_id) == (whole.complete_at,
                                                                whole.last_event_id)
        if got is None:  # past the response the tracker reads nothing more, so not this
            assert chunked.between_events == whole.between_events
        start = end
    whole = AnswerTracker(content_type, 2)
    whole.feed(answer)
    assert chunked.finish() == whole.finish()
    assert (chunked.complete_at, chunked.last_event_id) == (whole.complete_at,
                                                            whole.last_event_id)


def test_the_fingerprint_reads_integers_past_64_bits_exactly_and_nothing_else_differently():
    # orjson reads an integer outside 64 bits as a float: two such amounts shared a
    # fingerprint (found by review). The body is then read again, and only those integers
    # read otherwise, so every other call keeps the fingerprint it always had.
    def fp(arguments: bytes, *, body: bool = True) -> str:
        raw = (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t",'
               b'"arguments":' + arguments + b"}}")
        return fingerprint(one(raw), None, (), raw if body else None)

    for same in (b'{"to":"jos\xc3\xa9"}', b'{"t":1e-7,"u":1e16}', b'{"s":"12345678901234567890"}',
                 b'{"max":18446744073709551615,"min":-9223372036854775808}'):
        assert fp(same) == fp(same, body=False), same
    big = b'{"amount":123456789012345678901234567890}'
    bigger = b'{"amount":123456789012345678901234567891}'
    assert fp(big, body=False) == fp(bigger, body=False)  # the collision, read by orjson
    assert fp(big) != fp(bigger)
    assert fp(big) == fp(b'{ "amount" : 123456789012345678901234567890 }')


def test_the_tracker_follows_the_servers_requests_its_client_has_not_answered() -> None:
    tracker = AnswerTracker("text/event-stream", 5)
    assert not tracker.awaits_client
    tracker.feed(b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/progress",'
                 b'"params":{}}\n\n')
    assert not tracker.awaits_client  # a notification asks nothing
    tracker.feed(b'event: message\ndata: {"jsonrpc":"2.0","id":7,"method":"ping"}\n\n'
                 b'event: message\ndata: {"jsonrpc":"2.0","id":8,"method":"x/unknown"}\n\n')
    assert not tracker.awaits_client  # no tool waits on a ping, nor on what we do not know
    tracker.feed(b'event: message\ndata: {"jsonrpc":"2.0","id":0,"method":"elicitation/create",'
                 b'"params":{}}\n\nevent: message\ndata: {"jsonrpc":"2.0","id":"1",'
                 b'"method":"roots/list"}\n\n')
    assert tracker.awaits_client
    tracker.client_answered(1)  # "1" is not 1
    tracker.client_answered(0)
    assert tracker.awaits_client
    tracker.client_answered("1")
    assert not tracker.awaits_client
    assert not AnswerTracker("application/json", 5).awaits_client


@pytest.mark.parametrize(("body", "expected"), [
    (b'{"jsonrpc":"2.0","id":3,"result":{"action":"accept"}}', (3,)),
    (b'{"jsonrpc":"2.0","id":"a","error":{"code":-1,"message":"no"}}', ("a",)),
    (b'{"jsonrpc":"2.0","id":null,"error":{"code":-1,"message":"no"}}', ()),
    (b'[{"jsonrpc":"2.0","id":1,"result":{}},{"jsonrpc":"2.0","method":"x"},'
     b'{"jsonrpc":"2.0","id":2,"result":{}}]', (1, 2)),
    (b'{"jsonrpc":"2.0","id":3,"method":"tools/list"}', ()),
])
def test_the_server_requests_a_post_answers(body: bytes, expected: tuple) -> None:
    assert parse_post(body).answers == expected


@pytest.mark.parametrize(("accept", "expected"), [
    ("application/json, text/event-stream", True),
    ("text/event-stream;q=0.5", True),
    ("Text/Event-Stream", True),
    ("*/*", True),
    ("text/*", True),
    ("application/json", False),
    ("application/json, text/event-stream;q=0", False),
    ("text/event-stream;q=zero", False),
    ("", False),
    (None, False),
])
def test_which_accept_takes_an_sse_answer(accept: str | None, expected: bool) -> None:
    assert accepts_sse(accept) is expected
