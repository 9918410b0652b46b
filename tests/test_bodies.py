"""``policies.bodies``: a large request body is parsed with the cyclic collector paused, and
the collector is on again afterwards whatever the parse did."""

from __future__ import annotations

import gc

import orjson
import pytest

from policies import bodies


def test_a_large_body_of_small_objects_is_parsed_without_a_collection() -> None:
    # A 31 MB body of 700,000 small messages took 2.0 s to parse with the collector on and
    # 0.48 s with it paused (a new user's trial held the event loop ~2 s with one).
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
        collections.clear()
        with pytest.raises(orjson.JSONDecodeError):  # on again after a failed parse too
            bodies.loads(body[:-1])
        assert gc.isenabled()
        gc.disable()  # a collector the process turned off stays off
        bodies.loads(body)
        assert not gc.isenabled()
    finally:
        gc.enable()
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
    # The last of a repeated field, as Starlette's form gives it; RFC 2231's name*= too.
    body = _multipart(('form-data; name="model"', b"cheap"),
                      ("form-data; name*=utf-8''%6Dodel", b"whisper-1"))
    assert bodies.form_field(body, multipart, "model") == "whisper-1"
    urlencoded = "application/x-www-form-urlencoded"
    assert bodies.form_field(b"model=cheap&x=1&model=gpt%2D4o", urlencoded, "model") == "gpt-4o"
    assert bodies.form_field(b"x=1", urlencoded, "model") is None
    # Not a form as it says, or none at all: nothing read, nothing raised.
    for spoiled in (b"", b"garbage", body[:30], body.replace(b"\r\n", b"\n")):
        assert bodies.form_field(spoiled, multipart, "model") is None, spoiled
    assert bodies.form_field(body, "multipart/form-data", "model") is None  # no boundary
    assert bodies.form_field(body, "text/plain", "model") is None
    assert bodies.form_field(body.replace(b"name*=utf-8", b"name*=nope-8"), multipart,
                             "model") == "cheap"  # a charset Python lacks: that part unread
    # Past Starlette's 1,000 fields, which it refuses: unread, and not made a list of.
    many = b"&" * 5000 + b"model=x"
    assert bodies.form_field(many, urlencoded, "model") is None
    many = _multipart(*[('form-data; name="f"', b"x")] * bodies.MAX_FORM_FIELDS,
                      ('form-data; name="model"', b"x"))
    assert bodies.form_field(many, multipart, "model") is None
