"""An upstream's redirect, followed by the clients the agents use, stays inside Sluice.

The upstream here answers as Starlette and FastAPI do (``redirect_slashes``): its
``Location`` is built from the ``Host`` Sluice sent, which is the upstream's own. httpx (with
``follow_redirects=True``, as the OpenAI, Anthropic and MCP SDKs create theirs) and the
OpenAI SDK follow it; the upstream tells whether each request it got came through Sluice by
the ``X-Forwarded-For`` Sluice adds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx2 as httpx
import openai
import pytest
from aiohttp import web

from tests.conftest import route, serve_app


class RedirectingUpstream:
    """Redirects as a Starlette app would, and records ``(path, came through Sluice)``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []
        self.url = ""

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        runner, port = await serve_app(app)
        self.url = f"http://127.0.0.1:{port}"
        return runner

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.seen.append((path, "X-Forwarded-For" in request.headers))
        own = f"http://{request.host}"  # what Starlette's redirect_slashes writes
        locations = {
            "/mcp": f"{own}/mcp/?session=1",  # Starlette keeps the query
            "/v1/models": f"{own}/v1/models/",
            "/api/old": "/api/v1/models?a=%2F&b=#top",
            "/api/outside": "/elsewhere/x",
            "/api/base": "/api",
            "/away": "http://127.0.0.1:9/x",
            "/relative": "models",
            "/b": f"{own}/b/",  # route /a/'s trailing-slash redirect, onto route /a/b/
            "/b-path": "/b/",
            "/api/dots": f"{own}/api/../raw/x",  # /based/../raw/x: route raw's once resolved
            "/api/encoded-dots": "/api/%2E%2e/raw/x",
            "/long-port": "http://127.0.0.1:" + "0" * 4400 + "1/x",  # int() refuses 4300+
        }
        if path in locations:
            return web.Response(status=307, headers={"Location": locations[path]})
        if path == "/created":
            return web.json_response({"id": 1}, status=201,
                                     headers={"Location": f"{own}/items/1",
                                              "Content-Location": f"{own}/items/1?v=2"})
        if path == "/jobs":  # a long-running job: poll its Location
            return web.json_response({"id": "j1"}, status=202,
                                     headers={"Location": f"{own}/jobs/j1",
                                              "Refresh": f'5; URL="{own}/jobs/j1"'})
        if path == "/gone":
            return web.json_response({}, status=410, headers={"Location": f"{own}/new"})
        if path == "/same":  # a 200's are relayed as they came
            return web.json_response({}, headers={"Content-Location": f"{own}/same.json"})
        if path in ("/v1/models/", "/api/v1/models"):
            return web.json_response({"object": "list", "data": []})
        return web.json_response({"path": path, "query": request.query_string})


@pytest.fixture
async def redirecting() -> AsyncIterator[RedirectingUpstream]:
    """A :class:`RedirectingUpstream`, serving for the test."""
    upstream = RedirectingUpstream()
    runner = await upstream.start()
    try:
        yield upstream
    finally:
        await runner.cleanup()


async def test_sdks_follow_an_upstream_redirect_through_sluice(start_sluice, redirecting):
    sluice = await start_sluice({"routes": [
        route("raw", redirecting.url, "http"),
        route("openai", redirecting.url, "openai"),
    ]})
    async with httpx.AsyncClient(follow_redirects=True) as client:
        r = await client.post(f"{sluice.url}/raw/mcp",
                              json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert r.status_code == 200
        assert [h.headers["location"] for h in r.history] == ["/raw/mcp/?session=1"]
        assert str(r.url) == f"{sluice.url}/raw/mcp/?session=1"
    assert redirecting.seen == [("/mcp", True), ("/mcp/", True)]

    redirecting.seen.clear()
    llm = openai.AsyncOpenAI(base_url=f"{sluice.url}/openai/v1", api_key="sk-test",
                             max_retries=0)
    models = await llm.models.list()
    await llm.close()
    assert models.data == []
    # The SDK's second request came to Sluice too, not straight to the upstream.
    assert redirecting.seen == [("/v1/models", True), ("/v1/models/", True)]


async def test_location_mapped_under_the_base_path_only(start_sluice, redirecting):
    sluice = await start_sluice({"routes": [
        route("based", redirecting.url + "/api", "http"),
        route("raw", redirecting.url, "http"),
    ]})
    async with aiohttp.ClientSession() as session:
        async def location(path: str) -> tuple[int, str]:
            async with session.get(sluice.url + path, allow_redirects=False) as r:
                return r.status, r.headers.get("Location", "")

        # A path under the base path: the prefix takes its place; query and fragment
        # kept byte for byte.
        assert await location("/based/old") == (307, "/based/v1/models?a=%2F&b=#top")
        # Outside the base path, the base path itself, another origin, a relative
        # path: relayed as they came.
        assert await location("/based/outside") == (307, "/elsewhere/x")
        assert await location("/based/base") == (307, "/api")
        assert await location("/raw/away") == (307, "http://127.0.0.1:9/x")
        assert await location("/raw/relative") == (307, "models")
        assert await location("/raw/long-port") == (
            307, "http://127.0.0.1:" + "0" * 4400 + "1/x")
        # A dot-segment: mapped, the client would resolve it onto another route.
        assert await location("/based/dots") == (307, f"{redirecting.url}/api/../raw/x")
        assert await location("/based/encoded-dots") == (307, "/api/%2E%2e/raw/x")
        # A 201's Location and Content-Location name the new resource.
        async with session.post(sluice.url + "/raw/created") as r:
            assert r.status == 201
            assert r.headers["Location"] == "/raw/items/1"
            assert r.headers["Content-Location"] == "/raw/items/1?v=2"
    async with httpx.AsyncClient(follow_redirects=True) as client:
        r = await client.get(f"{sluice.url}/based/old")
        assert r.status_code == 200
        assert str(r.url) == f"{sluice.url}/based/v1/models?a=%2F&b=#top"
    assert redirecting.seen[-2:] == [("/api/old", True), ("/api/v1/models", True)]


async def test_a_replayed_redirect_points_where_the_first_one_did(start_sluice, redirecting):
    sluice = await start_sluice({"routes": [
        route("raw", redirecting.url, "http", idempotency={"mode": "dedup"})]})
    headers = {"Idempotency-Key": '"mcp-1"'}
    async with aiohttp.ClientSession() as session:
        answers = []
        for _ in range(2):
            async with session.post(f"{sluice.url}/raw/mcp", json={"n": 1},
                                    headers=headers, allow_redirects=False) as r:
                answers.append((r.status, r.headers["Location"],
                                r.headers.get("Idempotent-Replayed")))
    assert answers == [(307, "/raw/mcp/?session=1", None),
                       (307, "/raw/mcp/?session=1", "true")]
    assert redirecting.seen == [("/mcp", True)]


async def test_never_mapped_onto_a_longer_prefix_of_another_route(start_sluice, upstream,
                                                                  redirecting):
    """Routes ``/a/`` and ``/a/b/``: ``/a/``'s upstream redirecting ``/b`` to ``/b/`` is not
    mapped to ``/a/b/`` (route ``/a/b/``'s, which would get ``/a/``'s call and its
    Authorization): the Location is relayed as it came."""
    a = redirecting  # route /a/'s upstream
    sluice = await start_sluice({"routes": [
        {"name": "a", "path_prefix": "/a/", "upstream": a.url, "protocol": "http"},
        {"name": "ab", "path_prefix": "/a/b/", "upstream": upstream.url,
         "protocol": "http"}]})
    async with aiohttp.ClientSession() as session:
        for path, location in (("/a/b", f"{a.url}/b/"), ("/a/b-path", "/b/"),
                               ("/a/v1/models", "/a/v1/models/")):  # route /a/'s: mapped
            async with session.get(sluice.url + path, allow_redirects=False) as r:
                assert (r.status, r.headers["Location"]) == (307, location)
    async with httpx.AsyncClient(follow_redirects=True) as client:
        r = await client.get(f"{sluice.url}/a/b", headers={"Authorization": "Bearer a"})
        assert r.json() == {"path": "/b/", "query": ""}
    assert upstream.requests == []


async def test_mapped_in_any_answer_but_a_200(start_sluice, redirecting):
    """A 202's ``Location`` (the job a client polls), a 4xx's, and ``Refresh``'s URL are
    mapped as a 3xx's are; a 200's fields are relayed as they came."""
    sluice = await start_sluice({"routes": [route("raw", redirecting.url, "http")]})
    async with aiohttp.ClientSession() as session:
        async with session.post(sluice.url + "/raw/jobs", json={}) as r:
            assert r.status == 202
            assert r.headers["Location"] == "/raw/jobs/j1"
            assert r.headers["Refresh"] == '5; URL="/raw/jobs/j1"'
        async with session.get(sluice.url + "/raw/gone") as r:
            assert (r.status, r.headers["Location"]) == (410, "/raw/new")
        async with session.get(sluice.url + "/raw/same") as r:
            assert r.status == 200
            assert r.headers["Content-Location"] == f"{redirecting.url}/same.json"
