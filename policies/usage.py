"""Token usage per protocol: what a request may cost, and what its answer says it cost.

Metered endpoints (POST only; every other path of the route passes through unmetered):

==========================  ==================  ===============================================
endpoint (path ends with)   output cap field    usage in the answer
==========================  ==================  ===============================================
OpenAI ``/chat/completions``  ``max_completion_tokens``, ``max_tokens``  ``usage``; streams: a last
                                                chunk with ``choices: []`` and ``usage``, sent
                                                only if ``stream_options.include_usage``
OpenAI ``/completions``      ``max_tokens``      the same (the cap counts per prompt of a
                                                ``prompt`` list, times ``n`` or ``best_of``)
OpenAI ``/responses``        ``max_output_tokens``  ``usage``; streams: ``response.completed``
OpenAI ``/embeddings``       (none: 0 output)    ``usage``
Anthropic ``/messages``      ``max_tokens``      ``usage``; streams: ``message_start`` (input),
                                                then ``message_delta`` (final output)
Anthropic ``/chat/completions``  as OpenAI's     as OpenAI's (Anthropic's OpenAI compatibility)
==========================  ==================  ===============================================

Request side (:func:`read_request`): the body is parsed once for the model, the output cap,
``stream`` and ``stream_options``. Input tokens are *estimated* at one token per
:data:`BYTES_PER_TOKEN` bytes of the JSON body, a little more than English prose (about 4 bytes
a token, OpenAI's rule of thumb) or code (about 3.5) use. Only an attachment part of a
message (:data:`_ATTACHMENT_PARTS`: OpenAI ``image_url``, ``input_image``,
``computer_screenshot``, ``input_audio``, ``file``, ``input_file``; Anthropic ``image`` and
``document``, also in a tool's result) is counted otherwise, by what it carries: an
inline base64 image or audio as :data:`ATTACHMENT_TOKENS` instead of its size, any other
inline file (a text file, a PDF) at its decoded size, and one given by reference (an http(s)
URL, a file id) as :data:`ATTACHMENT_TOKENS`, as its size cannot be seen. The same bytes
anywhere else (a text part, a string ``content``, a tool's input) count as text, as the
upstream bills them. It is an estimate: CJK text and long audio can cost more than it says,
a PDF less (more, when given by reference), and the settle uses the upstream's count.

Response side (:class:`Meter`): the answer passes through byte for byte while usage is read
from it: a JSON body once complete, its top-level ``usage`` member (parsed from that member
on, see :meth:`Meter._read_json`; a chunked body is copied aside as it passes, up to
:data:`JSON_LIMIT_BYTES`), an SSE stream event by event as chunks arrive (events may split
across chunks). Only when Sluice itself asked an OpenAI stream for its usage chunk does
the stream change: that chunk is removed, so the client sees what it asked for. Then an
incomplete trailing event is held back until its end arrives (it might be the usage chunk;
an SSE client cannot act on part of an event anyway); a complete event is never held.
Otherwise every chunk is passed on as it came, and read after.

Any size of event or answer is read. An SSE event (or a chunked JSON answer) that grows past
:data:`JSON_LIMIT_BYTES` is not held whole: it is passed on as it comes (it is not the usage
chunk, which is a few hundred bytes), its first :data:`HEAD_BYTES` and last
:data:`TAIL_BYTES` are kept, and at its end the usage object is read from its tail (usage comes
last in an OpenAI or Anthropic object, e.g. a Responses ``response.completed`` event carrying
the whole output). Reading then goes on with the next event; stripping stays on. Each event
is read exactly once, wherever the chunks split it, and usage counts only grow (the maximum of
what each event reported), so no usage is counted twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import orjson
from multidict import CIMultiDict, istr

from policies import bodies
from policies.paths import readings

# Bytes are searched with ``find``, never ``sub in data``: CPython 3.11's ``in`` on bytes first
# tries ``sub`` as an int and builds (then drops) a TypeError, about 1,000 instructions more
# than ``find`` per test. An int (one byte) ``in`` bytes takes no such detour.

#: Bytes of request or streamed text counted as one token by the estimates.
BYTES_PER_TOKEN = 3
#: Tokens assumed per image or audio attachment, inline or by reference, and per file by
#: reference: Anthropic bills about w*h/750 per image, about 1,600 at the largest size it
#: takes unscaled; OpenAI about 765 for a 1024x1024 high-detail image.
ATTACHMENT_TOKENS = 1600
#: A JSON answer sent in chunks is held (a copy; the chunks go on at once) up to this size to
#: read its usage at the end, and an SSE event is held up to this size; past it only the
#: head and tail of either are kept (see the module docstring), bytes.
JSON_LIMIT_BYTES = 4 * 1024 * 1024
#: Bytes kept of the end of an event or answer past :data:`JSON_LIMIT_BYTES`, to read its usage.
TAIL_BYTES = 64 * 1024
#: Bytes kept of the start of such an event, to tell what kind it is.
HEAD_BYTES = 512
#: Content events of a stream parsed to measure their text; later ones count as their mean.
SAMPLE_EVENTS = 16
#: Types of the content parts that carry an image, audio or a file (OpenAI Chat Completions
#: and Responses; Anthropic Messages); any other part is read as text.
_ATTACHMENT_PARTS = frozenset({"image_url", "input_image", "computer_screenshot", "input_audio",
                               "file", "input_file", "image", "document"})
#: Responses input items whose ``output`` (not ``content``) may hold attachment parts.
_OUTPUT_ITEMS = frozenset({"function_call_output", "computer_call_output",
                           "custom_tool_call_output"})


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A metered API call.

    Attributes:
        name: for messages and events.
        cap_fields: request fields that cap output tokens; the largest present counts.
        write_field: where a configured default cap is written, ``None`` if output is 0.
        usage_option: streams carry usage only when ``stream_options.include_usage`` is set.
        choices: ``n`` asks for that many answers, each up to the cap.
        messages: the body member listing the messages (or input items) whose content parts
            may be attachments, ``None`` if the endpoint takes none.
    """

    name: str
    cap_fields: tuple[str, ...]
    write_field: str | None
    usage_option: bool
    choices: bool
    messages: str | None


CHAT = Endpoint("chat.completions", ("max_completion_tokens", "max_tokens"),
                "max_completion_tokens", usage_option=True, choices=True, messages="messages")
COMPLETIONS = Endpoint("completions", ("max_tokens",), "max_tokens", usage_option=True,
                       choices=True, messages=None)
RESPONSES = Endpoint("responses", ("max_output_tokens",), "max_output_tokens",
                     usage_option=False, choices=False, messages="input")
EMBEDDINGS = Endpoint("embeddings", (), None, usage_option=False, choices=False, messages=None)
MESSAGES = Endpoint("messages", ("max_tokens",), "max_tokens", usage_option=False,
                    choices=False, messages="messages")


#: ``(path suffix, endpoint)`` a POST is metered as on an ``openai`` route, first match wins.
_METERED = (("/chat/completions", CHAT), ("/completions", COMPLETIONS),
            ("/responses", RESPONSES), ("/embeddings", EMBEDDINGS))
#: The same on an ``anthropic`` route, which also serves the OpenAI SDK at
#: ``/chat/completions`` (Anthropic's OpenAI SDK compatibility: billed as any call, answered
#: in OpenAI's shape).
_ANTHROPIC_METERED = (("/messages", MESSAGES), ("/chat/completions", CHAT))


#: Looked up as ``istr``: a ``str`` name is lower-cased on every look-up in a CIMultiDict.
_CONTENT_ENCODING = istr("Content-Encoding")


def content_coding(headers: Mapping[str, str]) -> str | None:
    """The ``Content-Encoding`` of a message whose body is coded (gzip, br...), or ``None``
    when it is plain (absent, or ``identity``, RFC 9110 §8.4.1): a coded body cannot be read
    as JSON or SSE as it passes."""
    coding = headers.get(_CONTENT_ENCODING)
    return coding if coding and coding.lower() != "identity" else None


def endpoint_for(protocol: str, method: str, raw_path: str) -> Endpoint | None:
    """The metered endpoint a request calls, or ``None`` if it is not metered.

    Read as upstreams route it, every reading of :func:`policies.paths.readings` (the one
    rule ``endpoints:`` patterns match by too): uvicorn hands Starlette the decoded path, so
    vLLM, SGLang or the LiteLLM proxy serve ``/v1/chat%2Fcompletions`` as chat completions
    (it went through unmetered); Express and ASP.NET Core serve ``/V1/Chat/Completions``,
    Tomcat and Spring ``/v1/chat/completions;jsessionid=1`` (both went through unmetered, a
    security trial). The endpoints are tried in order (:data:`_METERED`), so a path some
    reading of which ends ``/chat/completions`` is chat, not legacy completions. Metering a
    path an upstream would not serve so costs nothing: its error answer is charged none. A
    POST whose readings name different endpoints (or one and none) never gets here: the
    handler refuses it (:func:`endpoints_differ`).
    """
    if method != "POST":
        return None
    found = readings(raw_path)
    for suffix, endpoint in _ANTHROPIC_METERED if protocol == "anthropic" else _METERED:
        for path in found:
            if path.endswith(suffix):
                return endpoint
    return None


def endpoints_differ(protocol: str, method: str, raw_path: str) -> bool:
    """Whether the readings of ``raw_path`` (:func:`policies.paths.readings`) name different
    metered endpoints, or one names an endpoint and another none: then Sluice cannot know
    what the upstream serves, and the request is refused (400 ``bad_request``, as a path
    with dot-segments is). Tomcat, Jetty and Spring drop ``;parameters`` before they decode,
    so ``/v1/responses;x=%2Fcompletions`` is ``responses`` to them, which
    :func:`endpoint_for` metered as legacy completions by its suffix order, and
    ``/v1/messages/count_tokens;x=%2Fmessages`` (free) was metered as ``messages`` (a
    review). Only a path with ``;``, ``%`` or ``\\`` is read (those are what make readings
    name different endpoints: ``readings`` takes a backslash for a slash, as Windows-born
    servers do, so ``/v1/chat\\/completions`` is chat and legacy completions; the caller may
    test for them first to skip the call); a POST's only, as only a POST is metered."""
    if method != "POST":
        return False
    path = raw_path.partition("?")[0] if "?" in raw_path else raw_path
    if ";" not in path and "%" not in path and "\\" not in path:
        return False
    suffixes = _ANTHROPIC_METERED if protocol == "anthropic" else _METERED
    named = {next((endpoint for suffix, endpoint in suffixes if reading.endswith(suffix)),
                  None) for reading in readings(path)}
    return len(named) > 1


@dataclass(slots=True)
class Usage:
    """Tokens of one call. ``cache_read_tokens`` and ``cache_write_tokens`` are part of
    ``input_tokens`` (OpenAI counts cached tokens in ``prompt_tokens``; Anthropic reports them
    beside ``input_tokens``, and they are added in here)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0


@dataclass(slots=True)
class RequestCost:
    """What one metered request may cost, read from its body.

    Attributes:
        model: the ``model`` field, ``None`` if absent.
        stream: the client asked for SSE.
        input_tokens: estimated input tokens (see the module docstring).
        output_cap: the most output tokens it may produce: its own cap, else the configured
            default, else ``None`` (unknown); times ``n`` when it asks for several choices.
        strip_usage: Sluice added ``stream_options.include_usage``, so the usage chunk must be
            removed from the client's stream.
        body: the body to forward (with the cap or the usage option added, if they were).
        recoded: ``body`` was rewritten whole from a body that was not UTF-8 JSON (UTF-16,
            a byte order mark...; :func:`policies.bodies.read_leniently`): a ``charset``
            its ``Content-Type`` names no longer holds.
        background: a Responses call with ``"background": true``: the upstream runs it to
            the end whether or not its caller stays (the answer is fetched later by
            ``GET /v1/responses/{id}``, which passes unmetered), so leaving or cutting its
            stream saves nothing.
    """

    endpoint: Endpoint
    model: str | None
    stream: bool
    input_tokens: int
    output_cap: int | None
    strip_usage: bool
    body: bytes
    recoded: bool = False
    background: bool = False


def read_request(endpoint: Endpoint, body: bytes, default_cap: int | None, write_cap: bool,
                 stream_usage: bool) -> RequestCost:
    """Parse a metered request once; optionally write the default cap and the usage option.

    Args:
        default_cap: output tokens to assume when the request sets no cap.
        write_cap: write ``default_cap`` into a request without a cap.
        stream_usage: add ``stream_options.include_usage`` to OpenAI streams.

    Raises:
        ValueError: the body is not a JSON object, or a cap or ``n`` is present but not a
            non-negative integer (reading it as "no cap" would reserve too little), or a
            Responses ``background`` is present but not a boolean (read as false, a call the
            upstream runs on would be charged as one it stops).
    """
    try:
        obj, exact = bodies.read_leniently(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"the body is not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError("the body is not a JSON object")
    get = obj.get
    model = get("model")
    if type(model) is not str:
        model = None
    elif not exact:
        model = _carried(model)
    cap = None
    for field in endpoint.cap_fields:
        value = get(field)
        if value is not None:
            if type(value) is not int or value < 0:
                raise ValueError(f"{field} must be a non-negative integer, not "
                                 f"{bodies.member_as_sent(body, field, value)}")
            # Both sent: the larger, as upstreams differ in which they read (vLLM reads
            # max_completion_tokens only when it is not 0; a hostile trial reserved 0 for a
            # call that could write 10,000).
            if cap is None or value > cap:
                cap = value
    added: dict[str, object] | None = None  # fields to add to the body, if any
    if cap is None:
        if endpoint.write_field is None:
            cap = 0  # no output: embeddings
        elif default_cap is not None:
            cap = default_cap
            if write_cap:
                added = {endpoint.write_field: default_cap}
    choices = get("n")
    if choices is not None and (type(choices) is not int or choices < 1):
        raise ValueError(f"n must be a positive integer, not "
                         f"{bodies.member_as_sent(body, 'n', choices)}")
    if endpoint is COMPLETIONS:
        if cap:
            cap *= _completions_answers(body, get("prompt"), get("best_of"), choices or 1)
    elif choices is not None and cap and endpoint.choices:
        cap *= choices  # the cap applies to each of the n choices
    stream = get("stream") is True
    strip = False
    if stream and endpoint.usage_option and stream_usage:
        options = get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            if added is None:
                added = {}
            added["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                       "include_usage": True}
            strip = True
    cost = RequestCost(endpoint, model, stream, estimate_input_tokens(endpoint, body, obj),
                       cap, strip, body if added is None else _with_fields(body, obj, added, exact),
                       recoded=added is not None and not exact)
    if endpoint is RESPONSES and (background := get("background")) is not None:
        if type(background) is not bool:
            # A lax upstream (vLLM) runs "true" in the background: read as not, its stream
            # left was charged what it streamed, not what the upstream ran on to bill.
            raise ValueError(f"background must be true or false, not "
                             f"{bodies.member_as_sent(body, 'background', background)}")
        cost.background = background
    return cost


def model_named(body: bytes) -> str | None:
    """The ``model`` an LLM request's body names, read as :func:`read_request` reads it
    (:func:`policies.bodies.read_leniently`): ``""`` for a JSON object naming none (or not
    as a string: vLLM serves a request with no model by its one model), ``None`` for a body
    that is no JSON object. For the policies keyed by model (``models:``); the accounting
    step parses the body again, so the second parse is paid on routes with ``models:``
    only."""
    if not body:
        return None
    try:
        doc, _ = bodies.read_leniently(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    model = doc.get("model")
    return _carried(model) if isinstance(model, str) else ""


def _carried(name: str) -> str:
    """``name`` as UTF-8 can carry it: a lone surrogate a lenient read took from a
    ``\\ud800`` escape is written as that escape's text. Model names become metric labels,
    and one such name made every later scrape of ``/metrics`` fail (a hostile trial); no
    ``models:`` block can name it (YAML is UTF-8), so it is ``default``'s either way."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode()
    return name


def _completions_answers(body: bytes, prompt: object, best_of: object, choices: int) -> int:
    """Answers a legacy Completions call may bill, each up to its cap: ``choices`` (``n``)
    per prompt, or ``best_of`` if more (that many are generated and billed, ``n`` returned),
    times the prompts of a list (of strings or of token-id lists; a list of ints is one
    prompt), each answered on its own.

    Raises:
        ValueError: ``best_of`` is present but not a positive integer.
    """
    if best_of is not None:
        if type(best_of) is not int or best_of < 1:
            raise ValueError(f"best_of must be a positive integer, not "
                             f"{bodies.member_as_sent(body, 'best_of', best_of)}")
        choices = max(choices, best_of)
    if type(prompt) is list and prompt and type(prompt[0]) is not int:
        choices *= len(prompt)
    return choices


def _with_fields(body: bytes, obj: dict, added: dict[str, object], exact: bool) -> bytes:
    """``body`` with top-level ``added`` fields. They are spliced in before the closing brace,
    keeping the client's bytes (and sparing a re-serialisation of a long prompt); the body is
    rewritten whole when one of them is already there (a duplicate key is ambiguous), and
    when it is not the UTF-8 JSON ``orjson`` reads (``exact`` false,
    :func:`policies.bodies.read_leniently`): then by the standard library, in ASCII, which
    keeps its ``NaN`` and lone surrogates as it read them."""
    if not exact:
        try:
            return json.dumps({**obj, **added}).encode()
        except RecursionError:
            raise ValueError("the body is nested too deeply for Sluice to rewrite") from None
    if not obj or any(key in obj for key in added):
        try:
            return orjson.dumps({**obj, **added})
        except orjson.JSONEncodeError:  # it reads 1,024 levels of nesting but writes 254
            raise ValueError("the body is nested too deeply for Sluice to rewrite "
                             "(254 levels at most)") from None
    end = body.rstrip().rfind(b"}")
    return body[:end] + b"," + orjson.dumps(added)[1:-1] + body[end:]


def estimate_input_tokens(endpoint: Endpoint, body: bytes, obj: dict) -> int:
    """Input tokens of a request body, estimated (see the module docstring); at least 1.

    Only the messages' content parts are walked (``endpoint.messages``, then each one's
    ``content``, a ``tool_result``'s ``content``, a tool output item's ``output``): the cost
    grows with the number of parts, not with the body's size, and no byte of it is searched.
    An attachment part's payload (its data, URL or file id) is taken out of the bytes counted
    as text and counted as :func:`_attachment` says; the rest of the part stays text.
    """
    size = len(body)
    flat = 0  # tokens of the attachments
    items = obj.get(endpoint.messages)  # None if it has none: no JSON key is None
    stack = [items] if type(items) is list else None
    while stack:
        for item in stack.pop():
            if type(item) is not dict:
                continue
            kind = item.get("type")  # none on a Chat or Anthropic message
            if kind is not None and type(kind) is str:  # a list or an object would not hash
                if kind in _ATTACHMENT_PARTS:
                    tokens, chars = _attachment(kind, item)
                    flat += tokens
                    size -= chars
                    continue
                if kind in _OUTPUT_ITEMS:
                    inner = item.get("output")
                    if type(inner) is dict:  # a computer_call_output's screenshot
                        stack.append([inner])
                    elif type(inner) is list:
                        stack.append(inner)
                    continue
            inner = item.get("content")
            if type(inner) is list:
                stack.append(inner)
    return max(1, -(-size // BYTES_PER_TOKEN)) + flat


def _attachment(kind: str, part: dict) -> tuple[int, int]:
    """``(tokens, characters)`` of an attachment part of type ``kind``: the tokens its payload
    counts for, and the characters of that payload (taken out of the body's text count);
    ``(0, 0)`` when it carries none that this reads, so all of it counts as text.

    The payload is inline (a ``data:`` URL or base64 data, see :func:`_inline`), an
    ``http(s)`` URL or a file id. One by URL or id is billed by what it points to, which
    cannot be seen here: :data:`ATTACHMENT_TOKENS`, as for an inline image. Shapes read:

    * OpenAI Chat Completions: ``image_url.url``; ``input_audio.data``; ``file.file_data``,
      ``file.file_id``.
    * OpenAI Responses: ``input_image`` and ``computer_screenshot``: ``image_url``,
      ``file_id``; ``input_file``: ``file_data``, ``file_url``, ``file_id``.
    * Anthropic: ``image`` and ``document``: a ``source`` of type ``base64``
      (``media_type``, ``data``), ``url`` or ``file`` (``file_id``); a ``text`` or
      ``content`` source is text.
    """
    if kind == "image" or kind == "document":
        source = part.get("source")
        if type(source) is not dict:
            return 0, 0
        how = source.get("type")
        if how == "base64":
            media = source.get("media_type")
            return _inline(source.get("data"), media if type(media) is str else "")
        if how == "url":
            return _linked(source.get("url"))
        return _by_id(source.get("file_id")) if how == "file" else (0, 0)
    if kind == "input_audio":
        audio = part.get("input_audio")
        return _inline(audio.get("data"), "audio/") if type(audio) is dict else (0, 0)
    if kind == "image_url":
        image = part.get("image_url")
        return _linked(image.get("url") if type(image) is dict else image)
    if kind == "file":  # Chat Completions: the file's members are under ``file``
        part = part.get("file")
        if type(part) is not dict:
            return 0, 0
    if kind == "input_image" or kind == "computer_screenshot":
        given = part.get("image_url")
        if type(given) is str and given:
            return _linked(given)
    else:  # file, input_file
        given = part.get("file_data")  # a data: URL or bare base64
        if type(given) is str and given:
            return _inline(given, None)
        given = part.get("file_url")
        if type(given) is str and given:
            return _linked(given)
    return _by_id(part.get("file_id"))


def _is_data_url(value: str) -> bool:
    """Whether ``value`` is a base64 ``data:`` URL."""
    return value.startswith("data:") and ";base64," in value[:128]


def _inline(value: object, media: str | None) -> tuple[int, int]:
    """``(tokens, characters)`` of an inline base64 payload of type ``media`` (``None``: the
    ``data:`` URL's, unknown if it is bare base64).

    An image or audio is billed by its size in pixels or seconds, not bytes:
    :data:`ATTACHMENT_TOKENS`. Anything else (``text/plain``, a PDF) is read by the model as
    its content: its decoded bytes count as text, so a prompt wrapped as
    ``data:text/plain;base64,`` is not counted flat (a hostile trial's: 1 MB of text reserved
    as 1,600 tokens, 12.5x a tenant's daily budget in one call).
    """
    if type(value) is not str:
        return 0, 0
    if media is None:
        media = value[5:value.find(";")] if _is_data_url(value) else ""
    if media.startswith(("image/", "audio/")):
        return ATTACHMENT_TOKENS, len(value)
    return -(-(len(value) * 3 // 4) // BYTES_PER_TOKEN), len(value)


def _linked(value: object) -> tuple[int, int]:
    """``(tokens, characters)`` of an attachment's URL: a base64 ``data:`` URL is inline (see
    :func:`_inline`), an ``http(s)`` one counts :data:`ATTACHMENT_TOKENS`; any other string is
    no attachment the upstream takes, and stays text: ``(0, 0)``."""
    if type(value) is not str:
        return 0, 0
    if _is_data_url(value):
        return _inline(value, None)
    if value[:8].lower().startswith(("http://", "https://")):
        return ATTACHMENT_TOKENS, len(value)
    return 0, 0


def _by_id(value: object) -> tuple[int, int]:
    """``(tokens, characters)`` of an attachment given by file id: :data:`ATTACHMENT_TOKENS`,
    its size unseen."""
    return (ATTACHMENT_TOKENS, len(value)) if type(value) is str and value else (0, 0)


def _text_bytes(node: object) -> int:
    """UTF-8 bytes of the generated text in a delta: its strings, minus bookkeeping fields."""
    if isinstance(node, str):
        return len(node) if node.isascii() else len(node.encode())
    total = 0
    if isinstance(node, dict):
        for key, value in node.items():
            if key not in _NOT_TEXT:
                total += _text_bytes(value)
    elif isinstance(node, list):
        for value in node:
            total += _text_bytes(value)
    return total


_NOT_TEXT = frozenset({"role", "type", "id", "index", "signature"})


def _count(value: object) -> int:
    return value if type(value) is int and value > 0 else 0


def cost_usd(usage: Usage, price_input: float, price_output: float, price_cache_read: float,
             price_cache_write: float) -> float:
    """USD of ``usage`` at prices in USD per million tokens. The cache parts are parts of
    the input (:class:`Usage`): an upstream reporting more cached tokens than input tokens
    is charged no more than its input count (a hostile trial: 99,999 cached of 10 prompt
    tokens cost 5,000 times the call)."""
    read = min(usage.cache_read_tokens, usage.input_tokens)
    write = min(usage.cache_write_tokens, usage.input_tokens - read)
    return (
        (usage.input_tokens - read - write) * price_input
        + read * price_cache_read
        + write * price_cache_write
        + usage.output_tokens * price_output
    ) / 1_000_000


#: :attr:`Meter.stream_error` of an error event that is the upstream's fault (it failed the
#: answer as a 5xx would), of one that names the request's own (as a 400 does), and of one
#: that names a rate limit or quota (as a 429 with rate-limit headers does).
SERVER, CLIENT, QUOTA = "server", "client", "quota"
#: Words of an error type or code (lower case, ``_`` dropped) that name a server-side fault:
#: Anthropic's ``overloaded_error``, ``api_error``, ``timeout_error``; OpenAI's
#: ``server_error``; vLLM's ``InternalServerError``, ``ServiceUnavailableError``...
_SERVER_WORDS = ("overload", "server", "apierror", "internal", "unavailable", "timeout")


def stream_error_side(event: object) -> str:
    """Whose fault a stream's error event says its failure is: :data:`SERVER`,
    :data:`CLIENT` or :data:`QUOTA` (see the breaker's section of the README).

    ``event`` is the event's parsed data: Anthropic's ``{"type": "error", "error": {"type":
    ...}}``, a Chat Completions chunk ``{"error": {"type": ..., "code": ...}}``, the
    Responses API's ``{"type": "error", "code": ...}`` or ``{"type": "response.failed",
    "response": {"error": {"code": ...}}}``. In order: an HTTP status in ``code`` or
    ``status`` (vLLM's; an integer or its three digits as a string, ``"503"``) decides as
    that status would (5xx server, 429 quota, other 4xx client); else a type or code naming
    a rate limit or quota (``rate_limit_exceeded``, OpenAI's ``insufficient_quota``) is a
    quota, one naming a server-side fault (:data:`_SERVER_WORDS`) is the server's, and any
    other named one (``invalid_request_error``, ``context_length_exceeded``,
    ``invalid_prompt``...) the client's; an event naming nothing (an ``error`` that is a
    string, an event that is not an error object at all) is the server's (the upstream gave
    up, and did not say the request was at fault).
    """
    error: object = event
    if isinstance(event, dict):
        if isinstance(event.get("error"), dict):
            error = event["error"]
        elif event.get("type") == "response.failed":
            response = event.get("response")
            error = response.get("error") if isinstance(response, dict) else None
    if not isinstance(error, dict):
        return SERVER
    names = []
    for field in ("code", "status", "type"):
        value = error.get(field)
        if type(value) is str and len(value) == 3 and value.isascii() and value.isdigit():
            value = int(value)  # a status sent as a string decides as the integer does
        if type(value) is int and 400 <= value <= 599:
            return SERVER if value >= 500 else QUOTA if value == 429 else CLIENT
        if isinstance(value, str) and value and (field != "type" or value != "error"):
            names.append(value.lower().replace("_", ""))
    if not names:
        return SERVER
    if any("ratelimit" in name or "quota" in name for name in names):
        return QUOTA
    if any(word in name for name in names for word in _SERVER_WORDS):
        return SERVER
    return CLIENT


def _finish_reason_given(data: bytes, first: int, last: int) -> bool:
    """Whether the chunk ``data[first:last]`` gives a choice's ``finish_reason`` (a string
    other than ``""``; every chunk before the last has ``null``, or ``""`` on some servers).
    A byte search and a look at what follows."""
    at = data.find(b'"finish_reason"', first, last)
    if at < 0:
        return False
    value = data[at + 15:at + 24].lstrip(b" \t\r\n:")
    return value.startswith(b'"') and not value.startswith(b'""')  # "" is none (some send it)


def _named_error(buf: bytes, start: int, end: int) -> bool:
    """Whether the SSE event ``buf[start:end]`` has an ``event:`` line naming ``error`` (its
    first such line, as sent: Anthropic's streams send one per event)."""
    if buf.startswith(b"event:", start):
        at = start + 6
    else:
        at = buf.find(b"\nevent:", start, end)
        if at < 0:
            return False
        at += 7
    if buf.startswith(b" ", at):
        at += 1
    line_end = buf.find(b"\n", at, end)
    return buf[at:end if line_end < 0 else line_end].rstrip(b"\r") == b"error"


_NONE, _JSON, _SSE = 0, 1, 2
_FINAL_RESPONSE_EVENTS = frozenset({"response.completed", "response.incomplete",
                                    "response.failed"})


class Meter:
    """Reads the usage of one answer as it passes (see the module docstring).

    :mod:`proxy.forward` calls ``request_headers`` before sending, ``start`` with the status
    and headers, then either ``body`` once (a buffered answer) or ``chunk`` per chunk and
    ``finish`` at a clean end; each returns the bytes to send on.

    Attributes:
        status: the upstream's status, 0 until headers arrive.
        complete: the whole answer went through (a clean end, not a cut).
        done: a stream's last event, as its API defines it, has been read: ``data: [DONE]``
            (Chat Completions, Completions), ``message_stop`` (Messages), or
            ``response.completed``, ``response.incomplete`` or ``response.failed``
            (Responses).
        failed: a stream's event reported an error (the upstream gave up mid-answer).
        stream_error: whose fault the first such event says it is (:func:`stream_error_side`:
            :data:`SERVER`, :data:`CLIENT`, :data:`QUOTA`), ``None`` when there was none.
        usage: as the upstream reported it so far.
        final: ``usage`` is the upstream's final count: a report (see :meth:`_take`) that no
            content followed outside a usage object (a report in a stream's first chunk
            counts none of the text after it; vLLM's ``continuous_usage_stats``, a usage
            object in every chunk, counts its own chunk's, and the last one is final).
        streamed_tokens: estimated output tokens in the content events passed on, for a
            stream that ends without usage: one per :data:`BYTES_PER_TOKEN` bytes of text, at
            least one per event with text; after the first :data:`SAMPLE_EVENTS` (parsed),
            each event counts as their mean, but one over twice their mean size, which is
            parsed and counted as they were.
        headers: added to the answer's headers (the budget's, set at admission).
    """

    # A meter is made per metered request, and most of its fields are used only by some
    # answers (a stream, a big one), so they start at class-level defaults instead of a
    # score of stores per meter. The few every call reads before writing are set by
    # __init__: reading a class-level default through an instance is the slower lookup.
    _mode = _NONE
    #: An SSE event not complete yet.
    _pending = b""
    #: Chunks that continue ``_pending`` without ending it, joined to it once one does: adding
    #: each to it copied the event so far per chunk, quadratic in its size (a 3 MB event in
    #: 1 KB chunks held the loop for 5 s).
    _parts: list[bytes] | None = None
    _parts_size = 0
    #: The last two bytes held (of ``_pending`` and ``_parts``), where a boundary may start.
    _edge = b""
    #: A JSON answer sent in chunks, held to be read at its end (the list is made by start).
    _json: list[bytes]
    _json_bytes = 0
    #: A JSON answer too big to hold: its last bytes.
    _json_tail: bytes | None = None
    #: Inside an SSE event too big to hold (passed on as it comes): its head, tail and size.
    _big = False
    _big_head = b""
    _big_tail = b""
    _big_size = 0
    #: The stream's lines end in CRLF (``None`` until its first line ending).
    _cr: bool | None = None
    #: They end in a bare CR: each is read as an LF (see ``_line_ending``).
    _bare_cr = False
    _sampled = 0
    _sample_tokens = 0
    _per_event = 1
    #: Bytes of the sampled events' data, and the size past which a later one is parsed.
    _sample_size = 0
    _big_event = 0
    status = 0
    complete = False
    done = False
    failed = False
    stream_error: str | None = None
    _final = False
    #: A Chat Completions or Completions chunk gave a choice's ``finish_reason``, or an
    #: Anthropic stream its ``message_delta``.
    _finished = False
    #: A JSON answer did not parse.
    _unreadable = False
    #: The upstream reported a negative count: none of this answer's counts is final.
    _negative = False
    #: An input count was reported (a later event may bring only the output count).
    _input_seen = False
    streamed_tokens = 0

    @property
    def cut_short(self) -> bool:
        """A stream that ended before its answer did, without an error event: its upstream
        closed it cleanly mid-answer, so what the caller got may be a part of the answer
        (the SDKs read such an end as the answer's, and raise nothing). Its answer is over
        at its last event (:attr:`done`), at Anthropic's ``message_delta`` (its stop
        reason), or, for Chat Completions and Completions, at a choice's ``finish_reason``:
        servers that never send ``data: [DONE]`` exist (older llama.cpp,
        text-generation-inference, mistral.rs), and their whole answers are answers. Not at
        a usage object: some servers send one in every chunk (vLLM's
        ``continuous_usage_stats``). With ``n`` over 1, the first choice to finish ends it
        (no choice is followed by its index). Or a JSON answer that is no JSON (cut short in
        its body's framing)."""
        if self._mode == _JSON:
            return self._unreadable
        return self._mode == _SSE and not (self.done or self.failed or self._finished)

    @property
    def final(self) -> bool:
        return self._final

    @final.setter
    def final(self, value: bool) -> None:
        self._final = value and not self._negative

    def __init__(self, endpoint: Endpoint, anthropic: bool, strip_usage: bool) -> None:
        self._kind = endpoint
        self._anthropic = anthropic
        self._strip = strip_usage
        self.usage = Usage()
        self.headers: dict[str, str] | None = None

    # -- the forwarder's calls ----------------------------------------------------------------

    #: The request's body was rewritten from UTF-16 or -32, now ASCII
    #: (:attr:`RequestCost.recoded`): a ``charset`` its ``Content-Type`` names is dropped.
    recoded = False

    def request_headers(self, headers: CIMultiDict[str]) -> None:
        """Ask for an uncompressed answer, so its bytes can be read as they pass; drop a
        ``charset`` a rewritten body no longer has (an upstream decoding by it read nothing,
        a review)."""
        headers["Accept-Encoding"] = "identity"
        if self.recoded:
            kind = headers.get("Content-Type")
            if kind is not None and "charset" in kind.lower():
                headers["Content-Type"] = kind.partition(";")[0].strip()

    def start(self, status: int, headers: CIMultiDict[str]) -> None:
        """Note the status; add the budget headers; choose how to read the body."""
        self.status = status
        if self.headers:
            headers.update(self.headers)
        if content_coding(headers):
            return  # compressed anyway: unreadable, so passed on untouched
        # Only a stream is read event by event, so only a stream can be stripped.
        content_type = headers.get("Content-Type", "").lower()  # case-insensitive (RFC 9110)
        if content_type.startswith("text/event-stream"):
            self._mode = _SSE
            if self._strip:
                headers.popall("Content-Length", None)  # the body may get shorter
        elif "json" in content_type:
            self._mode = _JSON
            self._json = []

    def body(self, data: bytes) -> bytes:
        """A whole buffered answer; returns it (without the usage chunk, if stripping)."""
        mode = self._mode
        if mode == _JSON:
            self._read_json(data)
        elif mode == _SSE:
            return self.chunk(data) + self.finish()
        self.complete = True
        return data

    def chunk(self, data: bytes) -> bytes:
        """One streamed chunk; returns what to write now (maybe less, never later data)."""
        if self._mode != _SSE:
            if self._mode == _JSON:  # a JSON answer sent in chunks: read it whole at the end
                if self._json_tail is not None:
                    self._json_tail = _tail(self._json_tail, data)
                elif self._json_bytes + len(data) <= JSON_LIMIT_BYTES:
                    self._json.append(data)
                    self._json_bytes += len(data)
                else:  # too big to hold: keep its end, where the usage object is
                    self._json_tail = _tail(b"".join(self._json), data)
                    self._json = []
            return data
        if self._cr is None:
            self._cr = self._line_ending(data)
        if self._bare_cr:
            # Read as LF; passed on so too only when the usage chunk is taken out (an event
            # is then rewritten anyway), else byte for byte, as every stream is.
            out = self._sse(data.replace(b"\r", b"\n"))
            return out if self._strip else data
        return self._sse(data)

    def _sse(self, data: bytes) -> bytes:
        """:meth:`chunk` for an SSE stream, its line endings read (LF or CRLF)."""
        if self._big:
            return self._big_chunk(data)
        if not self._pending and not self._cr and data.endswith(b"\n\n"):
            size = len(data)
            if data.find(b"\n\n") == size - 2:
                # The common case, one whole event per chunk: no splitting, no copies.
                if self._event(data, 0, size - 2) and self._strip:
                    return b""
                return data
        if self._pending:  # inside an event: does this chunk end it?
            edge = self._edge if self._parts is not None else self._pending[-2:]
            seen = edge + data[:2]
            size = len(self._pending) + self._parts_size + len(data)
            if (data.find(b"\n\n") < 0 and seen.find(b"\n\n") < 0 and size <= JSON_LIMIT_BYTES
                    and not (self._cr and (data.find(b"\n\r\n") >= 0
                                           or seen.find(b"\n\r\n") >= 0))):
                if self._parts is None:
                    self._parts = []
                self._parts.append(data)
                self._parts_size += len(data)
                self._edge = (edge + data)[-2:]
                return b"" if self._strip else data
            self._join()
        buf = self._pending + data if self._pending else data
        if self._strip:
            out, end = self._filter(buf)
            self._pending = buf[end:]
        else:
            out, end = data, self._scan(buf)
            self._pending = buf[end:] if end < len(buf) else b""
        if len(self._pending) > JSON_LIMIT_BYTES:  # too big to hold: pass it on as it comes
            held, self._pending = self._pending, b""
            self._big = True
            self._big_head = held[:HEAD_BYTES]
            self._big_tail = held[-TAIL_BYTES:]
            self._big_size = len(held)
            if self._strip:
                out += held
        return out

    def _join(self) -> None:
        """Join the chunks held in ``_parts`` to ``_pending``."""
        if self._parts is not None:
            self._pending = b"".join((self._pending, *self._parts))
            self._parts, self._parts_size = None, 0

    def _big_chunk(self, data: bytes) -> bytes:
        """A chunk inside an event too big to hold: passed on whole; the event's end, if in
        it, is read, and what follows is read as usual."""
        carry = self._big_tail[-2:]  # an event boundary may straddle the chunks
        end, after = self._boundary(carry + data[:2], 0)
        if 0 <= end < len(carry):
            cut, after = 0, after - len(carry)
        else:
            cut, after = self._boundary(data, 0)
        if cut < 0:
            self._big_tail = _tail(self._big_tail, data)
            self._big_size += len(data)
            return data
        self._big_tail = _tail(self._big_tail, data[:cut])
        self._big_size += cut
        self._end_big()
        rest = data[after:]
        return data[:after] + self._sse(rest) if rest else data

    def _end_big(self) -> None:
        """The big event ended: count it (its usage, or its size as streamed text)."""
        head, tail, size = self._big_head, self._big_tail, self._big_size
        self._big, self._big_head, self._big_tail, self._big_size = False, b"", b"", 0
        if not head.startswith(b"data:") and head.find(b"\ndata:") < 0:
            return  # a comment, or an event without data
        usage = _usage_in_tail(tail)
        if usage is not None:
            if not self._take(usage):
                return
            if self._anthropic:
                self.final = self.final or head.find(b"message_delta") >= 0
            elif self._kind is RESPONSES:
                self.final = self.final or any(head.find(kind.encode()) >= 0
                                               for kind in _FINAL_RESPONSE_EVENTS)
            else:
                self.final = True
        elif not (self.done and self._kind is not MESSAGES and self._kind is not RESPONSES):
            # (After [DONE], where the openai SDK stops reading, no text counts: as for a
            # small event, whose ``_event`` returns first.)
            self.streamed_tokens += max(1, size // BYTES_PER_TOKEN)
            self._final = False  # content after the usage so far (see ``_parse``)

    def finish(self) -> bytes:
        """The stream ended cleanly; returns any bytes still held back."""
        self.complete = True
        if self._mode == _JSON:
            if self._json_tail is not None:
                usage = _usage_in_tail(self._json_tail)
                if usage is not None and self._take(usage):
                    self.final = True
                self._json_tail = None
                return b""
            self._read_json(b"".join(self._json))
            self._json = []
            return b""
        if self._big:  # the stream ended inside a big event: it was passed on already
            self._end_big()
            return b""
        self._join()
        tail, self._pending = self._pending, b""
        if not tail or self._mode != _SSE:
            return b""
        ended = self.done, self._finished
        dropped = self._event(tail, 0, len(tail))
        # An event the stream ended inside is discarded by an SSE client (WHATWG): its usage
        # is read, but it is no last event of the answer.
        self.done, self._finished = ended
        return tail if self._strip and not dropped else b""

    def _read_json(self, data: bytes) -> None:
        """Take the usage of a whole JSON answer: its top-level ``usage`` object, if any.

        Only the answer's members from its last ``"usage":{`` key on are parsed, as one
        object, when they make one, which spares building its content (most of its bytes).
        They do exactly when that key is a member of the top-level object: under one nested
        deeper, closing brackets are left over. So on a valid answer this reads what parsing
        all of it would (the last ``usage`` member wins, as in a parse of all of it);
        otherwise all of it is parsed. Only an answer that is not valid JSON before that
        key, which parsing all of it would refuse, reads differently: its usage is taken.
        """
        at = data.rfind(b'"usage":{')
        obj = None
        # In valid JSON a quote after a brace, a comma or a space opens a key (one after a
        # backslash is an escaped quote inside a string).
        if at > 0 and data[at - 1] in b"{, \t\r\n":
            try:
                obj = orjson.loads(b"{" + data[at:])
            except orjson.JSONDecodeError:
                pass  # a key nested deeper: parse it all
        if obj is None:
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError as exc:
                # Cut short: the parse ran out at the end. Not a whole body orjson refuses
                # elsewhere (NaN, a byte-order mark), nor an empty one (a review). orjson
                # counts characters, and a body cut inside one is no UTF-8 at all.
                try:
                    end = len(data.rstrip().decode())
                except UnicodeDecodeError as bad:
                    self._unreadable = bad.reason == "unexpected end of data"
                    return
                self._unreadable = end > 0 and exc.pos >= end
                return
        if isinstance(obj, dict) and isinstance(usage := obj.get("usage"), dict) \
                and self._take(usage):
            self.final = True

    # -- SSE ----------------------------------------------------------------------------------

    def _line_ending(self, data: bytes) -> bool | None:
        """Whether the stream's lines end in CRLF (a stream keeps its line ending, so this is
        decided once), ``None`` while no line has ended. Lines ending in a bare CR (valid
        SSE, sent by no LLM API we know; the meter waited for an LF and held such a stream
        whole) set ``_bare_cr``: from then on each CR is read as an LF, the same line ending
        to an SSE reader (a raw CR can stand nowhere else in SSE: JSON text escapes it), and
        passed on as one when the usage chunk is taken out (else as it came)."""
        # What is held has no line ending yet, but may end in a CR: only that byte is read
        # again (all of it was, per chunk: quadratic in a long first line).
        held = self._edge if self._parts is not None else self._pending
        seen = held[-1:] + data if held else data
        lf = seen.find(b"\n")
        cr = seen.find(b"\r", 0, lf if lf >= 0 else len(seen))
        if cr >= 0 and cr + 1 < len(seen) and seen[cr + 1] != 0x0A:
            self._bare_cr = True
            self._join()
            self._pending = self._pending.replace(b"\r", b"\n")
            return False
        if lf < 0:
            return None
        return cr >= 0 or seen.find(b"\r", lf) >= 0 or self._big_tail.endswith(b"\r")

    def _boundary(self, buf: bytes, pos: int) -> tuple[int, int]:
        """``(end of event, start of the next)`` after ``pos``; ``(-1, -1)`` if incomplete."""
        end = buf.find(b"\n\n", pos)
        if self._cr:
            crlf = buf.find(b"\n\r\n", pos)
            if crlf >= 0 and (end < 0 or crlf < end):
                return crlf, crlf + 3
        return (end, end + 2) if end >= 0 else (-1, -1)

    def _scan(self, buf: bytes) -> int:
        """Read every complete event in ``buf``; returns where the incomplete tail starts."""
        pos = 0
        while True:
            end, after = self._boundary(buf, pos)
            if end < 0:
                return pos
            self._event(buf, pos, end)
            pos = after

    def _filter(self, buf: bytes) -> tuple[bytes, int]:
        """Like ``_scan``, also returning the complete events minus the usage chunk."""
        pos = kept_from = 0
        parts: list[bytes] = []
        while True:
            end, after = self._boundary(buf, pos)
            if end < 0:
                break
            if self._event(buf, pos, end):
                parts.append(buf[kept_from:pos])
                kept_from = after
            pos = after
        if not parts:
            return (buf[:pos] if pos < len(buf) else buf), pos
        parts.append(buf[kept_from:pos])
        return b"".join(parts), pos

    def _event(self, buf: bytes, start: int, end: int) -> bool:
        """Read the event ``buf[start:end]``; returns True if it is the usage chunk to strip.

        Only events carrying a usage object are parsed in full, found by the bytes
        ``"usage"`` followed by ``{`` (an escaped quote inside text cannot match). Content
        events are counted: the first :data:`SAMPLE_EVENTS` are parsed to measure their text,
        later ones count as the sample's mean, so a long stream costs a few byte searches per
        event and no copies; but a later event over twice the sample's mean size is parsed
        and counted by its text (counted as the mean, 3 KB tool arguments after
        one-character deltas were charged 40 tokens for ~15,000: a hostile trial; counted by
        size, a chunk carrying no text, an Azure content filter's results or a thinking
        block's signature, or text sent as escapes, was overcharged: a review).
        """
        if buf.startswith(b"data:", start):
            first = start + 5
        else:
            line = buf.find(b"\ndata:", start, end)
            if line < 0:
                return False  # a comment, or an event without data
            first = line + 6
        # The event's name is looked for in its head (its ``event:`` line, or the start of
        # its data; not past its end, where the next event's name may be), in ``buf``; its
        # data is read from ``data``.
        head = min(start + 64, end)
        data, last = buf, end
        if buf.find(b"\n", first, end) >= 0:  # several data lines: join them (WHATWG SSE)
            lines = [x[5:] for x in buf[start:end].split(b"\n") if x.startswith(b"data:")]
            data = b"\n".join(lines)
            first, last = 0, len(data)
        if data.find(b"{", first, first + 4) < 0:
            if data.startswith(b" [DONE]", first) or data.startswith(b"[DONE]", first):
                self.done = True  # as the SDK reads it: data, less one leading space
            elif self._kind is MESSAGES and _named_error(buf, start, end):
                self._failed(None)  # the anthropic SDK raises on it, whatever its data
            return False  # [DONE], or not JSON
        at = data.find(b'"usage"', first, last)
        if at >= 0 and data.find(b"{", at + 7, at + 11) >= 0:
            return self._parse(data[first:last], True)
        if self._kind is MESSAGES:
            if buf.find(b"content_block_delta", start, head) < 0:
                if buf.find(b"message_stop", start, head) >= 0:
                    self.done = True
                elif buf.find(b"message_delta", start, head) >= 0:
                    self._finished = True  # one without usage (one with is parsed above)
                elif buf.find(b"error", start, head) >= 0:
                    self._error_event(data[first:last], _named_error(buf, start, end))
                return False
        elif self._kind is RESPONSES:
            if buf.find(b".delta", start, head) < 0:
                if (buf.find(b"error", start, head) >= 0
                        or buf.find(b"response.failed", start, head) >= 0):
                    self._error_event(data[first:last])
                elif (buf.find(b"response.completed", start, head) >= 0
                      or buf.find(b"response.incomplete", start, head) >= 0):
                    self.done = True  # its usage, when there is one, is read above
                return False
        else:
            # OpenAI's {"error": ...} chunk; none after [DONE], where the openai SDK stops
            # reading (the other SDKs read on: their error events count wherever they are).
            if self.done:
                return False  # nor is its content counted: only a usage chunk is read (above)
            if (data.find(b'"error"', first, first + 10) >= 0
                    and self._error_event(data[first:last])):
                return False
            if not self._finished:
                self._finished = _finish_reason_given(data, first, last)
        # After a report, content is parsed: text it brings is no part of that report.
        if self._sampled < SAMPLE_EVENTS or last - first > self._big_event or self._final:
            self._parse(data[first:last], False)
        else:
            self.streamed_tokens += self._per_event
        return False

    def _error_event(self, payload: bytes, named: bool = False) -> bool:
        """Note an event reporting that the answer failed mid-stream (Anthropic's and the
        Responses API's ``"type": "error"``, the Responses API's ``response.failed``, a Chat
        Completions chunk whose ``error`` is anything but empty, as the openai SDK reads it:
        ``{"error": {...}}``, ``{"error": "upstream model crashed"}``; any event named
        ``error``, ``named``, as the anthropic SDK reads it, whatever its data): the stream
        that follows it ends without usage, as a cut one does. Returns whether it is one."""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            if named:
                self._failed(None)  # names no side: the server's
            return named
        kind = obj.get("type")
        failed = kind == "error" or (
            kind == "response.failed" if self._kind is RESPONSES
            else self._kind is not MESSAGES and bool(obj.get("error")))
        if failed:
            self._failed(obj)
        elif named:
            # An event named error whose data is no error (a ping's): it says no side.
            self._failed(obj if isinstance(obj.get("error"), dict) else None)
        return failed or named

    def _failed(self, event: object) -> None:
        """The stream reported an error in ``event`` (its parsed data, ``None`` when it
        names no side)."""

        self.failed = True
        if self.stream_error is None:
            self.stream_error = stream_error_side(event)

    def _parse(self, payload: bytes, has_usage: bool) -> bool:
        """Parse one event (``payload``: its data): take its usage, measure its text; True if
        it is to be stripped."""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(obj, dict):
            return False
        text = 0
        strip = False
        counted = False  # this event's own usage object is a full count
        if self._anthropic:
            kind = obj.get("type")
            if kind == "content_block_delta":
                text = _text_bytes(obj.get("delta"))
            elif kind == "message_start":
                message = obj.get("message")
                if isinstance(message, dict) and isinstance(u := message.get("usage"), dict):
                    self._take(u)
            elif kind == "message_delta":
                self._finished = True
                if isinstance(u := obj.get("usage"), dict):
                    self.final = self._take(u) or self.final
            elif kind == "error":  # one carrying usage is parsed here, not by _error_event
                self._failed(obj)
            elif kind == "message_stop":
                self.done = True
        elif self._kind is RESPONSES:
            kind = obj.get("type")
            if isinstance(kind, str):
                if kind.endswith(".delta"):
                    text = _text_bytes(obj.get("delta"))
                elif kind in _FINAL_RESPONSE_EVENTS:
                    self.done = True
                    response = obj.get("response")
                    if isinstance(response, dict) and isinstance(
                        u := response.get("usage"), dict
                    ) and self._take(u):
                        self.final = True
                    if kind == "response.failed":
                        self._failed(obj)
                elif kind == "error":  # one carrying usage, as above
                    self._failed(obj)
        else:
            choices = obj.get("choices")
            if has_usage and isinstance(u := obj.get("usage"), dict):
                counted = self._take(u)
                self.final = counted or self.final
                strip = self._strip and choices == []
                if obj.get("error") and not self.done:  # an error chunk carrying usage
                    self._failed(obj)
            if choices:
                field = "delta" if self._kind is CHAT else "text"
                for choice in choices:
                    if isinstance(choice, dict):
                        text += _text_bytes(choice.get(field))
                        if has_usage and choice.get("finish_reason"):
                            self._finished = True  # a chunk with usage skips the byte look
        if text:
            if self._final and not counted:
                # Text after the usage so far, which so does not count it, and only a later
                # usage object may: a stream's first chunk carrying {"completion_tokens": 0}
                # made the 50 chunks after it free (a hostile trial). Nor does a usage object
                # on this event that is no full count (``{}``, an input count alone, one
                # nested as Groq's ``x_groq.usage``): they kept the first chunk's count final
                # (a review). vLLM's ``continuous_usage_stats`` counts each chunk whole.
                self._final = False
            tokens = max(1, -(-text // BYTES_PER_TOKEN))
            self.streamed_tokens += tokens
            if self._sampled < SAMPLE_EVENTS:
                self._sampled += 1
                self._sample_tokens += tokens
                self._per_event = max(1, -(-self._sample_tokens // self._sampled))
                self._sample_size += len(payload)
                self._big_event = 2 * self._sample_size // self._sampled
        return strip

    def _take(self, raw: dict) -> bool:
        """Merge one usage object: each count becomes the largest reported so far (counts
        only grow: Anthropic's are cumulative); one that is not a non-negative integer is
        read as 0. Returns whether the usage so far is a report: an input count (in this
        object or an earlier one of the stream) and an output count (but for embeddings),
        integers under the protocol's names. One that is not (``{}``, another protocol's
        names, ``completion_tokens: null``), or that reports a negative count, is no report,
        so the call is charged as one without usage, not as one that used nothing (a negative
        count once made a call free; a null output count made its output free)."""
        u = self.usage
        if self._anthropic:
            read = _count(raw.get("cache_read_input_tokens"))
            write = _count(raw.get("cache_creation_input_tokens"))
            sent_in = raw.get("input_tokens")
            total_in = _count(sent_in) + read + write
            out = raw.get("output_tokens")
            if write > u.cache_write_tokens:
                u.cache_write_tokens = write
        else:
            if "prompt_tokens" in raw:  # Chat Completions, Completions, Embeddings
                total_in = raw.get("prompt_tokens")
                out = raw.get("completion_tokens")
                details = raw.get("prompt_tokens_details")
            else:  # Responses
                total_in = raw.get("input_tokens")
                out = raw.get("output_tokens")
                details = raw.get("input_tokens_details")
            read = details.get("cached_tokens") if isinstance(details, dict) else 0
            sent_in = total_in
        # The counts start at 0, so "larger than the count so far" also drops a negative one
        # (``type() is int`` drops a float, a string, null and a bool).
        sent_int, out_int = type(sent_in) is int, type(out) is int
        if type(total_in) is int and total_in > u.input_tokens:
            u.input_tokens = total_in
        if out_int and out > u.output_tokens:
            u.output_tokens = out
        if type(read) is int and read > u.cache_read_tokens:
            u.cache_read_tokens = read
        if (sent_int and sent_in < 0) or (out_int and out < 0):
            # No report, now or later in the stream (an Anthropic message_start's input
            # count is not merged again): charged as a call without usage.
            self._negative = True
            self._final = False
            return False
        if sent_int:
            self._input_seen = True
        # Both counts make a report: one without its output count (null, missing) would
        # charge the output as 0. The input may have come earlier in the stream (Anthropic's
        # message_start); embeddings have no output.
        return self._input_seen and (out_int or self._kind is EMBEDDINGS)


def _tail(kept: bytes, data: bytes) -> bytes:
    """The last :data:`TAIL_BYTES` of ``kept + data``, copying no more than needed."""
    if len(data) >= TAIL_BYTES:
        return data[-TAIL_BYTES:]
    return (kept + data)[-TAIL_BYTES:]


def _usage_in_tail(tail: bytes) -> dict | None:
    """The last ``"usage": {...}`` object in ``tail`` (the end of a JSON object or event),
    parsed; ``None`` if there is none. A ``"usage"`` key can only be matched outside JSON
    strings, where quotes are escaped."""
    at = len(tail)
    while (at := tail.rfind(b'"usage"', 0, at)) >= 0:
        start = tail.find(b"{", at + 7, at + 11)
        if start < 0 or tail[at + 7:start].strip(b" \t\r\n:") != b"":
            continue
        end = _object_end(tail, start)
        if end < 0:
            continue
        try:
            usage = orjson.loads(tail[start:end])
        except orjson.JSONDecodeError:
            continue
        if isinstance(usage, dict):
            return usage
    return None


def _object_end(buf: bytes, start: int) -> int:
    """Where the JSON object starting at ``buf[start]`` (a ``{``) ends, or -1 if it does not
    end within ``buf``."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(buf)):
        c = buf[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c == 0x7B:  # {
            depth += 1
        elif c == 0x7D:  # }
            depth -= 1
            if depth == 0:
                return i + 1
    return -1
