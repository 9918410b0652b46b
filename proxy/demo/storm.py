"""The retry-storm scenario: a fleet against a degrading provider, direct and through Sluice.

One run per mode, one after the other, on the same provider process and the same schedule:
``direct`` (agents -> provider) and ``sluice`` (agents -> a ``sluice serve`` subprocess with
:func:`sluice_config` -> provider). The provider (:mod:`proxy.demo.fakellm`) and the fleet
(:mod:`proxy.demo.fleet`) say what they model; :data:`FULL` and :data:`QUICK` are the
schedules. Everything binds 127.0.0.1, and the working files live in a temporary directory
removed on the way out.

What is reported per mode (:func:`summarise`): units of work, the requests the agents sent,
upstream attempts (counted by the provider) and their ratio to units (the amplification) and
to completed units (what each useful result cost: a proxy that refused everything would show
a low amplification and no completed unit), units completed within the deadline, the p50/p99
time to complete of the completed units only (the others have none), tokens billed and wasted
(billed for answers that completed no unit: answers to callers that had given up, and
duplicates), and duplicate side effects (completions beyond the first per
``Idempotency-Key``, counted by the provider).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.demo.fakellm import BIN_S, Phase, Provider
from proxy.demo.fleet import Fleet, FleetRun, Unit

STARTUP_TIMEOUT_S = 30.0
MODES = ("direct", "sluice")


@dataclass(frozen=True)
class Scenario:
    name: str
    provider: Provider
    fleet: Fleet

    @property
    def run_s(self) -> float:
        """How long one mode runs: the last unit's start plus its deadline, seconds."""
        return self.fleet.arrivals_s + self.fleet.deadline_s


#: ~20 s per mode. Healthy, the provider serves 16 completions of ~0.3 s at once (~53/s) and
#: the fleet asks for 40/s (75 %). A 3 s outage follows, then 5 s at half capacity (~27/s,
#: below the offered 40/s: a recovering provider with a backlog), then full capacity again.
#: The provider takes up to 128 requests before it refuses any: at half capacity that many
#: take ~4.8 s each, far past the agents' 2 s timeout, so work it accepts under overload is
#: mostly generated for callers that have left (with ``max_inflight`` 64 it sheds more itself,
#: and the direct fleet fares better: see docs/benchmarks.md).
FULL = Scenario(
    "full",
    Provider(phases=(Phase("healthy", 0, 3, 16), Phase("outage", 3, 6, 0),
                     Phase("recovering", 6, 11, 8), Phase("healthy", 11, math.inf, 16)),
             max_inflight=128),
    Fleet(rate=40, arrivals_s=14, deadline_s=6),
)
#: The same story in ~10 s per mode, for tests and a first look.
QUICK = Scenario(
    "quick",
    Provider(phases=(Phase("healthy", 0, 1, 16), Phase("outage", 1, 2.5, 0),
                     Phase("recovering", 2.5, 5, 8), Phase("healthy", 5, math.inf, 16)),
             max_inflight=128),
    Fleet(rate=40, arrivals_s=6, deadline_s=4),
)


def sluice_config(scenario: Scenario, upstream: str, port: int, admin_port: int,
                  workdir: Path) -> dict:
    """The config a user would write for this fleet and provider, with the reasoning.

    * ``concurrency.limit`` = the provider's healthy ``slots``: more requests at once only
      stretch every one's latency (it shares its capacity), so they wait in Sluice instead,
      where waiting costs nothing.
    * ``max_wait`` = the agents' timeout less the provider's worst time at that limit (at
      half capacity, ``work_s * 1.2 * 2``) less a margin: a request admitted after waiting
      that long still gets its answer before its caller gives up. A caller that gives up
      while its completion is being generated gets nothing for the tokens, and its retry is
      a duplicate.
    * ``queue`` by Little's law: the waiters that ``limit`` slots serve within ``max_wait``,
      ``limit * max_wait / service time`` at half capacity.
    * ``circuit_breaker``: ``fail_max`` 10 consecutive failures or a 50 % failure rate over
      5 s once 20 calls are in, so an outage opens it at once but a few stray 503s in a
      brownout do not make it flap; ``reset_timeout`` 1 s (scaled to this schedule's
      seconds-long outage), after which one probe goes through.
    * ``retry``: 2 attempts on 502/503/504 and connect errors, with the idempotency key, and
      not on ``timeout``: a timed-out completion may still be generated and billed, so
      repeating it would run it twice. The provider's ``Retry-After`` is honoured.
    * ``idempotency: dedup``: the agents' own keys are kept, sent upstream on every attempt,
      and a retry of a step whose answer Sluice already has gets it replayed.
    """
    provider, fleet = scenario.provider, scenario.fleet
    limit = max(p.slots for p in provider.phases)
    worst = provider.work_s * 1.2 * limit / min(p.slots for p in provider.phases if p.slots)
    max_wait = round(max(0.1, fleet.timeout_s - worst - 0.25), 2)
    queue = math.ceil(limit * max_wait / (worst / 1.2))
    return {
        "server": {"listen": f"127.0.0.1:{port}", "admin_listen": f"127.0.0.1:{admin_port}",
                   "drain_timeout": "1s"},
        "events": {"path": str(workdir / "events.jsonl")},
        "dead_letter": {"path": str(workdir / "dlq.sqlite")},
        "routes": [{
            "name": "llm", "path_prefix": "/llm/", "upstream": upstream, "protocol": "openai",
            "timeouts": {"connect": "1s", "total": "30s"},
            "concurrency": {"limit": limit, "queue": queue, "max_wait": f"{max_wait:g}s"},
            "circuit_breaker": {"fail_max": 10, "rate": 0.5, "window": "5s", "min_calls": 20,
                                "reset_timeout": "1s"},
            "retry": {"attempts": 2, "backoff": {"base": "250ms", "max": "1s"},
                      "on": [502, 503, 504, "connect_error"]},
            "idempotency": {"mode": "dedup"},
        }],
    }


# -- processes ------------------------------------------------------------------------------


@contextlib.contextmanager
def _process(argv: list[str], cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def provider_process(provider: Provider, workdir: Path, seed: int = 1) -> Iterator[str]:
    """Run the fake provider in its own process; yields its base URL."""
    argv = [sys.executable, "-m", "proxy.demo.fakellm", "--provider", provider.to_json(),
            "--seed", str(seed)]
    log = workdir / "provider.log"
    with _process(argv, workdir, log) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("port "):
            raise RuntimeError(f"the fake provider did not start:\n{log.read_text()}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"


@contextlib.contextmanager
def sluice_process(config: dict, workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``sluice serve`` (``python -m proxy serve``) on ``config``; ready when yielded.

    It waits for ``/readyz`` with blocking calls: it runs between the fleet's runs, when
    nothing else is scheduled on the event loop.
    """
    path = workdir / "sluice.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = workdir / "sluice.log"
    argv = [sys.executable, "-m", "proxy", "serve", "--config", str(path)]
    with _process(argv, workdir, log) as proc:
        ready = f"http://{config['server']['admin_listen']}/readyz"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sluice exited at startup:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(ready, timeout=1) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sluice not ready in {STARTUP_TIMEOUT_S:g}s")
            time.sleep(0.05)
        yield proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- runs -----------------------------------------------------------------------------------


@dataclass
class ModeResult:
    """What one mode's run produced."""

    mode: str
    units: list[Unit]
    answers: dict[str, int]  # what the agents' requests got, by status or Sluice reason
    upstream: dict  # the provider's stats (FakeLLM.stats, with per_key)
    sluice: dict[str, float] = field(default_factory=dict)  # Sluice's counters, if any


Progress = Callable[[str, float, dict], None]


async def run_mode(mode: str, url: str, provider_url: str, scenario: Scenario, seed: int,
                   progress: Progress | None = None, admin_url: str | None = None) -> ModeResult:
    """Reset the provider, run the fleet against ``url`` and collect both sides' counts."""
    async with aiohttp.ClientSession() as control:
        async with control.post(provider_url + "/_fake/reset") as r:
            r.raise_for_status()
        fleet = FleetRun(scenario.fleet, url, seed)
        task = asyncio.create_task(fleet.run())
        while not task.done():
            await asyncio.wait({task}, timeout=1.0)
            if progress is not None and not task.done():
                async with control.get(provider_url + "/_fake/stats") as r:
                    stats = await r.json()
                elapsed = time.monotonic() - fleet.t0
                progress(mode, elapsed, {
                    "phase": stats["phase"],
                    "started": min(scenario.fleet.units, math.ceil(elapsed * scenario.fleet.rate)),
                    "completed": fleet.completed, "upstream_attempts": stats["attempts"],
                    "upstream_inflight": stats["inflight"], "agents_waiting": fleet.in_flight,
                })
        units = await task
        async with control.get(provider_url + "/_fake/stats", params={"keys": "1"}) as r:
            upstream = await r.json()
        counters = await sluice_counters(control, admin_url) if admin_url else {}
    return ModeResult(mode, units, dict(fleet.answers), upstream, counters)


async def sluice_counters(session: aiohttp.ClientSession, admin_url: str) -> dict[str, float]:
    """Sluice's own counts from ``/metrics``: rejections by reason, retries, replays..."""
    async with session.get(admin_url + "/metrics") as r:
        text = await r.text()
    wanted = {"sluice_retries_total": "retries", "sluice_retry_overflow_total": "retry_overflow",
              "sluice_dead_letters_total": "dead_letters",
              "sluice_idempotent_replays_total": "replays",
              "sluice_upstream_attempts_total": "upstream_attempts",
              "sluice_work_units_total": "work_units"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] = out.get(wanted[sample.name], 0) + sample.value
            elif sample.name == "sluice_rejections_total" and sample.value:
                key = f"rejected_{sample.labels['reason']}"
                out[key] = out.get(key, 0) + sample.value
    return out


async def run_storm(scenario: Scenario, modes: tuple[str, ...] = MODES, seed: int = 1,
                    progress: Progress | None = None,
                    config_hook: Callable[[str, dict], dict] | None = None,
                    keep: Path | None = None) -> list[ModeResult]:
    """Run ``modes`` in order against one provider process; returns their results.

    A mode other than ``direct`` runs through a Sluice of its own; ``config_hook(mode,
    config)`` may change its config first (the benchmark's variants). The processes' logs,
    Sluice's config and event log go to a temporary directory, removed at the end, or to
    ``keep``, left in place.
    """
    results: list[ModeResult] = []
    with contextlib.ExitStack() as stack:
        if keep is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sluice-demo-")))
        else:
            workdir = keep
            workdir.mkdir(parents=True, exist_ok=True)
        with provider_process(scenario.provider, workdir, seed) as provider_url:
            for mode in modes:
                if mode == "direct":
                    url = provider_url + "/v1/chat/completions"
                    results.append(await run_mode(mode, url, provider_url, scenario, seed,
                                                  progress))
                    continue
                port, admin_port = free_port(), free_port()
                config = sluice_config(scenario, provider_url, port, admin_port, workdir)
                if config_hook is not None:
                    config = config_hook(mode, config)
                with sluice_process(config, workdir):
                    url = f"http://127.0.0.1:{port}/llm/v1/chat/completions"
                    results.append(await run_mode(mode, url, provider_url, scenario, seed,
                                                  progress, f"http://127.0.0.1:{admin_port}"))
    return results


# -- summary --------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def summarise(result: ModeResult, scenario: Scenario) -> dict[str, float | int | None]:
    """The headline figures of one mode (see the module docstring)."""
    units = result.units
    up = result.upstream
    done = [u.latency for u in units if u.latency is not None]
    tokens_per_call = scenario.provider.tokens_per_call
    useful = len(done) * tokens_per_call
    return {
        "units": len(units),
        "agent_requests": sum(u.requests for u in units),
        "upstream_attempts": up["attempts"],
        "amplification": up["attempts"] / len(units) if units else None,
        "attempts_per_completed": up["attempts"] / len(done) if done else None,
        "completed": len(done),
        "completion_rate": len(done) / len(units) if units else None,
        "p50_s": statistics.median(done) if done else None,
        "p99_s": _percentile(done, 0.99),
        "executions": up["executions"],
        "tokens_billed": up["tokens"],
        "tokens_wasted": max(0, up["tokens"] - useful),
        "duplicate_side_effects": up["duplicates"],
        "upstream_peak_inflight": up["peak_inflight"],
    }


def per_phase(result: ModeResult, scenario: Scenario) -> dict[str, dict[str, float]]:
    """Units grouped by the phase they started in: count, amplification, upstream attempts per
    completed unit (``None`` when none completed), completion rate."""
    per_key = result.upstream.get("per_key", {})
    groups: dict[str, list[Unit]] = {}
    for unit in units_by_phase(result.units, scenario):
        groups.setdefault(unit[0], []).append(unit[1])
    out = {}
    for phase, units in groups.items():
        attempts = sum(per_key.get(u.key, [0, 0])[0] for u in units)
        completed = sum(u.done is not None for u in units)
        out[phase] = {"units": len(units), "amplification": attempts / len(units),
                      "attempts_per_completed": attempts / completed if completed else None,
                      "completion_rate": completed / len(units)}
    return out


def units_by_phase(units: list[Unit], scenario: Scenario) -> Iterator[tuple[str, Unit]]:
    """``(phase label, unit)`` for each unit; a phase name seen twice gets its start time."""
    names = [p.name for p in scenario.provider.phases]
    for unit in units:
        phase = scenario.provider.phase_at(unit.start)
        label = phase.name if names.count(phase.name) == 1 else f"{phase.name}@{phase.start_s:g}s"
        yield label, unit


def timeline(result: ModeResult, scenario: Scenario) -> dict[str, list[float]]:
    """Per ``BIN_S`` bin: upstream attempts/s, upstream in flight, units completed/s."""
    bins = math.ceil(scenario.run_s / BIN_S)
    attempts = [0.0] * bins
    inflight = [0.0] * bins
    for row in result.upstream["timeline"]:
        i = round(row["t"] / BIN_S)
        if i < bins:
            attempts[i] = row["attempts"] / BIN_S
            inflight[i] = row["inflight"]
    completed = [0.0] * bins
    for unit in result.units:
        if unit.done is not None and int(unit.done / BIN_S) < bins:
            completed[int(unit.done / BIN_S)] += 1 / BIN_S
    return {"t": [i * BIN_S for i in range(bins)], "upstream_attempts_per_s": attempts,
            "upstream_inflight": inflight, "completed_per_s": completed}


def record(results: list[ModeResult], scenario: Scenario) -> dict:
    """Everything worth keeping from a storm, JSON-ready."""
    return {
        "scenario": scenario.name,
        "provider": json.loads(scenario.provider.to_json()),
        "fleet": {**dataclasses.asdict(scenario.fleet), "units": scenario.fleet.units},
        "modes": {r.mode: {"summary": summarise(r, scenario), "per_phase": per_phase(r, scenario),
                           "answers": r.answers, "sluice": r.sluice,
                           "upstream_outcomes": r.upstream["outcomes"],
                           "timeline": timeline(r, scenario)} for r in results},
    }

