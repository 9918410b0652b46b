"""Parsing a request's body: JSON without the cyclic garbage collector's help, and forms.

A body of many small objects makes a parse allocate millions of containers, and CPython's
cyclic collector, triggered by allocation counts, walks the growing heap again and again while
the parse runs: a 31 MB body of 700,000 small messages took 2.0 s to parse with the collector
on, 0.48 s with it paused (measured here with orjson 3, CPython 3.11), the whole time holding
the event loop and every other call. Nothing a parse makes can be garbage until it returns, so
pausing the collector for it frees nothing later than it would have been freed; past a size,
the request path's parses go through :func:`loads`.

Even so a large body holds the loop: a 25 MB MCP ``tools/call`` took ~0.45 s to parse, ~0.35 s
to fingerprint (its arguments written as canonical JSON) and ~0.1 s to free, and ``orjson``
holds the GIL throughout, so a worker thread would not give the loop back. Ten of them
arriving together were all worked through in one loop pass: an innocent call on another
route waited 12 s, ``/healthz`` up to 13 s, and connect timers of other calls fired late (a
hostile trial). So the work on a body of :data:`LARGE_BODY_BYTES` or more takes turns
(:class:`LargeBodies`): one at a time per process, with the loop serving everything else
between them.

Some calls send a form instead (OpenAI's audio transcriptions, image edits: a
``multipart/form-data`` body whose ``model`` field names the model): :func:`form_field`
reads one field of it with python-multipart, the parser of Starlette's forms (FastAPI,
vLLM), as the upstream's framework would; :class:`FormReader` from the event loop.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import concurrent.futures
import contextlib
import gc
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import unquote_plus

import orjson
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, QuerystringParser, parse_options_header

#: A body this long or longer, bytes, is parsed with the collector paused; a shorter one costs
#: the collector little, and the pause would cost more than it saves.
PAUSE_COLLECTOR_BYTES = 1 << 20


#: A request body this long or longer, bytes, is parsed, fingerprinted and its parsed tree
#: freed in turns (:class:`LargeBodies`); a smaller one costs the loop well under 20 ms.
LARGE_BODY_BYTES = 1 << 20


class LargeBodies:
    """Turns for the CPU-bound work on large JSON bodies (see the module docstring): one
    turn at a time per process. When another turn is waiting, the loop then rests: it serves
    everything else (small calls, probes, timers) for as long as the turn held it before the
    next begins. So with large bodies queued the loop is held by one body's step at a time,
    at most about half the time, not by every large body that arrived together: a single
    loop pass between turns did not let a small call through, which needs several. With
    none waiting, the turn is handed on after one loop pass: a lone body's next step (its
    fingerprint after its parse) does not wait out a rest with nothing to rest for (+0.2-0.3 s
    on a 14 MB call, a review). One per runtime.

    A turn that frees a parsed tree (fingerprints it first: ``holding``) goes before one that
    would parse a new body: so a body's parse and its fingerprint follow each other, and one
    large tree at a time is alive (in arrival order, ten 25 MB bodies were all parsed before
    the first was fingerprinted, each tree 500 MB).
    """

    __slots__ = ("_busy", "_holding", "_new", "rests")

    def __init__(self) -> None:
        self._busy = False
        #: Turns waiting, each a future resolved when it is handed the turn: those holding
        #: a parsed tree, and those that would parse one, each in arrival order.
        self._holding: collections.deque[asyncio.Future[None]] = collections.deque()
        self._new: collections.deque[asyncio.Future[None]] = collections.deque()
        #: Turns ended with another waiting, so followed by a rest.
        self.rests = 0

    @contextlib.asynccontextmanager
    async def turn(self, *, holding: bool = False) -> AsyncIterator[None]:
        """Wait for the turn and hold it for the block's work (``holding``: the block frees a
        parsed tree). It is handed on after one loop pass, or, if another turn is waiting,
        once the loop has served the rest for as long as the block held it."""
        loop = asyncio.get_running_loop()
        if self._busy:
            handed = loop.create_future()
            (self._holding if holding else self._new).append(handed)
            try:
                await handed
            except asyncio.CancelledError:
                if handed.done() and not handed.cancelled():  # handed it, then cancelled
                    self._hand_on()
                raise  # a future cancelled while waiting is skipped by _hand_on
        else:
            self._busy = True
        began = time.monotonic()  # not loop.time(): uvloop's is read once a loop pass
        try:
            yield
        finally:
            if self._waiting():
                self.rests += 1
                loop.call_later(time.monotonic() - began, self._hand_on)
            else:
                loop.call_soon(self._hand_on)

    def _waiting(self) -> bool:
        """Whether a turn is waiting (a caller that left while waiting is not)."""
        return any(not handed.done() for waiting in (self._holding, self._new)
                   for handed in waiting)

    def _hand_on(self) -> None:
        for waiting in (self._holding, self._new):
            while waiting:
                handed = waiting.popleft()
                if not handed.done():
                    handed.set_result(None)
                    return
        self._busy = False


def loads(body: bytes | str, parse: Callable[[Any], Any] = orjson.loads) -> Any:
    """``parse(body)`` (``orjson.loads`` by default), with the cyclic collector paused for a
    body of :data:`PAUSE_COLLECTOR_BYTES` or more if it was enabled.

    The pause matters mostly on Python 3.11, whose collector runs inside the parse each time
    allocations pass its threshold, walking the young objects again and again (27 MB of
    small objects: 1.71 s, 0.73 s paused). From 3.12 on a collection only falls due inside a
    C call and runs once after it (CPython gh-97922); paused, it runs once after
    ``gc.enable()``, which still saves some (0.72 s against 0.45 s on 3.12.1).

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


#: Fields a form is read for at most, and file parts apart (a part with a ``filename``):
#: Starlette's ``max_fields`` and ``max_files`` (FastAPI, vLLM), past which it refuses the form.
MAX_FORM_FIELDS = 1000
MAX_FORM_FILES = 1000
#: A multipart field's value is read up to this many bytes: Starlette's ``max_part_size``,
#: past which it refuses the form.
MAX_FORM_PART_BYTES = 1 << 20
#: A form body longer than this, bytes: an urlencoded one is not read at all (its field is
#: unreadable: python-multipart's ``QuerystringParser`` walks a run of ``&`` byte by byte in
#: Python and empty fields reach no cap: 32 MiB of ``&`` took 17.9 s, a review; an OpenAI
#: urlencoded call is a few hundred bytes), a multipart one is parsed in
#: :class:`FormReader`'s worker thread (python-multipart's parsers are Python code).
FORM_OFF_LOOP_BYTES = 64 * 1024
#: A form's ``model`` longer than this, bytes (as decoded), names no model: the field is
#: unreadable, and parsing keeps at most this much of it.
MAX_FORM_VALUE_BYTES = 256
#: The media types read as forms, as Starlette's ``Request.form`` reads them.
FORM_TYPES = frozenset({"multipart/form-data", "application/x-www-form-urlencoded"})


class _FormEnd(Exception):
    """A form's parse stops: a cap reached, or a part Starlette refuses."""


def _media_type(content_type: str) -> str:
    """The media type of a ``Content-Type`` value, lower case, without its parameters."""
    return content_type.partition(";")[0].strip().lower()


def is_form(content_type: str) -> bool:
    """Whether a request of ``Content-Type`` ``content_type`` carries a form that
    :func:`form_field` reads."""
    return _media_type(content_type) in FORM_TYPES


def form_field(body: bytes, content_type: str, name: str) -> str | None:
    """The value of form field ``name`` in ``body``, a ``multipart/form-data`` or
    ``application/x-www-form-urlencoded`` body as ``content_type`` (the request's header)
    says, read by python-multipart as Starlette's form reads it (FastAPI, vLLM): the last of a
    repeated field. ``None`` for a body of another type, or one without the field. A parse
    that fails or reaches a cap (:data:`MAX_FORM_FIELDS` fields, :data:`MAX_FORM_FILES` file
    parts, a field over :data:`MAX_FORM_PART_BYTES`), which Starlette refuses, stops there:
    the field's value read so far, if any, is the answer (a body naming its model and then
    spoiled is still that model's). ``None`` too, as unreadable, for an urlencoded body over
    :data:`FORM_OFF_LOOP_BYTES` (not parsed) and for a value over
    :data:`MAX_FORM_VALUE_BYTES`. Runs in the caller's thread, in time linear in the body:
    :meth:`FormReader.field` from the event loop."""
    media, params = parse_options_header(content_type)
    media = media.lower()
    found: list[str | None] = []
    try:
        if media == b"application/x-www-form-urlencoded":
            if len(body) > FORM_OFF_LOOP_BYTES:
                return None
            _urlencoded_field(body, name, found)
        elif media == b"multipart/form-data":
            boundary = params.get(b"boundary")
            if boundary:
                _multipart_field(body, boundary, params.get(b"charset"), name, found)
    except (_FormEnd, FormParserError, ValueError, LookupError):
        pass  # refused by Starlette from here on: what was read stands
    return found[-1] if found else None


def _urlencoded_field(body: bytes, name: str, found: list[str | None]) -> None:
    """:func:`form_field` of an urlencoded body: ``found`` holds the last value of ``name``
    read so far (no other is kept; ``None`` for one too long); only that field's value is
    unquoted (every field's unquoting, ``parse_qsl``'s, took 9 s of a 32 MiB body of
    ``%41``, a hostile trial)."""
    wanted = name.encode("latin-1")
    key = bytearray()
    value: bytearray | None = None
    fields = 0

    def on_field_start() -> None:
        nonlocal value
        key.clear()
        value = None

    def on_field_name(data: bytes, start: int, end: int) -> None:
        key.extend(data[start:end])

    def on_field_data(data: bytes, start: int, end: int) -> None:
        nonlocal value
        if value is None:
            # The name is whole once its value starts; an escaped name (m%6Fdel) is rare.
            if key != wanted and (len(key) > 3 * len(wanted)
                                  or unquote_plus(key.decode("latin-1")) != name):
                return
            value = bytearray()
        if len(value) <= _MAX_QUOTED_BYTES:  # one byte past it marks the value too long
            value.extend(data[start:min(end, start + _MAX_QUOTED_BYTES + 1 - len(value))])

    def on_field_end() -> None:
        nonlocal fields
        fields += 1
        if fields > MAX_FORM_FIELDS:
            raise _FormEnd
        if value is not None:
            text = (unquote_plus(value.decode("latin-1"))
                    if len(value) <= _MAX_QUOTED_BYTES else None)
            found[:] = [text if text is not None and _model_sized(text) else None]
        elif key == wanted:
            found[:] = [""]

    parser = QuerystringParser({"on_field_start": on_field_start,
                                "on_field_name": on_field_name,
                                "on_field_data": on_field_data,
                                "on_field_end": on_field_end})
    parser.write(body)
    parser.finalize()


def _model_sized(text: str) -> bool:
    """Whether a form's decoded value ``text`` is short enough to name a model."""
    return len(text.encode()) <= MAX_FORM_VALUE_BYTES


#: An urlencoded value is kept up to this many bytes as sent: each decoded byte is 3 at most
#: (``%41``), so one longer decodes past :data:`MAX_FORM_VALUE_BYTES`.
_MAX_QUOTED_BYTES = 3 * MAX_FORM_VALUE_BYTES


def _multipart_field(body: bytes, boundary: bytes, charset: bytes | None, name: str,
                     found: list[str | None]) -> None:
    """:func:`form_field` of a multipart body: ``found`` holds the last value of ``name``
    read so far (no other is kept; ``None`` for one too long). As Starlette's
    ``MultiPartParser`` reads it: fields and file parts counted apart, a part without a
    ``name`` refused."""
    encoding = codecs.lookup(charset.decode("latin-1") if charset else "utf-8").name
    header_name = bytearray()
    header_value = bytearray()
    disposition = b""
    value: bytearray | None = None
    size = 0
    fields = files = 0

    def on_part_begin() -> None:
        nonlocal disposition, value, size
        disposition, value, size = b"", None, 0

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_name.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.extend(data[start:end])

    def on_header_end() -> None:
        nonlocal disposition
        if header_name.lower() == b"content-disposition":
            disposition = bytes(header_value)
        header_name.clear()
        header_value.clear()

    def on_headers_finished() -> None:
        nonlocal value, fields, files
        options = parse_options_header(disposition)[1]
        if b"name" not in options:
            raise _FormEnd
        file = b"filename" in options
        if file:
            files += 1
        else:
            fields += 1
        if files > MAX_FORM_FILES or fields > MAX_FORM_FIELDS:
            raise _FormEnd
        if options[b"name"].decode(encoding, "replace") == name:
            value = bytearray()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        nonlocal size
        if value is not None:
            size += end - start
            if size > MAX_FORM_PART_BYTES:
                raise _FormEnd
            if len(value) <= MAX_FORM_VALUE_BYTES:  # one byte past it marks it too long
                value.extend(data[start:min(end, start + MAX_FORM_VALUE_BYTES + 1 - len(value))])

    def on_part_end() -> None:
        if value is not None:
            text = value.decode(encoding, "replace")
            found[:] = [text if len(value) <= MAX_FORM_VALUE_BYTES else None]

    parser = MultipartParser(boundary, {"on_part_begin": on_part_begin,
                                        "on_header_field": on_header_field,
                                        "on_header_value": on_header_value,
                                        "on_header_end": on_header_end,
                                        "on_headers_finished": on_headers_finished,
                                        "on_part_data": on_part_data,
                                        "on_part_end": on_part_end})
    parser.write(body)
    parser.finalize()


class FormReader:
    """Reads forms' fields from the event loop (:meth:`field`), a multipart body over
    :data:`FORM_OFF_LOOP_BYTES` in one worker thread of its own, started at its first such
    body: never in asyncio's default pool, which reloads (``load_config``) share, so a flood
    of forms queues behind itself alone. One per runtime, shut down by :meth:`close`."""

    def __init__(self) -> None:
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    async def field(self, body: bytes, content_type: str, name: str) -> str | None:
        """:func:`form_field`: on the loop for a body of :data:`FORM_OFF_LOOP_BYTES` or
        less (and for an urlencoded body of any size, which it reads only that small), else
        in the worker thread. A cancelled caller does not stop a parse under way there."""
        if (len(body) <= FORM_OFF_LOOP_BYTES
                or _media_type(content_type) != "multipart/form-data"):
            return form_field(body, content_type, name)
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="sluice-forms")
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, form_field, body, content_type, name)

    @property
    def started(self) -> bool:
        """Whether the worker thread was started (a large multipart body came)."""
        return self._thread is not None

    def close(self) -> None:
        """Shut the worker thread down, dropping parses not begun; one under way ends on its
        own (its caller gone)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None


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
