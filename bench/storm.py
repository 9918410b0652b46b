"""Retry storm: the ``sluice demo`` scenario, with repeats, variants and the issue's targets.

The provider, the fleet and Sluice's config are those of ``sluice demo``
(``proxy/demo/``: ``fakellm.py`` says how the provider degrades, ``fleet.py`` how the agents
retry, ``storm.py`` the schedule and why Sluice is configured as it is). In one run, per
repeat, the fleet is run against the same provider process:

* ``direct``: agents -> provider;
* ``sluice``: agents -> Sluice (concurrency limit + queue, breaker, retry, idempotency) ->
  provider;
* ablations, with ``--modes``: ``sluice-no-breaker`` (no ``circuit_breaker``),
  ``sluice-no-retry`` (no ``retry``), ``sluice-limit-only`` (only ``concurrency``).

Reported per mode: units of work, upstream attempts per unit (amplification) and per
completed unit, completion within the deadline, p50/p99 time to complete (of the completed
units only), tokens billed and wasted, duplicate side effects (counted by the provider per
``Idempotency-Key``); per phase a unit started in; and Sluice's own counters. Targets (issue
7): amplification <= 1.1 through Sluice where direct reaches >= 3, completion within the
deadline >= 2x direct, zero duplicate side effects.

    python -m bench storm                    # the demo's full schedule, ~45 s
    python -m bench storm --repeat 3 --modes direct,sluice,sluice-no-breaker
    python -m bench storm --max-inflight 64  # a provider that sheds more load itself
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from bench import common
from proxy.demo import report
from proxy.demo.storm import FULL, QUICK, ModeResult, Scenario, record, run_storm, summarise

VARIANTS = {
    "sluice": (),
    "sluice-no-breaker": ("circuit_breaker",),
    "sluice-no-retry": ("retry",),
    "sluice-limit-only": ("circuit_breaker", "retry", "idempotency"),
}


def strip(mode: str, config: dict) -> dict:
    """The demo's Sluice config less the policies variant ``mode`` goes without."""
    for route in config["routes"]:
        for key in VARIANTS[mode]:
            route.pop(key, None)
    return config


def targets_check(results: list[ModeResult], scenario: Scenario) -> list[str]:
    by_mode = {r.mode: summarise(r, scenario) for r in results}
    if "direct" not in by_mode or "sluice" not in by_mode:
        return []
    d, s = by_mode["direct"], by_mode["sluice"]
    ratio = s["completion_rate"] / d["completion_rate"] if d["completion_rate"] else None
    checks = [
        (f"amplification {s['amplification']:.2f} through Sluice, {d['amplification']:.2f} "
         f"direct (per completed unit: {common.fmt(s['attempts_per_completed'], '.2f')}, "
         f"{common.fmt(d['attempts_per_completed'], '.2f')})",
         s["amplification"] <= 1.1 and d["amplification"] >= 3, "<= 1.1 where direct >= 3"),
        (f"completion {s['completion_rate']:.0%} vs {d['completion_rate']:.0%} direct "
         f"({common.fmt(ratio, '.2f')}x)", ratio is not None and ratio >= 2, ">= 2x direct"),
        (f"duplicate side effects {s['duplicate_side_effects']} (direct "
         f"{d['duplicate_side_effects']})", s["duplicate_side_effects"] == 0, "0"),
    ]
    return ["; ".join(f"{text} ({'met' if ok else 'NOT met'}: {want})"
                      for text, ok, want in checks)]


def medians(runs: list[list[ModeResult]], scenario: Scenario) -> str:
    """Median and range over repeats of each mode's headline figures."""
    keys = (("amplification", ".2f"), ("attempts_per_completed", ".2f"),
            ("completion_rate", ".0%"), ("p99_s", ".2f"),
            ("tokens_wasted", ",.0f"), ("duplicate_side_effects", ",.0f"))
    modes = [r.mode for r in runs[0]]
    rows = [("mode", *(k for k, _ in keys))]
    for mode in modes:
        cells = []
        for key, spec in keys:
            values = [summarise(r, scenario)[key] for run in runs for r in run if r.mode == mode]
            values = [v for v in values if v is not None]
            if not values:
                cells.append("—")
                continue
            cells.append(f"{format(statistics.median(values), spec)} "
                         f"({format(min(values), spec)} to {format(max(values), spec)})")
        rows.append((mode, *cells))
    return common.table(rows, left=1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.parser("storm", __doc__)
    p.add_argument("--modes", default="direct,sluice",
                   help="direct,sluice[,sluice-no-breaker,sluice-no-retry,sluice-limit-only]")
    p.add_argument("--quick", action="store_true", help="the demo's --quick schedule")
    p.add_argument("--repeat", type=int, default=1, help="runs of every mode (1)")
    p.add_argument("--seed", type=int, default=1, help="the first repeat's seed (1)")
    p.add_argument("--max-inflight", type=int, help="provider: requests taken before it "
                   "refuses (128)")
    p.add_argument("--rate", type=float, help="fleet: units started per second (40)")
    p.add_argument("--deadline", type=float, help="fleet: seconds a unit may take (6)")
    p.add_argument("--timeout", type=float, help="fleet: SDK client timeout, s (2)")
    p.add_argument("--agent-tries", type=int, help="fleet: framework tries per step (3)")
    p.add_argument("--output", type=Path, help="JSON result path (bench/results/...)")
    args = p.parse_args(argv)
    args.modes = tuple(common.comma_list(p, args.modes, ("direct", *VARIANTS), "mode"))
    return args


def scenario_of(args: argparse.Namespace) -> Scenario:
    scenario = QUICK if args.quick else FULL
    if args.max_inflight:
        scenario = replace(scenario, provider=replace(scenario.provider,
                                                      max_inflight=args.max_inflight))
    fleet = {k: v for k, v in (("rate", args.rate), ("deadline_s", args.deadline),
                               ("timeout_s", args.timeout), ("agent_tries", args.agent_tries))
             if v is not None}
    return replace(scenario, fleet=replace(scenario.fleet, **fleet)) if fleet else scenario


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scenario = scenario_of(args)
    started = common.utcnow()
    info = common.versions()
    p, f = scenario.provider, scenario.fleet
    header = [*common.machine_lines("Sluice retry-storm benchmark", started, info),
              "provider: " + ", ".join(f"{ph.name} from {ph.start_s:g}s ({ph.slots} slots)"
                                       for ph in p.phases)
              + f"; ~{p.work_s:g}s per completion; refuses over {p.max_inflight} in flight",
              f"fleet: {f.rate:g} steps/s for {f.arrivals_s:g}s, deadline {f.deadline_s:g}s, "
              f"client timeout {f.timeout_s:g}s, SDK retries {f.sdk_retries}, framework "
              f"tries {f.agent_tries}"]
    print("\n".join(header), file=sys.stderr, flush=True)
    runs: list[list[ModeResult]] = []
    for n in range(args.repeat):
        seed = args.seed + n
        print(f"  repeat {n + 1}/{args.repeat} (seed {seed})...", file=sys.stderr, flush=True)
        runs.append(asyncio.run(run_storm(scenario, args.modes, seed, config_hook=strip)))
    load1 = common.loadavg()
    lines = [*header, f"load average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at end"]
    for n, results in enumerate(runs, 1):
        lines += ["", f"repeat {n} (seed {args.seed + n - 1}):", "",
                  report.side_by_side(results, scenario), "",
                  report.phase_table(results, scenario), "",
                  *("  " + report.answers_line(r) for r in results),
                  *(f"  {r.mode} counters: " + ", ".join(f"{k} {v:g}" for k, v in
                                                          sorted(r.sluice.items()))
                    for r in results if r.sluice),
                  *targets_check(results, scenario)]
    if args.repeat > 1:
        lines += ["", "median (min to max) over repeats:", "", medians(runs, scenario)]
    print("\n".join(lines), flush=True)
    out = common.result_path("storm", started, output=args.output)
    common.write_record(out, {"started": started.isoformat(), "versions": info,
                              "settings": {k: v for k, v in vars(args).items() if k != "output"},
                              "load_average_end": load1,
                              "repeats": [record(results, scenario) for results in runs]})
    print(f"\nfull record: {out}", file=sys.stderr)
    png = report.plot(runs[0], scenario, out.with_suffix(".png"))
    if png:
        print(f"plot: {png}", file=sys.stderr)
    else:
        print("NOTE: matplotlib is not installed (.venv/bin/pip install -e '.[bench]'): no plot.",
              file=sys.stderr)
    return 0
