"""``policies.bodies``: a large request body is parsed with the cyclic collector paused, and
the collector is on again afterwards whatever the parse did."""

from __future__ import annotations

import gc
import sys
import threading

import orjson
import pytest

from policies import bodies


def test_a_large_body_is_parsed_with_the_collector_paused() -> None:
    body = b'{"pad": "' + b"x" * bodies.PAUSE_COLLECTOR_BYTES + b'"}'
    seen = []

    def parse(text: bytes) -> object:
        seen.append(gc.isenabled())
        return orjson.loads(text)

    try:
        assert bodies.loads(body, parse)["pad"] and seen == [False] and gc.isenabled()
        with pytest.raises(orjson.JSONDecodeError):  # on again after a failed parse too
            bodies.loads(body[:-1], parse)
        assert seen == [False, False] and gc.isenabled()
        assert bodies.loads(b'{"a": 1}', parse) == {"a": 1}  # a small one: not paused
        assert seen == [False, False, True]
        gc.disable()  # a collector the process turned off stays off
        bodies.loads(body, parse)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason=(
    "3.12+ runs the cyclic collector only between bytecodes (CPython gh-97922): none runs "
    "inside orjson.loads, paused or not, and the one due runs right after gc.enable()"))
def test_a_large_body_of_small_objects_is_parsed_without_a_collection() -> None:
    # A 31 MB body of 700,000 small messages took 2.0 s to parse with the collector on and
    # 0.48 s with it paused on 3.11 (a new user's trial held the event loop ~2 s with one).
    body = orjson.dumps({"messages": [{"role": "user", "content": [1, {"a": []}]}] * 60_000})
    assert len(body) >= bodies.PAUSE_COLLECTOR_BYTES
    collections = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    threshold = gc.get_threshold()
    gc.set_threshold(100)  # a collection every 100 allocations, were it on
    gc.callbacks.append(count)
    try:
        # Read before anything else allocates: the next allocation runs the collection that
        # was due (once, over what the parse made: no walk per batch of allocations).
        doc = bodies.loads(body)
        during = len(collections)
        assert during == 0 and gc.isenabled()
        assert len(doc["messages"]) == 60_000
        collections.clear()
        orjson.loads(body)  # the same parse with the collector on collects, many times
        during = len(collections)
        assert during > 10
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)


def test_a_small_body_and_another_parser() -> None:
    assert bodies.loads(b'{"a": 1}') == {"a": 1}
    big = b'{"n": ' + b"1" * 30 + b', "pad": "' + b"x" * bodies.PAUSE_COLLECTOR_BYTES + b'"}'
    import json

    assert bodies.loads(big, json.loads)["n"] == int("1" * 30)


def _multipart(*parts: tuple[str, bytes], boundary: str = "b0undary") -> bytes:
    """A ``multipart/form-data`` body of ``(Content-Disposition, value)`` parts."""
    out = b"".join(b"--%s\r\nContent-Disposition: %s\r\n\r\n%s\r\n"
                   % (boundary.encode(), disposition.encode(), value)
                   for disposition, value in parts)
    return out + b"--%s--\r\n" % boundary.encode()


async def test_a_forms_field_is_read_as_starlette_reads_it() -> None:
    # OpenAI's transcriptions and image edits name their model in a form: a models: block
    # read the JSON body only, so such calls got no block at all (a hostile trial).
    multipart = "multipart/form-data; boundary=b0undary"
    body = _multipart(('form-data; name="file"; filename="a.wav"', b"RIFF" + bytes(range(256))),
                      ('form-data; name="model"', b"whisper-1"))
    assert bodies.form_field(body, multipart, "model") == "whisper-1"
    # The last of a repeated field, as Starlette's form gives it.
    body = _multipart(('form-data; name="model"', b"cheap"),
                      ('form-data; name="model"', b"whisper-1"))
    assert bodies.form_field(body, multipart, "model") == "whisper-1"
    urlencoded = "application/x-www-form-urlencoded"
    assert bodies.form_field(b"model=cheap&x=1&model=gpt%2D4o", urlencoded, "model") == "gpt-4o"
    assert bodies.form_field(b"x=1&m%6Fdel=a+b", urlencoded, "model") == "a b"
    assert bodies.form_field(b"x=1", urlencoded, "model") is None
    # Not a form as it says, or none at all: nothing read, nothing raised.
    for spoiled in (b"", b"garbage", body[:30]):
        assert bodies.form_field(spoiled, multipart, "model") is None, spoiled
    assert bodies.form_field(body, "multipart/form-data", "model") is None  # no boundary
    assert bodies.form_field(body, "text/plain", "model") is None
    # A part Starlette refuses (no name: RFC 2231's name*= is none to it) ends the form
    # there: a model named before it stands.
    body = _multipart(('form-data; name="model"', b"cheap"),
                      ("form-data; name*=utf-8''%6Dodel", b"whisper-1"))
    assert bodies.form_field(body, multipart, "model") == "cheap"
    # Past Starlette's 1,000 fields, which it refuses: read no further.
    many = b"&".join(b"f=%d" % i for i in range(bodies.MAX_FORM_FIELDS)) + b"&model=x"
    assert bodies.form_field(many, urlencoded, "model") is None
    many = _multipart(*[('form-data; name="f"', b"x")] * bodies.MAX_FORM_FIELDS,
                      ('form-data; name="model"', b"x"))
    assert bodies.form_field(many, multipart, "model") is None


def test_a_forms_model_read_before_a_cap_or_a_spoiled_end_stands() -> None:
    # A review: Starlette (FastAPI, vLLM) counts file parts and fields apart (1,000 each) and
    # the upstream's form parser reads the model before it meets a cap or a spoiled end; a
    # form that Sluice's reader refused whole named no model, so it dodged whisper-1's block.
    multipart = "multipart/form-data; boundary=b0undary"
    model = ('form-data; name="model"', b"whisper-1")
    files = [('form-data; name="f"; filename="x"', b"x")] * bodies.MAX_FORM_FILES
    fields = [('form-data; name="g"', b"y")] * (bodies.MAX_FORM_FIELDS - 1)
    # 1,000 files and 1,000 fields: a whole form to Starlette.
    assert bodies.form_field(_multipart(*files, *fields, model), multipart,
                             "model") == "whisper-1"
    # One file part too many, after the model: the model read stands.
    assert bodies.form_field(_multipart(model, *files, files[0]), multipart,
                             "model") == "whisper-1"
    unterminated = _multipart(model)[:-len(b"--b0undary--\r\n")] + (
        b'--b0undary\r\nContent-Disposition: form-data; name="pad"\r\n\r\nxxx')
    assert bodies.form_field(unterminated, multipart, "model") == "whisper-1"
    urlencoded = "application/x-www-form-urlencoded"
    many = b"model=whisper-1&" + b"&".join(b"f=%d" % i for i in range(bodies.MAX_FORM_FIELDS))
    assert bodies.form_field(many, urlencoded, "model") == "whisper-1"
    # A field over Starlette's part size ends the form too.
    big = _multipart(model, ('form-data; name="model"', b"m" * (bodies.MAX_FORM_PART_BYTES + 1)))
    assert bodies.form_field(big, multipart, "model") == "whisper-1"


async def test_a_large_multipart_form_is_parsed_in_the_readers_own_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A review: a 32 MiB form was parsed on the event loop (9 s of a body of %41), then in
    # asyncio's default pool, which reloads share: a few hostile forms starved them. A large
    # multipart form is parsed in the reader's one thread, a small form on the loop.
    threads: list[threading.Thread] = []
    parse = bodies.form_field

    def spy(body: bytes, content_type: str, name: str) -> str | None:
        threads.append(threading.current_thread())
        return parse(body, content_type, name)

    monkeypatch.setattr(bodies, "form_field", spy)
    multipart = "multipart/form-data; boundary=b0undary"
    small = b"f=1&model=whisper-1"
    large = _multipart(('form-data; name="file"; filename="a.wav"', b"\0" * (100 << 10)),
                       ('form-data; name="model"', b"whisper-1"))
    assert len(small) <= bodies.FORM_OFF_LOOP_BYTES < len(large)
    forms = bodies.FormReader()
    assert not forms.started  # no thread until a large form comes
    assert await forms.field(small, "application/x-www-form-urlencoded", "model") == "whisper-1"
    assert threads == [threading.current_thread()]  # a small form: no thread's hand-off
    assert not forms.started
    assert await forms.field(large, multipart, "model") == "whisper-1"
    assert await forms.field(large, multipart, "model") == "whisper-1"
    assert threads[1] is threads[2] is not threads[0]  # one thread, the reader's own
    assert threads[1].name.startswith("sluice-forms")
    forms.close()
    assert not forms.started
    threads[1].join(5)
    assert not threads[1].is_alive()


async def test_a_large_urlencoded_form_is_not_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    # A review: python-multipart's QuerystringParser walks a run of '&' byte by byte in
    # Python, and empty fields never reach the 1,000-field cap: 32 MiB of '&' took 17.9 s
    # of a worker thread. An OpenAI urlencoded call is tiny: a large one's model is
    # unreadable (default's block), and the body is not parsed at all, on the loop or off.
    parsers: list[object] = []
    real = bodies.QuerystringParser

    def spy(*args: object, **kwargs: object) -> object:
        parsers.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(bodies, "QuerystringParser", spy)
    urlencoded = "application/x-www-form-urlencoded"
    large = b"model=whisper-1&" + b"&" * bodies.FORM_OFF_LOOP_BYTES
    forms = bodies.FormReader()
    assert await forms.field(large, urlencoded, "model") is None
    assert bodies.form_field(large, urlencoded, "model") is None
    assert parsers == []
    assert not forms.started  # nor handed to a thread
    small = b"model=whisper-1&" + b"&" * (bodies.FORM_OFF_LOOP_BYTES - 16)
    assert len(small) == bodies.FORM_OFF_LOOP_BYTES
    assert await forms.field(small, urlencoded, "model") == "whisper-1"
    assert len(parsers) == 1 and not forms.started


def test_a_form_value_too_long_for_a_model_name_is_unreadable() -> None:
    # A review: an urlencoded model of 32 MiB of %41 was unquoted whole. A value over 256
    # bytes names no model: the field is unreadable (default's block), in either form.
    top = bodies.MAX_FORM_VALUE_BYTES
    urlencoded = "application/x-www-form-urlencoded"
    multipart = "multipart/form-data; boundary=b0undary"
    assert bodies.form_field(b"model=" + b"%41" * top, urlencoded, "model") == "A" * top
    assert bodies.form_field(b"model=" + b"%41" * (top + 1), urlencoded, "model") is None
    assert bodies.form_field(b"model=" + b"a" * (top + 1), urlencoded, "model") is None
    # The last model field is the upstream's: a long one after a short one is unreadable,
    # a short one after a long one names the model.
    assert bodies.form_field(b"model=x&model=" + b"a" * 5000, urlencoded, "model") is None
    assert bodies.form_field(b"model=" + b"a" * 5000 + b"&model=x", urlencoded, "model") == "x"
    model = ('form-data; name="model"', b"m" * top)
    assert bodies.form_field(_multipart(model), multipart, "model") == "m" * top
    long = ('form-data; name="model"', b"m" * (top + 1))
    assert bodies.form_field(_multipart(long), multipart, "model") is None
    short = ('form-data; name="model"', b"whisper-1")
    assert bodies.form_field(_multipart(short, long), multipart, "model") is None
    assert bodies.form_field(_multipart(long, short), multipart, "model") == "whisper-1"
