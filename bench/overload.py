"""Overload: offered load from 0.5x to 10x an upstream's capacity, direct vs through Sluice.

The upstream (``bench/upstream.py --slots 8 --delay 0.05``) serves 8 requests at once in
50 ms each: a capacity of 160 requests/s. Beyond that, requests wait in its own unbounded
FIFO queue, as in a server with 8 workers (a caller that gives up leaves the queue). The load
is open loop (``bench/loadgen.py --rate``): requests are due at a fixed rate whatever the
answers, each with a 2 s client timeout (``--timeout``), for ``--warmup`` (1 s) and then
``--duration`` seconds per step.

At each multiple of capacity, in one run, the same load goes:

* ``direct``: to the upstream;
* ``sluice``: through Sluice with only a concurrency limit on the route, sized the way a user
  would: ``limit`` = the upstream's 8 slots (more would only queue inside it); ``max_wait``
  100 ms; ``queue`` by Little's law, ``limit * wait / service time``, for half of
  ``max_wait`` (8 * 0.05 / 0.05 = 8): a request that gets a queue place is served well
  within ``max_wait``, and one that finds the queue full is refused at once.

Reported per step: the offered rate actually sent (and the generator's p99 lateness),
goodput (answers 200 completed inside the measured window, per second of it, and as a share
of capacity: not the warm-up's, whose queues start empty, nor the tail's, answered after the
load stopped), p50/p99 latency of the admitted requests (200s), the latency of requests
refused on arrival (Sluice's ``queue_full``: p50/p99), requests refused after queueing
(``queue_timeout``), client timeouts, and Sluice's CPU time per request it handled. The
latencies and counts are of the requests sent inside the measured window. Targets (issue 7)
at 10x: goodput >= 95 % of capacity, admitted p99 <= ``max_wait`` + upstream p99, rejection
p99 <= 5 ms.

    python -m bench overload                         # 0.5,1,2,5,10 x, 5 s each, ~2 min
    python -m bench overload --multiples 10 --repeat 3
    python -m bench overload --multiples 10 --profile   # + where a refusal's CPU goes (py-spy)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import common
from bench.common import fmt, pct
from bench.overhead import PYSPY_RATE_HZ, profile_report, summarise_profile

TARGETS = ("direct", "sluice")


@dataclass
class Step:
    """One row: one target at one multiple of capacity."""

    target: str
    multiple: float
    repeat: int
    offered_rps: float  # requests actually sent per second
    lag_p99_ms: float  # how late the generator sent them (its own shortfall)
    goodput_rps: float
    goodput_share: float  # of capacity
    ok_p50_ms: float | None
    ok_p99_ms: float | None
    refused_on_arrival: int
    refused_p50_ms: float | None
    refused_p99_ms: float | None
    refused_after_wait: int
    timeouts: int
    errors: int
    sluice_cpu_us_per_req: float | None
    load_before: tuple[float, float, float]
    upstream_served: int


def sluice_config(upstream: str, args: argparse.Namespace) -> dict:
    return {"routes": [{
        "name": "openai", "path_prefix": "/openai/", "upstream": upstream, "protocol": "openai",
        "concurrency": {"limit": args.slots, "queue": args.queue,
                        "max_wait": f"{args.max_wait * 1000:g}ms"},
    }]}


def upstream_served(upstream: common.Service) -> int:
    with urllib.request.urlopen(upstream.url + "/_stats", timeout=5) as r:
        return json.loads(r.read())["served"]


def measure(args: argparse.Namespace, target: str, url: str, multiple: float, repeat: int,
            upstream: common.Service, sluice: common.Service | None) -> Step:
    capacity = args.slots / args.delay
    rate = capacity * multiple
    load = common.loadavg()
    served0 = upstream_served(upstream)
    cpu0 = common.cpu_seconds(sluice.pid) if sluice else 0.0
    end = args.warmup + args.duration
    sent = common.collect_open(common.run_open(url, rate, end, args.timeout))
    cpu = common.cpu_seconds(sluice.pid) - cpu0 if sluice else None
    # Times are seconds from the start of the load; an answer completes at due + lag + latency.
    good = sum(1 for s in sent if s.outcome == "ok"
               and args.warmup <= s.due_s + s.lag_s + s.latency_s < end)
    measured = [s for s in sent if s.due_s >= args.warmup]
    ok = [s.latency_s * 1e3 for s in measured if s.outcome == "ok"]
    refused = [s.latency_s * 1e3 for s in measured if s.outcome == "queue_full"]
    last_due = max(s.due_s for s in sent)
    step = Step(
        target=target, multiple=multiple, repeat=repeat,
        offered_rps=len(sent) / max(last_due, 1e-9) if len(sent) > 1 else 0.0,
        lag_p99_ms=(pct([s.lag_s for s in sent], 0.99) or 0.0) * 1e3,
        goodput_rps=good / args.duration, goodput_share=good / args.duration / capacity,
        ok_p50_ms=pct(ok, 0.5), ok_p99_ms=pct(ok, 0.99),
        refused_on_arrival=len(refused), refused_p50_ms=pct(refused, 0.5),
        refused_p99_ms=pct(refused, 0.99),
        refused_after_wait=sum(1 for s in measured if s.outcome == "queue_timeout"),
        timeouts=sum(1 for s in measured if s.outcome == "timeout"),
        errors=sum(1 for s in measured if s.outcome not in ("ok", "queue_full", "queue_timeout",
                                                            "timeout")),
        sluice_cpu_us_per_req=cpu / len(sent) * 1e6 if cpu is not None else None,
        load_before=load, upstream_served=upstream_served(upstream) - served0,
    )
    print(f"  {multiple:>4g}x {target:<6} #{repeat}: offered {step.offered_rps:,.0f}/s, "
          f"goodput {step.goodput_share:.0%}, ok p99 {fmt(step.ok_p99_ms, '.0f')} ms, "
          f"refused p99 {fmt(step.refused_p99_ms, '.1f')} ms", file=sys.stderr, flush=True)
    # Let what the step left behind (queued requests, timers) clear before the next one.
    time.sleep(args.timeout + 0.5)
    return step


def profile_refusals(args: argparse.Namespace, sluice: common.Service, raw: Path) -> dict:
    """Sample Sluice with py-spy under the highest multiple's load (not a measured step)."""
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    rate = args.slots / args.delay * max(args.multiples)
    spy = subprocess.Popen(
        [py_spy, "record", "--pid", str(sluice.pid), "--rate", str(PYSPY_RATE_HZ), "--duration",
         str(max(1, int(args.duration) - 1)), "--format", "raw", "--output", str(raw)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    user0, sys0 = common.cpu_times(sluice.pid)
    sent = common.collect_open(common.run_open(sluice.url + common.UPSTREAM_PATH, rate,
                                               args.duration, args.timeout))
    user1, sys1 = common.cpu_times(sluice.pid)
    _, err = spy.communicate()
    if spy.returncode != 0 or not raw.exists():
        raise SystemExit(f"py-spy failed (root, or ptrace allowed, is needed):\n{err.decode()}")
    us_per_req = ((user1 - user0) + (sys1 - sys0)) / len(sent) * 1e6
    profile = summarise_profile(raw, us_per_req)
    refused = sum(1 for s in sent if s.outcome == "queue_full")
    profile.update(raw=str(raw), cpu_us_per_req=us_per_req, rps_while_profiled=len(sent) /
                   args.duration, sys_us_per_req=(sys1 - sys0) / len(sent) * 1e6,
                   scenario=f"{max(args.multiples):g}x overload, {refused / len(sent):.0%} "
                   "refused on arrival")
    return profile


def table(steps: list[Step]) -> str:
    rows = [("load", "path", "offered/s", "gen. lag p99 ms", "goodput/s", "of capacity",
             "ok p50 ms", "ok p99 ms", "refused at once", "refused p50 ms", "refused p99 ms",
             "queue_timeout", "client timeouts", "Sluice CPU us/req", "load1")]
    repeated = any(s.repeat > 1 for s in steps)
    for s in steps:
        rows.append((f"{s.multiple:g}x", s.target + (f" #{s.repeat}" if repeated else ""),
                     f"{s.offered_rps:,.0f}", f"{s.lag_p99_ms:.1f}", f"{s.goodput_rps:,.1f}",
                     f"{s.goodput_share:.1%}", fmt(s.ok_p50_ms, ".1f"), fmt(s.ok_p99_ms, ".1f"),
                     f"{s.refused_on_arrival:,}", fmt(s.refused_p50_ms, ".2f"),
                     fmt(s.refused_p99_ms, ".2f"), f"{s.refused_after_wait:,}",
                     f"{s.timeouts + s.errors:,}", fmt(s.sluice_cpu_us_per_req, ".0f"),
                     f"{s.load_before[0]:.2f}"))
    return common.table(rows)


def targets_check(steps: list[Step], args: argparse.Namespace, upstream_p99_ms: float
                  ) -> list[str]:
    """The issue's overload targets at the highest multiple, per repeat, met or not."""
    top = max(s.multiple for s in steps)
    bound = args.max_wait * 1e3 + upstream_p99_ms
    out = []
    for s in steps:
        if s.target != "sluice" or s.multiple != top:
            continue
        checks = [
            (f"goodput {s.goodput_share:.1%} of capacity", s.goodput_share >= 0.95, ">= 95%"),
            (f"admitted p99 {fmt(s.ok_p99_ms, '.1f')} ms",
             s.ok_p99_ms is not None and s.ok_p99_ms <= bound,
             f"<= max_wait + upstream p99 = {bound:.1f} ms"),
            (f"rejection p99 {fmt(s.refused_p99_ms, '.2f')} ms",
             s.refused_p99_ms is not None and s.refused_p99_ms <= 5.0, "<= 5 ms"),
        ]
        out.append(f"targets at {top:g}x, repeat {s.repeat}: " + "; ".join(
            f"{text} ({'met' if ok else 'NOT met'}: {want})" for text, ok, want in checks))
    return out


def plot(steps: list[Step], args: argparse.Namespace, path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    colours = {"direct": "#d62728", "sluice": "#1f77b4"}
    panels = (("goodput_share", "goodput, share of capacity", 100.0),
              ("ok_p99_ms", "p99 latency of answered requests, ms", 1.0),
              ("refused_p99_ms", "p99 latency of refusals on arrival, ms", 1.0))
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        for target in TARGETS:
            # The median of the repeats, with their range as an error bar.
            xs, mids, lows, highs = [], [], [], []
            for multiple in sorted({s.multiple for s in steps}):
                values = [getattr(s, key) * scale for s in steps if s.target == target
                          and s.multiple == multiple and getattr(s, key) is not None]
                if values:
                    xs.append(multiple)
                    mids.append(statistics.median(values))
                    lows.append(mids[-1] - min(values))
                    highs.append(max(values) - mids[-1])
            if xs:
                ax.errorbar(xs, mids, yerr=[lows, highs], fmt="o-", ms=4, capsize=3,
                            color=colours[target],
                            label="through Sluice" if target == "sluice" else "direct")
        ax.set_xscale("log")
        ax.set_xlabel("offered load, x capacity")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].axhline(95, color="grey", lw=0.8, ls="--")
    axes[1].axhline(args.max_wait * 1e3 + args.delay * 1e3, color="grey", lw=0.8, ls="--")
    axes[2].axhline(5, color="grey", lw=0.8, ls="--")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Overload: upstream of {args.slots} x {args.delay * 1e3:g} ms "
                 f"({args.slots / args.delay:.0f}/s); Sluice limit {args.slots}, queue "
                 f"{args.queue}, max_wait {args.max_wait * 1e3:g} ms", fontsize=9)
    fig.tight_layout()
    return common.save_plot(plt, fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.parser("overload", __doc__)
    p.add_argument("--multiples", default="0.5,1,2,5,10", help="x capacity (0.5,1,2,5,10)")
    p.add_argument("--duration", type=float, default=5.0,
                   help="measured seconds per step (5)")
    p.add_argument("--warmup", type=float, default=1.0,
                   help="unmeasured seconds of the same load before them (1)")
    common.add_queue_args(p)
    p.add_argument("--targets", default="direct,sluice")
    p.add_argument("--repeat", type=int, default=1, help="runs of every step, interleaved (1)")
    p.add_argument("--profile", action="store_true",
                   help="then sample Sluice with py-spy under the highest multiple's load")
    p.add_argument("--quick", action="store_true", help="multiples 0.5,10 at 3 s each")
    p.add_argument("--output", type=Path, help="JSON result path (bench/results/...)")
    args = p.parse_args(argv)
    if args.quick:
        # 0.5x, not 1x: the lowest multiple's direct p99 is the upstream p99 of the target.
        args.multiples, args.duration = "0.5,10", 3.0
    args.multiples = [float(m) for m in args.multiples.split(",") if m]
    args.targets = common.comma_list(p, args.targets, TARGETS, "target")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = common.utcnow()
    info = common.versions()
    header = [*common.machine_lines("Sluice overload benchmark", started, info),
              f"upstream: bench/upstream.py, {args.slots} slots x {args.delay * 1e3:g} ms = "
              f"{args.slots / args.delay:.0f} req/s capacity, unbounded FIFO queue; load: "
              f"open loop (bench/loadgen.py), {args.duration:g} s measured per step after "
              f"{args.warmup:g} s warm-up, client timeout {args.timeout:g} s",
              f"sluice: concurrency {{limit: {args.slots}, queue: {args.queue}, max_wait: "
              f"{args.max_wait * 1e3:g}ms}}, nothing else"]
    print("\n".join(header), file=sys.stderr, flush=True)
    steps: list[Step] = []
    out = common.result_path("overload", started, output=args.output)
    profile = None
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp, common.stopping() as live:
        workdir = Path(tmp)
        upstream = common.start_upstream(workdir, args.delay, args.slots)
        live.append(upstream)
        sluice = common.start_sluice(workdir, sluice_config(upstream.url, args))
        live.append(sluice)
        urls = {"direct": upstream.url + common.UPSTREAM_PATH,
                "sluice": sluice.url + common.UPSTREAM_PATH}
        for multiple in args.multiples:
            for repeat in range(1, args.repeat + 1):
                for target in args.targets:
                    steps.append(measure(args, target, urls[target], multiple, repeat,
                                         upstream, sluice if target == "sluice" else None))
        if args.profile:
            profile = profile_refusals(args, sluice, out.with_name(f"{out.stem}-pyspy.txt"))
    # The upstream's own p99 is its service time (a fixed sleep) plus scheduling: take the
    # direct p99 at the lowest load measured as the reference.
    low = [s for s in steps if s.target == "direct" and s.ok_p99_ms is not None]
    upstream_p99 = min(low, key=lambda s: s.multiple).ok_p99_ms if low else args.delay * 1e3
    load1 = common.loadavg()
    lines = [*header, f"load average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at end", "",
             table(steps), "", f"upstream p99 (direct, lowest load): {upstream_p99:.1f} ms",
             *targets_check(steps, args, upstream_p99)]
    if profile is not None:
        lines += ["", *profile_report(profile)]
    print("\n".join(lines), flush=True)
    common.write_record(out, {"profile": profile,"started": started.isoformat(), "versions": info,
                              "settings": {k: v for k, v in vars(args).items() if k != "output"},
                              "load_average_end": load1, "upstream_p99_ms": upstream_p99,
                              "steps": [asdict(s) for s in steps], "table": table(steps)})
    print(f"\nfull record: {out}", file=sys.stderr)
    png = plot(steps, args, out.with_suffix(".png"))
    if png:
        print(f"plot: {png}", file=sys.stderr)
    return 0
