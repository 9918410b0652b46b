"""Parsing a request's JSON body without the cyclic garbage collector's help.

A body of many small objects makes a parse allocate millions of containers, and CPython's
cyclic collector, triggered by allocation counts, walks the growing heap again and again while
the parse runs: a 31 MB body of 700,000 small messages took 2.0 s to parse with the collector
on, 0.48 s with it paused (measured here with orjson 3, CPython 3.11), the whole time holding
the event loop and every other call. Nothing a parse makes can be garbage until it returns, so
pausing the collector for it frees nothing later than it would have been freed; past a size,
the request path's parses go through :func:`loads`.
"""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Callable
from typing import Any

import orjson

#: A body this long or longer, bytes, is parsed with the collector paused; a shorter one costs
#: the collector little, and the pause would cost more than it saves.
PAUSE_COLLECTOR_BYTES = 1 << 20


def loads(body: bytes | str, parse: Callable[[Any], Any] = orjson.loads) -> Any:
    """``parse(body)`` (``orjson.loads`` by default), with the cyclic collector paused for a
    body of :data:`PAUSE_COLLECTOR_BYTES` or more if it was enabled.

    Raises:
        whatever ``parse`` raises (``orjson.JSONDecodeError`` for invalid JSON).
    """
    if len(body) < PAUSE_COLLECTOR_BYTES or not gc.isenabled():
        return parse(body)
    gc.disable()
    try:
        return parse(body)
    finally:
        gc.enable()


def read_leniently(body: bytes) -> tuple[Any, bool]:
    """``body`` parsed as an upstream written in Python would read it: ``(doc, True)`` when
    :func:`loads` reads it, else ``(doc, False)`` as the standard library's ``json.loads``
    reads bytes, which FastAPI/Starlette-based upstreams (vLLM, SGLang, the LiteLLM proxy)
    serve: a UTF-8 byte order mark, UTF-16 or UTF-32 text (RFC 8259 §8.1 lets a parser take
    them), ``NaN`` and ``Infinity``, a lone surrogate escape (§8.2: valid grammar). A policy
    that reads a body strictly would be dodged by such a body the upstream serves anyway. A
    doc read the second way is not UTF-8 JSON as sent: rewrite it whole, never splice it.

    Raises:
        orjson.JSONDecodeError: neither reads it (``orjson``'s error, for the message).
    """
    try:
        return loads(body), True
    except orjson.JSONDecodeError as strict:
        if not _python_may_read(body, strict):
            raise
        try:
            return loads(body, json.loads), False
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError
            raise strict from None


#: What ``orjson`` says at a value it does not take where Python reads ``NaN``/``Infinity``.
_NOT_A_VALUE = ("unexpected character, expected a JSON value", "no digit after sign")


def _python_may_read(body: bytes, refused: orjson.JSONDecodeError) -> bool:
    """Whether the standard library may read a body ``orjson`` refused with ``refused``:
    only for what it reads and ``orjson`` does not (an encoding, a lone surrogate, ``NaN``
    or ``Infinity`` where it stopped). Any other invalid body is not parsed a second time:
    a 26 MiB one held the event loop 1.2 s instead of 0.2 (a review)."""
    why = refused.msg
    if "surrogate" in why or "BOM" in why or b"\x00" in body[:4]:
        return True  # UTF-16/32 (with or without a byte order mark), a lone surrogate
    if why not in _NOT_A_VALUE or refused.pos is None:
        return False
    at = refused.pos  # in characters: bytes only while all before it are ASCII
    ahead = (body[at:at + 9] if body[:at].isascii()
             else body.decode("utf-8", "replace")[at:at + 9].encode())
    return ahead.startswith((b"NaN", b"Infinity"))


def shown(value: Any, limit: int = 40) -> str:
    """``value``, read from JSON or YAML, as its writer would write it, for a message to them:
    ``true``, ``null``, ``1e23``, ``[1]``, not Python's ``True``, ``None``, ``1e+23``; a string
    in single quotes, as Sluice's messages quote one. At most ``limit`` characters (cut with
    ``...``)."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            text = str(value)  # orjson refuses integers past 64 bits, which YAML reads
        except ValueError:  # past Python's 4300 digits
            text = "an integer of over 4300 digits"
    else:
        try:
            text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
        except TypeError:
            text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def member_as_sent(body: bytes, name: str, value: Any) -> str:
    """Top-level member ``name`` of JSON ``body``, read as ``value``, for a message to its
    sender: a number as its digits were sent (orjson reads an integer past 64 bits as a float,
    so ``100000000000000000000000`` would show as ``1e23``), else :func:`shown`. For a refusal
    only: it searches the body's text."""
    if type(value) is float:
        pattern = rb'"%s"\s*:\s*(-?[0-9][0-9.eE+-]{0,39})' % re.escape(name.encode())
        for found in re.finditer(pattern, body):
            try:
                if float(found.group(1)) == value:  # the same number, whichever member it is
                    return found.group(1).decode()
            except ValueError:
                continue
    return shown(value)
