"""What every benchmark shares: processes, load generation, CPU sampling, tables, results.

* processes: :class:`Service` (a started process and its URL), :func:`spawn`,
  :func:`wait_ready`, :func:`start_upstream` (``bench/upstream.py``), :func:`start_sluice`
  (``python -m proxy serve`` on a config dict), :func:`sluice_counters` (``/metrics``);
* load: :func:`run_closed` (wrk, or ``bench/loadgen.py`` without it: N connections back to
  back) and :func:`run_open` (``bench/loadgen.py --rate``: requests sent on a fixed schedule
  whatever the answers, in as many processes as the rate needs);
* measurement: :func:`cpu_times` (``/proc/PID/stat``), :func:`loadavg`, :func:`percentile`;
* reporting: :func:`machine_lines` (cores, load average, versions), :func:`table`,
  :func:`write_record` (``bench/results/<name>-<UTC time>.json``) and :func:`pyplot`
  (matplotlib if installed, else ``None`` and a note saying the plot is skipped).

Every process binds 127.0.0.1 only, and every :class:`Service` is stopped on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
STARTUP_TIMEOUT_S = 20.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

#: The request every benchmark sends (131 bytes), as the openai SDK would for a one-line prompt.
REQUEST_BODY = (
    '{"model":"gpt-4o-mini","messages":[{"role":"user","content":'
    '"Say hello in one short sentence, please."}],"max_tokens":16,"top_p":1}'
)
REQUEST_HEADERS = {
    "Content-Type": "application/json",
    "Authorization": "Bearer sk-bench-not-a-real-key",
    "X-Tenant-ID": "bench",
}
#: Path of the request at the upstream; proxies get it under ``/openai``.
UPSTREAM_PATH = "/v1/chat/completions"
PROXY_PREFIX = "/openai"
#: Open-loop requests one ``bench/loadgen.py`` process is asked to send per second at most.
OPEN_LOOP_RATE_PER_PROCESS = 600.0


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


def cpu_seconds(pid: int) -> float:
    user, system = cpu_times(pid)
    return user + system


def loadavg() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return round(one, 2), round(five, 2), round(fifteen, 2)


@dataclass
class Service:
    """A background process a benchmark started, and where it listens."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str  # base URL requests are sent to
    log: Path
    admin: str = ""  # Sluice's admin URL

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


def spawn(name: str, argv: list[str], tmp: Path, url: str) -> Service:
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                stdin=subprocess.DEVNULL)
    return Service(name, proc, url, log)


def wait_ready(service: Service, probe_url: str, method: str = "GET",
               timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Poll ``probe_url`` until it answers (any HTTP status) or the process dies; at most
    ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        if service.proc.poll() is not None:
            raise SystemExit(f"{service.name} exited at startup:\n{service.log.read_text()}")
        data = REQUEST_BODY.encode() if method == "POST" else None
        req = urllib.request.Request(probe_url, data=data, method=method,
                                     headers=REQUEST_HEADERS)
        try:
            with urllib.request.urlopen(req, timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{service.name} not ready after {timeout_s:g}s")
        time.sleep(0.05)


@contextlib.contextmanager
def stopping() -> Iterator[list[Service]]:
    """A list to put started services in; every one is stopped, last first, on the way out."""
    started: list[Service] = []
    try:
        yield started
    finally:
        for service in reversed(started):
            service.stop()


def start_upstream(tmp: Path, delay_s: float = 0.0, slots: int = 0,
                   name: str = "upstream") -> Service:
    """``bench/upstream.py``: answers after ``delay_s``, ``slots`` at once (0 = no limit)."""
    port = free_port()
    argv = [sys.executable, str(HERE / "upstream.py"), "--port", str(port), "--delay",
            str(delay_s), "--slots", str(slots)]
    service = spawn(name, argv, tmp, f"http://127.0.0.1:{port}")
    wait_ready(service, service.url + "/_stats")
    return service


def start_sluice(tmp: Path, config: dict, name: str = "sluice",
                 prefix: str = PROXY_PREFIX, wrapper: Sequence[str] = (),
                 timeout_s: float = STARTUP_TIMEOUT_S) -> Service:
    """``python -m proxy serve`` (the ``sluice`` CLI) from this checkout on ``config``.

    ``server.listen``/``admin_listen`` and ``events.path`` are filled in (free loopback
    ports, a file in ``tmp``) unless given. Run from the repository so it measures the code
    beside this script even when an installed ``sluice`` points elsewhere. ``wrapper``: a
    command it runs under (e.g. valgrind); ``timeout_s``: how long it may take to be ready.
    """
    config = json.loads(json.dumps(config))
    server = config.setdefault("server", {})
    server.setdefault("listen", f"127.0.0.1:{free_port()}")
    server.setdefault("admin_listen", f"127.0.0.1:{free_port()}")
    server.setdefault("drain_timeout", "2s")
    config.setdefault("events", {"path": str(tmp / f"{name}-events.jsonl")})
    config.setdefault("dead_letter", {"path": str(tmp / f"{name}-dlq.sqlite")})
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    service = spawn(name, [*wrapper, sys.executable, "-m", "proxy", "serve", "--config",
                           str(path)], tmp, f"http://{server['listen']}{prefix}")
    service.admin = f"http://{server['admin_listen']}"
    wait_ready(service, service.admin + "/readyz", timeout_s=timeout_s)
    return service


def sluice_counters(admin: str) -> dict[str, float]:
    """Sluice's counters so far, summed over routes: ``outcome:X``, ``rejected:REASON``,
    ``upstream_attempts``, ``retries``, ``replays``..."""
    with urllib.request.urlopen(admin + "/metrics", timeout=5) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    names = {"sluice_upstream_attempts_total": "upstream_attempts",
             "sluice_work_units_total": "work_units", "sluice_retries_total": "retries",
             "sluice_idempotent_replays_total": "replays"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sluice_requests_total":
                key = f"outcome:{s.labels['outcome']}"
            elif s.name == "sluice_rejections_total":
                key = f"rejected:{s.labels['reason']}"
            elif s.name in names:
                key = names[s.name]
            else:
                continue
            counts[key] = counts.get(key, 0.0) + s.value
    return counts


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


# -- load ------------------------------------------------------------------------------------


@dataclass
class Load:
    """What one closed-loop load run measured."""

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


#: wrk's ``done()`` hook: one ``BENCH_JSON {...}`` line with the counts and percentiles.
WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""
WRK_POST = """
wrk.method = "POST"
wrk.body = [==[{body}]==]
{headers}
"""


def find_wrk() -> str | None:
    return shutil.which("wrk")


def run_wrk(wrk: str, url: str, threads: int, connections: int, duration_s: float, tmp: Path,
            headers: dict[str, str] = REQUEST_HEADERS, script: str | None = None) -> Load:
    """wrk for ``duration_s`` seconds; ``script`` (Lua) replaces the default POST of
    :data:`REQUEST_BODY` with ``headers``; :data:`WRK_DONE` is added to it either way."""
    path = tmp / f"wrk-{os.getpid()}-{time.monotonic_ns()}.lua"
    if script is None:
        lua_headers = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
        script = WRK_POST.format(body=REQUEST_BODY, headers=lua_headers)
    path.write_text(script + WRK_DONE)
    argv = [wrk, f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s", "--timeout", "10s",
            "-s", str(path), url]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    finally:
        path.unlink()
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


def run_python_closed(url: str, threads: int, connections: int, duration_s: float,
                      headers: dict[str, str] = REQUEST_HEADERS) -> Load:
    """``bench/loadgen.py``, one process per ``thread``, ``connections`` shared among them."""
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
    return Load(
        requests=len(latencies), duration_s=max(r["duration_s"] for r in records),
        errors=sum(r["errors"] + r["status_errors"] for r in records),
        p50_ms=percentile(latencies, 0.50) / 1e3, p90_ms=percentile(latencies, 0.90) / 1e3,
        p99_ms=percentile(latencies, 0.99) / 1e3, max_ms=latencies[-1] / 1e3,
    )


def run_closed(wrk: str | None, url: str, threads: int, connections: int, duration_s: float,
               tmp: Path, headers: dict[str, str] = REQUEST_HEADERS) -> Load:
    """Closed-loop load: wrk when ``wrk`` is its path, else ``bench/loadgen.py``."""
    if wrk:
        return run_wrk(wrk, url, threads, connections, duration_s, tmp, headers)
    return run_python_closed(url, threads, connections, duration_s, headers)


@dataclass
class Sent:
    """One open-loop request: when it was due, how late it left, and what came back."""

    due_s: float  # seconds after the run's start
    lag_s: float  # how late it was sent
    latency_s: float
    status: int  # 0 when no answer (see ``outcome``)
    outcome: str  # "ok", the X-Sluice-Reason, "status:N", "timeout" or "error"
    tenant: str = ""


def run_open(url: str, rate: float, duration_s: float, timeout_s: float,
             headers: dict[str, str] = REQUEST_HEADERS, tenant: str = "") -> subprocess.Popen:
    """Start open-loop load in the background; :func:`collect_open` waits for its records.

    Requests are due every ``1 / rate`` seconds for ``duration_s`` seconds, spread over as
    many ``bench/loadgen.py --rate`` processes as ``rate`` needs (each sends at most
    :data:`OPEN_LOOP_RATE_PER_PROCESS`/s, interleaved with the others).
    """
    processes = max(1, math.ceil(rate / OPEN_LOOP_RATE_PER_PROCESS))
    argv = [sys.executable, str(HERE / "loadgen.py"), "--url", url, "--body", REQUEST_BODY,
            "--duration", str(duration_s), "--rate", str(rate), "--timeout", str(timeout_s),
            "--processes", str(processes)]
    for k, v in (headers | ({"X-Tenant-ID": tenant} if tenant else {})).items():
        argv += ["--header", f"{k}: {v}"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=REPO)


def collect_open(proc: subprocess.Popen, tenant: str = "") -> list[Sent]:
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"bench/loadgen.py failed (exit {proc.returncode})")
    return [Sent(*row, tenant=tenant) for row in json.loads(out)["sent"]]


# -- numbers and reports ---------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``, which must be sorted and non-empty."""
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def pct(values: Sequence[float], q: float) -> float | None:
    """Like :func:`percentile` on unsorted values; ``None`` when there are none."""
    return percentile(sorted(values), q) if values else None


def versions(extra: dict[str, str] | None = None) -> dict[str, str]:
    import uvloop

    out = {"python": platform.python_version(), "aiohttp": aiohttp.__version__,
           "uvloop": uvloop.__version__}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "proxy",
                                "policies"], capture_output=True, text=True).stdout.strip()
        out["sluice_commit"] = rev + ("+dirty" if dirty else "")
    return out | (extra or {})


def machine_lines(title: str, started: datetime.datetime, info: dict[str, str]) -> list[str]:
    """The header every benchmark prints: what ran, on what, how loaded the machine was."""
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0))
    load = loadavg()
    lines = [
        f"{title}, {started:%Y-%m-%d %H:%M} UTC, Sluice {info.get('sluice_commit', '?')}",
        f"machine: {cores} cores ({usable} usable), load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} at start",
        "versions: " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "sluice_commit"),
    ]
    if cores and load[0] > 0.5 * cores:
        lines.append(f"WARNING: load average {load[0]:.2f} on {cores} cores before starting: "
                     "other work shares the machine; prefer CPU us/req over req/s and latency, "
                     "or use --repeat")
    return lines


def table(rows: Sequence[Sequence[str]], left: int = 2) -> str:
    """A Markdown table; the first row is the header, the first ``left`` columns align left."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, r in enumerate(rows):
        cells = (cell.ljust(w) if i < left else cell.rjust(w)
                 for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
        lines.append("| " + " | ".join(cells) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def result_path(name: str, started: datetime.datetime, suffix: str = ".json",
                output: Path | None = None) -> Path:
    """``bench/results/<name>-<UTC time><suffix>``, or ``output`` with ``suffix``."""
    if output is not None:
        return output.with_suffix(suffix)
    return RESULTS / f"{name}-{started:%Y%m%dT%H%M%SZ}{suffix}"


def write_record(path: Path, record: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def pyplot() -> ModuleType | None:
    """matplotlib's pyplot on the Agg backend, or ``None`` (with a note) when not installed."""
    try:
        import matplotlib
    except ImportError:
        print("NOTE: matplotlib is not installed (.venv/bin/pip install -e '.[bench]'): no plot.",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(plt: ModuleType, fig: object, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)  # type: ignore[attr-defined]
    plt.close(fig)
    return path


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The argument parser of ``python -m bench NAME``: the module docstring's first paragraph
    is its description, the rest its epilog."""
    return argparse.ArgumentParser(prog=f"python -m bench {name}",
                                   description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=doc.split("\n\n", 1)[1])


def comma_list(p: argparse.ArgumentParser, value: str, allowed: Iterable[str],
               what: str) -> list[str]:
    """``value`` split on commas; a name not in ``allowed`` is a usage error naming it."""
    names = [name for name in value.split(",") if name]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        p.error(f"unknown {what}: {', '.join(unknown)} (choose from {', '.join(allowed)})")
    return names


def add_queue_args(p: argparse.ArgumentParser) -> None:
    """The options of a scenario with a slotted upstream and a Sluice queue in front of it."""
    p.add_argument("--timeout", type=float, default=2.0, help="client timeout, s (2)")
    p.add_argument("--slots", type=int, default=8, help="upstream slots = Sluice limit (8)")
    p.add_argument("--delay", type=float, default=0.05, help="upstream service time, s (0.05)")
    p.add_argument("--queue", type=int, default=8, help="Sluice queue places (8)")
    p.add_argument("--max-wait", type=float, default=0.1, help="Sluice max_wait, s (0.1)")


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
