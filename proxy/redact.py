"""Redacting secrets from what Sluice shows or logs (admin API, reload errors, ``dlq show``).

Sluice's config may hold credentials (a Redis URL with a password, an upstream URL with user
info, API keys in headers); nothing served on the admin port or written to the log may show them.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
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
      of its ``headers`` (all of it when it is no object);
    * Azure OpenAI On Your Data: ``data_sources[].parameters.authentication``'s and
      ``data_sources[].parameters.embedding_dependency.authentication``'s
      :data:`_DATA_SOURCE_SECRETS`.

    Returns the text and the paths masked (``tools[0].headers["X-Api-Key"]``). When something
    is masked the text is written again by :func:`json.dumps` (spacing and number spelling may
    differ from the body's); else it is ``text`` as stored. A body that is no JSON object (cut
    at ``max_body_bytes``, compressed) is shown as stored, unless it nests deeper than
    :data:`MAX_NESTING` levels (counted before it is parsed, JSON or not): then it is withheld
    as below. A body that is JSON only as some parsers read it (a key twice, which parsers
    take first or last; ``NaN`` or ``1e999``, which Python's writer cannot write back as JSON;
    nesting deeper than :data:`MAX_NESTING` levels) and that may name one of the fields above
    (:data:`_MASKED_NAMES`, a JSON escape included) is withheld (:data:`WITHHELD`, path
    ``"body"``): it cannot be masked as every upstream reads it. For display only: the letter
    keeps its body, which a replay sends."""
    body_text = text.removeprefix("\ufeff")  # a byte order mark, which json refuses
    try:
        if _nested_deeper_than(body_text, MAX_NESTING):
            raise _Odd("nested too deep")
        body = json.loads(body_text, object_pairs_hook=_no_twice, parse_constant=_odd,
                          parse_float=_finite)
    except (_Odd, RecursionError):  # RecursionError: a caller already deep in its stack
        if any(name in text for name in _MASKED_NAMES):
            return WITHHELD, ["body"]
        return text, []
    except ValueError:  # not JSON (or cut at max_body_bytes)
        return text, []
    if not isinstance(body, dict):
        return text, []
    masked: list[str] = []

    def mask(holder: dict[str, Any], key: str, path: str) -> None:
        if holder.get(key) is not None:
            holder[key] = REDACTED
            masked.append(path)

    def mask_authentication(holder: object, path: str) -> None:
        auth = holder.get("authentication") if isinstance(holder, dict) else None
        if isinstance(auth, dict):
            for name in _DATA_SOURCE_SECRETS:
                mask(auth, name, f"{path}.authentication.{name}")

    for at, server in _objects(body.get("mcp_servers")):
        mask(server, "authorization_token", f"mcp_servers[{at}].authorization_token")
    for at, tool in _objects(body.get("tools")):
        if tool.get("type") != "mcp":
            continue
        mask(tool, "authorization", f"tools[{at}].authorization")
        headers = tool.get("headers")
        if isinstance(headers, dict):
            for name in headers:
                mask(headers, name, f"tools[{at}].headers[{json.dumps(name)}]")
        else:  # not the documented object: all of it
            mask(tool, "headers", f"tools[{at}].headers")
    for at, source in _objects(body.get("data_sources")):
        parameters = source.get("parameters")
        path = f"data_sources[{at}].parameters"
        mask_authentication(parameters, path)
        if isinstance(parameters, dict):
            mask_authentication(parameters.get("embedding_dependency"),
                                f"{path}.embedding_dependency")
    if not masked:
        return text, []
    try:
        shown = json.dumps(body, ensure_ascii=False)
        shown.encode()
    except UnicodeEncodeError:  # a lone surrogate the body escaped ("\ud800"): escaped again
        shown = json.dumps(body)
    except RecursionError:  # read, but too deep for the writer under a deep caller
        return WITHHELD, ["body"]
    return text[:len(text) - len(body_text)] + shown, masked


#: What ``dlq show`` prints for a body it cannot mask (:func:`body_credentials_masked`).
WITHHELD = ("<withheld: this body is JSON only as some parsers read it (a key twice, NaN, "
            "1e999, deep nesting...) and names a credential field; sluice dlq show --unmask "
            "prints it>")
#: Parts of the field names :func:`body_credentials_masked` masks under, and the start of
#: a JSON escape (a parser reads ``"authoriz\\u0061tion"`` as ``"authorization"``): a body it
#: cannot read as strict JSON is withheld when it holds one of them.
_MASKED_NAMES = ("authoriz", "headers", "authentic", "\\u")


#: Nesting, levels of arrays and objects, past which :func:`body_credentials_masked` withholds
#: a body that names a credential field rather than read it: Python's json reads and writes
#: 993 levels on 3.11 (fewer under a deep caller: it shares the recursion limit), 1,497 on
#: 3.12 and 9,998 on 3.13, so a limit of Python's own would make what is shown depend on the
#: interpreter. 512 is under every one of them, with room for the caller's frames.
MAX_NESTING = 512
# A JSON string (unterminated too: it runs to the end) or a bracket, which is captured.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|([\[\]{}])', re.DOTALL)
_LEVEL = {"[": 1, "{": 1, "]": -1, "}": -1, "": 0}


def _nested_deeper_than(text: str, levels: int) -> bool:
    """Whether ``text``'s arrays and objects nest deeper than ``levels``, brackets in
    strings apart; one pass, no recursion, whether ``text`` is JSON or not."""
    if text.count("[") + text.count("{") <= levels:
        return False
    depths = accumulate(_LEVEL[bracket] for bracket in _STRING_OR_BRACKET.findall(text))
    return any(depth > levels for depth in depths)


class _Odd(ValueError):
    """A JSON body :func:`body_credentials_masked` cannot mask as every parser reads it."""


def _no_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, refused (:class:`_Odd`) when a key appears twice."""
    members = dict(pairs)
    if len(members) != len(pairs):
        raise _Odd("a key twice")
    return members


def _odd(constant: str) -> float:
    """``NaN``, ``Infinity`` and ``-Infinity``: no JSON; refused (:class:`_Odd`)."""
    raise _Odd(constant)


def _finite(number: str) -> float:
    """A JSON number with a fraction or exponent, refused (:class:`_Odd`) when it is out of
    a float's range (``1e999``: :func:`json.dumps` would write ``Infinity``)."""
    value = float(number)
    if math.isinf(value):
        raise _Odd(number)
    return value


def _objects(items: object) -> list[tuple[int, dict[str, Any]]]:
    """The objects of a JSON array, with their positions (nothing when it is no array)."""
    if not isinstance(items, list):
        return []
    return [(at, item) for at, item in enumerate(items) if isinstance(item, dict)]
