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
