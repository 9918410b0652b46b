"""The router (proxy/routes.py): the longest matching prefix wins, whatever the set of routes
(one-segment prefixes take a look-up by the path's first segment; any deeper one, the scan)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from proxy.routes import Router


def router(*prefixes: str) -> Router:
    return Router([SimpleNamespace(prefix=p) for p in prefixes])  # type: ignore[misc]


@pytest.mark.parametrize("prefixes", [
    ("/openai/", "/anthropic/"),
    ("/openai/", "/anthropic/", "/"),
    ("/openai/", "/openai/v2/", "/"),
    ("/a/b/", "/a/"),
])
@pytest.mark.parametrize("path", [
    "/openai/v1/chat/completions", "/openai/v2/x?y=1", "/openai", "/openai?x=/y/", "/openaix/",
    "/anthropic/v1/messages", "/a/b/c", "/a/bc", "/", "", "http://h/openai/", "//openai/",
])
def test_the_longest_matching_prefix_wins(prefixes: tuple[str, ...], path: str) -> None:
    found = router(*prefixes).match(path)
    matching = [p for p in prefixes if path.startswith(p)]
    expected = max(matching, key=len) if matching else None
    assert (found.prefix if found is not None else None) == expected


def test_prefixes_a_no_route_refusal_lists_are_bounded() -> None:
    """Listed in config order; past ten, counted (a config may hold thousands of routes)."""
    assert router("/openai/", "/anthropic/").prefixes == "/openai/, /anthropic/"
    many = router(*(f"/r{i}/" for i in range(2000)))
    assert many.prefixes == ", ".join(f"/r{i}/" for i in range(10)) + " and 1990 more"
