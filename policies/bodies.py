"""Parsing a request's body: JSON without the cyclic garbage collector's help, and forms.

A body of many small objects makes a parse allocate millions of containers, and CPython's
cyclic collector, triggered by allocation counts, walks the growing heap again and again while
the parse runs: a 31 MB body of 700,000 small messages took 2.0 s to parse with the collector
on, 0.48 s with it paused (measured here with orjson 3, CPython 3.11), the whole time holding
the event loop and every other call. Nothing a parse makes can be garbage until it returns, so
pausing the collector for it frees nothing later than it would have been freed; past a size,
the request path's parses go through :func:`loads`.

Some calls send a form instead (OpenAI's audio transcriptions, image edits: a
``multipart/form-data`` body whose ``model`` field names the model): :func:`form_field`
reads one field of it with library parsers, as the upstream's framework would.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import urllib.parse
import warnings
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import BodyPartReader, MultipartReader
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader

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


#: Fields a form is read for at most: Starlette's ``max_fields`` (FastAPI, vLLM), past which
#: it refuses the form; a body of millions of empty fields is not made a list of them.
MAX_FORM_FIELDS = 1000
#: A multipart body is handed to its reader in chunks of this many bytes.
FORM_CHUNK_BYTES = 64 * 1024


def form_field(body: bytes, content_type: str, name: str) -> str | None:
    """The value of form field ``name`` in ``body``, a ``multipart/form-data`` or
    ``application/x-www-form-urlencoded`` body as ``content_type`` (the request's header)
    says: the last of a repeated field, as Starlette's form (FastAPI, vLLM) reads it.
    ``None`` for a body of another type, one without the field, or one the parsers refuse
    (past :data:`MAX_FORM_FIELDS` fields too). A multipart body is read by aiohttp's reader
    over the bytes, all in memory, so it never waits: call it in the event loop's thread."""
    media = content_type.partition(";")[0].strip().lower()
    if media == "application/x-www-form-urlencoded":
        try:
            fields = urllib.parse.parse_qsl(body.decode("utf-8", "replace"),
                                            keep_blank_values=True,
                                            max_num_fields=MAX_FORM_FIELDS)
        except ValueError:  # too many fields
            return None
        values = [value for key, value in fields if key == name]
        return values[-1] if values else None
    if media != "multipart/form-data":
        return None
    reading = _multipart_field(body, content_type, name)
    # aiohttp warns of each malformed disposition it meets, its text in the message: a
    # caller's made-up headers would each print a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            reading.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        except (ValueError, LookupError, RuntimeError, HttpProcessingError):
            return None  # not the form it says (LookupError: a charset Python lacks)
    reading.close()  # it waited for bytes, which are all there: cannot happen
    return None


async def _multipart_field(body: bytes, content_type: str, name: str) -> str | None:
    """:func:`form_field` of a multipart body, by aiohttp's reader (the one its server reads
    uploads with) over a stream holding ``body``, ended."""
    loop = asyncio.get_running_loop()
    # Over the body's size the stream would ask the protocol to pause a transport it has not.
    content = StreamReader(BaseProtocol(loop), len(body) + 1, loop=loop)
    # In chunks, as from a socket: the reader gives back what it read past a part's end by
    # copying the rest of its current chunk (one chunk of the whole body: quadratic).
    for at in range(0, len(body), FORM_CHUNK_BYTES):
        content.feed_data(body[at:at + FORM_CHUNK_BYTES])
    content.feed_eof()
    found = None
    fields = 0
    async for part in MultipartReader({"Content-Type": content_type}, content):
        fields += 1
        if fields > MAX_FORM_FIELDS:
            return None
        if not isinstance(part, BodyPartReader):
            continue  # a multipart within: no field of the form
        # Its disposition parsed only when it may name the field (aiohttp's parse costs
        # about 0.1 ms a part); ``name*=`` spells it in RFC 2231's escapes.
        disposition = part.headers.get("Content-Disposition", "")
        if (name in disposition or "*" in disposition) and part.name == name:
            found = await part.text()
    return found


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
