"""The admin API: live route state, the redacted config, and the status page."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from aiohttp import web

from proxy.redact import REDACTED, redact
from tests.conftest import free_port, route
from tests.test_reload import CHAT, until


@pytest.mark.parametrize(("value", "expected"), [
    ({"api_key": "abc"}, {"api_key": REDACTED}),
    ({"redis_password": "pw", "authToken": "t", "tokens": "5000/day"},
     {"redis_password": REDACTED, "authToken": REDACTED, "tokens": "5000/day"}),
    ({"redis_url": "redis://:s3cret@127.0.0.1:6379/0"},
     {"redis_url": f"redis://:{REDACTED}@127.0.0.1:6379/0"}),
    ({"upstream": "https://user:pw@api.example.com/v1"},
     {"upstream": f"https://user:{REDACTED}@api.example.com/v1"}),
    ({"upstream": "https://ghp_abc@git.example.com"},
     {"upstream": f"https://{REDACTED}@git.example.com"}),
    ({"headers": {"X-Extra": "Bearer sk-123"}}, {"headers": {"X-Extra": REDACTED}}),
    ({"problems": ["f:3: state.redis_url: 'redis://u:pw@h:1/x' is not valid"]},
     {"problems": [f"f:3: state.redis_url: 'redis://u:{REDACTED}@h:1/x' is not valid"]}),
    ({"key_prefix": "sluice", "unknown_key_tenant": "guests", "auth_header": "x-api-key",
      "api_key": "k", "token_file": "/run/secrets/t", "secret_token": "t"},
     {"key_prefix": "sluice", "unknown_key_tenant": "guests", "auth_header": "x-api-key",
      "api_key": REDACTED, "token_file": "/run/secrets/t", "secret_token": REDACTED}),
    # A password with a raw '@', a quote or a space (redis-py accepts them) hides whole.
    ({"redis_url": "redis://:p@ss-word@127.0.0.1:6379/0",
      "a": "redis://:ab'cd@h:1/0", "b": "redis://user:pa ss@h:1/0",
      "problems": ["f:3: state.redis_url: 'redis://:p@ss'w@h:1/x' is not valid"]},
     {"redis_url": f"redis://:{REDACTED}@127.0.0.1:6379/0",
      "a": f"redis://:{REDACTED}@h:1/0", "b": f"redis://user:{REDACTED}@h:1/0",
      "problems": [f"f:3: state.redis_url: 'redis://:{REDACTED}@h:1/x' is not valid"]}),
    ({"list": ["sk-abc", "plain"], "limit": 5, "secret": None},
     {"list": [REDACTED, "plain"], "limit": 5, "secret": None}),
    # Credentials in a query (a hostile trial saw both in /admin/config in clear): redis-py
    # reads ?password=; some APIs take ?api_key=, also quoted by a refused reload's problem.
    ({"redis_url": "redis://127.0.0.1:6379/0?password=RQ&db=1",
      "upstream": "https://api.example.com/v1?api_key=K1&region=eu",
      "problems": ["f:9: routes[0].upstream: 'http://127.0.0.1:9/?api_key=Q2' must be an "
                   "http:// or https:// base URL with no query or fragment"],
      "note": "a budget of tokens=5 is no query"},
     {"redis_url": f"redis://127.0.0.1:6379/0?password={REDACTED}&db=1",
      "upstream": f"https://api.example.com/v1?api_key={REDACTED}&region=eu",
      "problems": [f"f:9: routes[0].upstream: 'http://127.0.0.1:9/?api_key={REDACTED}' must "
                   "be an http:// or https:// base URL with no query or fragment"],
      "note": "a budget of tokens=5 is no query"}),
    # And by their value, whatever the field's name (policies.secrets), as in a header.
    ({"problems": ["f:9: routes[0].upstream: 'http://h:9/?k=sk-Q3&page=2' has a query"]},
     {"problems": [f"f:9: routes[0].upstream: 'http://h:9/?k={REDACTED}&page=2' has a "
                   "query"]}),
    # Inside a longer string too (check-config echoed `'sk-...' is not a duration`), but
    # not a language tag or prose that names a scheme.
    ({"problems": ["f:8: server.drain_timeout: 'sk-proj-Ab12Cd34' is not a duration",
                   "f:9: server.stall_after: 'Bearer abcdefgh12345678' is not a duration",
                   "f:10: x: 'AKIAIOSFODNN7EXAMPLE' or eyJhbGc.eyJzdWI.c2ln, not sk-SK",
                   "f:11: a basic auth header, a token bucket, task-sk-1"]},
     {"problems": [f"f:8: server.drain_timeout: '{REDACTED}' is not a duration",
                   f"f:9: server.stall_after: 'Bearer {REDACTED}' is not a duration",
                   f"f:10: x: '{REDACTED}' or {REDACTED}, not sk-SK",
                   "f:11: a basic auth header, a token bucket, task-sk-1"]}),
    # A key of a vendor whose prefix Sluice does not know: its long run of letters and
    # digits (a new user's trial); a model name, a UUID or a date has none.
    ({"problems": ["f:9: x: '3f9a1c0b7d2e4f6a8b9c0d1e2f3a4b5c' is not a duration",
                   "f:9: x: 'gsk_8hJk2lMnOpQrStUvWxYz1234567890abcdEF' is not a rate",
                   "f:9: model 'gpt-4o-mini-2024-07-18' or 'claude-3-5-sonnet-20241022', "
                   "'123e4567-e89b-12d3-a456-426614174000'"]},
     {"problems": [f"f:9: x: '{REDACTED}' is not a duration",
                   f"f:9: x: '{REDACTED}' is not a rate",
                   "f:9: model 'gpt-4o-mini-2024-07-18' or 'claude-3-5-sonnet-20241022', "
                   "'123e4567-e89b-12d3-a456-426614174000'"]}),
    # A quoted value that is a credential whole, however short; an apostrophe before it
    # does not hide it (a review).
    ({"problems": ["f:2: x: 'Basic dXNlcjpwYXNz' is not a duration",
                   "f:3: can't read \"Bearer abcdefghijklmno\", it's 'basic'"]},
     {"problems": [f"f:2: x: 'Basic {REDACTED}' is not a duration",
                   f"f:3: can't read \"Bearer {REDACTED}\", it's 'basic'"]}),
])
def test_redact(value, expected):
    assert redact(value) == expected


async def test_routes_state_config_and_status_page(upstream, start_sluice):
    upstream.hold = asyncio.Event()
    sluice = await start_sluice({"routes": [
        route("llm", f"http://svc:hunter2@127.0.0.1:{upstream.port}",
              concurrency={"limit": 1, "queue": 4, "max_wait": "30s", "per_tenant": 3},
              rate={"requests": "100/min"}),
        route("plain", upstream.url),
    ]})
    async with aiohttp.ClientSession() as session:
        url = sluice.url + "/plain/v1/chat/completions"
        pending = [asyncio.create_task(session.post(
            sluice.url + "/llm/v1/chat/completions", json=CHAT,
            headers={"X-Tenant-ID": "acme"})) for _ in range(3)]
        await until(lambda: upstream.inflight == 1)
        await sluice.wait_metric("sluice_queue_depth", 2, route="llm")

        async with session.get(sluice.admin_url + "/admin/routes") as r:
            assert r.status == 200
            state = await r.json()
        llm, plain = state["routes"]
        assert state["inflight"] == 1 and state["draining"] is False
        assert llm["name"] == "llm" and llm["inflight"] == 1
        assert llm["upstream"] == f"http://svc:{REDACTED}@127.0.0.1:{upstream.port}"
        conc = llm["concurrency"]
        assert (conc["limit"], conc["inflight"], conc["queue"], conc["queued"]) == (1, 1, 4, 2)
        assert conc["tenants"] == {"acme": 3} and conc["max_wait_s"] == 30.0
        assert llm["rate"]["requests"] == {"rate": "100/min", "available": 97}
        assert plain["concurrency"] is None and plain["rate"] is None

        async with session.get(sluice.admin_url + "/admin/config") as r:
            view = await r.json()
        assert view["path"] == str(sluice.config_path)
        assert view["config"]["routes"][0]["upstream"].startswith(f"http://svc:{REDACTED}@")
        assert view["config"]["routes"][0]["rate"] == {
            "requests": "100/min", "tokens": None, "per_tenant": None}
        assert "hunter2" not in str(view)

        async with session.get(sluice.admin_url + "/admin/") as r:
            assert r.status == 200 and r.content_type == "text/html"
            page = await r.text()
        assert "hunter2" not in page
        assert "<b>llm</b>" in page and "1 / 1 in flight" in page and "2 / 4 queued" in page
        assert 'http-equiv=refresh' in page and "src=" not in page and "<script" not in page

        upstream.hold.set()
        for response in await asyncio.gather(*pending):
            assert response.status == 200
            response.release()
        async with session.post(url, json=CHAT) as r:
            assert r.status == 200


async def test_an_agent_pointed_at_the_admin_port_is_told_which_port_to_use(upstream,
                                                                             start_sluice):
    """A new user's SDK on ``http://127.0.0.1:9901/openai/v1`` got a bare "404: Not Found"."""
    sluice = await start_sluice({"routes": [route("openai", upstream.url)]})
    client = openai.AsyncOpenAI(base_url=sluice.admin_url + "/openai/v1", api_key="sk-test",
                                max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        await client.chat.completions.create(model="m", messages=CHAT["messages"])
    await client.close()
    assert refused.value.response.headers["X-Sluice-Reason"] == "no_route"
    assert str(refused.value) == (
        "Error code: 404 - Sluice: no route matches this path (/openai/v1/chat/completions; "
        "this is Sluice's admin port, server.admin_listen: /metrics, /healthz, /readyz, "
        f"/admin/; agents call server.listen, 127.0.0.1:{sluice.port})")
    assert upstream.requests == []
    async with aiohttp.ClientSession() as session:  # what it serves is served as before
        async with session.get(sluice.admin_url + "/healthz") as r:
            assert r.status == 200
        async with session.post(sluice.admin_url + "/metrics") as r:
            assert r.status == 405
        async with session.get(sluice.admin_url + "/admin/runs/nothing") as r:
            assert r.status == 404 and "no such run" in (await r.json())["error"]


async def test_every_policy_shows_its_state(upstream, start_sluice):
    """The default config's policies (breaker, retry, idempotency, budgets) all render."""
    sluice = await start_sluice({"routes": [route(
        "llm", upstream.url, "openai",
        circuit_breaker={"fail_max": 5}, retry={"attempts": 2},
        idempotency={"mode": "dedup"},
        budget={"tokens": "10000/day", "per": "tenant"},
        usage={"default_max_tokens": 100},
    )]})
    async with aiohttp.ClientSession() as session:
        async with session.post(sluice.url + "/llm/v1/chat/completions", json=CHAT,
                                headers={"X-Tenant-ID": "acme"}) as r:
            assert r.status == 200
        async with session.get(sluice.admin_url + "/admin/routes") as r:
            assert r.status == 200
            [llm] = (await r.json())["routes"]
        async with session.get(sluice.admin_url + "/admin/") as r:
            assert r.status == 200 and "acme" in await r.text()
    assert llm["breaker"] == {"state": "closed", "blocked_for_s": 0.0}
    spent = upstream.prompt_tokens + upstream.completion_tokens
    assert llm["accounting"]["budget_remaining"]["tenants"] == {"acme": {"tokens": 10000 - spent}}


async def test_readiness_is_read_from_our_own_process(upstream, start_sluice):
    """The tests' readiness check took a 200 from whatever held the admin port: another
    process on a reused port made a Sluice that never started look ready."""
    async def ready(_: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    impostor = web.Application()
    impostor.router.add_get("/readyz", ready)
    runner = web.AppRunner(impostor)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        with pytest.raises(AssertionError, match="exited at startup"):
            await start_sluice({"server": {"admin_listen": f"127.0.0.1:{port}"},
                                "routes": [route("svc", upstream.url, "http")]})
    finally:
        await runner.cleanup()
    sluice = await start_sluice({"routes": [route("svc", upstream.url, "http")]})
    async with aiohttp.ClientSession() as session:
        for path in ("/healthz", "/readyz"):
            async with session.get(sluice.admin_url + path) as r:
                assert (await r.json())["pid"] == sluice.proc.pid
