"""Where an upstream's redirect points, mapped back onto Sluice so that following it stays
inside Sluice: like nginx's ``proxy_redirect default`` (``Location`` and ``Refresh`` URLs
starting with the upstream's), plus absolute-path ``Location`` values and
``Content-Location``, on every status but 200.

Sluice forwards without following redirects (``allow_redirects=False``): the caller gets the
upstream's 3xx and follows it itself, as the SDKs do (httpx with ``follow_redirects=True``).
The upstream writes ``Location`` from the request it got, which names the upstream, not
Sluice: Starlette's trailing-slash redirect answers ``POST /mcp`` with ``307 Location:
http://<upstream host:port>/mcp/``, and the MCP and OpenAI SDKs sent the call again straight
to the upstream, past every limit; a path alone (``Location: /v1/models``) lacks the route's
prefix, and got 404 ``no_route`` from Sluice (a hostile trial).

So in any answer but a 200, ``Location``, ``Content-Location`` and the URL of ``Refresh``
are mapped back when they name a place under the route's upstream (a redirect's 3xx; a
201's new resource; the 202 Accepted whose ``Location`` a client polls for a job's end, as
long-running REST APIs answer; whatever the status, as nginx's ``proxy_redirect`` maps on
any). A 200's are relayed as they came: most answers are 200, and they pay one comparison
for this (a 200's ``Content-Location`` names the representation sent, which no client
follows). ``Refresh`` is mapped in its ``<seconds>; url=<URL>`` form (``url=`` in any case,
the URL quoted or not), as nginx maps it; the WHATWG form without ``url=`` is relayed as
it came. A value is mapped thus:

* an absolute URL whose origin (scheme, host, port, 80 and 443 when none is written;
  compared as written, no name is looked up) is the upstream's and whose path is under the
  upstream URL's base path, and an absolute-path reference (``/...``) under that base path,
  become the route's prefix followed by the rest of the path, as an absolute-path reference
  (``http://10.0.0.7:8000/mcp/?a=1`` on a route ``/tools/`` to ``http://10.0.0.7:8000``:
  ``/tools/mcp/?a=1``), which the client resolves against Sluice's own address; the query
  and fragment are kept byte for byte;
* anything else is relayed unchanged: another origin (Sluice is no open proxy, and the
  caller may mean to go there), a path outside the base path (Sluice has no URL for it; the
  base path itself without its last slash is outside too), a relative path (``models``:
  the client resolves it against the URL it called, at Sluice), a network-path reference
  (``//host/...``) or a value that is no URL;
* a path with a dot-segment (``..``, ``.``, encoded or not, as
  :func:`policies.paths.has_dot_segment` finds them): ``http://<upstream>/api/../admin/x``
  under a base path ``/api`` would be ``/tools/../admin/x``, which a client resolves to
  ``/admin/x``, another route's, with this one's ``Authorization``;
* and a place whose mapped path another route owns: with routes ``/a/`` and ``/a/b/``, route
  ``/a/``'s upstream redirecting ``/b`` to ``/b/`` would be mapped to ``/a/b/``, which Sluice
  routes to ``/a/b/``'s upstream, and the client following it would take the call (its
  ``Authorization``, a 307's body) there. A mapped value is one the client's next request
  reaches this route by, or there is none.

Unchanged is not contained: an upstream can always name another URL (another host; a path,
or a relative one, that resolves onto another route at Sluice), and the client follows it
with the headers it sent. The mapping keeps a client on its route only where it maps.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable, Collection

from aiohttp import hdrs
from multidict import CIMultiDict, istr

from policies.paths import has_dot_segment

#: ``scheme://authority`` and what follows the authority (path, query, fragment).
_ABSOLUTE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)(.*)", re.S)
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: The fields whose whole value is mapped.
_FIELDS = (hdrs.LOCATION, hdrs.CONTENT_LOCATION)
#: ``Refresh`` (aiohttp's ``hdrs`` names it not), whose URL is mapped.
_REFRESH = istr("Refresh")
#: ``Refresh: <seconds>; url=``, up to the URL (one pass: nothing after it is matched).
_REFRESH_URL = re.compile(r"[^;,]*[;,][ \t]*url[ \t]*=[ \t]*", re.I)


class Relocation:
    """The mapping of one route (its ``prefix``, ``/tools/``; its ``upstream`` base URL,
    scheme, host, port and base path without a trailing slash, as the config holds it;
    ``prefixes``, every route's prefix in the config, this one's included or not)."""

    __slots__ = ("_base", "_beneath", "_origin", "_prefix")

    def __init__(self, prefix: str, upstream: str, prefixes: Collection[str] = ()) -> None:
        parts = urllib.parse.urlsplit(upstream)
        scheme = parts.scheme.lower()
        self._origin = (scheme, (parts.hostname or "").lower(),
                        parts.port or _DEFAULT_PORTS.get(scheme))
        self._base = parts.path.rstrip("/")
        #: What a mapped path begins with (the prefix less its last slash: the rest of the
        #: path brings its own, as a request's path does going the other way).
        self._prefix = prefix[:-1]
        #: The longer prefixes beneath this one (``/a/b/`` beneath ``/a/``): the router gives
        #: a path the longest prefix it starts with (:meth:`proxy.routes.Router.match`), so a
        #: mapped path starting with one of these would be another route's.
        self._beneath = tuple(other for other in prefixes
                              if len(other) > len(prefix) and other.startswith(prefix))

    def rewrite(self, headers: CIMultiDict[str]) -> None:
        """Map ``headers``' ``Location``, ``Content-Location`` and ``Refresh`` fields (every
        line of each) in place; unchanged where they name no place under the upstream."""
        for name in _FIELDS:
            _replace(headers, name, self.mapped)
        _replace(headers, _REFRESH, self.refreshed)

    def refreshed(self, refresh: str) -> str:
        """A ``Refresh`` value with its URL :meth:`mapped` (``0; url=/tools/x`` for ``0;
        url=http://<upstream>/x``); unchanged without ``url=``."""
        found = _REFRESH_URL.match(refresh)
        if found is None:
            return refresh
        at = found.end()
        url = refresh[at:].rstrip(" \t")
        tail = refresh[at + len(url):]
        quote = url[:1]
        if quote in ("'", '"') and len(url) > 1 and url[-1] == quote:
            return refresh[:at] + quote + self.mapped(url[1:-1]) + quote + tail
        return refresh[:at] + self.mapped(url) + tail

    def mapped(self, location: str) -> str:
        """``location`` as the caller of Sluice should follow it (see the module docstring)."""
        if location[:1] == "/":
            if location[1:2] == "/":
                return location  # //host/...: another authority, by the caller's scheme
            rest = location
        else:
            absolute = _ABSOLUTE.fullmatch(location)
            if absolute is None or not self._same_origin(absolute[1], absolute[2]):
                return location
            rest = absolute[3]
            if rest[:1] != "/":
                rest = "/" + rest  # no path is the root path (RFC 9110 §4.2.3)
        base = self._base
        if base:
            if not rest.startswith(base) or rest[len(base):len(base) + 1] != "/":
                return location  # outside the base path (the base itself included)
            rest = rest[len(base):]
        if has_dot_segment(rest.partition("#")[0]):
            return location  # the client would resolve it: /tools/../admin/ is /admin/
        mapped = self._prefix + rest
        if self._beneath and mapped.startswith(self._beneath):
            return location  # another route's path: following it would take this one's call there
        return mapped

    def _same_origin(self, scheme: str, authority: str) -> bool:
        hostport = authority.rpartition("@")[2].lower()  # user info is not the origin's
        if hostport.startswith("["):
            host, _, port = hostport[1:].partition("]")
            if port and port[0] != ":":
                return False
            port = port[1:]
        else:
            host, _, port = hostport.partition(":")
        scheme = scheme.lower()
        if port:
            if not port.isascii() or not port.isdigit() or len(port) > 5:
                return False  # more digits than 65535's: int() refuses 4,300 and more
            number: int | None = int(port)
        else:
            number = _DEFAULT_PORTS.get(scheme)
        return (scheme, host, number) == self._origin


def _replace(headers: CIMultiDict[str], name: str, mapping: Callable[[str], str]) -> None:
    """Every ``name`` line of ``headers`` through ``mapping``, in place, where one changes."""
    values = headers.getall(name, None)
    if values is None:
        return
    mapped = [mapping(value) for value in values]
    if mapped != values:
        headers.popall(name)
        for value in mapped:
            headers.add(name, value)
