"""Redacting secrets from what Sluice shows or logs (admin API, reload errors, ``dlq show``).

Sluice's config may hold credentials (a Redis URL with a password, an upstream URL with user
info, API keys in headers); nothing served on the admin port or written to the log may show them.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote_plus

from policies.secrets import (
    AUTH_SCHEMES,
    SECRET_IN_TEXT,
    SECRET_VALUE,
    secret_query_field,
    secret_query_name,
)
from policies.state import redact_url

REDACTED = "<redacted>"

# Key names that hold secrets, matched on whole words of the key (``api_key``,
# ``redis_password``, ``auth_token``) so that ``tokens`` (a budget unit) is left alone.
_SECRET_WORDS = frozenset(
    {"secret", "password", "passwd", "token", "key", "apikey", "credential", "credentials",
     "authorization", "auth", "cookie"}
)
# A key ending in one of these names something about a secret, not the secret itself:
# ``state.key_prefix``, ``identity.unknown_key_tenant``, a ``token_file`` path.
_DESCRIBES_ONLY = frozenset({"prefix", "tenant", "header", "file", "path", "name", "id"})
_WORD_SPLIT = re.compile(r"[_\-.\s]+|(?<=[a-z])(?=[A-Z])")
# scheme://user:password@host or scheme://token@host, anywhere in a string (error messages
# quote the values they reject): the userinfo, up to the last '@' before the path (a
# password may hold '@' or quotes unescaped; redis-py accepts them).
_SCHEME = r"[a-zA-Z][a-zA-Z0-9+.-]*://"
_URL_USERINFO = re.compile(rf"\b({_SCHEME})([^/?#\s]*)@")
# A value that is a URL as a whole: redacted by parsing it (see redact_url).
_WHOLE_URL = re.compile(_SCHEME)
# A value quoted in a message (as refused values are: ``'Basic abc' is not a duration``).
_QUOTED = re.compile(r"""(?=(['"])([^'"\n]+)\1)""")  # a lookahead: every quote is tried
# 20 or more letters and digits in a row, at least three of each kind among them: a key's
# body, whatever its vendor's prefix (separators cut model names, UUIDs and dates into
# shorter runs; a number with its unit, ``99999999999999999999h``, has one letter).
_KEYLIKE = re.compile(r"(?<![A-Za-z0-9])(?=(?:[A-Za-z]*[0-9]){3})(?=(?:[0-9]*[A-Za-z]){3})"
                      r"[A-Za-z0-9]{20,}")
# An Authorization scheme and its space, kept when the rest is redacted.
_SCHEME_WORD = re.compile(rf"{AUTH_SCHEMES}\s+")
# A query field of a URL quoted inside a longer string (``...?api_key=abc&x=1'``).
_QUERY_FIELD = re.compile(r"([?&])([^=&\s'\"#?]+)(?:=([^&\s'\"#]*))?")


def redact(value: Any, key: str = "") -> Any:
    """A copy of a JSON-ready ``value`` with anything that looks like a secret replaced.

    Redacted: the value of a key with a secret-sounding word (``password``, ``token``,
    ``api_key``, ``auth``...); the password, or a lone token, in a URL's userinfo, and query
    fields that carry credentials by name or value (``?password=``, ``?api_key=``,
    ``?q=sk-...``), also inside a longer string (``redis://:pw@host`` ->
    ``redis://:<redacted>@host``); strings shaped like API keys or ``Authorization`` values
    (``sk-...``, ``Bearer ...``), as a whole or inside a longer string (a message quoting a
    value: ``'sk-...' is not a duration``, :data:`policies.secrets.SECRET_IN_TEXT`; a quoted
    value that is one whole, however short: ``'Basic dXNlcjpwYXNz'``).
    """
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, key) for v in value]
    if not isinstance(value, str):
        if value is not None and _secret_key(key) and not isinstance(value, bool):
            return REDACTED
        return value
    if _secret_key(key) or SECRET_VALUE.match(value):
        return REDACTED if value else value
    if _WHOLE_URL.match(value) and ("@" in value or "?" in value):
        # The whole authority (a password with spaces included), and credentials in the
        # query (redis-py reads ?password=; some APIs take ?api_key=).
        return redact_url(value)
    value = _URL_USERINFO.sub(_redact_userinfo, value)
    if "=" in value or "?" in value:
        value = _QUERY_FIELD.sub(_redact_query_field, value)
    if "'" in value or '"' in value:
        value = _redact_quoted(value)
    return SECRET_IN_TEXT.sub(_redact_in_text, value)


def _redact_quoted(text: str) -> str:
    """``text`` with each quoted value that is a credential as a whole (``'Basic
    dXNlcjpwYXNz'``, as a refused config value is quoted back) redacted, however short, and
    each that holds a run of 20 letters and digits, three of each at least (a key of a
    vendor whose prefix Sluice does not know: Azure's 32 hex digits, ``gsk_...``,
    ``hf_...``; a new user's trial): only its scheme, if any, is kept. Model names, UUIDs
    and durations have no such run. Every quote is tried as an opening one, so an apostrophe
    earlier in the text (``can't``) does not pair with the value's own quote."""
    parts: list[str] = []
    at = 0
    for match in _QUOTED.finditer(text):
        inner = match.group(2)
        if match.start(2) < at or not (SECRET_VALUE.match(inner) or _KEYLIKE.search(inner)):
            continue
        scheme = _SCHEME_WORD.match(inner)
        parts += (text[at:match.start(2)], scheme.group(0) if scheme else "", REDACTED)
        at = match.end(2)
    if not parts:
        return text
    parts.append(text[at:])
    return "".join(parts)


def _redact_in_text(match: re.Match[str]) -> str:
    return f"{match.group(1) or ''}{REDACTED}"


def _redact_query_field(match: re.Match[str]) -> str:
    name = unquote_plus(match.group(2))
    if not secret_query_field(name, unquote_plus(match.group(3) or "")):
        return match.group(0)
    if secret_query_name(name):  # the name is the token (``?sk-...``): none of it is shown
        return f"{match.group(1)}{REDACTED}"
    return f"{match.group(1)}{match.group(2)}={REDACTED}"


def _redact_userinfo(match: re.Match[str]) -> str:
    user, sep, _ = match.group(2).partition(":")
    return f"{match.group(1)}{user}:{REDACTED}@" if sep else f"{match.group(1)}{REDACTED}@"


def _secret_key(key: str) -> bool:
    words = [word.lower() for word in _WORD_SPLIT.split(key) if word]
    if words and words[-1] in _DESCRIBES_ONLY:
        return False
    return any(word in _SECRET_WORDS for word in words)


#: The fields of Azure OpenAI On Your Data's ``authentication`` objects (a data source's
#: ``parameters.authentication``, and its ``parameters.embedding_dependency.authentication``)
#: that hold a credential, by authentication ``type``: ``key`` (``api_key``,
#: ``key_and_key_id``), ``connection_string``, ``encoded_api_key``, ``access_token`` and
#: ``password`` (``username_and_password``); ``key_id``, ``username`` and a managed
#: identity's resource id name one and are shown
#: (https://learn.microsoft.com/azure/ai-services/openai/references/on-your-data).
_DATA_SOURCE_SECRETS = ("key", "connection_string", "encoded_api_key", "access_token",
                        "password")


def body_credentials_masked(text: str) -> tuple[str, list[str]]:
    """A request body as ``dlq show`` prints it: ``text`` with the credentials some
    provider APIs take in a JSON body replaced by :data:`REDACTED`, at these documented
    paths only (no guess from other keys' names):

    * Anthropic Messages, MCP connector: ``mcp_servers[].authorization_token``;
    * OpenAI Responses, a tool of ``"type": "mcp"``: its ``authorization`` and every value
      of its ``headers``;
    * Azure OpenAI On Your Data: ``data_sources[].parameters.authentication``'s and
      ``data_sources[].parameters.embedding_dependency.authentication``'s
      :data:`_DATA_SOURCE_SECRETS`.

    Read as an upstream's parser may read it: after a UTF-8 byte order mark; a key that
    appears more than once in an object is looked into, and masked, each time (a parser
    may take its first value, Python's takes the last; a ``type`` is ``mcp`` if any is).
    Returns the text (written again when anything was masked: every member kept, numbers
    as their tokens, ``1e999`` or ``NaN`` as the body has them, the mark kept; else
    ``text`` as it is) and the paths masked (``tools[0].headers["X-Api-Key"]``), empty when
    the body is no JSON object or holds none of them (a null is left as it is; a ``tools``
    that is an object, not the documented array, is not looked into). For display only:
    the letter keeps its body as sent, which a replay sends."""
    mark = "\ufeff" if text.startswith("\ufeff") else ""
    try:
        body = json.loads(text[len(mark):], object_pairs_hook=_Object, parse_float=_Raw,
                          parse_int=_Raw, parse_constant=_Raw)
    except (ValueError, RecursionError):  # not JSON (or cut at max_body_bytes)
        return text, []
    if not isinstance(body, _Object):
        return text, []
    masked: dict[str, None] = {}  # the paths, in order, once each

    def mask(holder: _Object, key: str, path: str) -> None:
        for member in holder.members:
            if member[0] == key and member[1] is not None:
                member[1] = REDACTED
                masked[path] = None

    def mask_authentication(holder: _Object, path: str) -> None:
        for auth in holder.every("authentication"):
            if isinstance(auth, _Object):
                for name in _DATA_SOURCE_SECRETS:
                    mask(auth, name, f"{path}.authentication.{name}")

    for servers in body.every("mcp_servers"):
        for at, server in _objects(servers):
            mask(server, "authorization_token", f"mcp_servers[{at}].authorization_token")
    for tools in body.every("tools"):
        for at, tool in _objects(tools):
            if "mcp" not in tool.every("type"):
                continue
            mask(tool, "authorization", f"tools[{at}].authorization")
            for headers in tool.every("headers"):
                if isinstance(headers, _Object):
                    for name, _ in headers.members:
                        mask(headers, name, f"tools[{at}].headers[{json.dumps(name)}]")
                else:  # not the documented object: all of it
                    mask(tool, "headers", f"tools[{at}].headers")
    for sources in body.every("data_sources"):
        for at, source in _objects(sources):
            for parameters in source.every("parameters"):
                if isinstance(parameters, _Object):
                    path = f"data_sources[{at}].parameters"
                    mask_authentication(parameters, path)
                    for dependency in parameters.every("embedding_dependency"):
                        if isinstance(dependency, _Object):
                            mask_authentication(dependency, f"{path}.embedding_dependency")
    if not masked:
        return text, []
    shown = mark + _written(body, ascii=False)
    try:
        shown.encode()
    except UnicodeEncodeError:  # a lone surrogate the body escaped ("\ud800"): escaped again
        shown = mark + _written(body, ascii=True)
    return shown, list(masked)


class _Object:
    """A JSON object as a body holds it: its members in order, a key that appears more than
    once each time."""

    __slots__ = ("members",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.members = [[key, value] for key, value in pairs]

    def every(self, key: str) -> list[Any]:
        """The value of each member named ``key``."""
        return [value for name, value in self.members if name == key]


class _Raw(str):
    """Text :func:`_written` writes as it is: a number as the body writes it (Python's
    float makes ``1e999`` ``inf``, which :func:`json.dumps` writes ``Infinity``, no JSON),
    or punctuation."""

    __slots__ = ()


def _written(value: Any, ascii: bool) -> str:
    """``value`` (a body as :func:`body_credentials_masked` reads it) as JSON text, spaced
    as :func:`json.dumps` writes it, non-ASCII text escaped if ``ascii``. Not recursive: a
    body nested 990 deep, which Python's parser reads, is written too."""
    out: list[str] = []
    todo: list[Any] = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, _Raw):
            out.append(item)
        elif isinstance(item, _Object):  # "{", then each member, then "}", off the stack
            todo.append(_Raw("}"))
            for at in range(len(item.members) - 1, -1, -1):
                key, member = item.members[at]
                todo += [member, _Raw(f"{', ' if at else ''}"
                                      f"{json.dumps(key, ensure_ascii=ascii)}: ")]
            todo.append(_Raw("{"))
        elif isinstance(item, list):
            todo.append(_Raw("]"))
            for at in range(len(item) - 1, -1, -1):
                todo += [item[at], _Raw(", " if at else "")]
            todo.append(_Raw("["))
        else:  # text, true, false, null
            out.append(json.dumps(item, ensure_ascii=ascii))
    return "".join(out)


def _objects(items: object) -> list[tuple[int, _Object]]:
    """The objects of a JSON array, with their positions (nothing when it is no array)."""
    if not isinstance(items, list):
        return []
    return [(at, item) for at, item in enumerate(items) if isinstance(item, _Object)]
