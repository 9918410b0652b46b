"""Decoding values Redis stored under the prefix: the one place a reply's ``read`` may fail
for what a key holds.

A key of the right type may hold content another program wrote (text in a number's field,
a record missing a field). Each decoder here turns its parse failure into
:class:`~policies.state.errors.BadRecord`, which :meth:`RedisState.run
<policies.state.connection.RedisState.run>` makes a key fault; any other exception a
``read`` raises is a bug and propagates (a 500 ``internal_error`` on the request path,
logged), rather than being served silently on the local fallback as a key fault.

Use them on stored values only (a counter's level, a record's JSON), not on what a script
computed and answered itself (an admitted flag, a wait): a failure there is a bug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from policies.state.errors import BadRecord

T = TypeVar("T")

# What the parsers below raise on content they cannot read (UnicodeDecodeError is a
# ValueError; orjson.JSONDecodeError too).
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError)


def built(what: str, build: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``build(*args, **kwargs)`` over values decoded from a stored record ``what``
    (e.g. ``Attempt(**fields)``), its failure a :class:`BadRecord`."""
    try:
        return build(*args, **kwargs)
    except _PARSE_ERRORS as exc:
        raise BadRecord(f"{what} holds what Sluice cannot read ({type(exc).__name__})"
                        ) from None


def stored_float(raw: bytes | str | None, what: str) -> float:
    """A stored number (``None``, an absent field, is unreadable)."""
    return built(what, float, raw)


def stored_int(raw: bytes | str | None, what: str) -> int:
    """A stored integer (``None``, an absent field, is unreadable)."""
    return built(what, int, raw)


def stored_text(raw: bytes, what: str) -> str:
    """Stored UTF-8 text."""
    return built(what, bytes.decode, raw)


def stored_hex(raw: bytes, what: str) -> bytes:
    """Stored hex digits, as the bytes they spell."""
    return built(what, lambda r: bytes.fromhex(r.decode()), raw)


def stored_json(raw: bytes | str, what: str, kind: type[T]) -> T:
    """A stored JSON value of type ``kind`` (``dict``, ``list``)."""
    value = built(what, orjson.loads, raw)
    if not isinstance(value, kind):
        raise BadRecord(f"{what} holds JSON of another shape")
    return value
