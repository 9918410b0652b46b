"""What Sluice costs per request: the same load direct, through Sluice, a bare proxy, HAProxy.

In one run, for each scenario, the same closed-loop load (POST of a ~130-byte chat-completion
request, keep-alive) goes to each target:

* ``direct``: straight to the upstream;
* ``sluice``: through a real ``sluice serve`` subprocess (``python -m proxy serve`` from this
  checkout), on the default config (``config/sluice.yaml``) with its ``openai`` route pointed at
  the upstream and its concurrency and rate policies set generously, so they run on every
  request but never refuse (its idempotency, breaker and retry blocks stay as they are);
* ``baseline``: through ``bench/passthrough.py``, a bare aiohttp + uvloop pass-through proxy
  with no policies, events or metrics, on the same low-level server and client settings as
  Sluice and sending the same bytes upstream, so "Sluice minus baseline" is what Sluice itself
  adds;
* ``floor`` (only when named in ``--targets``): through ``bench/floor.py``, the baseline
  plus the per-request work Sluice does for this request, written as tightly as plain
  Python allows: the least Sluice's work can cost on this stack;
* ``haproxy``: through HAProxy (``apt-get install -y haproxy``), one thread, keep-alive to
  the upstream, stripping the same path prefix: what a C proxy costs on the same machine in
  the same run. Skipped, with a note, when ``haproxy`` is not installed.

With ``--state redis`` the targets are ``direct``, ``sluice`` (the memory backend) and
``sluice-redis``: the same Sluice on the Redis state backend, on a ``redis-server`` the script
starts on a free loopback port (no persistence). In that mode both Sluice targets also get a
token rate and a tenant budget (limits no run reaches), so every call is metered: its request,
tenant and token buckets and its budget reservation are one admission, its settle another.
The table adds ``Redis RT/req``: scripts Redis ran during the measured run (``INFO
commandstats``: ``EVALSHA``/``EVAL``) per request served, and Redis's own CPU per request; an
unmeasured pass of 200 sequential calls under ``MONITOR`` then names each script (by SHA1).

Scenarios:

* ``fast``: an upstream that answers at once, 16 connections (``--connections``). The fast
  upstream is nginx (Debian's ``nginx-light``, one worker, ``return 200`` of a fixed JSON body)
  when installed, else ``bench/upstream.py`` (aiohttp + uvloop); ``--upstream`` chooses.
* ``slow``: ``bench/upstream.py`` answering after 50 ms (``--slow-delay``), 64 connections
  (``--slow-connections``): throughput against direct, and the p50 latency added.

The load generator is wrk (``apt-get install -y wrk``), 2 threads (``--threads``), ~10 s per
case (``--duration``) after a short warm-up (``--warmup``). Without wrk the script says so and
falls back to ``bench/loadgen.py`` (aiohttp, one process per thread), which is much slower and
competes for the same cores; compare its figures only with each other (a proxy spends more
CPU per request at the lower rates it reaches, as fewer requests share each loop turn).

"proxy CPU us/req" is the proxy process's user+system CPU time, read from ``/proc/PID/stat``
just before and just after the measured run, divided by the requests completed; it moves much less
than req/s and latency when other work shares the machine. Every process (load generator, proxy,
upstream) shares the machine's cores, so compare figures from the same run only. The table goes
to stdout, the full record (settings, versions, load averages, every case) to
``bench/results/overhead-<UTC time>.json``, and a plot of CPU per request and added p50 beside
it (with matplotlib).

With ``--profile`` (needs ``.venv/bin/pip install py-spy``), each scenario ends with one more,
unmeasured, run of the load through Sluice while py-spy samples it (``--profile-seconds``,
default ``--duration``); the raw stacks are saved beside the JSON record, and a summary is
printed under the table: where the CPU goes, the costliest functions, and what the event log
(``proxy/events.py``, orjson) and the metrics updates (``prometheus_client``,
``proxy/metrics.py``) cost, each with its call sites, in us per request.

    python -m bench overhead                      # both scenarios, 10 s per case
    python -m bench overhead --duration 5 --repeat 3 --scenarios fast
    python -m bench overhead --scenarios fast --targets sluice --profile
    python -m bench overhead --scenarios fast --profile --profile-seconds 30
    python -m bench overhead --state redis        # memory vs Redis backend, round trips
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import pkgutil
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis
import yaml

import policies.state
from bench import common
from bench.common import (
    PROXY_PREFIX,
    REPO,
    REQUEST_BODY,
    REQUEST_HEADERS,
    UPSTREAM_PATH,
    Load,
    Service,
)
from bench.upstream import COMPLETION  # nginx answers the same body
from policies.state.connection import Script
from proxy.config import StrictLoader

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = REPO / "config" / "sluice.yaml"
TARGETS = ("direct", "sluice", "baseline", "haproxy", "sluice-redis", "floor")
#: The targets of ``--state redis`` (unless ``--targets`` names others).
REDIS_TARGETS = ("direct", "sluice", "sluice-redis")
#: Calls of the unmeasured pass that names the scripts (under MONITOR).
MONITORED_CALLS = 200
#: What Sluice logs when a Redis call fails and it marks the backend down.
DOWN_LINE = "state backend is down"

#: What the official openai SDK (v2, async client) sends besides, for ``--sdk-headers``.
SDK_HEADERS = {
    "Accept": "application/json",
    "Accept-Encoding": "gzip, deflate",
    "User-Agent": "AsyncOpenAI/Python 2.3.0",
    "X-Stainless-Lang": "python",
    "X-Stainless-Package-Version": "2.3.0",
    "X-Stainless-OS": "Linux",
    "X-Stainless-Arch": "x64",
    "X-Stainless-Runtime": "CPython",
    "X-Stainless-Runtime-Version": "3.11.7",
    "X-Stainless-Async": "async:asyncio",
    "X-Stainless-Retry-Count": "0",
    "X-Stainless-Read-Timeout": "600",
}

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 10000000;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    fastcgi_temp_path {tmp}/nginx-fastcgi;
    uwsgi_temp_path {tmp}/nginx-uwsgi;
    scgi_temp_path {tmp}/nginx-scgi;
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        location / {{
            default_type application/json;
            return 200 '{body}';
        }}
    }}
}}
"""

# One thread, like the single-process Python proxies; keep-alive both ways; the prefix is
# stripped as Sluice and the baseline strip it.
HAPROXY_CONF = """
global
    nbthread 1
    maxconn 4096
defaults
    mode http
    option http-keep-alive
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend bench
    bind 127.0.0.1:{port}
    http-request replace-path {prefix}(.*) \\1
    default_backend upstream
backend upstream
    http-reuse always
    server up {upstream}
"""


# -- processes -------------------------------------------------------------------------------


def start_nginx(nginx: str, tmp: Path) -> Service:
    port = common.free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, body=COMPLETION.decode()))
    service = common.spawn("nginx", [nginx, "-p", str(tmp), "-c", str(conf), "-e",
                                     str(tmp / "nginx-error.log")], tmp,
                           f"http://127.0.0.1:{port}")
    common.wait_ready(service, service.url + UPSTREAM_PATH, "POST")
    return service


def start_baseline(tmp: Path, upstream: Service, wrapper: Sequence[str] = (),
                   timeout_s: float = common.STARTUP_TIMEOUT_S) -> Service:
    """``bench/passthrough.py`` in front of ``upstream`` (under ``wrapper``, if given)."""
    port = common.free_port()
    service = common.spawn("baseline", [*wrapper, sys.executable, str(HERE / "passthrough.py"),
                                        "--port", str(port), "--upstream", upstream.url,
                                        "--prefix", PROXY_PREFIX], tmp,
                           f"http://127.0.0.1:{port}{PROXY_PREFIX}")
    common.wait_ready(service, service.url + UPSTREAM_PATH, "POST", timeout_s=timeout_s)
    return service


def start_floor(tmp: Path, upstream: Service, wrapper: Sequence[str] = (),
                timeout_s: float = common.STARTUP_TIMEOUT_S) -> Service:
    """``bench/floor.py`` (the baseline plus Sluice's work, tight) in front of ``upstream``."""
    port = common.free_port()
    service = common.spawn("floor", [*wrapper, sys.executable, str(HERE / "floor.py"),
                                     "--port", str(port), "--upstream", upstream.url,
                                     "--events", str(tmp / "floor-events.jsonl")], tmp,
                           f"http://127.0.0.1:{port}{PROXY_PREFIX}")
    common.wait_ready(service, service.url + UPSTREAM_PATH, "POST", timeout_s=timeout_s)
    return service


#: The Python proxies started from one script of bench/, by target name.
STANDALONE = {"baseline": start_baseline, "floor": start_floor}


def start_haproxy(haproxy: str, tmp: Path, upstream: Service) -> Service:
    port = common.free_port()
    conf = tmp / "haproxy.cfg"
    conf.write_text(HAPROXY_CONF.format(port=port, prefix=PROXY_PREFIX,
                                        upstream=upstream.url.removeprefix("http://")))
    service = common.spawn("haproxy", [haproxy, "-db", "-f", str(conf)], tmp,
                           f"http://127.0.0.1:{port}{PROXY_PREFIX}")
    common.wait_ready(service, service.url + UPSTREAM_PATH, "POST")
    return service


def sluice_config(upstream: Service, metered: bool = False, state: dict | None = None
                  ) -> dict:
    """``config/sluice.yaml`` with the ``openai`` route sent upstream (ports: bench.common).

    The openai route keeps every policy but with limits no benchmark reaches: 1024 slots and
    queue places, ~100,000 requests/s per route and per tenant; ``metered`` adds a token rate
    and a tenant budget as large, so each call is also reserved and settled. ``state``: the
    ``state`` block (default: memory).
    """
    # Sluice's own YAML 1.2 loader: PyYAML's safe_load would read the retry block's "on" key
    # as the boolean true.
    config = yaml.load(DEFAULT_CONFIG.read_text(), Loader=StrictLoader)
    config["server"] = {"drain_timeout": "2s"}
    config.pop("events", None)
    config.pop("dead_letter", None)
    (route,) = (r for r in config["routes"] if r["name"] == "openai")
    route["upstream"] = upstream.url
    route["concurrency"] = {"limit": 1024, "queue": 1024, "max_wait": "5s", "per_tenant": 1024}
    route["rate"] = {"requests": "6000000/min", "per_tenant": {"requests": "6000000/min"}}
    if metered:
        route["rate"]["tokens"] = "600000000000/min"
        route["budget"] = {"tokens": "1000000000000000/day", "per": "tenant"}
    if state is not None:
        config["state"] = state
    return config


def start_redis(tmp: Path) -> Service:
    """A ``redis-server`` of the benchmark's own on a free loopback port, no persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--state redis needs redis-server: apt-get install -y redis-server")
    port = common.free_port()
    service = common.spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no", "--dir", str(tmp),
                                     "--protected-mode", "no"], tmp,
                           f"redis://127.0.0.1:{port}/0")
    deadline = time.monotonic() + 10
    while True:
        try:
            with redis.Redis.from_url(service.url, socket_timeout=1) as r:
                r.ping()
            return service
        except redis.RedisError:
            if service.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start:\n{service.log.read_text()}"
                                 ) from None
            time.sleep(0.05)


def scripts_run(url: str) -> int:
    """Scripts Redis has run (``EVALSHA``, ``EVAL``, ``FCALL`` calls): one per round trip, as
    Sluice sends every state call on the request path as one script."""
    with redis.Redis.from_url(url, socket_timeout=5) as r:
        stats = r.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items()
               if k in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall"))


def script_names() -> dict[str, str]:
    """SHA1 -> ``module.NAME`` of every Lua script the state backends send."""
    names = {}
    for info in pkgutil.iter_modules(policies.state.__path__):
        module = importlib.import_module(f"policies.state.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, Script):
                sha = hashlib.sha1(value.lua.encode()).hexdigest()
                names[sha] = f"{info.name}.{attr.lstrip('_')}"
    return names


def monitored_scripts(url: str, sluice: Service, calls: int) -> dict[str, float]:
    """Send ``calls`` sequential requests through ``sluice`` while ``MONITOR`` records what
    Redis runs; scripts per request by name (unmeasured: MONITOR slows Redis)."""
    names = script_names()
    seen: Counter[str] = Counter()
    client = redis.Redis.from_url(url, socket_timeout=None)
    ready = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        with client.monitor() as m:
            ready.set()
            for event in m.listen():
                words = event["command"].split()
                if words and words[0].upper() in ("EVALSHA", "EVAL"):
                    sha = words[1] if words[0].upper() == "EVALSHA" else hashlib.sha1(
                        words[1].encode()).hexdigest()
                    seen[names.get(sha, sha[:12])] += 1
                if stop.is_set() and words[:1] == ["PING"]:
                    return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    ready.wait(5)
    time.sleep(0.2)
    for _ in range(calls):
        req = urllib.request.Request(sluice.url + UPSTREAM_PATH, data=REQUEST_BODY.encode(),
                                     method="POST", headers=REQUEST_HEADERS)
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
    time.sleep(1.0)  # the last settles run in the background after the answers
    stop.set()
    with redis.Redis.from_url(url, socket_timeout=5) as r:
        r.ping()  # wakes the watcher up
    thread.join(5)
    client.close()
    return {name: count / calls for name, count in seen.most_common()}


# -- cases -------------------------------------------------------------------------------------


@dataclass
class Case:
    """One row of the table."""

    scenario: str
    target: str  # direct | sluice | baseline | haproxy | sluice-redis | floor
    repeat: int
    connections: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    requests: int
    errors: int
    duration_s: float
    proxy_cpu_s: float | None
    proxy_cpu_us_per_req: float | None
    proxy_cpu_percent: float | None  # of one core
    proxy_sys_us_per_req: float | None  # the kernel's part of proxy_cpu_us_per_req
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    vs_direct: float | None = None
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    sluice_counts: dict[str, float] = field(default_factory=dict)
    redis_round_trips_per_req: float | None = None  # scripts Redis ran per request served
    redis_cpu_us_per_req: float | None = None
    #: Times the Redis backend was marked down during the case (Sluice's log lines).
    redis_marked_down: int | None = None


def run_load(args: argparse.Namespace, tmp: Path, url: str, connections: int,
             duration_s: float) -> Load:
    return common.run_closed(args.wrk, url, args.threads, connections, duration_s, tmp,
                             args.headers)


def measure(args: argparse.Namespace, tmp: Path, scenario: str, target: str, repeat: int,
            url: str, connections: int, proxy: Service | None,
            store: Service | None = None) -> Case:
    """Warm up, then run the load once with the proxy's CPU time read around it (and, with
    ``store``, the Redis it uses: its scripts run and its CPU time)."""
    if args.warmup > 0:
        run_load(args, tmp, url, connections, args.warmup)
    before = common.loadavg()
    if store is not None:
        time.sleep(0.5)  # the warm-up's last settles
        scripts0, store_cpu0 = scripts_run(store.url), common.cpu_seconds(store.pid)
    user0, sys0 = common.cpu_times(proxy.pid) if proxy else (0.0, 0.0)
    result = run_load(args, tmp, url, connections, args.duration)
    user1, sys1 = common.cpu_times(proxy.pid) if proxy else (0.0, 0.0)
    cpu = (user1 - user0) + (sys1 - sys0) if proxy else None
    round_trips = store_cpu = None
    if store is not None:
        store_cpu = common.cpu_seconds(store.pid) - store_cpu0
        time.sleep(0.5)  # settles of the last answers run after them
        served = max(result.requests - result.errors, 1)
        round_trips = (scripts_run(store.url) - scripts0) / served
        store_cpu = store_cpu / served * 1e6
    after = common.loadavg()
    return Case(
        scenario=scenario, target=target, repeat=repeat, connections=connections,
        rps=result.rps, p50_ms=result.p50_ms, p90_ms=result.p90_ms, p99_ms=result.p99_ms,
        max_ms=result.max_ms, requests=result.requests, errors=result.errors,
        duration_s=result.duration_s, proxy_cpu_s=cpu,
        proxy_cpu_us_per_req=cpu / result.requests * 1e6 if cpu is not None else None,
        proxy_cpu_percent=cpu / result.duration_s * 100 if cpu is not None else None,
        proxy_sys_us_per_req=(sys1 - sys0) / result.requests * 1e6 if proxy else None,
        load_before=before, load_after=after,
        redis_round_trips_per_req=round_trips, redis_cpu_us_per_req=store_cpu,
    )


@contextlib.contextmanager
def services(args: argparse.Namespace, tmp: Path, nginx: bool,
             delay_s: float) -> Iterator[dict[str, Service]]:
    """Upstream and every proxy target of one scenario, by name; all stopped on the way out."""
    with common.stopping() as live:
        if nginx:
            upstream = start_nginx(args.nginx, tmp)
        else:
            upstream = common.start_upstream(tmp, delay_s, name=f"upstream-{delay_s:g}s")
        live.append(upstream)
        found = {"upstream": upstream}
        metered = args.state == "redis"
        if "sluice" in args.targets:
            found["sluice"] = common.start_sluice(tmp, sluice_config(upstream, metered))
            live.append(found["sluice"])
        if "sluice-redis" in args.targets:
            store = found["redis"] = start_redis(tmp)
            live.append(store)
            state = {"backend": "redis", "redis_url": store.url, "key_prefix": "bench"}
            found["sluice-redis"] = common.start_sluice(
                tmp, sluice_config(upstream, metered, state), name="sluice-redis")
            live.append(found["sluice-redis"])
        for name, start in STANDALONE.items():
            if name in args.targets:
                found[name] = start(tmp, upstream)
                live.append(found[name])
        if "haproxy" in args.targets:
            found["haproxy"] = start_haproxy(args.haproxy, tmp, upstream)
            live.append(found["haproxy"])
        yield found


def run_scenario(args: argparse.Namespace, scenario: str, root: Path,
                 scripts: dict[str, dict[str, float]]) -> tuple[list[Case], dict | None]:
    """Every repeat of every target, then the profile run if asked; returns both. With a
    ``sluice-redis`` target, ``scripts[scenario]`` gets the scripts per call by name."""
    if scenario == "fast":
        nginx, delay_s, connections = args.upstream == "nginx", 0.0, args.connections
    else:
        nginx, delay_s, connections = False, args.slow_delay, args.slow_connections
    tmp = root / scenario
    tmp.mkdir()
    cases: list[Case] = []
    with services(args, tmp, nginx, delay_s) as found:
        upstream = found["upstream"]
        sluice = found.get("sluice")
        for repeat in range(1, args.repeat + 1):
            direct: Case | None = None
            for target in args.targets:
                proxy = found.get(target)
                is_sluice = target.startswith("sluice")
                counts0 = common.sluice_counters(proxy.admin) if is_sluice else {}
                url = (upstream.url if target == "direct" else proxy.url) + UPSTREAM_PATH
                downs0 = proxy.log.read_text().count(DOWN_LINE) if is_sluice else 0
                case = measure(args, tmp, scenario, target, repeat, url, connections,
                               None if target == "direct" else proxy,
                               found.get("redis") if target == "sluice-redis" else None)
                if target == "sluice-redis":
                    case.redis_marked_down = proxy.log.read_text().count(DOWN_LINE) - downs0
                if is_sluice:
                    case.sluice_counts = common.counter_delta(
                        counts0, common.sluice_counters(proxy.admin))
                if target == "direct":
                    direct = case
                elif direct is not None:
                    case.vs_direct = case.rps / direct.rps
                    case.added_p50_ms = case.p50_ms - direct.p50_ms
                    case.added_p99_ms = case.p99_ms - direct.p99_ms
                cases.append(case)
                print(f"  {scenario:<5} {target:<8} #{repeat}: {case.rps:,.0f} req/s, "
                      f"p50 {case.p50_ms:.2f} ms", file=sys.stderr, flush=True)
        if "sluice-redis" in found:
            scripts[scenario] = monitored_scripts(found["redis"].url, found["sluice-redis"],
                                                  MONITORED_CALLS)
        profile = None
        if args.profile and sluice is not None:
            raw = args.output.with_name(f"{args.output.stem}-{scenario}-sluice-pyspy.txt")
            profile = profile_sluice(args, tmp, sluice, sluice.url + UPSTREAM_PATH,
                                     connections, raw)
            profile["scenario"] = scenario
            measured = [c.proxy_cpu_us_per_req for c in cases if c.target == "sluice"
                        and c.proxy_cpu_us_per_req is not None]
            if measured:
                profile["measured_us_per_req"] = statistics.median(measured)
    return cases, profile


# -- profile -----------------------------------------------------------------------------------

PYSPY_RATE_HZ = 200
_LINE = re.compile(r":\d+\)$")


def profile_sluice(args: argparse.Namespace, tmp: Path, sluice: Service, url: str,
                   connections: int, raw: Path) -> dict:
    """Sample Sluice with py-spy under the scenario's load (not one of the measured cases).

    py-spy pauses the process for each sample (so stacks are exact), which slows it; the CPU
    time per request, read around the run, is used to turn sample shares into us/request.
    Pausing lands more often on a syscall's return than the time spent there warrants, so the
    ``transport.write`` line over-states the kernel's share: the system time from ``/proc``
    (reported beside it) is the true figure.
    """
    raw.parent.mkdir(parents=True, exist_ok=True)
    seconds = args.profile_seconds or args.duration
    spy = subprocess.Popen(
        [args.py_spy, "record", "--pid", str(sluice.pid), "--rate", str(PYSPY_RATE_HZ),
         "--duration", str(max(1, int(seconds) - 1)), "--format", "raw", "--output",
         str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    user0, sys0 = common.cpu_times(sluice.pid)
    result = run_load(args, tmp, url, connections, seconds)
    user1, sys1 = common.cpu_times(sluice.pid)
    cpu = (user1 - user0) + (sys1 - sys0)
    _, err = spy.communicate()
    if spy.returncode != 0 or not raw.exists():
        raise SystemExit(f"py-spy failed (root, or ptrace allowed, is needed):\n{err.decode()}")
    us_per_req = cpu / result.requests * 1e6
    summary = summarise_profile(raw, us_per_req)
    summary.update(raw=str(raw), cpu_us_per_req=us_per_req, rps_while_profiled=result.rps,
                   sys_us_per_req=(sys1 - sys0) / result.requests * 1e6)
    return summary


def _owner(frames: list[str]) -> str:
    """Who a sample's CPU time belongs to, from its stack (leaf last)."""
    leaf = frames[-1]
    if "_writelines (aiohttp/http_writer.py" in leaf or "write (aiohttp/http_writer.py" in leaf:
        return "in transport.write (the kernel's send; py-spy over-samples syscalls)"
    if leaf.startswith("Runner.run (asyncio/runners.py"):
        return "event loop (uvloop's C code: epoll, recv, callbacks)"
    for frame in reversed(frames):
        if "(proxy/" in frame or "(policies/" in frame:
            return "Sluice's own code (proxy/, policies/, with events and metrics)"
        if "(prometheus_client/" in frame or "(aiolimiter/" in frame or "(orjson" in frame:
            return "Sluice's own code (proxy/, policies/, with events and metrics)"
        if "(aiohttp/" in frame:
            client = any(f"(aiohttp/{m}" in f for f in frames
                         for m in ("client", "connector"))
            return "aiohttp client (request to the upstream)" if client else \
                "aiohttp server (request from the caller)"
    return "other (stdlib, outside any of the above)"


#: Parts of Sluice whose cost the profile reports on its own: a sample is theirs when any
#: frame of its stack is in one of their files (the C code they call, orjson's ``dumps`` or a
#: lock, shows as the self time of the frame that called it).
COMPONENTS = {
    "event log": ("(proxy/events.py",),
    "metrics": ("(prometheus_client/", "(proxy/metrics.py"),
}
#: A thread-pool worker waiting for work: py-spy samples it as if it were running.
_IDLE_LEAVES = frozenset({"_worker (concurrent/futures/thread.py)"})


def summarise_profile(raw: Path, us_per_req: float, top: int = 15) -> dict:
    """Shares of py-spy's collapsed stacks: by owner, the top functions by self time,
    Sluice's functions inclusive, and each of :data:`COMPONENTS` with its call sites (the
    caller of the first frame in the component's files). Idle thread-pool workers' samples
    are left out of the total (and counted in ``idle_samples``)."""
    total = idle = 0
    owners: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    parts: Counter[str] = Counter()
    sites: dict[str, Counter[str]] = {name: Counter() for name in COMPONENTS}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [_LINE.sub(")", f) for f in stack.split(";")]
        if frames[-1] in _IDLE_LEAVES:
            idle += n
            continue
        total += n
        owners[_owner(frames)] += n
        self_time[frames[-1]] += n
        for name in set(frames):
            if "(proxy/" in name or "(policies/" in name:
                inclusive[name] += n
        for part, files in COMPONENTS.items():
            first = next((i for i, f in enumerate(frames) if any(m in f for m in files)), None)
            if first is not None:
                parts[part] += n
                caller = frames[first - 1] if first else "?"
                sites[part][f"{caller} -> {frames[first]}"] += n

    def rows(counter: Counter[str], limit: int | None = None) -> list[dict]:
        return [{"name": k, "share": v / total, "us_per_req": v / total * us_per_req}
                for k, v in counter.most_common(limit)]

    # The entry points (cli, __main__, serve) hold every sample; they say nothing.
    sluice_frames = [r for r in rows(inclusive) if r["share"] < 0.99][:top]
    components = [{"name": part, "share": parts[part] / total,
                   "us_per_req": parts[part] / total * us_per_req,
                   "samples": parts[part], "sites": rows(sites[part], 6)}
                  for part in COMPONENTS]
    return {"samples": total, "idle_samples": idle, "owners": rows(owners),
            "self": rows(self_time, top), "sluice_inclusive": sluice_frames,
            "components": components}


def profile_report(profile: dict) -> list[str]:
    out = [f"py-spy profile of Sluice, {profile['scenario']} scenario: {profile['samples']} "
           f"samples at {PYSPY_RATE_HZ} Hz, {profile['cpu_us_per_req']:.0f} us CPU/req while "
           f"sampled ({profile['rps_while_profiled']:,.0f} req/s, slowed by the sampling), "
           f"of which {profile['sys_us_per_req']:.0f} us in the kernel (/proc); "
           f"{profile.get('idle_samples', 0)} samples of idle thread-pool workers left out"]
    for title, key in (("where the CPU goes", "owners"), ("top functions, self time", "self"),
                       ("Sluice's functions, inclusive", "sluice_inclusive")):
        out.append(f"  {title}:")
        out += [f"    {r['share']:6.1%}  {r['us_per_req']:6.1f} us/req  {r['name']}"
                for r in profile[key]]
    # A share of a few percent rests on a few dozen samples: say how many.
    measured = profile.get("measured_us_per_req")
    out.append("  components, inclusive (samples; call sites below each):")
    for part in profile.get("components", []):
        at_measured = (f"; {part['share'] * measured:.1f} us/req of the {measured:.0f} measured "
                       "without sampling" if measured else "")
        out.append(f"    {part['share']:6.1%}  {part['us_per_req']:6.1f} us/req  {part['name']} "
                   f"({part['samples']} samples{at_measured})")
        out += [f"      {r['share']:6.1%}  {r['us_per_req']:6.1f} us/req  {r['name']}"
                for r in part["sites"]]
    out.append(f"  raw stacks: {profile['raw']}")
    return out


# -- report ------------------------------------------------------------------------------------


def table(cases: list[Case]) -> str:
    head = ("scenario", "path", "conns", "req/s", "vs direct", "p50 ms", "+p50 ms", "p99 ms",
            "+p99 ms", "proxy CPU us/req", "of which kernel", "proxy CPU %", "Redis RT/req",
            "Redis CPU us/req", "errors", "load1 before→after")
    rows = [head]
    for c in cases:
        label = c.target if c.repeat == 1 and not _repeated(cases) else f"{c.target} #{c.repeat}"
        rows.append((
            c.scenario, label, str(c.connections), f"{c.rps:,.0f}", common.fmt(c.vs_direct, ".1%"),
            f"{c.p50_ms:.2f}", common.fmt(c.added_p50_ms, "+.2f"), f"{c.p99_ms:.2f}",
            common.fmt(c.added_p99_ms, "+.2f"),
            common.fmt(c.proxy_cpu_us_per_req, ".0f"), common.fmt(c.proxy_sys_us_per_req, ".0f"),
            common.fmt(c.proxy_cpu_percent, ".0f"), common.fmt(c.redis_round_trips_per_req, ".2f"),
            common.fmt(c.redis_cpu_us_per_req, ".0f"),
            str(c.errors), f"{c.load_before[0]:.2f}→{c.load_after[0]:.2f}",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for n, r in enumerate(rows):
        cells = (cell.ljust(w) if i < 2 else cell.rjust(w)
                 for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
        lines.append("| " + " | ".join(cells) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _repeated(cases: list[Case]) -> bool:
    return any(c.repeat > 1 for c in cases)


def summary(cases: list[Case]) -> list[str]:
    """Medians over repeats of the figures the issue asks about, per scenario."""
    out = []
    for scenario in dict.fromkeys(c.scenario for c in cases):
        def med(target: str, attr: str, scenario: str = scenario) -> float | None:
            values = [getattr(c, attr) for c in cases
                      if c.scenario == scenario and c.target == target
                      and getattr(c, attr) is not None]
            return statistics.median(values) if values else None

        for target in ("sluice", "sluice-redis", "baseline", "floor", "haproxy"):
            cpu = med(target, "proxy_cpu_us_per_req")
            if cpu is None:
                continue
            trips = med(target, "redis_round_trips_per_req")
            redis_part = "" if trips is None else (
                f", {trips:.2f} Redis round trips per call (Redis CPU "
                f"{common.fmt(med(target, 'redis_cpu_us_per_req'), '.0f')} us/req; backend "
                f"marked down {med(target, 'redis_marked_down'):.0f} times)")
            out.append(
                f"{scenario}: {target} serves {common.fmt(med(target, 'vs_direct'), '.1%')} of "
                f"direct's req/s, adds {common.fmt(med(target, 'added_p50_ms'), '+.2f')} ms at "
                f"p50 and {common.fmt(med(target, 'added_p99_ms'), '+.2f')} ms at p99, costs "
                f"{cpu:.0f} us of proxy CPU per request{redis_part}"
            )
        b = med("baseline", "proxy_cpu_us_per_req")
        for target, whose in (("sluice", "Sluice's"), ("floor", "The floor's")):
            s = med(target, "proxy_cpu_us_per_req")
            if s is None or b is None:
                continue
            # Each repeat's target against the baseline measured in the same repeat: the
            # machine's speed drifts between repeats far more than within one.
            paired = _paired_ratios(cases, scenario, target)
            per_repeat = (f"; per repeat {', '.join(f'{r:.2f}' for r in paired)}, median "
                          f"{statistics.median(paired):.2f}x" if len(paired) > 1 else "")
            out.append(f"{scenario}: {whose} own share over the bare aiohttp proxy: "
                       f"{s - b:+.0f} us/req ({s / b:.2f}x{per_repeat})")
    return out


def _paired_ratios(cases: list[Case], scenario: str, target: str = "sluice") -> list[float]:
    """``target``'s CPU per request over the baseline's, repeat by repeat."""
    cpu = {(c.target, c.repeat): c.proxy_cpu_us_per_req for c in cases
           if c.scenario == scenario and c.proxy_cpu_us_per_req}
    return [cpu[(target, r)] / cpu[("baseline", r)]
            for r in sorted({r for _, r in cpu})
            if (target, r) in cpu and ("baseline", r) in cpu]




def plot(cases: list[Case], path: Path) -> Path | None:
    """Proxy CPU per request and added p50 per target and scenario (medians over repeats)."""
    plt = common.pyplot()
    if plt is None:
        return None
    scenarios = list(dict.fromkeys(c.scenario for c in cases))
    targets = [t for t in TARGETS[1:] if any(c.target == t for c in cases)]
    colours = {"sluice": "#1f77b4", "baseline": "#7f7f7f", "haproxy": "#2ca02c",
               "sluice-redis": "#d62728", "floor": "#9467bd"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    width = 0.8 / max(len(targets), 1)
    for n, target in enumerate(targets):
        for ax, attr in zip(axes, ("proxy_cpu_us_per_req", "added_p50_ms"), strict=True):
            values = []
            for scenario in scenarios:
                found = [getattr(c, attr) for c in cases if c.scenario == scenario
                         and c.target == target and getattr(c, attr) is not None]
                values.append(statistics.median(found) if found else 0.0)
            ax.bar([i + n * width for i in range(len(scenarios))], values, width,
                   color=colours[target], label=target)
    for ax, title in zip(axes, ("proxy CPU per request, us", "p50 added over direct, ms"),
                         strict=True):
        ax.set_xticks([i + width * (len(targets) - 1) / 2 for i in range(len(scenarios))],
                      scenarios)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].axhline(150, color="grey", lw=0.8, ls="--")
    axes[1].axhline(1, color="grey", lw=0.8, ls="--")
    axes[0].legend(fontsize=8)
    fig.suptitle("Overhead: fast upstream (16 conns) and 50 ms upstream (64 conns); dashed: "
                 "targets", fontsize=9)
    fig.tight_layout()
    return common.save_plot(plt, fig, path)


def tool_versions(args: argparse.Namespace) -> dict[str, str]:
    """Versions of the tools a case used besides Python's: wrk, nginx, HAProxy."""
    out = {}
    if args.wrk:
        r = subprocess.run([args.wrk, "-v"], capture_output=True, text=True)
        first = (r.stdout + r.stderr).split()  # "wrk debian/4.1.0-3+b2 [epoll] Copyright..."
        out["wrk"] = " ".join(first[:2]) if first else "wrk"
    if args.upstream == "nginx":
        r = subprocess.run([args.nginx, "-v"], capture_output=True, text=True)
        out["nginx"] = r.stderr.strip().removeprefix("nginx version: ")
    if "haproxy" in args.targets:
        r = subprocess.run([args.haproxy, "-v"], capture_output=True, text=True)
        out["haproxy"] = r.stdout.split()[2] if r.stdout.split()[2:] else "?"
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser("overhead", __doc__)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per case (10)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first (2)")
    p.add_argument("--threads", type=int, default=2, help="load generator threads (2)")
    p.add_argument("--connections", type=int, default=16, help="fast scenario (16)")
    p.add_argument("--slow-connections", type=int, default=64, help="slow scenario (64)")
    p.add_argument("--slow-delay", type=float, default=0.05, help="slow upstream, s (0.05)")
    p.add_argument("--scenarios", default="fast,slow", help="fast,slow")
    p.add_argument("--targets",
                   help="direct,sluice,baseline,haproxy (the default; direct first, for the "
                   "'vs direct' columns; haproxy only when installed); with --state redis "
                   "direct,sluice,sluice-redis; floor (bench/floor.py) only when named")
    p.add_argument("--state", choices=("memory", "redis"), default="memory",
                   help="redis: also run Sluice on the Redis backend (its own redis-server), "
                   "every call metered; report Redis round trips per call")
    p.add_argument("--repeat", type=int, default=1, help="runs of every case, interleaved (1)")
    p.add_argument("--upstream", choices=("auto", "nginx", "aiohttp"), default="auto",
                   help="fast upstream: nginx if installed (auto), or bench/upstream.py")
    p.add_argument("--loadgen", choices=("auto", "wrk", "python"), default="auto",
                   help="wrk if installed (auto), or bench/loadgen.py")
    p.add_argument("--sdk-headers", action="store_true",
                   help="also send the ~12 headers the openai SDK adds (default: 3 headers)")
    p.add_argument("--profile", action="store_true",
                   help="also sample Sluice with py-spy under each scenario's load")
    p.add_argument("--profile-seconds", type=float,
                   help="length of the profiled run, s (--duration); longer gives the small "
                   "shares more samples")
    p.add_argument("--quick", action="store_true", help="3 s per case after 1 s of warm-up")
    p.add_argument("--output", type=Path, help="JSON result path (bench/results/...)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.warmup = 3.0, 1.0
    args.scenarios = common.comma_list(p, args.scenarios, ("fast", "slow"), "scenario")
    if args.targets is None:
        args.targets = ",".join(REDIS_TARGETS if args.state == "redis" else TARGETS[:4])
    args.targets = common.comma_list(p, args.targets, TARGETS, "target")
    args.headers = REQUEST_HEADERS | (SDK_HEADERS if args.sdk_headers else {})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM unwinds like ^C, so every child process is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = common.utcnow()
    args.output = common.result_path("overhead", started, output=args.output)
    if args.profile:
        args.py_spy = shutil.which("py-spy") or shutil.which(
            "py-spy", path=str(Path(sys.executable).parent))
        if args.py_spy is None:
            raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    args.wrk = common.find_wrk() if args.loadgen != "python" else None
    if args.wrk is None:
        if args.loadgen == "wrk":
            raise SystemExit("wrk is not installed: apt-get update && apt-get install -y wrk")
        print("NOTE: wrk not found (install it: apt-get update && apt-get install -y wrk); "
              "falling back to bench/loadgen.py, which is slower and shares the proxy's cores: "
              "compare its figures only with each other, not with wrk's.", file=sys.stderr)
    # Debian puts nginx and haproxy in /usr/sbin, which a non-root PATH often lacks.
    args.nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    args.haproxy = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    if "haproxy" in args.targets and args.haproxy is None:
        args.targets.remove("haproxy")
        print("NOTE: haproxy is not installed (apt-get install -y haproxy): no haproxy target.",
              file=sys.stderr)
    if args.upstream == "auto":
        args.upstream = "nginx" if args.nginx else "aiohttp"
    elif args.upstream == "nginx" and not args.nginx:
        raise SystemExit("nginx is not installed: apt-get install -y nginx-light")
    if args.upstream == "aiohttp" and "fast" in args.scenarios:
        print("NOTE: fast upstream is bench/upstream.py (aiohttp); nginx (apt-get install -y "
              "nginx-light) leaves more of the shared cores to the proxy.", file=sys.stderr)

    load0 = common.loadavg()
    info = common.versions(tool_versions(args))
    loadgen = (f"{info['wrk']}, {args.threads} threads" if args.wrk
               else f"bench/loadgen.py (aiohttp), {args.threads} processes")
    fast_up = (f"nginx {info.get('nginx', '')} (1 worker, return 200)"
               if args.upstream == "nginx" else "bench/upstream.py (aiohttp + uvloop)")
    header = [
        *common.machine_lines("Sluice overhead benchmark", started, info),
        f"load: {loadgen}, POST {len(REQUEST_BODY)} B chat completion with "
        f"{len(args.headers)} headers (+ Host, Content-Length), keep-alive, "
        f"{args.duration:g} s per case after {args.warmup:g} s warm-up",
        f"upstreams: fast = {fast_up}; slow = bench/upstream.py, {args.slow_delay * 1e3:g} ms "
        f"per answer",
    ]
    print("\n".join(header), file=sys.stderr, flush=True)

    cases: list[Case] = []
    profiles: list[dict] = []
    scripts: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as root:
        for scenario in args.scenarios:
            scenario_cases, profile = run_scenario(args, scenario, Path(root), scripts)
            cases += scenario_cases
            if profile:
                profiles.append(profile)
    load1 = common.loadavg()

    lines = [*header, f"load average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at end", "",
             table(cases), "", *summary(cases)]
    for c in cases:
        rejected = {k: v for k, v in c.sluice_counts.items() if k.startswith("rejected:")}
        if rejected or c.errors:
            lines.append(f"WARNING: {c.scenario} {c.target} #{c.repeat}: {c.errors} errors, "
                         f"Sluice rejections {rejected or 0}")
    for scenario, per_call in scripts.items():
        lines += ["", f"{scenario}: Redis scripts per call, by name ({MONITORED_CALLS} "
                      "sequential calls under MONITOR, unmeasured):"]
        lines += [f"  {count:5.2f}  {name}" for name, count in per_call.items()]
        lines.append(f"  {sum(per_call.values()):5.2f}  in all")
    for profile in profiles:
        lines += ["", *profile_report(profile)]
    print("\n".join(lines), flush=True)

    record = {
        "started": started.isoformat(), "load_average_start": load0, "load_average_end": load1,
        "versions": info,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "request_body_bytes": len(REQUEST_BODY), "cases": [asdict(c) for c in cases],
        "table": table(cases), "summary": summary(cases), "profiles": profiles,
        "redis_scripts_per_call": scripts,
    }
    common.write_record(args.output, record)
    print(f"\nfull record: {args.output}", file=sys.stderr)
    png = plot(cases, args.output.with_suffix(".png"))
    if png:
        print(f"plot: {png}", file=sys.stderr)
    return 0
