"""``sluice demo``: run the retry storm twice (direct, then through Sluice) and compare.

Prints what it is about to do, a progress line while each run goes, then the side-by-side
result, the per-phase figures, what the agents' requests got back, and where the plot (only
with matplotlib installed: :data:`NO_PLOT` says how) and, with ``--json``, the full
record were written. Exit status 0 when both runs completed, 1 if one could not be run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from proxy.demo import report
from proxy.demo.storm import FULL, QUICK, ModeResult, Scenario, record, run_storm, summarise

#: Said when matplotlib is missing. The command is the README's (a new user's trial: this said
#: ``pip install '.[bench]'``, the README ``.venv/bin/pip install -e '.[bench]'``).
NO_PLOT = ("No plot: matplotlib is not installed (from a clone of Sluice's repository: "
           ".venv/bin/pip install -e '.[bench]'; the package called sluice on PyPI is another "
           "project).")


def _intro(scenario: Scenario, out: TextIO) -> None:
    p, f = scenario.provider, scenario.fleet
    phases = ", ".join(
        f"{ph.name} {ph.start_s:g}-{ph.end_s:g}s" if ph.end_s < scenario.run_s
        else f"{ph.name} from {ph.start_s:g}s" for ph in p.phases)
    healthy = max(ph.slots for ph in p.phases)
    print("Sluice demo: a retry storm on a local fake LLM provider, direct and through Sluice",
          file=out)
    print(f"  provider: {healthy} completions of ~{p.work_s:g}s at once "
          f"(~{healthy / p.work_s:.0f}/s) when healthy; more in flight share that capacity; "
          f"over {p.max_inflight} it answers 503", file=out)
    print(f"  schedule: {phases}", file=out)
    print(f"  fleet: {f.rate:g} agent steps/s for {f.arrivals_s:g}s ({f.units} units), each "
          f"with its own Idempotency-Key; openai-SDK retries (2) inside a framework step retry "
          f"(3 tries); client timeout {f.timeout_s:g}s; a step counts if done within "
          f"{f.deadline_s:g}s", file=out)
    print(f"  each run takes ~{scenario.run_s:g}s", file=out, flush=True)


class _Progress:
    """One status line per run: rewritten in place on a terminal, every 2 s otherwise."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.last = 0.0

    def __call__(self, mode: str, elapsed: float, state: dict) -> None:
        line = (f"  [{report.TITLES.get(mode, mode):>14}] {elapsed:5.1f}s {state['phase']:<10} "
                f"steps started {state['started']:>4}, done {state['completed']:>4}; "
                f"upstream attempts {state['upstream_attempts']:>5}, "
                f"in the provider {state['upstream_inflight']:>3}")
        if self.tty:
            self.out.write("\r" + line)
            self.out.flush()
        elif time.monotonic() - self.last >= 2:
            self.last = time.monotonic()
            print(line, file=self.out, flush=True)

    def end(self) -> None:
        if self.tty:
            self.out.write("\n")


def verdict(results: list[ModeResult], scenario: Scenario) -> list[str]:
    """Plain sentences comparing the two runs."""
    by_mode = {r.mode: summarise(r, scenario) for r in results}
    if set(by_mode) != {"direct", "sluice"}:
        return []
    d, s = by_mode["direct"], by_mode["sluice"]
    return [
        f"Upstream attempts per unit of work: {d['amplification']:.2f} direct, "
        f"{s['amplification']:.2f} through Sluice; per completed unit: "
        f"{report.cell(d['attempts_per_completed'], '.2f')} direct, "
        f"{report.cell(s['attempts_per_completed'], '.2f')} through Sluice.",
        f"Steps completed within {scenario.fleet.deadline_s:g}s: {d['completion_rate']:.0%} "
        f"direct, {s['completion_rate']:.0%} through Sluice.",
        f"Tokens wasted: {d['tokens_wasted']:,} direct, {s['tokens_wasted']:,} through Sluice; "
        f"duplicate side effects: {d['duplicate_side_effects']} direct, "
        f"{s['duplicate_side_effects']} through Sluice.",
    ]


def _unwritable(path: Path) -> str | None:
    """Why ``path`` could not be written (its directory missing or not writable, or a
    directory itself), else ``None``."""
    if path.is_dir():
        return "it is a directory"
    directory = path.parent
    if not directory.is_dir():
        return f"the directory {str(directory)!r} does not exist"
    if not os.access(path if path.exists() else directory, os.W_OK):
        return "this user cannot write it"
    return None


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the demo as ``sluice demo`` does; returns the exit status."""
    scenario = QUICK if args.quick else FULL
    # The files it writes, checked before the run: a path it cannot write lost the whole
    # record at the end, with a traceback (a hostile trial).
    outputs = [Path(args.json)] if args.json else []
    if not args.no_plot:
        outputs.append(Path(args.plot))
    for path in outputs:
        unwritable = _unwritable(path)
        if unwritable is not None:
            print(f"sluice demo: cannot write {str(path)!r}: {unwritable}", file=sys.stderr)
            return 2
    _intro(scenario, out)
    progress = _Progress(out)
    started = time.monotonic()
    try:
        results = asyncio.run(run_storm(scenario, seed=args.seed, progress=progress))
    except (RuntimeError, OSError) as exc:
        progress.end()
        print(f"sluice demo: {exc}", file=sys.stderr)
        return 1
    progress.end()
    print(f"\nResult ({time.monotonic() - started:.0f}s in all; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}):\n", file=out)
    print(report.side_by_side(results, scenario), file=out)
    print("\nBy the phase a step started in (upstream attempts per step and per completed "
          "step, steps completed):\n", file=out)
    print(report.phase_table(results, scenario), file=out)
    print("\nWhat the agents' requests got back (each request sent counted once):", file=out)
    for result in results:
        print("  " + report.answers_line(result), file=out)
    print("", file=out)
    for line in verdict(results, scenario):
        print(line, file=out)
    if args.json:
        path = Path(args.json)
        path.write_text(json.dumps(record(results, scenario), indent=1) + "\n")
        print(f"Full record: {path}", file=out)
    if args.no_plot:
        return 0
    written = report.plot(results, scenario, Path(args.plot))
    if written is None:
        print(NO_PLOT, file=out)
    else:
        print(f"Plot: {written}", file=out)
    return 0
