"""The upstream client's request class: the header set aiohttp would build, built faster."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from multidict import CIMultiDict
from yarl import URL

from proxy.client import VerbatimRequest


class _AiohttpsCopy(VerbatimRequest):
    """The same class with aiohttp's own header copy, to compare against."""

    update_headers = aiohttp.ClientRequest.update_headers


@pytest.mark.parametrize("fields", [
    [("x-lower", "a"), ("X-Twice", "1"), ("Authorization", "Bearer k"), ("x-twice", "2")],
    [("X-A", "1"), ("host", "caller.example")],  # a Host of its own replaces the URL's
    [],
])
async def test_the_request_headers_are_aiohttps_in_its_order(fields):
    url = URL("http://127.0.0.1:8081/v1/x", encoded=True)
    loop = asyncio.get_running_loop()
    ours = VerbatimRequest("POST", url, headers=CIMultiDict(fields), loop=loop)
    theirs = _AiohttpsCopy("POST", url, headers=CIMultiDict(fields), loop=loop)
    assert list(ours.headers.items()) == list(theirs.headers.items())
    assert next(iter(ours.headers.items()))[0].lower() == "host"
