"""A new user's mistakes, each met as the brief says: a bad config names file, line and key
(``check-config`` and ``serve`` alike, exit 2) and a reload refuses it while the old config
keeps serving; a Redis fault at start never takes the proxy down; no secret reaches a caller or
the log. Every check runs the real ``sluice`` command (``check-config`` and ``serve`` as
subprocesses) or a served Sluice (``start_sluice``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.conftest import REPO, free_port, route, wait_until
from tests.redis_servers import require_redis

#: Bound on a ``sluice`` command that must end by itself, seconds (generous: a loaded machine).
COMMAND_TIMEOUT_S = 60.0


def sluice(*args: str, env: dict[str, str | None] | None = None
           ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m proxy ARGS`` (the console script's entry point) to its end, with
    ``env`` added to this environment (a ``None`` value unsets that variable)."""
    environ = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args], cwd=REPO, capture_output=True, text=True,
        timeout=COMMAND_TIMEOUT_S, env={k: v for k, v in environ.items() if v is not None},
    )


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def assert_config_error(path: Path, problem: str, *, forbidden: str = "",
                        env: dict[str, str | None] | None = None) -> None:
    """``check-config`` and ``serve`` both refuse ``path`` with exit 2 and ``problem`` (a
    ``FILE:LINE: KEY: ...`` start), no traceback, and never ``forbidden``."""
    for args in (("check-config", str(path)), ("serve", "--config", str(path))):
        done = sluice(*args, env=env)
        assert done.returncode == 2, (args, done.returncode, done.stderr)
        assert problem in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        if forbidden:
            assert forbidden not in done.stderr + done.stdout


ROUTE = """routes:
  - name: r
    path_prefix: /r/
    upstream: http://127.0.0.1:9
"""


# --- 1. state.redis_url: env:NAME with the variable unset -----------------------------------

@pytest.mark.parametrize("name", ["SLUICE_NO_SUCH_VAR", "my-url"])
def test_unset_redis_url_variable_is_a_config_error(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / "sluice.yaml",
                 f"state:\n  backend: redis\n  redis_url: env:{name}\n" + ROUTE)
    assert_config_error(
        path, f"{path}:3: state.redis_url: environment variable {name} is not set",
        env={name: None})


def test_redis_url_variable_holding_no_url_never_shows_it(tmp_path: Path) -> None:
    path = write(tmp_path / "sluice.yaml",
                 "state:\n  backend: redis\n  redis_url: env:SLUICE_TEST_BAD_URL\n" + ROUTE)
    assert_config_error(path, f"{path}:3: state.redis_url: $SLUICE_TEST_BAD_URL must start",
                        forbidden="hunter2",
                        env={"SLUICE_TEST_BAD_URL": "http://:hunter2@cache:6379"})


async def test_reload_to_an_unset_redis_url_variable_is_refused(start_sluice, upstream) -> None:
    sluice_ = await start_sluice({"routes": [route("r", upstream.url, protocol="http")]})
    data = yaml.safe_load(sluice_.config_path.read_text())
    data["state"] = {"backend": "redis", "redis_url": "env:SLUICE_NO_SUCH_VAR"}
    sluice_.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    sluice_.signal(signal.SIGHUP)
    await sluice_.wait_metric("sluice_config_reload_failures_total", 1, timeout=20)
    await wait_until(lambda: "environment variable SLUICE_NO_SUCH_VAR is not set"
                     in sluice_.stderr(), what="the refusal in the log")
    async with aiohttp.ClientSession() as session:
        async with session.get(sluice_.url + "/r/ping") as r:
            assert r.status == 200  # the old config keeps serving
        async with session.get(sluice_.admin_url + "/readyz") as r:
            assert (await r.json())["state"]["backend"] == "memory"
    assert "Traceback" not in sluice_.stderr()


# --- 3. an upstream URL no request could ever reach ------------------------------------------

@pytest.mark.parametrize("upstream,problem", [
    ("http://127.0.0.1:19001:99", "the port after the host must be a number from 1 to 65535"),
    ("http://127.0.0.1:70000", "the port after the host must be a number from 1 to 65535"),
    ("http://127.0.0.1:0", "the port after the host must be a number from 1 to 65535"),
    ("http://user:hunter2@:8080", "the URL has no host"),
])
def test_unreachable_upstream_url_is_a_config_error(tmp_path: Path, upstream: str,
                                                    problem: str) -> None:
    path = write(tmp_path / "sluice.yaml", ROUTE.replace("http://127.0.0.1:9", upstream))
    assert_config_error(path, f"{path}:4: routes[0].upstream: {problem}", forbidden="hunter2")


async def test_reload_to_an_unreachable_upstream_is_refused(start_sluice, upstream) -> None:
    sluice_ = await start_sluice({"routes": [route("r", upstream.url, protocol="http")]})
    data = yaml.safe_load(sluice_.config_path.read_text())
    data["routes"][0]["upstream"] = "http://127.0.0.1:70000"
    sluice_.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    sluice_.signal(signal.SIGHUP)
    await sluice_.wait_metric("sluice_config_reload_failures_total", 1, timeout=20)
    async with aiohttp.ClientSession() as session, session.get(sluice_.url + "/r/ping") as r:
        assert r.status == 200  # still the old upstream
    assert len(upstream.requests) == 1


# --- 4. admin.token_file naming no usable file -----------------------------------------------

@pytest.mark.parametrize("content,problem", [
    (None, "cannot read"),
    ("  \n", "is empty: it must hold the admin bearer token"),
])
def test_missing_or_empty_token_file_is_a_config_error(tmp_path: Path, content: str | None,
                                                       problem: str) -> None:
    if content is not None:
        write(tmp_path / "nosuch-token.txt", content)
    path = write(tmp_path / "sluice.yaml", "admin:\n  token_file: nosuch-token.txt\n" + ROUTE)
    assert_config_error(path, f"{path}:2: admin.token_file: ", env={"SLUICE_ADMIN_TOKEN": None})
    assert problem in sluice("check-config", str(path)).stderr


async def test_token_file_is_read_beside_the_config_and_a_reload_losing_it_is_refused(
        start_sluice, upstream, tmp_path: Path) -> None:
    """A relative ``token_file`` is found next to the config (wherever Sluice was started
    from); a reload naming a missing one is refused and the old token keeps working."""
    write(tmp_path / "admin-token", "s3cret-admin\n")
    sluice_ = await start_sluice({"admin": {"token_file": "admin-token"},
                                  "routes": [route("r", upstream.url, protocol="http")]},
                                 env={"SLUICE_ADMIN_TOKEN": ""})
    cancel = sluice_.admin_url + "/admin/runs/run-1/cancel"
    bearer = {"Authorization": "Bearer s3cret-admin"}
    async with aiohttp.ClientSession() as session:
        async with session.post(cancel, headers=bearer) as r:
            assert r.status == 200, await r.text()
        data = yaml.safe_load(sluice_.config_path.read_text())
        data["admin"]["token_file"] = "nosuch-token.txt"
        sluice_.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        sluice_.signal(signal.SIGHUP)
        await sluice_.wait_metric("sluice_config_reload_failures_total", 1, timeout=20)
        await wait_until(lambda: "admin.token_file: cannot read" in sluice_.stderr(),
                         what="the refusal in the log")
        async with session.post(cancel, headers=bearer) as r:
            assert r.status == 200, await r.text()
        # A FIFO put in the token file's place blocked the whole proxy when the file was read
        # at each request (found by review). It is read at a reload, which refuses it: the
        # token in force stays, and the proxy serves on.
        data["admin"]["token_file"] = "admin-token"
        sluice_.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        sluice_.signal(signal.SIGHUP)  # the file in force again: nothing to rebuild
        await sluice_.wait_metric("sluice_config_reloads_unchanged_total", 1, timeout=20)
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        os.replace(fifo, tmp_path / "admin-token")
        await sluice_.wait_metric("sluice_config_reload_failures_total", 2, timeout=20)
        async with session.post(cancel, headers=bearer, timeout=aiohttp.ClientTimeout(10)) as r:
            assert r.status == 200, await r.text()
        async with session.get(sluice_.url + "/r/ping", timeout=aiohttp.ClientTimeout(10)) as r:
            assert r.status == 200
    assert "admin.token_file: cannot read the file it names: not a regular file" in \
        sluice_.stderr()


async def test_the_admin_token_in_force_is_the_last_one_a_reload_accepted(
        start_sluice, upstream, tmp_path: Path) -> None:
    """A hostile trial: the token file was read at each admin request, so emptying it (a
    rotation caught midway, a bad deploy) took the token away at once, though the reload
    it triggered was refused and logged "the running config stays in force": cancels got
    403. As Envoy and HAProxy do, what is in force is what was last accepted: the refused
    file leaves the old token working, and a good new one applies by the reload its
    change triggers."""
    token = tmp_path / "admin-token"
    write(token, "old-admin-token\n")
    sluice_ = await start_sluice({"admin": {"token_file": str(token)},
                                  "routes": [route("r", upstream.url, protocol="http")]},
                                 env={"SLUICE_ADMIN_TOKEN": ""})
    cancel = sluice_.admin_url + "/admin/runs/run-1/cancel"

    async def status(bearer: str) -> int:
        async with aiohttp.ClientSession() as session, session.post(
                cancel, headers={"Authorization": f"Bearer {bearer}"}) as r:
            return r.status

    assert await status("old-admin-token") == 200
    write(token, "  \n")  # emptied: the watch reloads, and the reload is refused
    await sluice_.wait_metric("sluice_config_reload_failures_total", 1, timeout=20)
    assert await sluice_.metric("sluice_config_last_reload_successful") == 0
    assert await status("old-admin-token") == 200
    write(token, "new-admin-token\n")  # rotated: applied with the reload it triggers
    await sluice_.wait_metric("sluice_config_reloads_total", 1, timeout=20)
    assert await status("new-admin-token") == 200
    assert await status("old-admin-token") == 401
    assert "old-admin-token" not in sluice_.stderr()
    assert "new-admin-token" not in sluice_.stderr()


# --- 2 and 6. a Redis that refuses or is absent at start; what the log says about it --------

def with_password(url: str, db: int | None = None) -> str:
    """``url`` carrying the password ``hunter2`` (the test Redis's default user has none, so
    it accepts any), with database ``db`` if given."""
    url = url.replace("redis://", "redis://default:hunter2@", 1)
    return url if db is None else f"{url.rsplit('/', 1)[0]}/{db}"


async def readyz(sluice_) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(sluice_.admin_url + "/readyz") as r:
            assert r.status == 200  # still ready: on_unavailable says how calls are served
            return await r.json()


@pytest.mark.parametrize("mode,status", [("local", 200), ("reject", 503)])
async def test_redis_refusing_at_start_is_an_outage_not_a_crash(start_sluice, upstream,
                                                                mode: str, status: int) -> None:
    """``SLUICE_REDIS_URL`` naming database 99 (out of range): Sluice starts and serves as
    ``on_unavailable`` says, shows the backend down with the reason, and logs it once with
    the password redacted."""
    url = with_password(require_redis(), db=99)
    sluice_ = await start_sluice({
        "state": {"backend": "redis", "redis_url": "env:SLUICE_REDIS_URL",
                  "on_unavailable": mode, "timeout": "500ms"},
        "routes": [route("r", upstream.url, protocol="http", rate={"requests": "1000/min"})],
    }, env={"SLUICE_REDIS_URL": url})
    state = (await readyz(sluice_))["state"]
    assert state["up"] is False and "DB index is out of range" in state["last_error"]
    assert await sluice_.metric("sluice_state_backend_up", backend="redis") == 0
    async with aiohttp.ClientSession() as session, session.get(sluice_.url + "/r/x") as r:
        assert r.status == status
    await wait_until(lambda: "state backend unavailable" in sluice_.stderr(),
                     what="the outage in the log")
    log = sluice_.stderr()
    assert "state.redis_url redis://default:<redacted>@" in log
    assert "DB index is out of range" in log
    for never in ("Traceback", "Unclosed", "hunter2"):
        assert never not in log, log


async def test_redis_absent_at_start_is_logged_once(start_sluice, upstream) -> None:
    sluice_ = await start_sluice({
        "state": {"backend": "redis", "timeout": "200ms",
                  "redis_url": f"redis://:hunter2@127.0.0.1:{free_port()}/0"},
        "routes": [route("r", upstream.url, protocol="http")],
    })
    await wait_until(lambda: "state backend unavailable" in sluice_.stderr(),
                     what="the outage in the log")
    # Several probes fail after the first; none of them is a new outage.
    await sluice_.wait_metric("sluice_state_backend_up", 0, backend="redis")
    async with asyncio.timeout(30):
        while (await readyz(sluice_))["state"]["failures"] < 4:  # a probe every 0.5 s
            await asyncio.sleep(0.05)
    log = sluice_.stderr()
    assert log.count("state backend unavailable") == 1, log
    assert "redis://:<redacted>@127.0.0.1" in log and "Connection refused" in log
    assert "hunter2" not in log and "answers again" not in log


async def test_healthy_redis_at_start_is_no_recovery(start_sluice, upstream) -> None:
    sluice_ = await start_sluice({
        "state": {"backend": "redis", "redis_url": with_password(require_redis()),
                  "timeout": "500ms"},
        "routes": [route("r", upstream.url, protocol="http")],
    })
    await wait_until(lambda: "serving on" in sluice_.stderr(), what="the start in the log")
    log = sluice_.stderr()
    assert "state backend answers (state.redis_url redis://default:<redacted>@" in log, log
    assert "again" not in log and "unavailable" not in log and "hunter2" not in log, log


# --- 5. what a caller refused for an unavailable Redis is told --------------------------------

@pytest.mark.parametrize("protocol,path", [("http", "/r/x"), ("openai", "/r/v1/chat/completions")])
async def test_state_unavailable_tells_callers_no_internal_address(start_sluice, upstream,
                                                                   protocol: str,
                                                                   path: str) -> None:
    port = free_port()
    sluice_ = await start_sluice({
        "state": {"backend": "redis", "timeout": "200ms", "on_unavailable": "reject",
                  "redis_url": f"redis://127.0.0.1:{port}/0"},
        "routes": [route("r", upstream.url, protocol=protocol, rate={"requests": "1000/min"})],
    })
    async with aiohttp.ClientSession() as session:
        async with session.post(sluice_.url + path, json={"model": "m", "messages": []}) as r:
            assert r.status == 503
            body = await r.text()
    assert "state_unavailable" in body
    # Not "does not answer" alone: a wrong password is refused too (a new user's trial).
    assert "refuses Sluice" in body and "/readyz" in body
    for internal in (str(port), "127.0.0.1", "Error 111", "ConnectionError", "redis://"):
        assert internal not in body, body
    # The operator still sees the cause: on the admin port, and in the log.
    assert f"127.0.0.1:{port}" in (await readyz(sluice_))["state"]["last_error"]
    assert f"127.0.0.1:{port}" in sluice_.stderr()


# --- 7. small things: the log and the 421 message ---------------------------------------------

async def test_refused_reload_logs_its_problem_once(start_sluice, upstream) -> None:
    """An edit the watcher refuses, then the SIGHUP the operator sends after it: the problem
    line is logged once, the second refusal says the file is unchanged."""
    sluice_ = await start_sluice({"routes": [route("r", upstream.url, protocol="http")]})
    text = sluice_.config_path.read_text()
    sluice_.config_path.write_text(text + "routes: []\n")
    await sluice_.wait_metric("sluice_config_reload_failures_total", 1, timeout=20)
    sluice_.signal(signal.SIGHUP)
    await sluice_.wait_metric("sluice_config_reload_failures_total", 2, timeout=20)
    await wait_until(lambda: "unchanged since the last refusal" in sluice_.stderr(),
                     what="the second refusal in the log")
    assert sluice_.stderr().count("routes: duplicate key") == 1, sluice_.stderr()


async def test_listen_on_port_0_logs_the_port_bound(start_sluice, upstream) -> None:
    sluice_ = await start_sluice({"server": {"listen": "127.0.0.1:0"},
                                  "routes": [route("r", upstream.url, protocol="http")]})
    await wait_until(lambda: "serving on" in sluice_.stderr(), what="the start in the log")
    match = re.search(r"serving on 127\.0\.0\.1:(\d+) \(admin 127\.0\.0\.1:(\d+)\)",
                      sluice_.stderr())
    assert match is not None, sluice_.stderr()
    port, admin_port = int(match[1]), int(match[2])
    assert port != 0 and admin_port == sluice_.admin_port
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/r/x") as r:
            assert r.status == 200  # the port logged is the one serving


async def test_421_names_sluice_once(start_sluice, upstream) -> None:
    sluice_ = await start_sluice({"routes": [route("r", upstream.url, protocol="http")]})
    async with aiohttp.ClientSession() as session:
        async with session.get(sluice_.url + "/r/x", headers={"Host": "elsewhere.example"}) as r:
            assert r.status == 421
            message = (await r.json())["error"]["message"]
    assert message.startswith("Sluice does not serve this Host"), message
    assert "Sluice: Sluice" not in message
    assert message.count("server.allowed_hosts") == 1, message


# --- 8. files built to hurt the loader (a hostile trial) ----------------------------------------

#: Nine levels of ten aliases each: 10^9 values once expanded, from a file of ~600 bytes.
ALIAS_BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10))


@pytest.mark.parametrize("case,problem", [
    ("deep", ":{deep}: (yaml): nested too deeply (more than 64 levels of lists and mappings)"),
    ("aliases", ":1: (yaml): more than 1,000,000 values once its aliases are expanded"),
    ("device", ":1: (file): cannot read: not a regular file"),
    ("fifo", ":1: (file): cannot read: not a regular file"),
    ("huge", ":1: (file): cannot read: longer than 4194304 bytes"),
])
def test_a_hostile_file_is_a_config_error_not_a_crash_or_a_hang(tmp_path: Path, case: str,
                                                               problem: str) -> None:
    # Seen: a deeply nested file crashed check-config with a RecursionError traceback; an
    # alias bomb ran until killed; a config path pointing at /dev/zero read without end.
    path = tmp_path / "sluice.yaml"
    if case == "deep":
        write(path, ROUTE + "x: " + "[" * 50_000 + "]" * 50_000 + "\n")
    elif case == "aliases":
        write(path, ROUTE + ALIAS_BOMB)
    elif case in ("device", "fifo"):
        # serve reads its file again at each reload: only a regular file will do. (check-config
        # reads a pipe or device to its end, for /dev/stdin and <(...); see the next test.)
        if case == "device":
            path.symlink_to("/dev/zero")
        else:
            os.mkfifo(path)  # opening it for reading would wait for a writer
        done = sluice("serve", "--config", str(path))
        assert done.returncode == 2 and f"{path}{problem}" in done.stderr, done.stderr
        return
    else:
        write(path, ROUTE + "# " + "x" * (4 * 1024 * 1024) + "\n")
    # Refused by the depth it reaches on its line (the line after ROUTE's), not by the
    # recursion it would cause; found in milliseconds, where PyYAML's scanner took seconds.
    assert_config_error(path, f"{path}{problem.format(deep=ROUTE.count(chr(10)) + 1)}")


@pytest.mark.parametrize("tail,where", [
    ("x: &a [*a]\n", ":{n}: x[0]"),
    ("y: &b {z: *b}\n", ":{n}: y.z"),
])
def test_an_alias_to_a_node_it_is_inside_is_named_at_its_line(tmp_path: Path, tail: str,
                                                              where: str) -> None:
    """Nothing could read such a loop: it was reported as ``:1: (yaml): nested too deeply``,
    naming neither its line nor its key (a new user's trial)."""
    path = tmp_path / "sluice.yaml"
    write(path, ROUTE + tail)
    line = (ROUTE + tail).count("\n")
    assert_config_error(path, f"{path}{where.format(n=line)}: an alias to a list or mapping "
                              "it is inside (a loop)")


def test_check_config_reads_stdin_and_stops_at_the_size_bound(tmp_path: Path) -> None:
    config = (REPO / "config" / "sluice.yaml").read_text()
    done = subprocess.run([sys.executable, "-m", "proxy", "check-config", "/dev/stdin"],
                          cwd=REPO, input=config, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    assert (done.returncode, done.stdout) == (0, "/dev/stdin: ok (2 route(s))\n"), done.stderr
    done = sluice("check-config", "/dev/zero")
    assert done.returncode == 2
    assert "/dev/zero:1: (file): cannot read: longer than 4194304 bytes" in done.stderr
    # A file the piped config names is found from the working directory, not /dev (review).
    write(tmp_path / "admin-token", "s3cret\n")
    piped = config.replace("token_file: null", "token_file: admin-token")
    done = subprocess.run([sys.executable, "-m", "proxy", "check-config", "/dev/stdin"],
                          cwd=tmp_path, input=piped, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    # /dev/stdin redirected from a file (`< sluice.yaml`) is that file: what it names is
    # found beside it, not in /dev (a new user's trial, round 35), whatever the directory.
    write(tmp_path / "piped.yaml", piped)
    with (tmp_path / "piped.yaml").open() as redirected:
        done = subprocess.run([sys.executable, "-m", "proxy", "check-config", "/dev/stdin"],
                              cwd=REPO, stdin=redirected, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    # A named FIFO is read once a writer comes (opened without waiting, it read as empty).
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    checking = subprocess.Popen([sys.executable, "-m", "proxy", "check-config", str(fifo)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    fifo.write_text(config)  # blocks until check-config opens it for reading
    out, err = checking.communicate(timeout=COMMAND_TIMEOUT_S)
    assert (checking.returncode, out) == (0, f"{fifo}: ok (2 route(s))\n"), err


async def test_reloads_go_on_after_hostile_files_and_stop_exits_0(start_sluice, upstream,
                                                                  tmp_path: Path) -> None:
    # Seen: after a deeply nested file, reloading stopped for good (the watch task died, no
    # failure counted), and SIGTERM then exited 1 with the RecursionError.
    sluice_ = await start_sluice({"routes": [route("r", upstream.url, protocol="http",
                                                   concurrency={"limit": 2})]})
    good = sluice_.config_path.read_text()
    hostile = [good + "x: " + "[" * 50_000 + "]" * 50_000 + "\n", good + ALIAS_BOMB]
    for failures, text in enumerate(hostile, start=1):
        sluice_.config_path.write_text(text)
        sluice_.signal(signal.SIGHUP)
        await sluice_.wait_metric("sluice_config_reload_failures_total", failures, timeout=30)
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    os.replace(link, sluice_.config_path)
    sluice_.signal(signal.SIGHUP)
    await sluice_.wait_metric("sluice_config_reload_failures_total", 3, timeout=30)
    sluice_.config_path.unlink()
    sluice_.config_path.write_text(good.replace("limit: 2", "limit: 3"))
    sluice_.signal(signal.SIGHUP)
    await sluice_.wait_metric("sluice_concurrency_limit", 3, route="r", timeout=30)
    sluice_.signal(signal.SIGTERM)
    assert await sluice_.wait_exit() == 0
    assert "Traceback" not in sluice_.stderr()
