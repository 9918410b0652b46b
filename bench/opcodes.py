"""Where a proxy's per-request work goes: Python bytecodes executed per request, by function.

``instructions`` says how much each proxy runs per request; this says where, in the terms a
Python change moves. Each target runs under ``bench/optrace.py``, which counts every bytecode
the main thread executes, against its function, while the measured load runs (wrk, 1 thread,
2 connections, nginx upstream, as ``instructions`` does), and the counts are divided by the
requests wrk completed. The counts are exact and repeat run to run whatever the machine's
load (the divisor moves by the few requests in flight at the end, well under 1%); opcodes
per request track callgrind's instructions per request closely (both ~1.8x the baseline for
Sluice on 2026-12-03), though an opcode's cost varies (a call into C counts as one) and
nothing in C is counted.

    python -m bench opcodes                       # baseline and sluice, Sluice's top functions
    python -m bench opcodes --targets baseline,sluice-plain --top 40
    python -m bench opcodes --group               # totals per package instead of per function
    python -m bench opcodes --lines 40            # also Sluice's 40 costliest source lines

Targets are ``instructions``' (``baseline``, ``floor``, ``sluice``, ``sluice-plain``,
``sluice-no-BLOCK``). The table gives opcodes and Python calls per request and the ratio to
the baseline; then, for every target but the baseline, its functions (or packages) by opcodes
per request.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from bench import common, overhead
from bench.common import HERE, UPSTREAM_PATH, Service
from bench.instructions import TARGETS, each_target, parse_targets, save, target_config
from bench.optrace import refuse_unsupported_python

#: Seconds a target has to write its counts after SIGUSR2.
WRITE_TIMEOUT_S = 30.0


def _short(where: str) -> str:
    """``file:line:name`` with the site-packages, stdlib or repository prefix cut."""
    for marker in ("site-packages/", "/lib/python3"):
        if marker in where:
            where = where.split(marker, 1)[1]
            return where.split("/", 1)[1] if marker == "/lib/python3" else where
    return where.replace(str(common.REPO) + "/", "")


def _package(where: str) -> str:
    path = _short(where).split(":", 1)[0]
    return path.split("/", 1)[0] if "/" in path else path


def measure(args: argparse.Namespace, tmp: Path, upstream: Service, target: str) -> dict:
    """Start ``target`` under the counter, warm it up, count one measured run."""
    out = tmp / f"{target}-opcodes.json"
    wrapper = [sys.executable, str(HERE / "optrace.py"), str(out), "--"]
    if target in overhead.STANDALONE:
        service = overhead.STANDALONE[target](tmp, upstream, wrapper)
    else:
        service = common.start_sluice(tmp, target_config(upstream, target), target,
                                      wrapper=wrapper)
    try:
        url = service.url + UPSTREAM_PATH
        common.run_closed(args.wrk, url, 1, 2, args.warmup, tmp)
        os.kill(service.pid, signal.SIGUSR1)
        load = common.run_closed(args.wrk, url, 1, 2, args.duration, tmp)
        os.kill(service.pid, signal.SIGUSR2)
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the write is one json.dump: let it finish
    finally:
        service.stop()
    if load.requests <= load.errors or not out.exists():
        raise SystemExit(f"{target}: nothing measured ({load.requests} requests, "
                         f"{load.errors} errors)")
    rows = json.loads(out.read_text())
    n = load.requests
    case = {"target": target, "requests": n, "errors": load.errors,
            "opcodes": sum(r[1] for r in rows) / n, "calls": sum(r[2] for r in rows) / n,
            "functions": sorted(([_short(w), o / n, c / n] for w, o, c in rows if o or c),
                                key=lambda r: -r[1])}
    lines = Path(str(out) + ".lines")
    if lines.exists():
        case["lines"] = sorted(([_short(w), o / n] for w, o in json.loads(lines.read_text())
                                if str(common.REPO) in w and "-packages/" not in w),
                               key=lambda r: -r[1])
    return case


def costly_lines(case: dict, top: int) -> list[str]:
    """The repository's ``top`` source lines by opcodes per request, with their text."""
    rows = []
    sources: dict[str, list[str]] = {}
    for where, ops in case["lines"][:top]:
        path, line = where.rsplit(":", 1)
        if path not in sources:
            sources[path] = (common.REPO / path).read_text().splitlines()
        # A frame with no line number (``None``: code run before its first line) has no text.
        text = sources[path][int(line) - 1].strip() if line.isdigit() else ""
        rows.append((where, f"{ops:,.0f}", text[:70]))
    return [f"\n{case['target']}, costliest lines:",
            common.table([("line", "opcodes/req", "source"), *rows])]


def breakdown(case: dict, top: int, group: bool) -> list[str]:
    """A target's functions (or packages, with ``group``) by opcodes per request."""
    if group:
        ops: collections.Counter[str] = collections.Counter()
        calls: collections.Counter[str] = collections.Counter()
        for where, o, c in case["functions"]:
            ops[_package(where)] += o
            calls[_package(where)] += c
        rows = [(name, f"{o:,.0f}", f"{calls[name]:.1f}") for name, o in ops.most_common(top)]
        head = ("package", "opcodes/req", "calls/req")
    else:
        rows = [(where, f"{o:,.0f}", f"{c:.1f}") for where, o, c in case["functions"][:top]]
        head = ("function", "opcodes/req", "calls/req")
    return [f"\n{case['target']}:", common.table([head, *rows])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser("opcodes", __doc__)
    p.add_argument("--targets", default="baseline,sluice",
                   help=f"comma list of {', '.join(TARGETS)} (baseline,sluice); the baseline "
                   "is always measured")
    p.add_argument("--duration", type=float, default=4.0, help="seconds counted (4)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first (2)")
    p.add_argument("--top", type=int, default=30, help="functions (or packages) listed (30)")
    p.add_argument("--group", action="store_true", help="totals per package")
    p.add_argument("--lines", type=int, default=0, metavar="N",
                   help="also list the repository's N costliest source lines (0)")
    p.add_argument("--quick", action="store_true", help="2 s counted after 1 s of warm-up")
    p.add_argument("--output", type=Path, help="JSON result path (bench/results/...)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.warmup = 2.0, 1.0
    args.targets = parse_targets(p, args.targets)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refuse_unsupported_python()  # before any target starts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.wrk = common.find_wrk()
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if args.wrk is None or nginx is None:
        print("NOTE: wrk or nginx is not installed (apt-get install -y wrk nginx-light): "
              "opcodes skipped.", file=sys.stderr)
        return 0
    if args.lines:
        os.environ["OPTRACE_LINES"] = "1"  # read by bench/optrace.py in each target
    started = common.utcnow()
    cases = each_target(args, measure, lambda c: f"{c['opcodes']:,.0f} opcodes/request")
    base = next(c["opcodes"] for c in cases if c["target"] == "baseline")
    info = common.versions()
    lines = common.machine_lines("opcodes", started, info)
    lines.append(common.table(
        [("target", "requests", "errors", "opcodes/req", "calls/req", "vs baseline",
          "+opcodes/req")]
        + [(c["target"], f"{c['requests']:,}", f"{c['errors']:,}", f"{c['opcodes']:,.0f}",
            f"{c['calls']:,.1f}", f"{c['opcodes'] / base:.2f}x",
            f"{c['opcodes'] - base:+,.0f}") for c in cases]))
    for case in cases:
        if case["target"] != "baseline":
            lines += breakdown(case, args.top, args.group)
            if args.lines:
                lines += costly_lines(case, args.lines)
    print("\n".join(lines))
    path = save("opcodes", started, info, args, cases)
    print(f"\nfull record: {path}")
    return 0
