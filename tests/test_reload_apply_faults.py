"""A fault while applying a valid config on reload: the build leaves the old config serving.

The config is valid, so only a bug (or a MemoryError) can raise while it is applied; the fault
is injected into the constructor or the ``reconfigure`` of a real policy, in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import proxy.routes
from policies.concurrency import ConcurrencyLimiter
from proxy.config import load_config
from proxy.reload import Reloader
from proxy.runtime import Runtime
from proxy.server import build_admin_app
from tests.conftest import route, serve_app, serve_runtime
from tests.fakeupstream import FakeUpstream
from tests.test_reload import CHAT, until


def old_config(upstream: str, directory: Path) -> dict:
    """``a`` with one slot and a breaker, ``b`` with none; one call of a run at a time."""
    return {
        "dead_letter": {"path": str(directory / "dlq.sqlite")},
        "fanout": {"width": 1, "max_wait": "0s"},
        "routes": [
            route("a", upstream, concurrency={"limit": 1, "queue": 0},
                  circuit_breaker={"fail_max": 1, "reset_timeout": "1h"}),
            route("b", upstream),
        ],
    }


def new_config(upstream: str, directory: Path) -> dict:
    """Three slots on ``a``, its breaker gone; a rate on ``b``; three calls of a run."""
    return {
        "dead_letter": {"path": str(directory / "dlq.sqlite")},
        "fanout": {"width": 3, "max_wait": "0s"},
        "routes": [
            route("a", upstream, concurrency={"limit": 3, "queue": 0}),
            route("b", upstream, rate={"requests": "100/s"}),
        ],
    }


@dataclass
class Served:
    runtime: Runtime
    reloader: Reloader
    path: Path
    url: str
    admin_url: str

    def write(self, config: dict) -> None:
        """Replace the config file as an editor does (write aside, rename over)."""
        aside = self.path.with_name(self.path.name + ".tmp")
        aside.write_text(yaml.safe_dump(config, sort_keys=False))
        aside.replace(self.path)

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """``{(sample name, sorted labels): value}`` from ``/metrics``."""
        async with aiohttp.ClientSession() as s, s.get(self.admin_url + "/metrics") as r:
            text = await r.text()
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples}

    async def metric(self, name: str, **labels: str) -> float | None:
        """A sample's value, ``None`` when ``/metrics`` has no such series."""
        return (await self.metrics()).get((name, tuple(sorted(labels.items()))))

    async def wait_metric(self, name: str, value: float, timeout: float = 20.0,
                          **labels: str) -> None:
        """Wait until a sample equals ``value``."""
        deadline = time.monotonic() + timeout
        while (current := await self.metric(name, **labels)) != value:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}{labels} is {current}, expected {value}")
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def sluice(config: dict, directory: Path) -> AsyncIterator[Served]:
    """Sluice in this process: proxy and admin ports, and the reload watch on its file."""
    path = directory / "sluice.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    runtime = Runtime(load_config(path))
    await runtime.open()
    reloader = Reloader(runtime, path, poll_interval_s=0.05)
    proxy_runner, port = await serve_runtime(runtime)
    admin_runner, admin_port = await serve_app(build_admin_app(runtime, reloader))
    reloader.start()
    try:
        yield Served(runtime, reloader, path, f"http://127.0.0.1:{port}",
                     f"http://127.0.0.1:{admin_port}")
    finally:
        await reloader.stop()
        await admin_runner.cleanup()
        await proxy_runner.cleanup()
        await runtime.close()


def fail_building_rates(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make building any route's ``rate`` raise; returns the routes it failed for.

    The reload that meets the fault has been handled once it is seen here: from the raise to
    the end of its handling it does not await."""
    failed: list[str] = []

    def broken(config: object, backends: object, name: str, protocol: str) -> None:
        failed.append(name)
        raise RuntimeError(f"injected: building route {name}'s rate limiter")

    monkeypatch.setattr(proxy.routes, "RateLimiter", broken)
    return failed


async def post(session: aiohttp.ClientSession, url: str, **headers: str) -> int | str:
    """The status of a chat call; a refusal's with its reason, as ``503 queue_full``."""
    async with session.post(url, json=CHAT, headers=headers) as response:
        await response.read()
        reason = response.headers.get("X-Sluice-Reason")
        return response.status if reason is None else f"{response.status} {reason}"


async def test_a_fault_building_a_reload_leaves_the_old_config_serving_with_its_gauges(
        upstream: FakeUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with sluice(old_config(upstream.url, tmp_path), tmp_path) as served, \
            aiohttp.ClientSession() as session:
        failed = fail_building_rates(monkeypatch)
        served.write(new_config(upstream.url, tmp_path))  # route a builds, then b fails
        await until(lambda: failed == ["b"], what="the reload to build route b")

        upstream.hold = hold = asyncio.Event()
        a_url = served.url + "/a/v1/chat/completions"
        b_url = served.url + "/b/v1/chat/completions"
        # a: one slot, no queue, as before the reload.
        held_a = asyncio.create_task(post(session, a_url))
        await until(lambda: upstream.inflight == 1, what="a's call at the upstream")
        assert await post(session, a_url) == "503 queue_full"
        # The top-level fan-out: still one call of a run at a time, on any route.
        held_b = asyncio.create_task(post(session, b_url, **{"X-Run-ID": "r1"}))
        await until(lambda: upstream.inflight == 2, what="b's call at the upstream")
        second = asyncio.create_task(post(session, b_url, **{"X-Run-ID": "r1"}))
        await until(lambda: second.done() or upstream.inflight == 3,
                    what="the run's second call to be answered or forwarded")
        assert second.done() and second.result() == "429 fanout_limited"
        hold.set()
        assert await held_a == 200 and await held_b == 200
        upstream.hold = None

        # /metrics reads the running objects: a's one slot, and its breaker, which the
        # failed reload would have removed, as it opens.
        assert await served.metric("sluice_concurrency_limit", route="a") == 1
        assert await served.metric("sluice_circuit_state", route="a") == 0
        assert await post(session, a_url, **{"x-fake-status": "500"}) == 500
        assert served.runtime.routes[0].breaker is not None
        assert served.runtime.routes[0].breaker.state_value() == 2
        assert await served.metric("sluice_circuit_state", route="a") == 2


async def test_a_fault_building_a_reload_is_counted_and_the_next_good_file_applies(
        upstream: FakeUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="sluice")
    async with sluice(old_config(upstream.url, tmp_path), tmp_path) as served, \
            aiohttp.ClientSession() as session:
        failed = fail_building_rates(monkeypatch)
        served.write(new_config(upstream.url, tmp_path))
        await until(lambda: failed == ["b"], what="the reload to build route b")

        assert await served.metric("sluice_config_reload_failures_total") == 1
        assert await served.metric("sluice_config_last_reload_successful") == 0
        assert await served.metric("sluice_config_reloads_total") == 0
        attempt = served.reloader.last_attempt
        assert attempt is not None and attempt["ok"] is False
        assert attempt["problems"] == [
            f"{served.path}:1: (apply): not applied (RuntimeError; see the log)"]
        async with session.get(served.admin_url + "/admin/config") as r:
            assert (await r.json())["last_reload"]["ok"] is False
        (record,) = [r for r in caplog.records if r.exc_info is not None]
        assert "nothing of it is applied" in record.getMessage()
        assert "injected: building route b's rate limiter" in caplog.text  # the traceback
        assert served.runtime.config.fanout is not None
        assert served.runtime.config.fanout.width == 1

        # The watch goes on: the same file again, the fault gone, applies in full.
        monkeypatch.undo()
        served.write(new_config(upstream.url, tmp_path))
        await served.wait_metric("sluice_config_reloads_total", 1)
        assert await served.metric("sluice_config_last_reload_successful") == 1
        assert await served.metric("sluice_concurrency_limit", route="a") == 3
        assert await served.metric("sluice_circuit_state", route="a") is None
        a, b = served.runtime.routes
        assert a.breaker is None and b.rate is not None
        upstream.hold = hold = asyncio.Event()
        run = [asyncio.create_task(post(
            session, served.url + "/b/v1/chat/completions", **{"X-Run-ID": "r1"}))
            for _ in range(3)]
        await until(lambda: upstream.inflight == 3, what="three calls of the run forwarded")
        hold.set()
        for call in run:
            assert await call == 200


async def commit_partly(served, upstream: FakeUpstream, tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Write the new config, whose commit fails as it reconfigures route a's limiter (the
    changes made before it stay), and wait for that fault."""
    failed: list[int] = []

    def broken(self: ConcurrencyLimiter, limit: int, *args: object, **kwargs: object) -> None:
        failed.append(limit)
        raise RuntimeError("injected: reconfiguring a limiter")

    monkeypatch.setattr(ConcurrencyLimiter, "reconfigure", broken)
    served.write(new_config(upstream.url, tmp_path))
    await until(lambda: failed == [3], what="the commit to reconfigure a's limiter")


async def test_a_fault_committing_a_reload_is_counted_and_a_sighup_completes_it(
        upstream: FakeUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="sluice")
    async with sluice(old_config(upstream.url, tmp_path), tmp_path) as served:
        await commit_partly(served, upstream, tmp_path, monkeypatch)

        assert await served.metric("sluice_config_reload_failures_total") == 1
        assert await served.metric("sluice_config_last_reload_successful") == 0
        attempt = served.reloader.last_attempt
        assert attempt is not None and attempt["problems"] == [
            f"{served.path}:1: (apply): partly applied (RuntimeError; see the log)"]
        (record,) = [r for r in caplog.records if r.exc_info is not None]
        assert "a SIGHUP applies it again in full" in record.getMessage()
        assert served.runtime.config.routes[0].concurrency is not None
        assert served.runtime.config.routes[0].concurrency.limit == 1  # not swapped in

        monkeypatch.undo()
        os.kill(os.getpid(), signal.SIGHUP)  # the same file again
        await served.wait_metric("sluice_config_reloads_total", 1)
        assert await served.metric("sluice_concurrency_limit", route="a") == 3
        assert await served.metric("sluice_circuit_state", route="a") is None


async def test_the_old_file_put_back_after_a_partly_applied_reload_is_applied_again(
        upstream: FakeUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A review: the file in force put back after a commit's fault read as unchanged (its text
    # is the config in force), so the changes made before the fault stayed.
    async with sluice(old_config(upstream.url, tmp_path), tmp_path) as served:
        await commit_partly(served, upstream, tmp_path, monkeypatch)
        monkeypatch.undo()
        served.write(old_config(upstream.url, tmp_path))
        await served.wait_metric("sluice_config_reloads_total", 1)
        assert await served.metric("sluice_config_reloads_unchanged_total") == 0
        assert await served.metric("sluice_config_last_reload_successful") == 1
