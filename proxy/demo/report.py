"""The storm's results for people: side-by-side tables, and a plot when matplotlib is there."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from proxy.demo.fleet import ABANDONED
from proxy.demo.storm import ModeResult, Scenario, per_phase, summarise, timeline

TITLES = {"direct": "direct", "sluice": "through Sluice"}
#: Answer labels other than a status or a Sluice reason, in plain words.
ANSWER_WORDS = {"timeout": "client timeout", "connect_error": "connection error",
                ABANDONED: "abandoned at the step deadline"}


def cell(value: float | int | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` when there is none."""
    return "-" if value is None else format(value, spec)


def table(rows: Sequence[tuple[str, ...]], align_left: int = 1) -> str:
    """A plain-text table; the first row is the header, the first ``align_left`` columns are
    left-aligned and the rest right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i < align_left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def side_by_side(results: list[ModeResult], scenario: Scenario) -> str:
    """The headline figures of each mode, one column per mode."""
    sums = [summarise(r, scenario) for r in results]
    deadline = scenario.fleet.deadline_s
    lines: list[tuple[str, ...]] = [("", *(TITLES.get(r.mode, r.mode) for r in results))]

    def row(label: str, key: str, spec: str) -> None:
        lines.append((label, *(cell(s[key], spec) for s in sums)))

    row("units of work", "units", ",")
    row("requests the agents sent", "agent_requests", ",")
    row("upstream attempts", "upstream_attempts", ",")
    row("upstream attempts per unit of work", "amplification", ".2f")
    row("upstream attempts per completed unit", "attempts_per_completed", ".2f")
    lines.append((f"completed within {deadline:g} s",
                  *(f"{s['completed']:,} ({s['completion_rate']:.0%})" for s in sums)))
    # A step that did not complete has no time to complete: these leave it out, so a mode
    # that completes few steps (only the quick ones) can look faster than one that completes
    # many.
    row("p50 time to complete, s (completed steps only)", "p50_s", ".2f")
    row("p99 time to complete, s (completed steps only)", "p99_s", ".2f")
    row("tokens billed", "tokens_billed", ",")
    row("tokens wasted", "tokens_wasted", ",")
    row("duplicate side effects", "duplicate_side_effects", ",")
    row("peak requests in the provider", "upstream_peak_inflight", ",")
    return table(lines)


def phase_table(results: list[ModeResult], scenario: Scenario) -> str:
    """Per phase a unit started in: units, upstream attempts per unit and per completed unit,
    completion rate."""
    phases = [per_phase(r, scenario) for r in results]
    header = ("units started in", "units",
              *(f"{TITLES.get(r.mode, r.mode)}: attempts/unit, /completed, completed"
                for r in results))
    lines: list[tuple[str, ...]] = [header]
    for name in phases[0]:
        cells = []
        for p in phases:
            figures = p.get(name)
            cells.append("-" if figures is None else
                         f"{figures['amplification']:.2f}, "
                         f"{cell(figures['attempts_per_completed'], '.2f')}, "
                         f"{figures['completion_rate']:.0%}")
        lines.append((name, str(phases[0][name]["units"]), *cells))
    return table(lines)


def answers_line(result: ModeResult) -> str:
    """What the agents' requests got back, most common first: every request sent counted
    once, by status, Sluice's reason, or :data:`ANSWER_WORDS`, so the counts sum to the
    requests sent (the total shown first)."""
    total = sum(result.answers.values())
    parts = [f"{ANSWER_WORDS.get(label, label)} {n:,} ({n / total:.0%})"
             for label, n in sorted(result.answers.items(), key=lambda kv: -kv[1])]
    return (f"{TITLES.get(result.mode, result.mode)}, {total:,} requests: "
            + ", ".join(parts))


def plot(results: list[ModeResult], scenario: Scenario, path: Path,
         title: str = "Retry storm: direct vs through Sluice") -> Path | None:
    """Write the storm's timelines as a PNG; ``None`` (nothing written) without matplotlib."""
    try:
        import matplotlib

        # Its font cache is built on first use and logged at INFO, which is noise here.
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    spare = iter(("#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"))
    colours = {r.mode: {"direct": "#d62728", "sluice": "#1f77b4"}.get(r.mode) or next(spare)
               for r in results}
    fig, axes = plt.subplots(3, 1, figsize=(8, 7 + 0.2 * len(results)), sharex=True)
    panels = (("upstream_attempts_per_s", "upstream attempts/s"),
              ("upstream_inflight", "requests in the provider"),
              ("completed_per_s", "units completed/s"))
    end = scenario.run_s
    for ax, (key, label) in zip(axes, panels, strict=True):
        for phase in scenario.provider.phases:
            if phase.name != "healthy" and phase.start_s < end:
                ax.axvspan(phase.start_s, min(phase.end_s, end),
                           color="#ffbbbb" if phase.slots == 0 else "#ffe9b0", alpha=0.5,
                           lw=0)
        for result in results:
            series = timeline(result, scenario)
            ax.step(series["t"], series[key], where="post", lw=1.4,
                    color=colours[result.mode], label=TITLES.get(result.mode, result.mode))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for phase in scenario.provider.phases:
        if phase.name != "healthy" and phase.start_s < end:
            axes[0].text((phase.start_s + min(phase.end_s, end)) / 2, 1.0, phase.name,
                         transform=axes[0].get_xaxis_transform(), ha="center", va="bottom",
                         fontsize=8)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds since the run started")
    sums = {r.mode: summarise(r, scenario) for r in results}
    facts = "\n".join(
        f"{TITLES.get(m, m)}: {s['amplification']:.2f} attempts/unit "
        f"({cell(s['attempts_per_completed'], '.2f')} per completed), "
        f"{s['completion_rate']:.0%} done in {scenario.fleet.deadline_s:g} s, "
        f"{s['duplicate_side_effects']} dup."
        for m, s in sums.items())
    fig.suptitle(f"{title}\n{facts}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
