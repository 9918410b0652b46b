"""What Sluice costs per request: the same load direct, through Sluice, and through a bare proxy.

In one run, for each scenario, the same closed-loop load (POST of a ~130-byte chat-completion
request, keep-alive) goes to three targets:

* ``direct``: straight to the upstream;
* ``sluice``: through a real ``sluice serve`` subprocess (``python -m proxy serve`` from this
  checkout), on the default config (``config/sluice.yaml``) with its ``openai`` route pointed at
  the upstream and its concurrency and rate policies set generously, so they run on every
  request but never refuse;
* ``baseline``: through ``bench/passthrough.py``, a bare aiohttp + uvloop pass-through proxy
  with no policies, so "Sluice minus baseline" is what Sluice itself adds.

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
to stdout, and the full record (settings, versions, load averages, every case) to
``bench/results/overhead-<UTC time>.json``.

With ``--profile`` (needs ``pip install py-spy``), each scenario ends with one more,
unmeasured, run of the load through Sluice while py-spy samples it; the raw stacks are saved
beside the JSON record, and a summary (where the CPU goes, and the costliest functions, in us
per request) is printed under the table.

    python bench/overhead.py                      # both scenarios, 10 s per case
    python bench/overhead.py --duration 5 --repeat 3 --scenarios fast
    python bench/overhead.py --scenarios fast --targets sluice --profile
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import uvloop
import yaml
from prometheus_client.parser import text_string_to_metric_families
from upstream import COMPLETION  # bench/upstream.py: nginx answers the same body

from proxy.config import StrictLoader

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
DEFAULT_CONFIG = REPO / "config" / "sluice.yaml"

#: The request every case sends (131 bytes), as the openai SDK would for a one-line prompt.
REQUEST_BODY = (
    '{"model":"gpt-4o-mini","messages":[{"role":"user","content":'
    '"Say hello in one short sentence, please."}],"max_tokens":16,"top_p":1}'
)
REQUEST_HEADERS = {
    "Content-Type": "application/json",
    "Authorization": "Bearer sk-bench-not-a-real-key",
    "X-Tenant-ID": "bench",
}
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
#: Path of the request at the upstream; Sluice and the baseline get it under ``/openai``.
UPSTREAM_PATH = "/v1/chat/completions"
PROXY_PREFIX = "/openai"
STARTUP_TIMEOUT_S = 20.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [==[{body}]==]
{headers}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {{"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""

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


# -- processes -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU time of process ``pid`` (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK  # proc(5) fields 14, 15


def loadavg() -> tuple[float, float, float]:
    with open("/proc/loadavg") as f:
        one, five, fifteen = f.read().split()[:3]
    return float(one), float(five), float(fifteen)


@dataclass
class Service:
    """A background process the benchmark started, and where it listens."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str  # base URL requests are sent to
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _wait_ready(service: Service, probe_url: str, method: str = "GET") -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if service.proc.poll() is not None:
            raise SystemExit(f"{service.name} exited at startup:\n{service.log.read_text()}")
        try:
            data = REQUEST_BODY.encode() if method == "POST" else None
            req = urllib.request.Request(probe_url, data=data, method=method,
                                         headers=REQUEST_HEADERS)
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{service.name} not ready after {STARTUP_TIMEOUT_S}s")
        time.sleep(0.05)


def _spawn(name: str, argv: list[str], tmp: Path, url: str) -> Service:
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    return Service(name, proc, url, log)


def start_nginx(nginx: str, tmp: Path) -> Service:
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, body=COMPLETION.decode()))
    service = _spawn("nginx", [nginx, "-p", str(tmp), "-c", str(conf), "-e",
                               str(tmp / "nginx-error.log")], tmp, f"http://127.0.0.1:{port}")
    _wait_ready(service, service.url + UPSTREAM_PATH, "POST")
    return service


def start_aiohttp_upstream(tmp: Path, delay_s: float) -> Service:
    port = free_port()
    service = _spawn(f"upstream-{delay_s:g}s", [sys.executable, str(HERE / "upstream.py"),
                     "--port", str(port), "--delay", str(delay_s)], tmp,
                     f"http://127.0.0.1:{port}")
    _wait_ready(service, service.url + UPSTREAM_PATH, "POST")
    return service


def start_baseline(tmp: Path, upstream: Service) -> Service:
    port = free_port()
    service = _spawn("baseline", [sys.executable, str(HERE / "passthrough.py"), "--port",
                     str(port), "--upstream", upstream.url, "--prefix", PROXY_PREFIX], tmp,
                     f"http://127.0.0.1:{port}{PROXY_PREFIX}")
    _wait_ready(service, service.url + UPSTREAM_PATH, "POST")
    return service


def sluice_config(upstream: Service, port: int, admin_port: int, events: Path) -> dict:
    """``config/sluice.yaml`` with local ports, an event file, and ``openai`` sent upstream.

    The openai route keeps both policies but with limits no benchmark reaches: 1024 slots and
    queue places, ~100,000 requests/s per route and per tenant.
    """
    config = yaml.load(DEFAULT_CONFIG.read_text(), Loader=StrictLoader)
    config["server"]["listen"] = f"127.0.0.1:{port}"
    config["server"]["admin_listen"] = f"127.0.0.1:{admin_port}"
    config["server"]["drain_timeout"] = "2s"
    config["events"]["path"] = str(events)
    (route,) = (r for r in config["routes"] if r["name"] == "openai")
    route["upstream"] = upstream.url
    route["concurrency"] = {"limit": 1024, "queue": 1024, "max_wait": "5s", "per_tenant": 1024}
    route["rate"] = {"requests": "6000000/min", "per_tenant": {"requests": "6000000/min"}}
    return config


def start_sluice(tmp: Path, upstream: Service) -> tuple[Service, str]:
    """A ``sluice serve`` subprocess in front of ``upstream``; returns it and its admin URL."""
    port, admin_port = free_port(), free_port()
    path = tmp / "sluice.yaml"
    path.write_text(yaml.safe_dump(sluice_config(upstream, port, admin_port,
                                                 tmp / "events.jsonl")))
    # ``python -m proxy`` is ``sluice`` (SPEC); run from REPO it measures the code beside this
    # script even when the installed ``sluice`` points at another checkout.
    service = _spawn("sluice", [sys.executable, "-m", "proxy", "serve", "--config", str(path)], tmp,
                     f"http://127.0.0.1:{port}{PROXY_PREFIX}")
    admin = f"http://127.0.0.1:{admin_port}"
    _wait_ready(service, admin + "/readyz")
    _wait_ready(service, service.url + UPSTREAM_PATH, "POST")
    return service, admin


def sluice_counts(admin: str) -> dict[str, float]:
    """Requests by outcome and rejections by reason so far, from ``/metrics``."""
    with urllib.request.urlopen(admin + "/metrics", timeout=5) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sluice_requests_total" and s.labels.get("route") == "openai":
                counts[f"outcome:{s.labels['outcome']}"] = s.value
            elif s.name == "sluice_rejections_total" and s.value:
                counts[f"rejected:{s.labels['reason']}"] = s.value
    return counts


# -- load generation ---------------------------------------------------------------------------


@dataclass
class Load:
    """What one load run measured."""

    requests: int
    duration_s: float
    errors: int  # connect/read/write/timeout errors plus non-2xx/3xx answers
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s


def run_wrk(wrk: str, url: str, threads: int, connections: int, duration_s: float,
            tmp: Path, headers: dict[str, str] = REQUEST_HEADERS) -> Load:
    script = tmp / "post.lua"
    lua_headers = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
    script.write_text(WRK_SCRIPT.format(body=REQUEST_BODY, headers=lua_headers))
    argv = [wrk, f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s", "--timeout", "10s",
            "-s", str(script), url]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("BENCH_JSON ")), None)
    if line is None:
        raise SystemExit(f"wrk printed no result:\n{out}")
    r = json.loads(line.removeprefix("BENCH_JSON "))
    return Load(
        requests=r["requests"], duration_s=r["duration_us"] / 1e6,
        errors=r["connect"] + r["read"] + r["write"] + r["timeout"] + r["status"],
        p50_ms=r["p50_us"] / 1e3, p90_ms=r["p90_us"] / 1e3, p99_ms=r["p99_us"] / 1e3,
        max_ms=r["max_us"] / 1e3,
    )


def run_python_loadgen(url: str, threads: int, connections: int, duration_s: float,
                       headers: dict[str, str] = REQUEST_HEADERS) -> Load:
    shares = [connections // threads + (i < connections % threads) for i in range(threads)]
    argv = [sys.executable, str(HERE / "loadgen.py"), "--url", url, "--body", REQUEST_BODY,
            "--duration", str(duration_s)]
    for k, v in headers.items():
        argv += ["--header", f"{k}: {v}"]
    procs = [subprocess.Popen([*argv, "--connections", str(n)], stdout=subprocess.PIPE)
             for n in shares if n]
    records = [json.loads(p.communicate()[0]) for p in procs]
    latencies = sorted(lat for r in records for lat in r["latencies_us"])
    if not latencies:
        raise SystemExit("the load generator completed no request")

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] / 1e3

    return Load(
        requests=len(latencies), duration_s=max(r["duration_s"] for r in records),
        errors=sum(r["errors"] + r["status_errors"] for r in records),
        p50_ms=pct(0.50), p90_ms=pct(0.90), p99_ms=pct(0.99), max_ms=latencies[-1] / 1e3,
    )


# -- cases -------------------------------------------------------------------------------------


@dataclass
class Case:
    """One row of the table."""

    scenario: str
    target: str  # direct | sluice | baseline
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
    sluice_counts: dict[str, float] = field(default_factory=dict)


def run_load(args: argparse.Namespace, tmp: Path, url: str, connections: int,
             duration_s: float) -> Load:
    if args.wrk:
        return run_wrk(args.wrk, url, args.threads, connections, duration_s, tmp, args.headers)
    return run_python_loadgen(url, args.threads, connections, duration_s, args.headers)


def measure(args: argparse.Namespace, tmp: Path, scenario: str, target: str, repeat: int,
            url: str, connections: int, proxy: Service | None) -> Case:
    """Warm up, then run the load once with the proxy's CPU time read around it."""
    if args.warmup > 0:
        run_load(args, tmp, url, connections, args.warmup)
    before = loadavg()
    user0, sys0 = cpu_times(proxy.pid) if proxy else (0.0, 0.0)
    result = run_load(args, tmp, url, connections, args.duration)
    user1, sys1 = cpu_times(proxy.pid) if proxy else (0.0, 0.0)
    cpu = (user1 - user0) + (sys1 - sys0) if proxy else None
    after = loadavg()
    return Case(
        scenario=scenario, target=target, repeat=repeat, connections=connections,
        rps=result.rps, p50_ms=result.p50_ms, p90_ms=result.p90_ms, p99_ms=result.p99_ms,
        max_ms=result.max_ms, requests=result.requests, errors=result.errors,
        duration_s=result.duration_s, proxy_cpu_s=cpu,
        proxy_cpu_us_per_req=cpu / result.requests * 1e6 if cpu is not None else None,
        proxy_cpu_percent=cpu / result.duration_s * 100 if cpu is not None else None,
        proxy_sys_us_per_req=(sys1 - sys0) / result.requests * 1e6 if proxy else None,
        load_before=before, load_after=after,
    )


@dataclass
class Stack:
    """The processes of one scenario."""

    upstream: Service
    sluice: Service
    sluice_admin: str
    baseline: Service


@contextlib.contextmanager
def services(args: argparse.Namespace, tmp: Path, nginx: bool, delay_s: float) -> Iterator[Stack]:
    """Upstream, Sluice and baseline for one scenario; all stopped on the way out."""
    started: list[Service] = []
    try:
        if nginx:
            upstream = start_nginx(args.nginx, tmp)
        else:
            upstream = start_aiohttp_upstream(tmp, delay_s)
        started.append(upstream)
        sluice, admin = start_sluice(tmp, upstream)
        started.append(sluice)
        baseline = start_baseline(tmp, upstream)
        started.append(baseline)
        yield Stack(upstream, sluice, admin, baseline)
    finally:
        for service in reversed(started):
            service.stop()


def run_scenario(args: argparse.Namespace, scenario: str,
                 root: Path) -> tuple[list[Case], dict | None]:
    """Every repeat of every target, then the profile run if asked; returns both."""
    if scenario == "fast":
        nginx, delay_s, connections = args.upstream == "nginx", 0.0, args.connections
    else:
        nginx, delay_s, connections = False, args.slow_delay, args.slow_connections
    tmp = root / scenario
    tmp.mkdir()
    cases: list[Case] = []
    with services(args, tmp, nginx, delay_s) as stack:
        proxies = {"direct": None, "sluice": stack.sluice, "baseline": stack.baseline}
        urls = {"direct": stack.upstream.url, "sluice": stack.sluice.url,
                "baseline": stack.baseline.url}
        for repeat in range(1, args.repeat + 1):
            direct: Case | None = None
            for target in args.targets:
                counts0 = sluice_counts(stack.sluice_admin) if target == "sluice" else {}
                case = measure(args, tmp, scenario, target, repeat,
                               urls[target] + UPSTREAM_PATH, connections, proxies[target])
                if target == "sluice":
                    counts1 = sluice_counts(stack.sluice_admin)
                    case.sluice_counts = {k: v - counts0.get(k, 0.0) for k, v in counts1.items()
                                          if v - counts0.get(k, 0.0)}
                if target == "direct":
                    direct = case
                elif direct is not None:
                    case.vs_direct = case.rps / direct.rps
                    case.added_p50_ms = case.p50_ms - direct.p50_ms
                cases.append(case)
                print(f"  {scenario:<5} {target:<8} #{repeat}: {case.rps:,.0f} req/s, "
                      f"p50 {case.p50_ms:.2f} ms", file=sys.stderr, flush=True)
        profile = None
        if args.profile:
            raw = args.output.with_name(f"{args.output.stem}-{scenario}-sluice-pyspy.txt")
            profile = profile_sluice(args, tmp, stack.sluice, stack.sluice.url + UPSTREAM_PATH,
                                     connections, raw)
            profile["scenario"] = scenario
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
    spy = subprocess.Popen(
        [args.py_spy, "record", "--pid", str(sluice.pid), "--rate", str(PYSPY_RATE_HZ),
         "--duration", str(max(1, int(args.duration) - 1)), "--format", "raw", "--output",
         str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    user0, sys0 = cpu_times(sluice.pid)
    result = run_load(args, tmp, url, connections, args.duration)
    user1, sys1 = cpu_times(sluice.pid)
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


def summarise_profile(raw: Path, us_per_req: float, top: int = 15) -> dict:
    """Shares of py-spy's collapsed stacks: by owner, and the top functions by self time."""
    total = 0
    owners: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        owners[_owner(frames)] += n
        self_time[_LINE.sub(")", frames[-1])] += n
        for name in {_LINE.sub(")", f) for f in frames}:
            if "(proxy/" in name or "(policies/" in name:
                inclusive[name] += n

    def rows(counter: Counter[str], limit: int | None = None) -> list[dict]:
        return [{"name": k, "share": v / total, "us_per_req": v / total * us_per_req}
                for k, v in counter.most_common(limit)]

    # The entry points (cli, __main__, serve) hold every sample; they say nothing.
    sluice_frames = [r for r in rows(inclusive) if r["share"] < 0.99][:top]
    return {"samples": total, "owners": rows(owners), "self": rows(self_time, top),
            "sluice_inclusive": sluice_frames}


def profile_report(profile: dict) -> list[str]:
    out = [f"py-spy profile of Sluice, {profile['scenario']} scenario: {profile['samples']} "
           f"samples at {PYSPY_RATE_HZ} Hz, {profile['cpu_us_per_req']:.0f} us CPU/req while "
           f"sampled ({profile['rps_while_profiled']:,.0f} req/s, slowed by the sampling), "
           f"of which {profile['sys_us_per_req']:.0f} us in the kernel (/proc)"]
    for title, key in (("where the CPU goes", "owners"), ("top functions, self time", "self"),
                       ("Sluice's functions, inclusive", "sluice_inclusive")):
        out.append(f"  {title}:")
        out += [f"    {r['share']:6.1%}  {r['us_per_req']:6.1f} us/req  {r['name']}"
                for r in profile[key]]
    out.append(f"  raw stacks: {profile['raw']}")
    return out


# -- report ------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(cases: list[Case]) -> str:
    head = ("scenario", "path", "conns", "req/s", "vs direct", "p50 ms", "+p50 ms", "p99 ms",
            "proxy CPU us/req", "of which kernel", "proxy CPU %", "errors",
            "load1 before→after")
    rows = [head]
    for c in cases:
        label = c.target if c.repeat == 1 and not _repeated(cases) else f"{c.target} #{c.repeat}"
        rows.append((
            c.scenario, label, str(c.connections), f"{c.rps:,.0f}", _fmt(c.vs_direct, ".1%"),
            f"{c.p50_ms:.2f}", _fmt(c.added_p50_ms, "+.2f"), f"{c.p99_ms:.2f}",
            _fmt(c.proxy_cpu_us_per_req, ".0f"), _fmt(c.proxy_sys_us_per_req, ".0f"),
            _fmt(c.proxy_cpu_percent, ".0f"),
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

        for target in ("sluice", "baseline"):
            cpu = med(target, "proxy_cpu_us_per_req")
            if cpu is None:
                continue
            out.append(
                f"{scenario}: {target} serves {_fmt(med(target, 'vs_direct'), '.1%')} of direct's "
                f"req/s, adds {_fmt(med(target, 'added_p50_ms'), '+.2f')} ms at p50, "
                f"costs {cpu:.0f} us of proxy CPU per request"
            )
        s, b = med("sluice", "proxy_cpu_us_per_req"), med("baseline", "proxy_cpu_us_per_req")
        if s is not None and b is not None:
            out.append(f"{scenario}: Sluice's own share over the bare aiohttp proxy: "
                       f"{s - b:+.0f} us/req ({s / b:.2f}x)")
    return out


def versions(args: argparse.Namespace) -> dict[str, str]:
    out = {"python": platform.python_version(), "aiohttp": aiohttp.__version__,
           "uvloop": uvloop.__version__}
    if args.wrk:
        r = subprocess.run([args.wrk, "-v"], capture_output=True, text=True)
        first = (r.stdout + r.stderr).split()  # "wrk debian/4.1.0-3+b2 [epoll] Copyright..."
        out["wrk"] = " ".join(first[:2]) if first else "wrk"
    if args.upstream == "nginx":
        r = subprocess.run([args.nginx, "-v"], capture_output=True, text=True)
        out["nginx"] = r.stderr.strip().removeprefix("nginx version: ")
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "proxy",
                                "policies"], capture_output=True, text=True).stdout.strip()
        out["sluice_commit"] = rev + ("+dirty" if dirty else "")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per case (10)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first (2)")
    p.add_argument("--threads", type=int, default=2, help="load generator threads (2)")
    p.add_argument("--connections", type=int, default=16, help="fast scenario (16)")
    p.add_argument("--slow-connections", type=int, default=64, help="slow scenario (64)")
    p.add_argument("--slow-delay", type=float, default=0.05, help="slow upstream, s (0.05)")
    p.add_argument("--scenarios", default="fast,slow", help="fast,slow")
    p.add_argument("--targets", default="direct,sluice,baseline",
                   help="direct,sluice,baseline (direct first, for the 'vs direct' columns)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every case, interleaved (1)")
    p.add_argument("--upstream", choices=("auto", "nginx", "aiohttp"), default="auto",
                   help="fast upstream: nginx if installed (auto), or bench/upstream.py")
    p.add_argument("--loadgen", choices=("auto", "wrk", "python"), default="auto",
                   help="wrk if installed (auto), or bench/loadgen.py")
    p.add_argument("--sdk-headers", action="store_true",
                   help="also send the ~12 headers the openai SDK adds (default: 3 headers)")
    p.add_argument("--profile", action="store_true",
                   help="also sample Sluice with py-spy under each scenario's load")
    p.add_argument("--output", type=Path, help="JSON result path (bench/results/...)")
    args = p.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.targets = [t for t in args.targets.split(",") if t]
    args.headers = REQUEST_HEADERS | (SDK_HEADERS if args.sdk_headers else {})
    if set(args.scenarios) - {"fast", "slow"} or set(args.targets) - {"direct", "sluice",
                                                                        "baseline"}:
        p.error("unknown scenario or target")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM unwinds like ^C, so every child process is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = datetime.datetime.now(datetime.UTC)
    args.output = args.output or RESULTS / f"overhead-{started:%Y%m%dT%H%M%SZ}.json"
    if args.profile:
        args.py_spy = shutil.which("py-spy") or shutil.which(
            "py-spy", path=str(Path(sys.executable).parent))
        if args.py_spy is None:
            raise SystemExit("--profile needs py-spy: pip install py-spy")
    args.wrk = shutil.which("wrk") if args.loadgen != "python" else None
    if args.wrk is None:
        if args.loadgen == "wrk":
            raise SystemExit("wrk is not installed: apt-get update && apt-get install -y wrk")
        print("NOTE: wrk not found (install it: apt-get update && apt-get install -y wrk); "
              "falling back to bench/loadgen.py, which is slower and shares the proxy's cores: "
              "compare its figures only with each other, not with wrk's.", file=sys.stderr)
    # Debian puts nginx in /usr/sbin, which a non-root PATH often lacks.
    args.nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if args.upstream == "auto":
        args.upstream = "nginx" if args.nginx else "aiohttp"
    elif args.upstream == "nginx" and not args.nginx:
        raise SystemExit("nginx is not installed: apt-get install -y nginx-light")
    if args.upstream == "aiohttp" and "fast" in args.scenarios:
        print("NOTE: fast upstream is bench/upstream.py (aiohttp); nginx (apt-get install -y "
              "nginx-light) leaves more of the shared cores to the proxy.", file=sys.stderr)

    cores = os.cpu_count()
    affinity = len(os.sched_getaffinity(0))
    load0 = loadavg()
    info = versions(args)
    loadgen = (f"{info['wrk']}, {args.threads} threads" if args.wrk
               else f"bench/loadgen.py (aiohttp), {args.threads} processes")
    fast_up = (f"nginx {info.get('nginx', '')} (1 worker, return 200)"
               if args.upstream == "nginx" else "bench/upstream.py (aiohttp + uvloop)")
    header = [
        f"Sluice overhead benchmark, {started:%Y-%m-%d %H:%M} UTC, "
        f"Sluice {info.get('sluice_commit')}",
        f"machine: {cores} cores ({affinity} usable), load average {load0[0]:.2f} {load0[1]:.2f} "
        f"{load0[2]:.2f} at start",
        f"load: {loadgen}, POST {len(REQUEST_BODY)} B chat completion with "
        f"{len(args.headers)} headers (+ Host, Content-Length), keep-alive, "
        f"{args.duration:g} s per case after {args.warmup:g} s warm-up",
        f"upstreams: fast = {fast_up}; slow = bench/upstream.py, {args.slow_delay * 1e3:g} ms "
        f"per answer",
        f"python {info['python']}, aiohttp {info['aiohttp']}, uvloop {info['uvloop']}",
    ]
    if load0[0] > 0.5 * cores:
        header.append(f"WARNING: load average {load0[0]:.2f} on {cores} cores before starting: "
                      "other work shares the machine; trust CPU us/req over req/s, or --repeat")
    print("\n".join(header), file=sys.stderr, flush=True)

    cases: list[Case] = []
    profiles: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as root:
        for scenario in args.scenarios:
            scenario_cases, profile = run_scenario(args, scenario, Path(root))
            cases += scenario_cases
            if profile:
                profiles.append(profile)
    load1 = loadavg()

    lines = [*header, f"load average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at end", "",
             table(cases), "", *summary(cases)]
    for c in cases:
        rejected = {k: v for k, v in c.sluice_counts.items() if k.startswith("rejected:")}
        if rejected or c.errors:
            lines.append(f"WARNING: {c.scenario} {c.target} #{c.repeat}: {c.errors} errors, "
                         f"Sluice rejections {rejected or 0}")
    for profile in profiles:
        lines += ["", *profile_report(profile)]
    print("\n".join(lines), flush=True)

    out = args.output
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "started": started.isoformat(), "cores": cores, "usable_cores": affinity,
        "load_average_start": load0, "load_average_end": load1, "versions": info,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "request_body_bytes": len(REQUEST_BODY), "cases": [asdict(c) for c in cases],
        "table": table(cases), "summary": summary(cases), "profiles": profiles,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nfull record: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
