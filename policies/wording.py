"""Counts in what users read, with their nouns agreeing: ``1 slot``, ``2 slots``."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` followed by ``noun`` in the singular for 1, else in the plural (``noun + "s"``
    unless ``plural`` is given): ``counted(1, "call") == "1 call"``,
    ``counted(3, "older one") == "3 older ones"``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
