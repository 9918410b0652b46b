"""``proxy.locations.Relocation``: an upstream's ``Location`` (``Content-Location``,
``Refresh``'s URL) mapped back onto its route, or relayed as it came (the module docstring's
rules, one value at a time; tests/test_redirects.py has them through Sluice and the SDKs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from multidict import CIMultiDict

from proxy.locations import Relocation
from proxy.routes import Router

UP = "http://10.0.0.7:8000"


@pytest.mark.parametrize(("location", "expected"), [
    ("http://10.0.0.7:8000/mcp/?a=1#f", "/tools/mcp/?a=1#f"),
    ("HTTP://10.0.0.7:8000/x", "/tools/x"),  # scheme and host in any case
    ("http://10.0.0.7:8000", "/tools/"),  # no path is the root path (RFC 9110 §4.2.3)
    ("http://10.0.0.7:8000?q=1", "/tools/?q=1"),
    ("http://10.0.0.7:8000#top", "/tools/#top"),
    ("http://user:pw@10.0.0.7:8000/x", "/tools/x"),  # user info is not the origin's
    ("http://a@b@10.0.0.7:8000/x", "/tools/x"),  # the last @ ends it
    ("/v1/models", "/tools/v1/models"),
    ("/", "/tools/"),
    # Relayed as they came: another authority...
    ("//10.0.0.7:8000/x", "//10.0.0.7:8000/x"),
    ("https://10.0.0.7:8000/x", "https://10.0.0.7:8000/x"),
    ("http://10.0.0.7/x", "http://10.0.0.7/x"),  # port 80
    ("http://10.0.0.8:8000/x", "http://10.0.0.8:8000/x"),
    ("http://10.0.0.7:8000@evil/x", "http://10.0.0.7:8000@evil/x"),
    # ... a bad port ...
    ("http://10.0.0.7:80a0/x", "http://10.0.0.7:80a0/x"),
    ("http://10.0.0.7:+8000/x", "http://10.0.0.7:+8000/x"),
    ("http://10.0.0.7:\uff18\uff10\uff10\uff10/x",  # fullwidth digits: not ASCII
     "http://10.0.0.7:\uff18\uff10\uff10\uff10/x"),
    ("http://10.0.0.7:008000/x", "http://10.0.0.7:008000/x"),  # past five digits
    ("http://10.0.0.7:" + "0" * 4400 + "8000/x", "http://10.0.0.7:" + "0" * 4400 + "8000/x"),
    # ... a relative path, no URL at all ...
    ("models", "models"),
    ("../admin/x", "../admin/x"),
    ("", ""),
    ("http:/x", "http:/x"),
    ("mailto:a@10.0.0.7", "mailto:a@10.0.0.7"),
    # ... a dot-segment, plain, encoded once or twice, with parameters, a backslash ...
    ("/x/../admin", "/x/../admin"),
    ("http://10.0.0.7:8000/x/./y", "http://10.0.0.7:8000/x/./y"),
    ("/%2E%2e/admin", "/%2E%2e/admin"),
    ("/%252e%252e/admin", "/%252e%252e/admin"),
    ("/x/..;a=1/admin", "/x/..;a=1/admin"),
    ("/x\\..\\admin", "/x\\..\\admin"),
    ("/x/..", "/x/.."),
    ("/x/..?y", "/x/..?y"),
    # ... but dots that are no segment are mapped, and a fragment is no part of the path.
    ("/x/..y/.z", "/tools/x/..y/.z"),
    ("/x?a=/../b", "/tools/x?a=/../b"),
    ("/x#/../b", "/tools/x#/../b"),
])
def test_a_route_on_an_upstream_without_a_base_path(location: str, expected: str) -> None:
    assert Relocation("/tools/", UP).mapped(location) == expected


@pytest.mark.parametrize(("upstream", "location", "expected"), [
    # A default port written is the same as none, either side.
    ("https://api.example.com", "https://api.example.com:443/v1", "/r/v1"),
    ("https://api.example.com:443", "https://api.example.com/v1", "/r/v1"),
    ("http://api.example.com", "http://api.example.com:80/v1", "/r/v1"),
    ("http://api.example.com:80", "http://API.example.com/v1", "/r/v1"),
    ("http://api.example.com", "http://api.example.com:/v1", "/r/v1"),  # empty: the default
    ("https://api.example.com", "http://api.example.com:443/v1",
     "http://api.example.com:443/v1"),
    ("https://api.example.com", "https://api.example.com:80/v1",
     "https://api.example.com:80/v1"),
    # IPv6: the brackets hold the host, the port follows them.
    ("http://[::1]:8000", "http://[::1]:8000/x", "/r/x"),
    ("http://[::1]:8000", "http://[::1]/x", "http://[::1]/x"),
    ("http://[::1]:8000", "http://[::1]x:8000/x", "http://[::1]x:8000/x"),
    ("http://[::1]:8000", "http://[::1]:80a/x", "http://[::1]:80a/x"),
    ("http://[::1]:8000", "http://[::2]:8000/x", "http://[::2]:8000/x"),
    ("http://[::1]", "http://u@[::1]/x", "/r/x"),
    # A base path: the prefix takes its place; outside it (its own name included) unchanged.
    ("http://h/api", "http://h/api/v1?x", "/r/v1?x"),
    ("http://h/api/", "/api/v1", "/r/v1"),
    ("http://h/api", "/api/", "/r/"),
    ("http://h/api", "/api", "/api"),
    ("http://h/api", "http://h", "http://h"),
    ("http://h/api", "/apix/v1", "/apix/v1"),
    ("http://h/api", "/other", "/other"),
    ("http://h/api", "http://h/api/../admin/x", "http://h/api/../admin/x"),
])
def test_origin_and_base_path(upstream: str, location: str, expected: str) -> None:
    assert Relocation("/r/", upstream).mapped(location) == expected


def test_the_root_prefix() -> None:
    assert Relocation("/", UP).mapped(UP + "/x/y") == "/x/y"


PREFIXES = ("/a/", "/a/b/", "/a/b/c/", "/c/", "/ab/", "/")


@pytest.mark.parametrize(("prefix", "location", "expected"), [
    ("/a/", "/b/", "/b/"),  # /a/b/ is route /a/b/'s
    ("/a/", "/b/x?y", "/b/x?y"),
    ("/a/", "/b/c/", "/b/c/"),
    ("/a/", UP + "/b/", UP + "/b/"),
    ("/a/", "/b", "/a/b"),  # routed to /a/ (it needs the slash): mapped
    ("/a/", "/b?x=/", "/a/b?x=/"),
    ("/a/", "/bc/", "/a/bc/"),
    ("/a/", "/c/", "/a/c/"),  # /c/ is no prefix beneath /a/
    ("/a/b/", "/c/x", "/c/x"),  # /a/b/c/x is route /a/b/c/'s
    ("/a/b/", "/d", "/a/b/d"),
    ("/", "/a/x", "/a/x"),  # every other prefix is beneath /
    ("/", "/zz", "/zz"),
    ("/c/", "/a/b/", "/c/a/b/"),
])
def test_never_onto_a_longer_prefix_of_another_route(prefix: str, location: str,
                                                     expected: str) -> None:
    relocation = Relocation(prefix, UP, PREFIXES)
    assert relocation.mapped(location) == expected
    if prefix == "/":
        return  # under the root prefix, a value mapped and one relayed are the same string
    # The router's own answer: a value is mapped exactly when its mapped path is routed
    # back to this prefix.
    router = Router([SimpleNamespace(prefix=p) for p in PREFIXES])  # type: ignore[misc]
    mapped = prefix[:-1] + location.removeprefix(UP)
    found = router.match(mapped)
    assert (found is not None and found.prefix == prefix) == (expected == mapped)


@pytest.mark.parametrize(("refresh", "expected"), [
    ("0; url=http://10.0.0.7:8000/y", "0; url=/t/y"),
    ('5;URL="http://10.0.0.7:8000/y" ', '5;URL="/t/y" '),
    ("5, url='/y'", "5, url='/t/y'"),
    ("1;url=/y\t ", "1;url=/t/y\t "),
    ("0; url = /y", "0; url = /t/y"),
    ('0; url="/y', '0; url="/y'),  # an unbalanced quote: no URL Sluice reads
    ('0; url="', '0; url="'),
    ("0; url=", "0; url="),
    ("5; http://10.0.0.7:8000/y", "5; http://10.0.0.7:8000/y"),  # no url=: as it came
    ("0;url=http://other/y", "0;url=http://other/y"),
    ("3", "3"),
])
def test_refresh(refresh: str, expected: str) -> None:
    assert Relocation("/t/", UP).refreshed(refresh) == expected


def test_rewrite_maps_every_line_and_leaves_unchanged_fields_alone() -> None:
    headers = CIMultiDict([("Location", UP + "/a"), ("X-Other", "1"),
                           ("Location", "http://elsewhere/b"),
                           ("Content-Location", UP + "/c"), ("Refresh", "0; url=/d"),
                           ("Link", f"<{UP}/e>; rel=next")])
    Relocation("/t/", UP).rewrite(headers)
    assert headers.getall("Location") == ["/t/a", "http://elsewhere/b"]
    assert headers["Content-Location"] == "/t/c"
    assert headers["Refresh"] == "0; url=/t/d"
    assert headers["Link"] == f"<{UP}/e>; rel=next"  # not a field Sluice maps
    assert headers["X-Other"] == "1"

    untouched = CIMultiDict([("Location", "http://elsewhere/b"), ("X-Other", "1")])
    before = list(untouched.items())
    Relocation("/t/", UP).rewrite(untouched)
    assert list(untouched.items()) == before  # nothing removed and added back
    Relocation("/t/", UP).rewrite(empty := CIMultiDict())
    assert not empty
