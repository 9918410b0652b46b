"""Retry-storm benchmark: a fleet of agents with SDK-style retries, direct vs through Sluice.

Each simulated agent starts a unit of work (one chat completion with a fresh
``Idempotency-Key``) on a fixed schedule, ``--rate`` units per second for the whole fleet
whatever became of earlier units (open loop, so every mode is offered the same work), and
retries exactly as the official openai SDK does by default
(``max_retries=2``; ``x-should-retry`` first; ``retry-after-ms``/``Retry-After`` up to 120 s,
else ``min(0.5 * 2^k, 8) * (1 - 0.25 U)``; retries 408, 409, 429, >= 500 and connection
errors; ``x-stainless-retry-count`` sent). The local fake upstream degrades mid-run on the same
schedule in every mode:

    healthy  [0, 3) s    80 ms per call, room for 64 at once
    outage   [3, 7) s    every call 503 after 10 ms (no Retry-After)
    brownout [7, 10) s   room for 6 at once (75 calls/s); the rest 503 at once
    healthy  [10, 13) s

Modes, run one after the other in this process: ``direct`` (agents -> upstream),
``sluice`` (agents -> Sluice with ``retry`` and ``circuit_breaker`` -> upstream) and
``sluice-retry`` (Sluice with ``retry`` only, to separate the breaker's effect).

Reported per mode: units of work started, upstream attempts, amplification (upstream attempts
per unit of work), completion rate (units that succeeded within ``--deadline`` seconds of
starting; a unit is abandoned at that point), goodput (such units per second of run), and the
requests agents sent. The whole run takes under a minute.

Usage: ``.venv/bin/python bench/storm.py [--agents 30] [--deadline 5] [--modes direct,sluice]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from email.utils import mktime_tz, parsedate_tz
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
PHASES = (("healthy", 0.0, 3.0), ("outage", 3.0, 7.0), ("brownout", 7.0, 10.0),
          ("healthy", 10.0, 13.0))
RUN_S = PHASES[-1][2]
LATENCY_S = 0.08
CAPACITY = {"healthy": 64, "outage": 0, "brownout": 6}
ATTEMPT_TIMEOUT_S = 10.0
BODY = json.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}).encode()
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [
    {"index": 0, "finish_reason": "stop",
     "message": {"role": "assistant", "content": "ok"}}]}).encode()

# The openai SDK's constants (openai/_constants.py, 3.x).
SDK_MAX_RETRIES = 2
SDK_INITIAL_DELAY_S = 0.5
SDK_MAX_DELAY_S = 8.0
SDK_MAX_RETRY_AFTER_S = 120.0

# Sluice's settings: the SPEC's example retry block, and a breaker with a short open time.
ROUTE = {"name": "llm", "path_prefix": "/llm/", "protocol": "openai",
         "retry": {"attempts": 3, "backoff": {"base": "250ms", "max": "8s"}}}
BREAKER = {"fail_max": 5, "rate": 0.5, "window": "5s", "min_calls": 20, "reset_timeout": "2s"}


def phase_at(t: float) -> str:
    for name, start, end in PHASES:
        if start <= t < end:
            return name
    return PHASES[-1][0]


class Upstream:
    """The degrading fake provider; counts every attempt per idempotency key."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.inflight = 0
        self.attempts: dict[str, int] = {}
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def reset(self) -> None:
        self.t0 = time.monotonic()
        self.attempts = {}

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        key = request.headers.get("Idempotency-Key", "")
        self.attempts[key] = self.attempts.get(key, 0) + 1
        phase = phase_at(time.monotonic() - self.t0)
        if phase == "outage":
            await asyncio.sleep(0.01)
            return web.json_response({"error": {"message": "down", "type": "server_error"}},
                                     status=503)
        if self.inflight >= CAPACITY[phase]:
            return web.json_response({"error": {"message": "overloaded",
                                                "type": "server_error"}}, status=503)
        self.inflight += 1
        try:
            await asyncio.sleep(LATENCY_S)
        finally:
            self.inflight -= 1
        return web.Response(body=ANSWER, content_type="application/json")


def _retry_after(headers: aiohttp.typedefs.LooseHeaders) -> float | None:
    for name, divisor in (("retry-after-ms", 1000), ("retry-after", 1)):
        value = headers.get(name)
        if value is not None:
            with contextlib.suppress(ValueError):
                return float(value) / divisor
    date = parsedate_tz(headers.get("retry-after") or "")
    return None if date is None else mktime_tz(date) - time.time()


@dataclass
class Unit:
    started: float  # seconds since the mode's start
    phase: str
    key: str
    ok: bool = False
    duration: float = math.inf
    requests: int = 0


@dataclass
class ModeResult:
    name: str
    units: list[Unit] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    sluice: dict[str, float] = field(default_factory=dict)


async def do_unit(session: aiohttp.ClientSession, url: str, unit: Unit,
                  deadline: float) -> None:
    """One unit of work, abandoned after ``deadline`` seconds (it can no longer count)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(deadline):
            await _sdk_call(session, url, unit)


async def _sdk_call(session: aiohttp.ClientSession, url: str, unit: Unit) -> None:
    """One call with the openai SDK's retry behaviour (``_base_client.py``)."""
    start = time.monotonic()
    for taken in range(SDK_MAX_RETRIES + 1):
        headers = {"Content-Type": "application/json", "Idempotency-Key": unit.key,
                   "x-stainless-retry-count": str(taken)}
        unit.requests += 1
        status, response_headers = None, {}
        try:
            async with session.post(url, data=BODY, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=ATTEMPT_TIMEOUT_S)) as r:
                await r.read()
                status, response_headers = r.status, r.headers
        except (aiohttp.ClientError, TimeoutError):
            pass
        if status is not None and status < 400:
            unit.ok = True
            unit.duration = time.monotonic() - start
            return
        if taken == SDK_MAX_RETRIES:
            return
        wait = _retry_after(response_headers) if status is not None else None
        if status is not None:
            if wait is not None and math.isfinite(wait) and wait > SDK_MAX_RETRY_AFTER_S:
                return
            verdict = response_headers.get("x-should-retry")
            if verdict == "false":
                return
            if verdict != "true" and not (status in (408, 409, 429) or status >= 500):
                return
        if wait is None or not 0 < wait <= SDK_MAX_RETRY_AFTER_S:
            wait = min(SDK_INITIAL_DELAY_S * 2.0 ** taken, SDK_MAX_DELAY_S)
            wait *= 1 - 0.25 * random.random()
        await asyncio.sleep(wait)


async def agent(session: aiohttp.ClientSession, url: str, t0: float, interval: float,
                deadline: float, units: list[Unit], running: set[asyncio.Task]) -> None:
    """Start a unit every ``interval`` seconds whatever became of the last ones (open loop),
    so every mode is offered the same work."""
    at = random.uniform(0, interval)
    while at < RUN_S:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        unit = Unit(at, phase_at(at), uuid.uuid4().hex)
        units.append(unit)
        task = asyncio.create_task(do_unit(session, url, unit, deadline))
        running.add(task)
        task.add_done_callback(running.discard)
        at += interval


async def run_mode(name: str, url: str, upstream: Upstream, agents: int, rate: float,
                   deadline: float) -> ModeResult:
    result = ModeResult(name)
    upstream.reset()
    t0 = upstream.t0
    running: set[asyncio.Task] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(agent(session, url, t0, agents / rate, deadline, result.units,
                                     running) for _ in range(agents)))
        await asyncio.gather(*running)
    result.attempts = dict(upstream.attempts)
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_sluice(workdir: Path, upstream_url: str, breaker: bool
                       ) -> tuple[subprocess.Popen, str, str]:
    port, admin = free_port(), free_port()
    route = dict(ROUTE, upstream=upstream_url)
    if breaker:
        route["circuit_breaker"] = BREAKER
    tag = "breaker" if breaker else "retry"
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "admin_listen": f"127.0.0.1:{admin}",
                   "drain_timeout": "1s"},
        "events": {"path": str(workdir / f"events-{tag}.jsonl")},
        "dead_letter": {"path": str(workdir / f"dlq-{tag}.sqlite")},
        "routes": [route],
    }
    path = workdir / f"sluice-{tag}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--config", str(path)],
                            cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=(workdir / f"sluice-{tag}.stderr").open("wb"))
    admin_url = f"http://127.0.0.1:{admin}"
    async with aiohttp.ClientSession() as s:
        for _ in range(400):
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(admin_url + "/readyz") as r:
                    if r.status == 200:
                        return proc, f"http://127.0.0.1:{port}/llm/v1/chat/completions", admin_url
            await asyncio.sleep(0.05)
    proc.kill()
    raise RuntimeError("sluice did not start")


async def sluice_counters(admin_url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(admin_url + "/metrics") as r:
        text = await r.text()
    wanted = {"sluice_retries_total": "retries", "sluice_retry_overflow_total": "retry_overflow",
              "sluice_dead_letters_total": "dead_letters"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] = sample.value
            elif (sample.name == "sluice_rejections_total"
                  and sample.labels.get("reason") == "circuit_open"):
                out["circuit_open"] = sample.value
    return out


def summarise(result: ModeResult, deadline: float) -> dict[str, float]:
    units = result.units
    done = [u for u in units if u.ok and u.duration <= deadline]
    attempts = sum(result.attempts.values())
    durations = [u.duration for u in done]
    return {
        "units": len(units),
        "client_requests": sum(u.requests for u in units),
        "upstream_attempts": attempts,
        "amplification": attempts / len(units) if units else 0.0,
        "completed": len(done),
        "completion_rate": len(done) / len(units) if units else 0.0,
        "goodput": len(done) / RUN_S,
        "p50_s": statistics.median(durations) if durations else math.nan,
    }


def per_phase(result: ModeResult, deadline: float) -> dict[str, tuple[int, float, float]]:
    out = {}
    for phase in dict.fromkeys(name for name, _, _ in PHASES):
        units = [u for u in result.units if u.phase == phase]
        attempts = sum(result.attempts.get(u.key, 0) for u in units)
        done = sum(1 for u in units if u.ok and u.duration <= deadline)
        out[phase] = (len(units), attempts / max(len(units), 1), done / max(len(units), 1))
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=30)
    parser.add_argument("--rate", type=float, default=100.0,
                        help="units of work started per second by the whole fleet")
    parser.add_argument("--deadline", type=float, default=5.0,
                        help="a unit counts as completed if it succeeded within this (s)")
    parser.add_argument("--modes", default="direct,sluice,sluice-retry")
    args = parser.parse_args()
    upstream = Upstream()
    await upstream.start()
    upstream_url = f"http://127.0.0.1:{upstream.port}"
    results: list[ModeResult] = []
    with tempfile.TemporaryDirectory(prefix="sluice-storm-") as tmp:
        for mode in args.modes.split(","):
            if mode == "direct":
                results.append(await run_mode(mode, upstream_url + "/v1/chat/completions",
                                              upstream, args.agents, args.rate, args.deadline))
                continue
            proc, url, admin = await start_sluice(Path(tmp), upstream_url, mode == "sluice")
            try:
                result = await run_mode(mode, url, upstream, args.agents, args.rate,
                                        args.deadline)
                result.sluice = await sluice_counters(admin)
            finally:
                proc.terminate()
                proc.wait(10)
            results.append(result)
    await upstream.stop()

    print(f"\nstorm: {args.agents} agents starting {args.rate:g} units/s in all, openai-SDK "
          f"retries (max_retries=2), {RUN_S:g} s per mode, deadline {args.deadline:g} s, "
          f"{os.cpu_count()} CPUs")
    print("schedule: " + ", ".join(f"{n} {a:g}-{b:g}s" for n, a, b in PHASES))
    header = (f"{'mode':13} {'units':>6} {'client req':>10} {'upstream':>9} {'amplif.':>8} "
              f"{'done<=D':>8} {'rate':>6} {'goodput/s':>10} {'p50 s':>6}")
    print(header)
    print("-" * len(header))
    for r in results:
        s = summarise(r, args.deadline)
        print(f"{r.name:13} {s['units']:>6} {s['client_requests']:>10} "
              f"{s['upstream_attempts']:>9} {s['amplification']:>8.2f} {s['completed']:>8} "
              f"{s['completion_rate']:>6.1%} {s['goodput']:>10.1f} {s['p50_s']:>6.3f}")
    print("\nper phase of a unit's start: units / upstream attempts per unit / completion rate")
    for r in results:
        cells = "  ".join(f"{phase} {n}/{amp:.2f}/{rate:.0%}"
                          for phase, (n, amp, rate) in per_phase(r, args.deadline).items())
        print(f"{r.name:13} {cells}")
    for r in results:
        if r.sluice:
            print(f"{r.name:13} sluice counters: " + ", ".join(
                f"{k} {v:g}" for k, v in sorted(r.sluice.items())))


if __name__ == "__main__":
    asyncio.run(main())
