"""Property tests (hypothesis, bounded examples) of what parses caller- or user-supplied text:
the config loader, the SSE usage reader and identity validation."""

from __future__ import annotations

import hashlib
import json
import re
from types import SimpleNamespace
from unittest import mock

import orjson
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import CollectorRegistry, Counter, generate_latest

from policies import usage
from policies.config import ConfigError
from policies.usage import CHAT, MESSAGES, RESPONSES, Meter
from proxy.config import _KNOWN_KEYS, parse_config
from proxy.identity import IdentityRejected, identify
from tests.conftest import REPO

FAST = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
PROBLEM = re.compile(r"^<fuzz>:\d+: \S.*: \S")

# -- the config loader ------------------------------------------------------------------------

DEFAULT_CONFIG = (REPO / "config" / "sluice.yaml").read_text()
KEYS = sorted(_KNOWN_KEYS)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**9),
                    st.floats(allow_nan=False), st.text(max_size=20),
                    st.sampled_from(["5s", "250ms", "600/min", "10/total", "http://x", "/a/",
                                     "openai", "mcp", "dedup", "on", "1:30", "0755", "*"]))
structures = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner,
                        max_size=5)),
    max_leaves=30)


def assert_only_config_errors(text: str) -> None:
    try:
        parse_config(text, "<fuzz>")
    except ConfigError as exc:
        assert exc.problems
        for problem in exc.problems:
            assert PROBLEM.match(problem), problem


@FAST
@example("08")  # once a ValueError: not an octal number, though it looks like one
@given(st.text(max_size=300))
def test_config_loader_any_text(text):
    assert_only_config_errors(text)


@FAST
@given(structures)
def test_config_loader_any_yaml_structure(data):
    assert_only_config_errors(yaml.safe_dump(data, allow_unicode=True))


@FAST
@example(at=0, cut=1, insert="?")  # ``? ...``: a complex key once raised TypeError
@given(st.integers(0, len(DEFAULT_CONFIG)), st.integers(0, 40),
       st.text(alphabet=st.sampled_from(list(" \n\t:-[]{}#&*!|>'\"%@`,?0123456789abx")),
               max_size=12))
def test_config_loader_mutated_default_config(at, cut, insert):
    assert_only_config_errors(DEFAULT_CONFIG[:at] + insert + DEFAULT_CONFIG[at + cut:])


# -- the SSE usage reader ---------------------------------------------------------------------

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {
    "cached_tokens": 2}}
USAGE_EVENT = {"id": "c", "choices": [], "usage": USAGE}
texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
chat_events = st.one_of(
    texts.map(lambda t: {"id": "c", "choices": [{"index": 0, "delta": {"content": t}}],
                         "usage": None}),
    st.just("[DONE]"), st.just(": keep-alive"), st.just(USAGE_EVENT),
    st.just({"id": "c", "choices": [{"index": 0, "delta": {"content": '"usage": {'}}]}),
)


def final_expected(events: list) -> bool:
    """Whether a usage event counts as final: one came, and no text after the last one (a
    usage object that content follows counts none of it, :attr:`policies.usage.Meter.final`)."""
    if USAGE_EVENT not in events:
        return False
    last = len(events) - 1 - events[::-1].index(USAGE_EVENT)
    done = events.index("[DONE]") if "[DONE]" in events else len(events)  # the end: no text
    return not any(isinstance(event, dict) and event["choices"]
                   and event["choices"][0]["delta"]["content"]
                   for event in events[last + 1:max(done, last + 1)])


def sse_bytes(events: list, crlf: bool) -> bytes:
    out = b""
    for event in events:
        if isinstance(event, str) and event.startswith(":"):
            out += event.encode() + b"\n\n"
        else:
            data = event if isinstance(event, str) else json.dumps(event)
            out += f"data: {data}\n\n".encode()
    return out.replace(b"\n", b"\r\n") if crlf else out


def run_meter(stream: bytes, cuts: list[int], strip: bool, kind=CHAT, content_type: str =
              "text/event-stream") -> tuple[bytes, Meter]:
    meter = Meter(kind, anthropic=kind is MESSAGES, strip_usage=strip)
    meter.start(200, CIMultiDict({"Content-Type": content_type}))
    out, last = b"", 0
    for cut in sorted(set(cuts)):
        if 0 < cut < len(stream):
            out += meter.chunk(stream[last:cut])
            last = cut
    out += meter.chunk(stream[last:])
    return out + meter.finish(), meter


def cut_points(stream_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(1, max(1, stream_size - 1)), max_size=12)


@FAST
@given(st.lists(chat_events, max_size=12), st.booleans(), st.booleans(), st.data())
def test_usage_reader_any_split_same_result_usage_once(events, crlf, strip, data):
    stream = sse_bytes(events, crlf)
    cuts = data.draw(cut_points(len(stream)))
    whole, meter_whole = run_meter(stream, [], strip)
    out, meter = run_meter(stream, cuts, strip)
    assert out == whole
    assert meter.usage == meter_whole.usage and meter.final == meter_whole.final
    assert meter.streamed_tokens == meter_whole.streamed_tokens
    if strip:
        assert out == sse_bytes([e for e in events if e != USAGE_EVENT], crlf)
    else:
        assert out == stream
    if USAGE_EVENT in events:  # once or several times, it counts once
        assert (meter.usage.input_tokens, meter.usage.output_tokens) == (7, 3)
        assert meter.final == final_expected(events)
    else:
        assert (meter.usage.input_tokens, meter.usage.output_tokens) == (0, 0)


@FAST
@given(st.lists(st.one_of(chat_events, st.integers(600, 3000).map(
    lambda n: {"id": "c", "choices": [{"index": 0, "delta": {"content": "z" * n}}]})),
    max_size=8), st.booleans(), st.data())
def test_usage_reader_events_past_the_hold_limit(events, crlf, data):
    """The same with the hold limit at 512 bytes, so that events outgrow it at any split."""
    stream = sse_bytes(events, crlf)
    cuts = data.draw(cut_points(len(stream)))
    with mock.patch.object(usage, "JSON_LIMIT_BYTES", 512):
        out, meter = run_meter(stream, cuts, strip=True)
    assert out == sse_bytes([e for e in events if e != USAGE_EVENT], crlf)
    assert meter.final == final_expected(events)
    assert meter.usage.output_tokens == (3 if USAGE_EVENT in events else 0)


@FAST
@given(st.binary(max_size=2000), st.data(), st.sampled_from([CHAT, RESPONSES, MESSAGES]),
       st.booleans(), st.sampled_from(["text/event-stream", "application/json"]),
       st.sampled_from([64, 4 * 1024 * 1024]))
def test_usage_reader_never_crashes_on_any_bytes(stream, data, kind, strip, content_type,
                                                 limit):
    cuts = data.draw(cut_points(len(stream)))
    with mock.patch.object(usage, "JSON_LIMIT_BYTES", limit), \
            mock.patch.object(usage, "TAIL_BYTES", max(limit // 2, 16)):
        out, meter = run_meter(stream, cuts, strip, kind, content_type)
    if not strip or content_type != "text/event-stream":
        assert out == stream  # only the usage chunk is ever removed, and only when asked
    u = meter.usage
    assert min(u.input_tokens, u.output_tokens, u.cache_read_tokens) >= 0


json_keys = st.sampled_from(["usage", "prompt_tokens", "completion_tokens", "choices",
                              'x"usage', "usage\\", ""])
json_texts = st.one_of(st.text(max_size=12), st.sampled_from(
    ['"usage":{', '\\"usage\\":{', '{"usage":{"prompt_tokens":9}}', "}]", "{[", "\\"]))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 50), json_texts),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(json_keys, inner, max_size=5)),
    max_leaves=25)


@FAST
@given(st.dictionaries(json_keys, json_values, max_size=6), st.sampled_from([
    orjson.dumps, lambda o: json.dumps(o).encode(),
    lambda o: json.dumps(o, separators=(",", ":"), indent=1).encode()]))
@example({"usage": {}}, orjson.dumps)  # found by CI: an empty usage object is no report
def test_json_answer_reads_what_parsing_all_of_it_does(answer, dumps):
    """The usage of a valid JSON answer, however its members nest and are spaced, is the one
    a parse of the whole answer finds (the meter parses only its end when it can)."""
    body = dumps(answer)
    meter = Meter(CHAT, anthropic=False, strip_usage=False)
    meter.start(200, CIMultiDict({"Content-Type": "application/json"}))
    assert meter.body(body) == body
    whole = Meter(CHAT, anthropic=False, strip_usage=False)
    if isinstance(found := orjson.loads(body).get("usage"), dict):
        whole.final = whole._take(found)  # a usage object without counts is no report
    assert (meter.usage, meter.final) == (whole.usage, whole.final)


# -- identity validation ----------------------------------------------------------------------

CONFIG = parse_config(yaml.safe_dump({"routes": [
    {"name": "up", "path_prefix": "/up/", "upstream": "http://127.0.0.1:1"}]}), "<test>")
with mock.patch.dict("os.environ", {"SLUICE_FUZZ_TENANTS": json.dumps({
        hashlib.sha256(key).hexdigest(): tenant for key, tenant in (
            (b"sk-a", "team-a"), (b"sk-b", "team-b"), (b"\xe9", "latin"))})}):
    TRUSTED = parse_config(yaml.safe_dump({
        "identity": {"unknown_key_tenant": "guests", "tenants": "env:SLUICE_FUZZ_TENANTS"},
        "routes": [{"name": "up", "path_prefix": "/up/", "upstream": "http://x"}]}), "<test>")
HEADERS = ["X-Tenant-ID", "X-Run-ID", "X-Request-ID", "X-Parent-Run-ID", "X-Priority",
           "Authorization", "x-api-key"]


def as_aiohttp_decodes(raw: bytes) -> str:
    """A header value as aiohttp hands it over: OWS stripped, UTF-8 with surrogateescape."""
    return raw.strip(b" \t").decode("utf-8", "surrogateescape")


def runtime(config) -> SimpleNamespace:
    return SimpleNamespace(config=config, next_request_id=lambda: "generated-1")


def assert_identify_is_safe(config, fields: list[tuple[str, bytes]]) -> None:
    headers = CIMultiDict((name, as_aiohttp_decodes(value)) for name, value in fields)
    request = SimpleNamespace(headers=CIMultiDictProxy(headers), query_string="")
    try:
        who = identify(runtime(config), request)  # type: ignore[arg-type]
    except IdentityRejected as refused:
        orjson.dumps({"tenant": refused.tenant, "detail": refused.detail})
        return
    values = [who.tenant, who.run, who.request_id, who.parent_run, who.priority]
    orjson.dumps(values)  # an event can carry each of them
    registry = CollectorRegistry()
    Counter("t", "t", ["tenant", "run"], registry=registry).labels(
        who.tenant, who.run or "").inc()
    generate_latest(registry)  # and a metric label
    for value in values:
        assert value is None or (value.isascii() and value.isprintable() and " " not in value)


@FAST
@given(st.lists(st.tuples(st.sampled_from(HEADERS), st.binary(max_size=150)), max_size=6))
def test_identity_accepts_or_refuses_any_bytes(fields):
    assert_identify_is_safe(CONFIG, fields)


@FAST
@given(st.lists(st.tuples(st.sampled_from(HEADERS), st.one_of(
    st.binary(max_size=60), st.sampled_from([b"Bearer sk-a", b"sk-a", b"Bearer \xe9", b"team-a",
                                             b"Bearer  sk-a ", b"bearer sk-b"]))), max_size=6))
def test_trusted_identity_accepts_or_refuses_any_bytes(fields):
    assert_identify_is_safe(TRUSTED, fields)
