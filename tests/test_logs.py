"""policies/logs.py: a warning marked PER_CALL is let through once per text every EVERY_S
seconds, and the next line says how many were held back; other records are untouched."""

from __future__ import annotations

import logging

from policies.logs import MAX_TEXTS, PER_CALL, RepeatFilter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(msg: str, *args: object, per_call: bool = True) -> logging.LogRecord:
    made = logging.LogRecord("sluice", logging.WARNING, __file__, 1, msg, args, None)
    if per_call:
        made.__dict__.update(PER_CALL)
    return made


def test_repeats_are_held_back_and_counted_into_the_next_line():
    clock = Clock()
    quiet = RepeatFilter(every_s=10.0, clock=clock)
    assert quiet.filter(record("budget settle on %s not applied", "openai"))
    held = [quiet.filter(record("budget settle on %s not applied", "openai"))
            for _ in range(41)]
    assert held == [False] * 41
    assert quiet.filter(record("rate refund on %s not applied", "openai"))  # another text
    clock.now += 9.9
    assert not quiet.filter(record("budget settle on %s not applied", "openai"))
    clock.now += 0.2
    line = record("budget settle on %s not applied", "openai")
    assert quiet.filter(line)
    assert line.getMessage() == ("budget settle on openai not applied "
                                 "(42 more like it held back over 10s)")
    clock.now += 10.0
    line = record("budget settle on %s not applied", "openai")
    assert quiet.filter(line) and line.getMessage() == "budget settle on openai not applied"


def test_unmarked_records_always_pass_untouched():
    quiet = RepeatFilter(clock=Clock())
    lines = [record("state backend unavailable: %s", "timed out", per_call=False)
             for _ in range(5)]
    assert all(quiet.filter(line) for line in lines)
    assert {line.getMessage() for line in lines} == {"state backend unavailable: timed out"}


def test_texts_remembered_are_bounded_and_the_least_recently_seen_goes_first():
    clock = Clock()
    quiet = RepeatFilter(clock=clock)
    assert quiet.filter(record("lost write 0"))
    for i in range(1, MAX_TEXTS):
        clock.now += 0.001
        assert quiet.filter(record(f"lost write {i}"))
    assert not quiet.filter(record("lost write 0"))  # seen again: now the most recent
    assert quiet.filter(record("one text too many"))  # forgets "lost write 1"
    assert len(quiet._texts) == MAX_TEXTS
    assert quiet.filter(record("lost write 1"))  # forgotten, so let through
    assert not quiet.filter(record("lost write 0"))


def test_held_counts_are_reported_when_their_burst_ends_and_at_shutdown():
    clock = Clock()
    quiet = RepeatFilter(every_s=10.0, clock=clock)
    for _ in range(50):
        quiet.filter(record("budget settle on %s not applied", "a"))
    for _ in range(3):
        quiet.filter(record("rate refund on %s not applied", "a"))
    assert quiet.held() == []  # within the window: the next line may still carry it
    clock.now += 10.0
    assert quiet.held() == ["budget settle on a not applied (49 more like it held back over 10s)",
                            "rate refund on a not applied (2 more like it held back over 10s)"]
    assert quiet.held(final=True) == []  # reported once
    quiet.filter(record("rate refund on %s not applied", "a"))
    clock.now += 1.0
    assert quiet.held(final=True) == [
        "rate refund on a not applied (1 more like it held back over 1s)"]
