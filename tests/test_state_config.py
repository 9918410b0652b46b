"""The ``state`` block: validated and redacted, connected at start, its health shown.

Whatever the policies keep in it (tests/test_shared_*.py), a replica must say which backend it
uses and whether it answers: ``sluice_state_backend_up`` and ``/readyz`` detail, which stays
ready while Redis is down (``on_unavailable`` says how calls are served meanwhile).
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from proxy.cli import main
from tests.conftest import route, wait_until
from tests.redis_servers import REDIS_URL, RedisServer, require_redis

ROUTE = """routes:
  - name: r
    path_prefix: /r/
    upstream: http://127.0.0.1:9
"""


@pytest.mark.parametrize("state,problem", [
    ("  backend: redis\n", "state: backend redis needs redis_url"),
    ("  backend: redis\n  redis_url: http://:hunter2@cache:6379\n",
     "state.redis_url: must start with redis://, rediss:// or unix:// (or be env:NAME)"),
    # A query field redis-py does not take passed here and ended `sluice serve` with a
    # TypeError at start (a new user's trial); the field's name is said, never its value.
    ("  backend: redis\n  redis_url: 'redis://cache:6379/0?PASSWORD=hunter2'\n",
     "bad.yaml:3: state.redis_url: has a query field redis-py does not take ('PASSWORD')"),
    ("  backend: redis\n  redis_url: 'redis://:hunter2@cache:6379/0?socket_timeout=soon'\n",
     "state.redis_url: is not a Redis URL redis-py can read: Invalid value for "
     "'socket_timeout'"),
    # A password holding '/' is read as the port, and redis-py's message quoted it (a review).
    ("  backend: redis\n  redis_url: 'redis://:hunter2/x@cache:6379/0'\n",
     "state.redis_url: is not a Redis URL redis-py can read: Port could not be cast to "
     "integer value as '<redacted>'"),
    # redis-py refuses these with a RedisError, not a ValueError: check-config ended in a
    # traceback, and a reload said "could not be read (RedisError; see the log)" (a hostile
    # trial). Its words may quote a query value, which may be the password itself.
    ("  backend: redis\n  redis_url: 'redis://:hunter2@cache:6379/0?protocol=9'\n",
     "bad.yaml:3: state.redis_url: is not a Redis URL redis-py can read: protocol must be "
     "either 2 or 3"),
    ("  backend: redis\n  redis_url: 'rediss://:hunter2@cache:6379/0?ssl_cert_reqs=bogus'\n",
     "bad.yaml:3: state.redis_url: is not a Redis URL redis-py can read: Invalid SSL "
     "Certificate Requirements Flag: bogus"),
    ("  backend: redis\n  redis_url: 'rediss://:hunter2@cache:6379/0?ssl_cert_reqs=hunter2'\n",
     "bad.yaml:3: state.redis_url: is not a Redis URL redis-py can read: Invalid SSL "
     "Certificate Requirements Flag: <redacted>"),
    # redis-py ignores a database that is not a number: the typo served database 0.
    ("  backend: redis\n  redis_url: 'redis://:hunter2@cache:6379/99x'\n",
     "bad.yaml:3: state.redis_url: has a path that is no database number"),
    ("  backend: sqlite\n", "state.backend:"),
    ("  replicas: 0\n", "state.replicas:"),
    ("  key_prefix: 'a{b}'\n", "state.key_prefix:"),
    ("  timeout: 2s\n  lease: 5s\n", "bad.yaml:3: state.lease: lease of 5s is shorter than 4 x "
                                     "the timeout of 2s"),
])
def test_bad_state_block_names_the_key_and_never_the_password(tmp_path: Path, capsys,
                                                             state: str, problem: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("state:\n" + state + ROUTE)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert problem in err, err
    assert "hunter2" not in err


async def test_redis_backend_reports_up_then_down_then_up(start_sluice, tmp_path: Path) -> None:
    """A replica whose Redis stops stays ready, says the backend is down and how it serves;
    when Redis answers again it says so, with no restart."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        sluice = await start_sluice({
            "state": {"backend": "redis", "redis_url": server.url, "timeout": "200ms",
                      "replicas": 2},
            "routes": [route("r", "http://127.0.0.1:9", protocol="http")],
        })
        async with aiohttp.ClientSession() as session:
            async def ready() -> dict:
                async with session.get(sluice.admin_url + "/readyz") as r:
                    assert r.status == 200
                    return await r.json()

            # Ready before its first probe has answered (it serves either way): waited for,
            # as a loaded machine may take longer than the 200 ms timeout for it.
            await sluice.wait_metric("sluice_state_backend_up", 1, backend="redis")
            detail = await ready()
            assert detail["state"]["backend"] == "redis" and detail["state"]["up"] is True
            server.stop()
            await sluice.wait_metric("sluice_state_backend_up", 0, backend="redis")
            detail = await ready()
            assert detail["state"]["up"] is False
            assert detail["state"]["on_unavailable"] == "local"
            await wait_until(lambda: "enforces 1/2 of every limit" in sluice.stderr())
            server.start()
            await sluice.wait_metric("sluice_state_backend_up", 1, backend="redis")
            assert (await ready())["state"]["up"] is True
    finally:
        server.stop()


async def test_password_in_redis_url_is_never_shown(start_sluice) -> None:
    require_redis()
    url = REDIS_URL.replace("redis://", "redis://default:hunter2@", 1)
    sluice = await start_sluice({
        "state": {"backend": "redis", "redis_url": url, "timeout": "200ms"},
        "routes": [route("r", "http://127.0.0.1:9", protocol="http")],
    })
    async with aiohttp.ClientSession() as session:
        for path in ("/admin/config", "/readyz", "/admin/", "/metrics"):
            async with session.get(sluice.admin_url + path) as r:
                assert "hunter2" not in await r.text(), path
    assert "hunter2" not in sluice.stderr()


async def test_redis_url_from_an_environment_variable(start_sluice) -> None:
    url = require_redis()
    sluice = await start_sluice({
        "state": {"backend": "redis", "redis_url": "env:SLUICE_TEST_REDIS", "timeout": "200ms"},
        "routes": [route("r", "http://127.0.0.1:9", protocol="http")],
    }, env={"SLUICE_TEST_REDIS": url})
    assert await sluice.metric("sluice_state_backend_up", backend="redis") == 1
