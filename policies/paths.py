"""Request paths as an upstream routes them, for the policies that key on a path.

RFC 3986 §6.2.2.2: a percent-encoded unreserved character (ALPHA, DIGIT, ``-._~``, §2.3) is
the character itself, and upstreams decode it before routing (aiohttp, Starlette, Express):
``/v1/chat/completion%73`` *is* ``/v1/chat/completions``. A policy that matched the raw path
would let the encoded spelling dodge it, so it matches :func:`decode_unreserved` of it.
Encoded reserved characters (``%2F``) stay encoded there: to some upstreams they are data,
not separators (encoded dot-segments are refused at the door,
``has_dot_segment``). But others route on a more lenient reading,
:func:`as_routed`: uvicorn hands Starlette the fully decoded path (``/v1/jobs%2F3`` is
``/v1/jobs/3`` there), nginx merges runs of slashes, Express ignores a trailing one. So a
policy keyed on a path applies when either reading matches it: metering
(:func:`policies.usage.endpoint_for`) and ``endpoints:`` patterns
(:class:`policies.operations.Operations`), which ``/v1/jobs%2F3``, ``/v1//jobs/3`` and
``/v1/jobs/3/`` dodged (a hostile trial). IIS and frameworks on Windows split segments at a
backslash too, so :func:`as_routed` reads ``\\`` (and ``%5C``) as a slash.

``endpoints:`` patterns go further (a later hostile trial): Express (its default) and
ASP.NET Core route paths case-insensitively, so they are matched folded to lower case, and
Tomcat, Jetty and Spring drop a segment's ``;parameters`` (RFC 3986 §3.3), so a path with
them is matched without them too (:func:`without_params`): ``/V1/JOBS/3``,
``/v1/jobs;x=1/4`` and ``/v1;v=2/jobs/5`` are all ``/v1/jobs/*``'s. Metering reads the same
spellings (a later security trial: ``/v1/Chat/Completions`` and
``/v1/chat/completions;jsessionid=1`` passed a token budget unmetered), so both ask
:func:`readings` for them: one rule for every policy keyed on a path. When a metered POST's
readings name different endpoints (``/v1/responses;x=%2Fcompletions`` is responses to
Tomcat, whose ``;parameters`` go before it decodes, completions to others), it is refused
(:func:`policies.usage.endpoints_differ`, a review).
"""

from __future__ import annotations

import re
from urllib.parse import unquote

_ENCODED_UNRESERVED = re.compile(
    r"%(4[1-9A-Fa-f]|5[0-9Aa]|6[1-9A-Fa-f]|7[0-9Aa]|3[0-9]|2[DEde]|5[Ff]|7[Ee])")
_SLASH_RUN = re.compile(r"//+")
_ENCODED_SEPARATOR = re.compile(r"%2[Ff]|%5[Cc]")
_PARAMS = re.compile(r";[^/]*")
#: Azure OpenAI's ``/openai/deployments/{name}/...``: the segment after ``deployments`` names
#: the deployment, hence the model (its own path segment, followed by the operation's).
_DEPLOYMENT = re.compile(r"(?:^|/)deployments/([^/]+)/", re.IGNORECASE)


def decode_unreserved(path: str) -> str:
    """``path`` (raw, as sent) with its percent-encoded unreserved characters decoded."""
    if "%" not in path:
        return path
    return _ENCODED_UNRESERVED.sub(lambda m: chr(int(m.group(1), 16)), path)


def as_routed(path: str) -> str:
    """``path`` (a path without its query, :func:`decode_unreserved` already) as the most
    lenient common upstreams route it: ``%2F``, a backslash and ``%5C`` as a slash, and a
    run of slashes as one (the module docstring; a trailing slash is kept:
    :func:`without_trailing_slash`); ``path`` itself, the same object, when none applies."""
    routed = path
    if "%" in routed:
        routed = _ENCODED_SEPARATOR.sub("/", routed)
    if "\\" in routed:
        routed = routed.replace("\\", "/")
    if "//" in routed:
        routed = _SLASH_RUN.sub("/", routed)
    return path if routed == path else routed


def without_params(path: str) -> str:
    """``path`` less each segment's ``;parameters`` (``/v1;v=2/jobs;x=1/4`` is
    ``/v1/jobs/4``), as Tomcat, Jetty and Spring route it; ``path`` itself, the same object,
    when it has none."""
    return _PARAMS.sub("", path) if ";" in path else path


def without_trailing_slash(path: str) -> str:
    """``path`` less a trailing slash (Express routes ``/jobs/5/`` as ``/jobs/5``); ``path``
    itself, the same object, when it has none (or is ``/``)."""
    return path[:-1] if len(path) > 1 and path[-1] == "/" else path


def readings(path: str) -> tuple[str, ...]:
    """Every reading of ``path`` (raw, as sent, its query included or not) that a common
    upstream may route, folded to lower case: :func:`decode_unreserved` of it, then
    :func:`as_routed`, :func:`without_trailing_slash` and :func:`without_params` (the module
    docstring). A policy keyed on a path applies when any reading matches it.

    A path already in the form every upstream reads alike (lower case; no ``%``, ``;``,
    backslash, run of slashes or trailing slash: what SDKs send) is its only reading, found
    without building another string: the hot path pays for a few character tests only."""
    if "?" in path:
        path = path.partition("?")[0]
    if (path.islower() and "%" not in path and ";" not in path and "\\" not in path
            and "//" not in path and path[-1] != "/"):
        return (path,)
    lowered = decode_unreserved(path).lower()
    routed = as_routed(lowered)
    found = {lowered, routed, without_trailing_slash(routed)}
    if ";" in lowered:
        bare = as_routed(without_params(lowered))
        found.update((bare, without_trailing_slash(bare)))
    return tuple(found)


def deployment_named(path: str) -> str | None:
    """The deployment an Azure OpenAI path (after a route's prefix, query included or not)
    calls, read as :func:`as_routed` reads it: ``gpt-4o`` for
    ``/openai/deployments/gpt-4o/chat/completions``; ``None`` for a path naming none.
    Azure picks the model by it, whatever the body's ``model`` says."""
    found = _DEPLOYMENT.search(as_routed(decode_unreserved(path.partition("?")[0])))
    return found.group(1) if found is not None else None


def has_dot_segment(raw_path: str) -> bool:
    """True if the path part has a ``.`` or ``..`` segment, plain or percent-encoded (once or
    twice), with ``\\`` taken for a ``/`` too, and a segment's ``;parameters`` left out.

    Such paths are refused rather than forwarded: an upstream that resolves them would serve a
    path other than the one Sluice routed on (RFC 3986 §5.2.4); some servers (IIS, and
    frameworks on Windows) also split segments at a backslash, Tomcat, Jetty and Spring drop
    a segment's parameters before resolving (``/base/..;/admin`` is ``/admin`` to them), and
    an upstream that decodes twice reads ``%252e`` as ``.`` (a hostile trial forwarded all
    three). A path whose twice-decoded form holds no dot-segment is forwarded, ``%25`` or not.
    An upstream's redirect to such a path is not mapped onto the route either
    (:mod:`proxy.locations`): a client resolves the segments, onto another route maybe.
    """
    if "." not in raw_path and "%" not in raw_path:
        return False
    path = unquote(raw_path.partition("?")[0])
    if "%" in path:
        path += "/" + unquote(path)  # both readings' segments, in one pass
    return any(segment.partition(";")[0] in (".", "..")
               for segment in path.replace("\\", "/").split("/"))
