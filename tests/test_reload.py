"""Hot reload end to end: limits change under load, bad files are refused, ConfigMap swaps land."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.config import StrictLoader
from tests.conftest import REPO, free_port, route, status_of, wait_until
from tests.redis_servers import delete_prefix, new_prefix, require_redis

CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}


def rewrite(path: Path, mutate: Callable[[dict], object]) -> None:
    """Change the YAML config at ``path`` the way an editor does: write aside, rename over."""
    data = yaml.load(path.read_text(), Loader=StrictLoader)
    mutate(data)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)


def set_limit(limit: int) -> Callable[[dict], None]:
    def mutate(data: dict) -> None:
        data["routes"][0]["concurrency"]["limit"] = limit
    return mutate


async def until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await asyncio.sleep(0.02)


async def test_limit_changes_under_load_without_failing_a_request(upstream, start_sluice):
    upstream.delay = 0.15
    sluice = await start_sluice({"routes": [
        route("llm", upstream.url, concurrency={"limit": 2, "queue": 64, "max_wait": "60s"})]})
    statuses: list[int] = []
    stop = asyncio.Event()

    async def agent(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with session.post(sluice.url + "/llm/v1/chat/completions", json=CHAT) as r:
                await r.read()
                statuses.append(r.status)

    async def sluice_inflight() -> float:
        return await sluice.metric("sluice_inflight_requests", route="llm")

    async with aiohttp.ClientSession() as session:
        agents = [asyncio.create_task(agent(session)) for _ in range(8)]
        await until(lambda: len(statuses) >= 6, what="traffic under limit 2")
        assert upstream.peak_inflight == 2

        rewrite(sluice.config_path, set_limit(4))
        await sluice.wait_metric("sluice_concurrency_limit", 4, route="llm")
        upstream.peak_inflight = upstream.inflight
        done = len(statuses)
        await until(lambda: len(statuses) >= done + 12, what="traffic under limit 4")
        assert upstream.peak_inflight == 4  # raised: queued requests took the new slots

        rewrite(sluice.config_path, set_limit(1))
        await sluice.wait_metric("sluice_concurrency_limit", 1, route="llm")
        deadline = time.monotonic() + 20
        while await sluice_inflight() > 1:  # requests admitted under 4 finish first
            assert time.monotonic() < deadline, "in-flight requests did not drain to 1"
            await asyncio.sleep(0.02)
        upstream.peak_inflight = upstream.inflight
        done = len(statuses)
        await until(lambda: len(statuses) >= done + 6, what="traffic under limit 1")
        assert upstream.peak_inflight == 1  # lowered: holds as soon as the excess finished

        stop.set()
        await asyncio.gather(*agents)

    assert len(statuses) >= 24
    assert set(statuses) == {200}, f"a request failed across reloads: {sorted(set(statuses))}"
    assert upstream.cancelled == 0
    assert await sluice.metric("sluice_config_reloads_total") == 2
    await until(lambda: len([e for e in sluice.events() if e["event"] == "config_reloaded"]) == 2)
    reloads = [e for e in sluice.events() if e["event"] == "config_reloaded"]
    assert [e["routes_changed"] for e in reloads] == [["llm"], ["llm"]]


async def test_invalid_file_keeps_the_old_limit(upstream, start_sluice):
    upstream.hold = asyncio.Event()
    sluice = await start_sluice({"routes": [
        route("llm", upstream.url, concurrency={"limit": 2, "queue": 0})]})

    def break_it(data: dict) -> None:
        data["routes"][0]["concurrency"]["limit"] = "two"
        data["routes"][0]["concurrency"]["max_wiat"] = "1s"

    rewrite(sluice.config_path, break_it)
    await sluice.wait_metric("sluice_config_reload_failures_total", 1)
    assert await sluice.metric("sluice_config_last_reload_successful") == 0
    assert await sluice.metric("sluice_config_reloads_total") == 0
    assert await sluice.metric("sluice_concurrency_limit", route="llm") == 2
    log = sluice.stderr()
    name = sluice.config_path.name
    assert f"{name}:" in log and ": routes[0].concurrency.limit: " in log
    assert ": routes[0].concurrency.max_wiat: unknown key" in log

    # The old limit still holds: two requests reach the upstream, the third is refused.
    async with aiohttp.ClientSession() as session:
        url = sluice.url + "/llm/v1/chat/completions"
        held = [asyncio.create_task(session.post(url, json=CHAT)) for _ in range(2)]
        await until(lambda: upstream.inflight == 2)
        async with session.post(url, json=CHAT) as third:
            assert third.status == 503
            assert third.headers["X-Sluice-Reason"] == "queue_full"
        async with session.get(sluice.admin_url + "/admin/config") as r:
            view = await r.json()
        assert view["last_reload"]["ok"] is False
        assert any(": routes[0].concurrency.limit: " in p for p in view["last_reload"]["problems"])
        assert view["config"]["routes"][0]["concurrency"]["limit"] == 2
        upstream.hold.set()
        for response in await asyncio.gather(*held):
            assert response.status == 200
            response.release()

    def fix_it(data: dict) -> None:
        data["routes"][0]["concurrency"] = {"limit": 3, "queue": 0}

    rewrite(sluice.config_path, fix_it)  # fixed: the next good file applies
    await sluice.wait_metric("sluice_concurrency_limit", 3, route="llm")
    assert await sluice.metric("sluice_config_last_reload_successful") == 1


async def test_a_file_cut_after_an_empty_block_is_refused_and_the_limit_holds(
        upstream, start_sluice, tmp_path):
    """A hostile trial: a file written in place, its writer paused just after
    ``concurrency:``, was read as the route without its block (YAML null, taken as absent),
    and the reload lifted the limit: the queued calls reached the upstream at once. An empty
    block is a config error now, so the cut file is refused and the limit holds."""
    limit = {"limit": 2, "queue": 8, "max_wait": "30s"}
    sluice = await start_sluice({"server": {"drain_timeout": "5s"},
                                 "events": {"path": str(tmp_path / "events.jsonl")},
                                 "dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
                                 "routes": [route("llm", upstream.url, concurrency=limit)]})
    text = sluice.config_path.read_text()
    assert text.rstrip().endswith("max_wait: 30s")  # the block is the file's last
    cut = text.index("concurrency:\n") + len("concurrency:\n")
    upstream.hold = asyncio.Event()
    url = sluice.url + "/llm/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        calls = [asyncio.create_task(status_of(session, url, CHAT)) for _ in range(5)]
        await sluice.wait_metric("sluice_queue_depth", 3, route="llm")
        sluice.config_path.write_text(text[:cut])  # in place: the writer stops here a while
        await sluice.wait_metric("sluice_config_reload_failures_total", 1)
        assert ": routes[0].concurrency: is empty (null)" in sluice.stderr()
        assert await sluice.metric("sluice_concurrency_limit", route="llm") == 2
        assert await sluice.metric("sluice_queue_depth", route="llm") == 3
        sluice.config_path.write_text(text.replace("limit: 2", "limit: 3"))  # the rest comes
        await sluice.wait_metric("sluice_concurrency_limit", 3, route="llm")
        await until(lambda: upstream.inflight == 3, what="a third call under limit 3")
        upstream.hold.set()
        assert await asyncio.gather(*calls) == [200] * 5
    assert upstream.peak_inflight == 3


async def test_configmap_symlink_swap_is_picked_up(upstream, start_sluice, tmp_path):
    # The layout the kubelet gives a ConfigMap volume, and its atomic update (AtomicWriter):
    # write a new timestamped directory, point ..data_tmp at it, rename it over ..data.
    mount = tmp_path / "etc-sluice"
    (mount / "..2026_01_01_00_00_00.1").mkdir(parents=True)
    (mount / "..data").symlink_to("..2026_01_01_00_00_00.1")
    (mount / "sluice.yaml").symlink_to("..data/sluice.yaml")
    sluice = await start_sluice(
        {"routes": [route("llm", upstream.url, concurrency={"limit": 2, "queue": 4})]},
        config_path=mount / "sluice.yaml",
    )
    data = yaml.load((mount / "sluice.yaml").read_text(), Loader=StrictLoader)
    data["routes"][0]["concurrency"]["limit"] = 5
    new_dir = mount / "..2026_01_01_00_01_00.2"
    new_dir.mkdir()
    (new_dir / "sluice.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (mount / "..data_tmp").symlink_to(new_dir.name)
    os.replace(mount / "..data_tmp", mount / "..data")

    await sluice.wait_metric("sluice_concurrency_limit", 5, route="llm")
    await until(lambda: any(e["event"] == "config_reloaded" for e in sluice.events()))
    reloaded = [e for e in sluice.events() if e["event"] == "config_reloaded"]
    assert reloaded[-1]["trigger"] == "file"
    assert reloaded[-1]["path"] == str(mount / "sluice.yaml")
    async with aiohttp.ClientSession() as session, session.post(
            sluice.url + "/llm/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200


async def test_an_in_place_copy_that_keeps_size_and_mtime_is_applied(upstream, start_sluice):
    """A hostile trial: ``cp -p`` of a release's config (same size, its fixed mtime) over the
    running file was never reloaded; the watch compared device, inode, size and mtime only,
    and the write changed none of them. Its ctime changes, and is compared too."""
    sluice = await start_sluice({"routes": [route(
        "llm", upstream.url, concurrency={"limit": 2, "queue": 4})]})
    path = sluice.config_path
    release = 1_700_000_000_000_000_000  # ns: an archive's or a build's fixed mtime
    os.utime(path, ns=(release, release))
    # That change seen first: the same text, nothing to apply.
    await sluice.wait_metric("sluice_config_reloads_unchanged_total", 1)
    text = path.read_text()
    new = text.replace("limit: 2", "limit: 7")
    assert len(new) == len(text)
    with path.open("r+") as file:  # as cp -p writes: same inode, then the mtime copied
        file.write(new)
    os.utime(path, ns=(release, release))
    await sluice.wait_metric("sluice_concurrency_limit", 7, route="llm")
    assert await sluice.metric("sluice_config_reloads_total") == 1


async def test_a_held_key_that_was_unset_is_said_unset(upstream, start_sluice):
    """A new user's trial: the log read "dead_letter.max_records_per_tenant changed ... still
    None until a restart"."""
    sluice = await start_sluice({"routes": [route("llm", upstream.url)]})
    rewrite(sluice.config_path,
            lambda data: data["dead_letter"].update(max_records_per_tenant=50))
    await sluice.wait_metric("sluice_config_reloads_total", 1)
    await until(lambda: "config reload: dead_letter.max_records_per_tenant changed but cannot "
                "change while running; still unset until a restart" in sluice.stderr())


async def test_sighup_reloads_and_listeners_stay_put(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route("llm", upstream.url)]})
    # The file as in force: nothing to apply (a hostile trial: every SIGHUP rebuilt it all).
    sluice.signal(signal.SIGHUP)
    await sluice.wait_metric("sluice_config_reloads_unchanged_total", 1)
    assert await sluice.metric("sluice_config_reloads_total") == 0
    assert "nothing to apply" in sluice.stderr()

    def move_listener(data: dict) -> None:
        data["server"]["listen"] = "127.0.0.1:1"
        data["routes"][0]["timeouts"] = {"connect": "2s", "total": "60s"}

    rewrite(sluice.config_path, move_listener)
    sluice.signal(signal.SIGHUP)
    await sluice.wait_metric("sluice_config_reloads_total", 1)
    await until(lambda: any(e["event"] == "config_reloaded" for e in sluice.events()))
    async with aiohttp.ClientSession() as session:
        async with session.post(sluice.url + "/llm/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200  # still on the old address
        async with session.get(sluice.admin_url + "/admin/config") as r:
            view = await r.json()
    assert view["last_reload"]["held"] == ["server.listen"]
    assert view["config"]["server"]["listen"] == f"127.0.0.1:{sluice.port}"
    assert view["config"]["routes"][0]["timeouts"] == {
        "connect": 2.0, "total": 60.0, "idle": 600.0, "deadline_header": "X-Request-Timeout"}
    assert "server.listen changed but cannot change while running" in sluice.stderr()

    # A change outside the routes is named too (it read "changed none" for a new price).
    rewrite(sluice.config_path,
            lambda data: data.update(pricing={"gpt-x": {"input": 1.0, "output": 2.0}}))
    await sluice.wait_metric("sluice_config_reloads_total", 2)
    await until(lambda: len([e for e in sluice.events() if e["event"] == "config_reloaded"]) == 2)
    last = [e for e in sluice.events() if e["event"] == "config_reloaded"][-1]
    assert (last["sections_changed"], last["routes_changed"]) == (["pricing"], [])
    assert "other sections changed: pricing" in sluice.stderr()


async def test_routes_added_and_removed(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        route("old", upstream.url, concurrency={"limit": 3})]})
    async with aiohttp.ClientSession() as session:
        async with session.post(sluice.url + "/old/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200

        def swap(data: dict) -> None:
            data["routes"] = [route("new", upstream.url, concurrency={"limit": 7})]

        rewrite(sluice.config_path, swap)
        await sluice.wait_metric("sluice_concurrency_limit", 7, route="new")
        async with session.post(sluice.url + "/new/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        async with session.post(sluice.url + "/old/v1/chat/completions", json=CHAT) as r:
            assert r.status == 404
        metrics = await sluice.metrics()
    assert not [key for key in metrics if ("route", "old") in key[1]]
    assert metrics[("sluice_requests_total", (("outcome", "2xx"), ("route", "new")))] == 1
    await until(lambda: any(e["event"] == "config_reloaded" for e in sluice.events()))
    event = [e for e in sluice.events() if e["event"] == "config_reloaded"][-1]
    assert (event["routes_added"], event["routes_removed"]) == (["new"], ["old"])


async def test_a_call_queued_across_two_reloads_is_counted_and_drained(upstream, start_sluice):
    # Seen in a hostile trial: a call queued behind a reload's old route object was admitted
    # there after a second reload had dropped that object (it had nothing *admitted* then),
    # so nothing counted it: the in-flight gauge read 0 while it ran, and SIGTERM exited at
    # once and cut it.
    sluice = await start_sluice({"server": {"drain_timeout": "20s"}, "routes": [
        route("llm", upstream.url, concurrency={"limit": 1, "queue": 4, "max_wait": "20s"})]})
    url = sluice.url + "/llm/v1/chat/completions"
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        def call(delay: str) -> Coroutine[Any, Any, int]:
            return status_of(session, url, CHAT, {"x-fake-delay": delay})

        # Each reload changes the file (the same one again rebuilds nothing): every route
        # object is replaced, the route's block unchanged.
        first = asyncio.create_task(call("0"))
        await until(lambda: upstream.inflight == 1, what="the first call at the upstream")
        rewrite(sluice.config_path, lambda data: data["server"].update(drain_timeout="21s"))
        await sluice.wait_metric("sluice_config_reloads_total", 1)
        second = asyncio.create_task(call("1.5"))  # queued on the first reload's object
        await sluice.wait_metric("sluice_queue_depth", 1, route="llm")
        rewrite(sluice.config_path, lambda data: data["server"].update(drain_timeout="22s"))
        await sluice.wait_metric("sluice_config_reloads_total", 2)
        upstream.hold.set()
        assert await first == 200
        await until(lambda: upstream.inflight == 1, what="the queued call at the upstream")
        assert await sluice.metric("sluice_inflight_requests", route="llm") == 1
        sluice.signal(signal.SIGTERM)
        assert await second == 200  # drained, not cut
    assert await sluice.wait_exit() == 0
    assert "drained" in sluice.stderr()


async def test_a_changed_idempotency_block_keeps_stored_answers_and_keys_in_flight(
        upstream, start_sluice):
    # Seen in a hostile trial (memory backend): a reload changing only the block's ttl gave
    # the route a fresh store, so a stored answer's duplicate ran at the upstream again, and
    # a duplicate of a call still running ran beside it.
    sluice = await start_sluice({"routes": [
        route("llm", upstream.url, idempotency={"mode": "dedup", "ttl": "1h"})]})
    url = sluice.url + "/llm/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        async def call(key: str) -> tuple[int, str]:
            async with session.post(url, json=CHAT, headers={"Idempotency-Key": key}) as r:
                await r.read()
                return r.status, r.headers.get("Idempotent-Replayed", "")

        assert await call("stored") == (200, "")
        upstream.hold = asyncio.Event()
        running = asyncio.create_task(call("running"))
        await until(lambda: upstream.inflight == 1, what="the keyed call at the upstream")
        rewrite(sluice.config_path,
                lambda data: data["routes"][0]["idempotency"].update(ttl="2h", max_wait="30s"))
        await sluice.wait_metric("sluice_config_reloads_total", 1)
        assert await call("stored") == (200, "true")
        duplicate = asyncio.create_task(call("running"))
        await asyncio.sleep(0.2)  # the duplicate waits for its twin; it must not go upstream
        assert upstream.inflight == 1
        upstream.hold.set()
        assert (await running, await duplicate) == ((200, ""), (200, "true"))
    assert len(upstream.requests) == 2


async def test_a_deleted_config_file_is_logged_and_the_running_config_serves(upstream,
                                                                            start_sluice):
    """Deleting the file logged nothing (a new user's trial): now one warning, and the
    running config goes on serving; the file's return is applied."""
    sluice = await start_sluice({"routes": [route(
        "llm", upstream.url, concurrency={"limit": 2, "queue": 4})]})
    text = sluice.config_path.read_text()
    sluice.config_path.unlink()
    await until(lambda: "is gone; the running config stays in force" in sluice.stderr(),
                what="the warning")
    assert await status_of_chat(sluice) == 200
    data = yaml.load(text, Loader=StrictLoader)
    data["routes"][0]["concurrency"]["limit"] = 3
    sluice.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    await sluice.wait_metric("sluice_concurrency_limit", 3, route="llm")
    assert sluice.stderr().count("is gone") == 1


async def status_of_chat(sluice) -> int:
    async with aiohttp.ClientSession() as session, session.post(
            sluice.url + "/llm/v1/chat/completions", json=CHAT) as r:
        return r.status


async def test_a_held_state_change_names_its_key_and_never_prints_the_redis_url(
        upstream, start_sluice):
    """A reload that changes only ``state.redis_url`` logged ``state changed ...; still
    StateConfig(...)``: the URL is kept out of reprs (it may hold a password), so the line
    did not say what changed (a hostile review). It names the key now, and its value
    nowhere."""
    url = require_redis()
    prefix = new_prefix()
    try:
        sluice = await start_sluice({"routes": [route("llm", upstream.url)],
                                     "state": {"backend": "redis", "redis_url": url,
                                               "key_prefix": prefix}})
        rewrite(sluice.config_path, lambda data: data["state"].update(
            redis_url="redis://:hunter2-secret@127.0.0.1:6379/0"))
        await sluice.wait_metric("sluice_config_reloads_total", 1)
        async with aiohttp.ClientSession() as session, session.get(
                sluice.admin_url + "/admin/config") as r:
            view = await r.json()
        assert view["last_reload"]["held"] == ["state.redis_url"]
        await until(lambda: "state.redis_url changed but cannot change while running"
                    in sluice.stderr())
        await until(lambda: "other sections changed: none (held until a restart: "
                    "state.redis_url)" in sluice.stderr())
        assert "hunter2" not in sluice.stderr()
    finally:
        delete_prefix(url, prefix)


async def test_a_held_restart_only_change_sets_restart_pending_until_the_file_is_back(
        upstream, start_sluice):
    """A hostile trial: a reload that held back a restart-only key (here the upstream pool's
    idle timeout; a listen address or ``state`` alike) was reported as a plain success, so
    no alert could tell that what runs is not the file. ``sluice_config_restart_pending``
    says so, while ``sluice_config_last_reload_successful`` stays 1 (the rest applied)."""
    sluice = await start_sluice({"routes": [route("llm", upstream.url)]})
    assert await sluice.metric("sluice_config_restart_pending") == 0
    rewrite(sluice.config_path, lambda data: data["server"].update(upstream_idle_timeout="3s"))
    await sluice.wait_metric("sluice_config_reloads_total", 1)
    assert await sluice.metric("sluice_config_restart_pending") == 1
    assert await sluice.metric("sluice_config_last_reload_successful") == 1
    # A refused file says nothing of what a restart would change: the gauge stays.
    rewrite(sluice.config_path, lambda data: data["server"].update(drain_timeout="soon"))
    await sluice.wait_metric("sluice_config_reload_failures_total", 1)
    assert await sluice.metric("sluice_config_restart_pending") == 1
    rewrite(sluice.config_path, lambda data: data["server"].update(
        upstream_idle_timeout="4s", drain_timeout="5s"))  # back to what runs
    await sluice.wait_metric("sluice_config_reloads_total", 2)
    assert await sluice.metric("sluice_config_restart_pending") == 0


async def test_a_removed_limit_admits_its_queued_calls_and_counts_them_when_back(
        upstream, start_sluice):
    # Seen in a hostile trial: calls queued behind a concurrency block a reload removed
    # stayed in the old limiter, out of every gauge, and were answered 503 queue_timeout at
    # its max_wait while newcomers went straight through; the block added back while calls
    # admitted under it still ran started empty beside them (2 at the upstream on limit: 1).
    limit = {"limit": 1, "queue": 4, "max_wait": "30s"}
    sluice = await start_sluice({"routes": [route("llm", upstream.url, concurrency=limit)]})
    url = sluice.url + "/llm/v1/chat/completions"
    upstream.hold = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        calls = [asyncio.create_task(status_of(session, url, CHAT)) for _ in range(3)]
        await until(lambda: upstream.inflight == 1, what="the first call at the upstream")
        await sluice.wait_metric("sluice_queue_depth", 2, route="llm")
        rewrite(sluice.config_path, lambda data: data["routes"][0].pop("concurrency"))
        await sluice.wait_metric("sluice_config_reloads_total", 1)
        # At once, as under a raised limit (the test waits 20 s of the 30 s max_wait).
        await until(lambda: upstream.inflight == 3, what="the queued calls at the upstream")
        rewrite(sluice.config_path,
                lambda data: data["routes"][0].update(concurrency=limit))
        await sluice.wait_metric("sluice_concurrency_limit", 1, route="llm")
        calls.append(asyncio.create_task(status_of(session, url, CHAT)))
        await sluice.wait_metric("sluice_queue_depth", 1, route="llm")  # the 3 count
        assert upstream.inflight == 3
        upstream.hold.set()
        assert await asyncio.gather(*calls) == [200] * 4
    assert upstream.peak_inflight == 3
    assert await sluice.metric("sluice_inflight_requests", route="llm") == 0


async def test_a_file_changed_while_the_running_config_was_read_is_applied(upstream, tmp_path):
    """An ops trial: a config slow to read (~20 s for a large pricing table) replaced while
    Sluice started was never applied: the watch took the file's fingerprint after the load,
    so the new file looked like the one in force. The fingerprint is taken before the read
    (``proxy.cli``), and the first poll applies the newer file."""
    from proxy.config import load_config
    from proxy.reload import Reloader, fingerprint
    from proxy.runtime import Runtime

    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump({"routes": [route(
        "llm", upstream.url, concurrency={"limit": 2, "queue": 0})]}, sort_keys=False))
    read = fingerprint(path)
    config = load_config(path)
    rewrite(path, set_limit(7))  # replaced after the read, before the watch starts
    runtime = Runtime(config)
    await runtime.open()
    reloader = Reloader(runtime, path, poll_interval_s=0.05, read=read)
    reloader.start()
    try:
        await until(lambda: runtime.config.routes[0].concurrency.limit == 7,
                    what="the newer file applied")
        assert reloader.last_attempt is not None and reloader.last_attempt["trigger"] == "file"
    finally:
        await reloader.stop()
        await runtime.close()


async def test_a_reload_of_the_files_in_force_rebuilds_nothing(upstream, tmp_path):
    """A hostile trial: a touch or a chmod of the config (its ctime moves) or a SIGHUP rebuilt
    every route, holding the event loop 0.3-0.56 s at 1,000 routes (4 s at 10,000). A reload
    that finds the config file, and the files it names, holding the text of the config in
    force rebuilds nothing; a byte changed in either is applied, as before."""
    from proxy.config import load_config
    from proxy.reload import Reloader
    from proxy.runtime import Runtime

    key_digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"{key_digest}: team-a\n")
    path = tmp_path / "sluice.yaml"
    text = yaml.safe_dump({"identity": {"tenants": "tenants.yaml"}, "routes": [route(
        "llm", upstream.url, concurrency={"limit": 2, "queue": 0})]}, sort_keys=False)
    path.write_text(text)
    runtime = Runtime(load_config(path))
    await runtime.open()
    reloader = Reloader(runtime, path)
    metrics = runtime.metrics.registry

    def sample(name: str) -> float | None:
        return metrics.get_sample_value(name)

    try:
        routes = list(runtime.routes)
        os.chmod(path, 0o600)
        assert await reloader.reload("file") is False
        path.with_name("new.yaml").write_text(text)  # the same text, a new inode
        os.replace(path.with_name("new.yaml"), path)
        assert await reloader.reload("sighup") is False
        assert runtime.routes == routes and all(
            now is then for now, then in zip(runtime.routes, routes, strict=True))
        assert sample("sluice_config_reloads_unchanged_total") == 2
        assert sample("sluice_config_reloads_total") == 0
        assert reloader.last_attempt is not None and reloader.last_attempt["unchanged"]

        # A refused edit undone: the file in force is good again, and nothing is rebuilt.
        path.write_text(text.replace("limit: 2", "limit: many"))
        assert await reloader.reload("file") is False
        assert sample("sluice_config_last_reload_successful") == 0
        path.write_text(text)
        assert await reloader.reload("file") is False
        assert sample("sluice_config_last_reload_successful") == 1
        assert all(now is then for now, then in zip(runtime.routes, routes, strict=True))
        assert sample("sluice_config_reloads_unchanged_total") == 3

        # A byte changed in a file the config names is applied.
        tenants.write_text(f"{key_digest}: team-b\n")
        assert await reloader.reload("file") is True
        assert runtime.config.identity.keys == {key_digest: "team-b"}
        assert runtime.routes[0] is not routes[0]
        assert sample("sluice_config_reloads_total") == 1
        # ... and is in force from then on: the same files again rebuild nothing.
        routes = list(runtime.routes)
        assert await reloader.reload("sighup") is False
        assert runtime.routes[0] is routes[0]
        assert sample("sluice_config_reloads_unchanged_total") == 4
    finally:
        await runtime.close()


async def test_a_call_whose_body_arrives_across_a_reload_is_served_by_one_config(
        upstream, start_sluice):
    # A hostile trial: the tenant header was read before the body and the timeout header
    # after it, so a reload landing in between served alice's call (config A's tenant
    # header) with config B's 1 ms deadline: a 504 neither config gives.
    upstream.delay = 0.2
    sluice = await start_sluice({
        "identity": {"tenant_header": "X-Ten-A", "timeout_header": "X-Timeout-A"},
        "routes": [route("llm", upstream.url)]})
    body = b'{"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}'
    reader, writer = await asyncio.open_connection("127.0.0.1", sluice.port)
    writer.write(b"POST /llm/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                 b"X-Ten-A: alice\r\nX-Timeout-B: 0.001\r\n\r\n" % len(body) + body[:5])
    await writer.drain()
    await asyncio.sleep(0.5)  # the head read and its identity taken; the body still arriving

    def to_b(data: dict) -> None:
        data["identity"] = {"tenant_header": "X-Ten-B", "timeout_header": "X-Timeout-B"}

    rewrite(sluice.config_path, to_b)
    await sluice.wait_metric("sluice_config_reloads_total", 1)
    writer.write(body[5:])
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status.startswith(b"HTTP/1.1 200"), status
    await until(lambda: any(e["event"] == "completed" for e in sluice.events()))
    [done] = [e for e in sluice.events() if e["event"] == "completed"]
    assert done["tenant"] == "alice"


async def test_a_reload_that_needs_a_dead_letter_file_it_cannot_open_is_refused(tmp_path):
    """A hostile trial: a ``dead_letter.path`` that cannot be opened stops a start whose
    routes retry, but a reload adding the first retry block was applied, and the first dead
    letter was lost. The reload opens the file as the start does, and is refused if it
    cannot: the old config serves, and the problem names the key on its line."""
    from proxy.config import load_config
    from proxy.reload import Reloader
    from proxy.runtime import Runtime

    letters = tmp_path / "dlq.sqlite"
    letters.write_bytes(b"not a database " * 300)  # a file pasted over it, say
    path = tmp_path / "sluice.yaml"
    config = {"dead_letter": {"path": str(letters)},
              "routes": [route("llm", "http://127.0.0.1:9")]}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    runtime = Runtime(load_config(path))
    await runtime.open()
    reloader = Reloader(runtime, path)
    try:
        rewrite(path, lambda data: data["routes"][0].update(retry={"attempts": 2}))
        assert await reloader.reload("sighup") is False
        assert runtime.config.routes[0].retry is None
        assert reloader.last_attempt is not None
        assert reloader.last_attempt["problems"] == [
            f"{path}:2: dead_letter.path: cannot open {str(letters)!r}: file is not a "
            "database; a route would retry, and its dead letters be lost (the path changes "
            "on a restart only)"]
        letters.unlink()  # the file moved away: the same config applies
        assert await reloader.reload("sighup") is True
        assert runtime.config.routes[0].retry is not None and letters.exists()
    finally:
        await runtime.close()


async def test_a_reload_to_an_event_log_in_a_missing_directory_is_refused(start_sluice,
                                                                          tmp_path):
    """A hostile trial: ``events.path`` is restart-only, so a reload naming one in a missing
    directory was held "until a restart" and counted a success, and that restart exited 1
    (a crash loop). The reload is refused as check-config and the start refuse it, naming
    the key on its line, and the running config stays in force."""
    sluice = await start_sluice({"routes": [route("llm", "http://127.0.0.1:9")]})
    missing = tmp_path / "missing" / "events.jsonl"

    def move_events(data: dict) -> None:
        data["events"] = {"path": str(missing)}
        data["routes"][0]["concurrency"] = {"limit": 3}

    rewrite(sluice.config_path, move_events)
    sluice.signal(signal.SIGHUP)
    await sluice.wait_metric("sluice_config_reload_failures_total", 1)
    assert await sluice.metric("sluice_config_last_reload_successful") == 0
    assert await sluice.metric("sluice_config_reloads_total") == 0
    lines = sluice.config_path.read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if text.startswith("events:")) + 1
    assert (f"{sluice.config_path}:{line}: events.path: the directory "
            f"{str(missing.parent)!r} does not exist: Sluice creates the file, not its "
            "directory") in sluice.stderr()
    missing.parent.mkdir()  # the directory made: the reload applies, held until a restart
    sluice.signal(signal.SIGHUP)
    await sluice.wait_metric("sluice_config_reloads_total", 1)
    assert await sluice.metric("sluice_config_restart_pending") == 1


async def test_an_event_log_whose_directory_went_away_does_not_refuse_other_reloads(
        start_sluice, tmp_path):
    """A review: the check of ``events.path`` looked at the running server's own path too,
    which it has open, so once its directory was removed (a cleanup job, a rotation) every
    later reload was refused, a rotated admin token's with it."""
    logs = tmp_path / "logs"
    logs.mkdir()
    sluice = await start_sluice({"events": {"path": str(logs / "events.jsonl")},
                                 "routes": [route("llm", "http://127.0.0.1:9")]})
    await wait_until(lambda: (logs / "events.jsonl").exists(), what="the event log opened")
    (logs / "events.jsonl").unlink()
    logs.rmdir()

    def raise_limit(data: dict) -> None:
        data["routes"][0]["concurrency"] = {"limit": 3}

    rewrite(sluice.config_path, raise_limit)
    sluice.signal(signal.SIGHUP)
    await sluice.wait_metric("sluice_config_reloads_total", 1)
    assert await sluice.metric("sluice_config_reload_failures_total") == 0


#: ``sluice serve`` whose reloads read the config file forever (``argv``: the config, then a
#: file written once a reload's read has begun): a parse slow beyond any bound, made so
#: deterministically.
_SERVE_WITH_A_READ_THAT_NEVER_ENDS = """
import sys, threading
from pathlib import Path
import proxy.reload
from proxy.cli import main

def never_ends(*args, **kwargs):
    Path(sys.argv[2]).write_text("reading")
    threading.Event().wait()

proxy.reload.load_config = never_ends
sys.exit(main(["serve", "--config", sys.argv[1]]))
"""


def test_a_stop_during_a_reload_s_read_does_not_wait_for_the_read(tmp_path: Path) -> None:
    """A hostile trial: SIGTERM while a reload parsed a large config (1 to 4 MiB) drained at
    once, then the process stayed up until the parse ended (10 s, 62 s: past docker stop's
    grace, so SIGKILLed): the parse ran on asyncio's default executor, whose thread exit
    waits for. The read is abandoned: here it never ends, and the process exits anyway."""
    port, admin = free_port(), free_port()
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump({
        "server": {"listen": f"127.0.0.1:{port}", "admin_listen": f"127.0.0.1:{admin}",
                   "drain_timeout": "1s"},
        "events": {"path": str(tmp_path / "events.jsonl")},
        "dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
        "routes": [route("llm", "http://127.0.0.1:9")]}, sort_keys=False))
    reading = tmp_path / "reading"
    with (tmp_path / "stderr").open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE_WITH_A_READ_THAT_NEVER_ENDS, str(path), str(reading)],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=stderr)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            assert time.monotonic() < deadline, "sluice never became ready"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=5):
                    break
            except OSError:
                time.sleep(0.05)
        with path.open("a") as edited:  # a file in force unchanged is not read again
            edited.write("# edited\n")
        proc.send_signal(signal.SIGHUP)
        while not reading.exists():
            assert time.monotonic() < deadline, "the reload never began its read"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)  # no bound on speed: without the fix, never
        except subprocess.TimeoutExpired:
            raise AssertionError("still running after its drain, waiting for the reload's "
                                 "read:\n" + (tmp_path / "stderr").read_text()) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = (tmp_path / "stderr").read_text()
    assert code == 0, log
    assert "drained" in log
