"""What Sluice costs per request, in instructions: a figure the machine's load does not move.

``overhead`` measures CPU time per request, which on a shared 2-core VM moves by +-30% between
runs (other work, steal, cache and frequency effects, how many requests share each loop turn),
so a change worth 5% cannot be seen in it. This benchmark counts the user-space instructions
each proxy executes per request instead: it runs the proxy under valgrind's callgrind
(``apt-get install -y valgrind``), with counting switched on (``callgrind_control -i on``)
only for the measured run, and divides the instructions counted by the requests wrk
completed. The count repeats to within ~1% for the same code and settings whatever else the
machine does; it leaves out the kernel (the socket calls, the same for every target: 2
``read`` and 2 ``write`` per request) and says nothing of cache misses, so it ranks code
paths, not wall time. Under callgrind a proxy runs ~50x slower, so each run is a few hundred
to a few thousand requests.

Targets (one nginx upstream, as ``overhead``'s fast scenario; wrk 1 thread):

* ``baseline``: ``bench/passthrough.py``, the bare aiohttp + uvloop pass-through proxy;
* ``floor``: ``bench/floor.py``, the baseline plus Sluice's per-request work written tight;
* ``sluice``: Sluice on ``overhead``'s config (``config/sluice.yaml``, every policy of the
  ``openai`` route on, with limits no run reaches);
* ``sluice-plain``: the same route with no policy blocks and ``protocol: http`` (no usage
  accounting): what the request path costs without its policies;
* ``sluice-no-BLOCK``: the ``sluice`` config without one block of the route (``concurrency``,
  ``rate``, ``idempotency``, ``circuit_breaker``, ``retry``), or ``sluice-no-usage`` with
  ``protocol: http`` instead of ``openai``: what that one policy costs.

The table gives instructions per request (thousands; all requests wrk completed, failed ones
included: the errors column should read 0) and the ratio to the baseline, which every run
measures; the record (settings, versions, Sluice's commit, load averages, every case) goes to
``bench/results/instructions-<UTC time>.json`` and, with matplotlib, a bar chart beside it.

    python -m bench instructions                  # baseline, sluice, sluice-plain (~2 min)
    python -m bench instructions --targets baseline,sluice,sluice-no-rate,sluice-no-usage
"""

from __future__ import annotations

import argparse
import copy
import datetime
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import common, overhead
from bench.common import UPSTREAM_PATH, Service

#: Route blocks a ``sluice-no-BLOCK`` target drops (``usage``: the protocol's accounting).
BLOCKS = ("concurrency", "rate", "idempotency", "circuit_breaker", "retry", "usage")
TARGETS = ("baseline", "floor", "sluice", "sluice-plain",
           *(f"sluice-no-{b}" for b in BLOCKS))
#: Seconds a proxy may take to start under valgrind.
STARTUP_TIMEOUT_S = 300.0


def target_config(upstream: Service, target: str) -> dict:
    """``overhead``'s Sluice config, with the route's blocks the target drops dropped."""
    config = copy.deepcopy(overhead.sluice_config(upstream))
    (route,) = (r for r in config["routes"] if r["name"] == "openai")
    if target == "sluice-plain":
        for block in BLOCKS:
            route.pop(block, None)
        route["protocol"] = "http"
    elif target == "sluice-no-usage":
        route.pop("usage", None)
        route["protocol"] = "http"
    elif target.startswith("sluice-no-"):
        route.pop(target.removeprefix("sluice-no-"))
    return config


def _counted(out: Path) -> int:
    """Instructions in callgrind's dumps named ``out*`` (counting was on only while
    measured, so the largest total is the measured run's)."""
    total = 0
    for dump in out.parent.glob(out.name + "*"):
        for line in dump.read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                total = max(total, int(line.split()[1]))
    return total


def _control(service: Service, *flags: str) -> None:
    subprocess.run(["callgrind_control", *flags, str(service.pid)], check=True,
                   capture_output=True)


def measure(args: argparse.Namespace, tmp: Path, upstream: Service, target: str) -> dict:
    """Start ``target`` under callgrind, warm it up, count one measured run."""
    out = tmp / f"{target}.callgrind"
    wrapper = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={out}"]
    if target in overhead.STANDALONE:
        service = overhead.STANDALONE[target](tmp, upstream, wrapper, STARTUP_TIMEOUT_S)
    else:
        service = common.start_sluice(tmp, target_config(upstream, target), target,
                                      wrapper=wrapper, timeout_s=STARTUP_TIMEOUT_S)
    try:
        url = service.url + UPSTREAM_PATH
        common.run_closed(args.wrk, url, 1, args.connections, args.warmup, tmp)
        _control(service, "-i", "on")
        load = common.run_closed(args.wrk, url, 1, args.connections, args.duration, tmp)
        _control(service, "-i", "off")
        _control(service, "-d")
    finally:
        service.stop()
    instructions = _counted(out)
    if load.requests <= load.errors or instructions == 0:
        raise SystemExit(f"{target}: nothing measured ({load.requests} requests, "
                         f"{load.errors} errors, {instructions} instructions)")
    return {"target": target, "requests": load.requests, "errors": load.errors,
            "instructions": instructions, "per_request": instructions / load.requests}


def plot(rows: list[dict], path: Path) -> Path | None:
    """A bar per target: thousands of instructions per request (``None`` without matplotlib)."""
    plt = common.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    names = [r["target"] for r in rows][::-1]
    values = [r["per_request"] / 1e3 for r in rows][::-1]
    ax.barh(names, values, color=["#999999" if n == "baseline" else "#3a7ebf" for n in names])
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:,.0f}k", va="center")
    ax.set_xlabel("thousand instructions per request (callgrind, user space)")
    ax.set_title("What each proxy runs per request")
    fig.tight_layout()
    return common.save_plot(plt, fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser("instructions", __doc__)
    p.add_argument("--targets", default="baseline,sluice,sluice-plain",
                   help=f"comma list of {', '.join(TARGETS)} (baseline,sluice,sluice-plain); "
                   "the baseline is always measured")
    p.add_argument("--duration", type=float, default=15.0,
                   help="seconds of the measured run (15; ~1,000-3,000 requests)")
    p.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds first (5)")
    p.add_argument("--connections", type=int, default=4, help="wrk connections (4)")
    p.add_argument("--quick", action="store_true", help="6 s counted after 2 s of warm-up")
    p.add_argument("--output", type=Path, help="JSON result path (bench/results/...)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.warmup = 6.0, 2.0
    args.targets = parse_targets(p, args.targets)
    return args


def parse_targets(p: argparse.ArgumentParser, value: str) -> list[str]:
    """``--targets``: names of :data:`TARGETS`, the baseline first whether named or not."""
    targets = common.comma_list(p, value, TARGETS, "target")
    if "baseline" not in targets:
        targets.insert(0, "baseline")
    return targets


def each_target(args: argparse.Namespace,
                measure: Callable[[argparse.Namespace, Path, Service, str], dict],
                describe: Callable[[dict], str]) -> list[dict]:
    """``measure(args, tmp, upstream, target)`` of every target in turn, one nginx upstream
    for them all; ``describe(row)`` is the progress line printed after each."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as name, \
            common.stopping() as services:
        tmp = Path(name)
        nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
        upstream = overhead.start_nginx(nginx, tmp)
        services.append(upstream)
        for target in args.targets:
            t0 = time.monotonic()
            rows.append(measure(args, tmp, upstream, target))
            print(f"{target}: {describe(rows[-1])} ({rows[-1]['requests']} requests, "
                  f"{time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    return rows


def save(name: str, started: datetime.datetime, info: dict[str, str],
         args: argparse.Namespace, cases: list[dict]) -> Path:
    """Write a benchmark's JSON record (settings, versions, load, every case); its path."""
    path = common.result_path(name, started, output=args.output)
    common.write_record(path, {
        "started": started.isoformat(), "versions": info,
        "load_average_end": common.loadavg(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cases": cases})
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.wrk = common.find_wrk()
    for tool in ("valgrind", "callgrind_control", "nginx", "wrk"):
        if shutil.which(tool) is None and shutil.which(tool, path="/usr/sbin") is None:
            print(f"NOTE: {tool} is not installed (apt-get install -y valgrind nginx-light "
                  "wrk): instructions skipped.", file=sys.stderr)
            return 0
    started = common.utcnow()
    rows = each_target(args, measure,
                       lambda r: f"{r['per_request'] / 1e3:,.1f}k instructions/request")
    base = next(r["per_request"] for r in rows if r["target"] == "baseline")
    table = common.table(
        [("target", "requests", "errors", "k instr/req", "vs baseline", "+k instr/req")]
        + [(r["target"], f"{r['requests']:,}", f"{r['errors']:,}",
            f"{r['per_request'] / 1e3:,.1f}", f"{r['per_request'] / base:.2f}x",
            f"{(r['per_request'] - base) / 1e3:+,.1f}") for r in rows])
    info = common.versions()
    print("\n".join(common.machine_lines("instructions", started, info)))
    print(table)
    path = save("instructions", started, info, args, rows)
    print(f"\nfull record: {path}")
    chart = plot(rows, path.with_suffix(".png"))
    if chart is not None:
        print(f"plot: {chart}")
    return 0
