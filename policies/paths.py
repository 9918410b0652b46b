"""Request paths as an upstream routes them, for the policies that key on a path.

RFC 3986 §6.2.2.2: a percent-encoded unreserved character (ALPHA, DIGIT, ``-._~``, §2.3) is
the character itself, and upstreams decode it before routing (aiohttp, Starlette, Express):
``/v1/chat/completion%73`` *is* ``/v1/chat/completions``. A policy that matched the raw path
would let the encoded spelling dodge it, so it matches :func:`decode_unreserved` of it.
Encoded reserved characters (``%2F``) stay encoded: they are data, not separators, and
encoded dot-segments are refused at the door (``proxy.routes.has_dot_segment``). Metering
(:func:`policies.usage.endpoint_for`) reads ``%2F`` as a slash too: Starlette routes on the
fully decoded path, so an LLM endpoint spelled with one is still the endpoint there.
"""

from __future__ import annotations

import re

_ENCODED_UNRESERVED = re.compile(
    r"%(4[1-9A-Fa-f]|5[0-9Aa]|6[1-9A-Fa-f]|7[0-9Aa]|3[0-9]|2[DEde]|5[Ff]|7[Ee])")


def decode_unreserved(path: str) -> str:
    """``path`` (raw, as sent) with its percent-encoded unreserved characters decoded."""
    if "%" not in path:
        return path
    return _ENCODED_UNRESERVED.sub(lambda m: chr(int(m.group(1), 16)), path)
