"""Fairness: one noisy tenant and two quiet ones on one route, with and without ``per_tenant``.

The upstream (``bench/upstream.py --slots 8 --delay 0.05``, capacity 160 requests/s) is
shared by three tenants sending open-loop load at the same time (``X-Tenant-ID``): ``quiet-a``
and ``quiet-b`` at 40 requests/s each (a quarter of capacity each: what they need is
there), and ``noisy`` at 4x capacity (640/s), for ``--duration`` seconds, with a 2 s client
timeout. In one run the same load goes:

* ``direct``: to the upstream (one FIFO queue for everyone);
* ``shared``: through Sluice with ``concurrency: {limit: 8, queue: 8, max_wait: 100ms}``, the
  overload benchmark's config: the route is protected, but its slots and queue go to
  whoever asks most;
* ``per_tenant``: the same plus ``per_tenant: 4``: a tenant may hold at most 4 of the 8 slots
  and queue places together, and is refused (429 ``tenant_concurrency``) beyond that, so the
  noisy tenant can take half the route and the quiet ones keep what they need (2 slots each
  at 40/s x 50 ms).

Reported per target and tenant: requests sent per second, goodput (answered 200 per second)
and its share of what the tenant asked for, p50/p99 latency of the answered requests, and
refusals by reason (on arrival: ``queue_full``, ``tenant_concurrency``; after waiting:
``queue_timeout``) and client timeouts.

Then (issue 12) the queue's scheduler: per-tenant and per-class p50/p95/p99 waits under skewed
load (a heavy tenant at 10x a light one), FIFO against Sluice's weighted fair queueing with
aging, on a simulated clock (``bench/scheduler.py``); and cancel-to-quiet: the time from
``POST /admin/runs/{run}/cancel`` to the last of a run's 8 callers (3 in flight, 5 queued)
having its answer, against a real Sluice.

    python -m bench fairness                 # 8 s per target, ~40 s
    python -m bench fairness --noisy 10 --repeat 3
    python -m bench fairness --scheduler-only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import common
from bench.common import fmt, pct

TARGETS = ("direct", "shared", "per_tenant")


@dataclass
class TenantRow:
    target: str
    tenant: str
    repeat: int
    asked_rps: float
    goodput_rps: float
    served_share: float  # goodput / asked
    ok_p50_ms: float | None
    ok_p99_ms: float | None
    outcomes: dict[str, int] = field(default_factory=dict)


def sluice_config(upstream: str, args: argparse.Namespace, per_tenant: int | None) -> dict:
    concurrency: dict[str, object] = {"limit": args.slots, "queue": args.queue,
                                      "max_wait": f"{args.max_wait * 1e3:g}ms"}
    if per_tenant:
        concurrency["per_tenant"] = per_tenant
    return {"routes": [{"name": "openai", "path_prefix": "/openai/", "upstream": upstream,
                        "protocol": "openai", "concurrency": concurrency}]}


def measure(args: argparse.Namespace, target: str, url: str, repeat: int) -> list[TenantRow]:
    capacity = args.slots / args.delay
    rates = {"quiet-a": capacity * args.quiet, "quiet-b": capacity * args.quiet,
             "noisy": capacity * args.noisy}
    procs = {t: common.run_open(url, r, args.duration, args.timeout, tenant=t)
             for t, r in rates.items()}
    rows = []
    for tenant, proc in procs.items():
        sent = common.collect_open(proc, tenant)
        ok = [s.latency_s * 1e3 for s in sent if s.outcome == "ok"]
        rows.append(TenantRow(
            target=target, tenant=tenant, repeat=repeat, asked_rps=len(sent) / args.duration,
            goodput_rps=len(ok) / args.duration, served_share=len(ok) / max(len(sent), 1),
            ok_p50_ms=pct(ok, 0.5), ok_p99_ms=pct(ok, 0.99),
            outcomes=dict(Counter(s.outcome for s in sent if s.outcome != "ok")),
        ))
        print(f"  {target:<10} #{repeat} {tenant:<8} goodput {rows[-1].goodput_rps:6.1f}/s "
              f"({rows[-1].served_share:.0%} of asked), p99 {fmt(rows[-1].ok_p99_ms, '.0f')} ms",
              file=sys.stderr, flush=True)
    time.sleep(args.timeout + 0.5)  # let queued leftovers clear before the next target
    return rows


def table(rows: list[TenantRow]) -> str:
    repeated = any(r.repeat > 1 for r in rows)
    out = [("path", "tenant", "asked/s", "goodput/s", "served", "ok p50 ms", "ok p99 ms",
            "refused (reason: count)")]
    for r in rows:
        refused = ", ".join(f"{k}: {v:,}" for k, v in sorted(r.outcomes.items())) or "—"
        out.append((r.target + (f" #{r.repeat}" if repeated else ""), r.tenant,
                    f"{r.asked_rps:,.0f}", f"{r.goodput_rps:,.1f}", f"{r.served_share:.0%}",
                    fmt(r.ok_p50_ms, ".1f"), fmt(r.ok_p99_ms, ".1f"), refused))
    return common.table(out)


def plot(rows: list[TenantRow], args: argparse.Namespace, path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    tenants = list(dict.fromkeys(r.tenant for r in rows))
    targets = [t for t in TARGETS if any(r.target == t for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(targets)
    colours = {"direct": "#d62728", "shared": "#ff7f0e", "per_tenant": "#1f77b4"}
    labels = {"direct": "direct", "shared": "Sluice, shared queue",
              "per_tenant": "Sluice, per_tenant"}
    for n, target in enumerate(targets):
        def median(tenant: str, attr: str, target: str = target) -> float:
            values = [getattr(r, attr) or 0.0 for r in rows
                      if r.target == target and r.tenant == tenant]
            return statistics.median(values)

        xs = [i + n * width for i in range(len(tenants))]
        axes[0].bar(xs, [median(t, "served_share") * 100 for t in tenants], width,
                    color=colours[target], label=labels[target])
        axes[1].bar(xs, [median(t, "ok_p99_ms") for t in tenants], width,
                    color=colours[target], label=labels[target])
    for ax, title in zip(axes, ("share of its requests answered, % (median of repeats)",
                                "p99 latency of answered requests, ms (median)"), strict=True):
        ax.set_xticks([i + width * (len(targets) - 1) / 2 for i in range(len(tenants))],
                      tenants)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    capacity = args.slots / args.delay
    fig.suptitle(f"Fairness: upstream {capacity:.0f}/s; quiet tenants {args.quiet:g}x capacity "
                 f"each, noisy {args.noisy:g}x; per_tenant {args.per_tenant}", fontsize=9)
    fig.tight_layout()
    return common.save_plot(plt, fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.parser("fairness", __doc__)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per target (8)")
    common.add_queue_args(p)
    p.add_argument("--per-tenant", type=int, default=4, help="per_tenant cap (4)")
    p.add_argument("--quiet", type=float, default=0.25, help="each quiet tenant, x capacity")
    p.add_argument("--noisy", type=float, default=4.0, help="the noisy tenant, x capacity")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--repeat", type=int, default=1, help="runs of every target, interleaved")
    p.add_argument("--quick", action="store_true", help="4 s per target")
    p.add_argument("--output", type=Path, help="JSON result path (bench/results/...)")
    p.add_argument("--scheduler-only", action="store_true",
                   help="only the scheduler comparison and cancel-to-quiet (~10 s)")
    p.add_argument("--sim-seconds", type=float, default=600.0, help="simulated seconds (600)")
    p.add_argument("--sim-load", type=float, default=1.3, help="offered load, x capacity")
    p.add_argument("--sim-ratio", type=float, default=10.0, help="heavy:light tenant ratio")
    p.add_argument("--sim-aging", type=float, default=5.0, help="concurrency.aging, s (5)")
    p.add_argument("--cancel-rounds", type=int, default=20, help="cancel-to-quiet runs (20)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 4.0
    args.targets = common.comma_list(p, args.targets, TARGETS, "target")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = common.utcnow()
    info = common.versions()
    capacity = args.slots / args.delay
    header = [*common.machine_lines("Sluice fairness benchmark", started, info),
              f"upstream: {args.slots} slots x {args.delay * 1e3:g} ms = {capacity:.0f} req/s; "
              f"tenants (open loop, {args.duration:g} s, client timeout {args.timeout:g} s): "
              f"quiet-a and quiet-b {capacity * args.quiet:.0f}/s each, noisy "
              f"{capacity * args.noisy:.0f}/s",
              f"sluice: concurrency {{limit: {args.slots}, queue: {args.queue}, max_wait: "
              f"{args.max_wait * 1e3:g}ms}}; per_tenant target adds per_tenant: "
              f"{args.per_tenant}"]
    print("\n".join(header), file=sys.stderr, flush=True)
    rows: list[TenantRow] = []
    if args.scheduler_only:
        args.targets = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp, common.stopping() as live:
        workdir = Path(tmp)
        upstream = common.start_upstream(workdir, args.delay, args.slots)
        live.append(upstream)
        urls = {"direct": upstream.url + common.UPSTREAM_PATH}
        for target, cap in (("shared", None), ("per_tenant", args.per_tenant)):
            if target in args.targets:
                sluice = common.start_sluice(workdir, sluice_config(upstream.url, args, cap),
                                             name=f"sluice-{target}")
                live.append(sluice)
                urls[target] = sluice.url + common.UPSTREAM_PATH
        for repeat in range(1, args.repeat + 1):
            for target in args.targets:
                rows += measure(args, target, urls[target], repeat)
        sched_text, sched = scheduler_section(args)
        quiet_text, quiet = cancel_to_quiet(workdir, args.cancel_rounds)
    load1 = common.loadavg()
    lines = [*header, f"load average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at end", "",
             table(rows) if rows else "(load targets skipped: --scheduler-only)", "",
             sched_text, "", quiet_text]
    print("\n".join(lines), flush=True)
    out = common.result_path("fairness", started, output=args.output)
    common.write_record(out, {"started": started.isoformat(), "versions": info,
                              "settings": {k: v for k, v in vars(args).items() if k != "output"},
                              "load_average_end": load1, "rows": [asdict(r) for r in rows],
                              "scheduler": sched, "cancel_to_quiet_ms": quiet,
                              "table": table(rows)})
    print(f"\nfull record: {out}", file=sys.stderr)
    png = plot(rows, args, out.with_suffix(".png")) if rows else None
    if png:
        print(f"plot: {png}", file=sys.stderr)
    return 0


# --- the scheduler (issue 12): FIFO against WFQ + aging, and cancel-to-quiet -----------------


def scheduler_section(args: argparse.Namespace) -> tuple[str, dict[str, object]]:
    """Per-tenant and per-class p50/p95/p99 queue waits, FIFO and Sluice's scheduler on the
    same arrivals (simulated clock, ``bench/scheduler.py``)."""
    from bench import scheduler

    results, unloaded = scheduler.compare(seconds=args.sim_seconds, limit=args.slots,
                                          service_s=1.0, load=args.sim_load,
                                          ratio=args.sim_ratio, aging=args.sim_aging)
    title = (f"scheduler (simulated {args.sim_seconds:g} s, {args.slots} slots x 1 s service, "
             f"heavy:light = {args.sim_ratio:g}:1 at {args.sim_load:g}x capacity, aging "
             f"{args.sim_aging:g} s, max_wait 600 s)")
    record = {f"{name} {key[0]} {key[1]}": {
        "calls": len(values), "p50_s": scheduler.percentile(values, .5),
        "p95_s": scheduler.percentile(values, .95), "p99_s": scheduler.percentile(values, .99)}
        for name, waits in results.items() for key, values in waits.items()}
    record["light_alone_p95_s"] = unloaded
    # What a hand-over costs as the queue holds more tenants: aging against none (the same
    # limiter, one candidate a class either way, so the cost should not grow with tenants).
    costs = {n: (scheduler.hand_over_cost(n, None), scheduler.hand_over_cost(n, args.sim_aging))
             for n in (128, 1_000, 5_000)}
    record["hand_over_us"] = {str(n): {"no_aging": off, "aging": on}
                              for n, (off, on) in costs.items()}
    lines = ["hand-over CPU, one call queued per tenant: tenants  no aging  aging  ratio"]
    lines += [f"{'':<48}{n:>7}  {off:>6.1f}  {on:>5.1f}  {on / off:>4.2f}x"
              for n, (off, on) in costs.items()]
    return f"{title}\n{scheduler.table(results, unloaded)}\n" + "\n".join(lines), record


def cancel_to_quiet(workdir: Path, rounds: int) -> tuple[str, list[float]]:
    """A run with 3 calls in flight (at an upstream that takes 30 s) and 5 queued is cancelled
    through the admin port; measured: from sending the cancel to the last of the 8 callers
    having its answer, ms, one replica, ``rounds`` times."""
    import asyncio

    import aiohttp

    token = "bench-admin-token"
    (workdir / "admin-token").write_text(token)
    with common.stopping() as live:
        upstream = common.start_upstream(workdir, 30.0, 0, name="slow-upstream")
        live.append(upstream)
        sluice = common.start_sluice(workdir, {
            "admin": {"token_file": str(workdir / "admin-token")},
            "routes": [{"name": "openai", "path_prefix": "/openai/", "upstream": upstream.url,
                        "protocol": "openai",
                        "concurrency": {"limit": 3, "queue": 10, "max_wait": "60s"}}]},
            name="sluice-cancel")
        live.append(sluice)

        async def one(session: aiohttp.ClientSession, run: str) -> float:
            headers = {**common.REQUEST_HEADERS, "X-Run-ID": run}

            async def call() -> float:
                async with session.post(sluice.url + common.UPSTREAM_PATH,
                                        data=common.REQUEST_BODY, headers=headers) as r:
                    await r.read()
                return time.monotonic()

            calls = [asyncio.create_task(call()) for _ in range(8)]
            while True:
                async with session.get(f"{sluice.admin}/admin/runs/{run}") as r:
                    # One tenant's run of that id (the benchmark's calls name no tenant).
                    shown = (await r.json())["runs"][0] if r.status == 200 else {}
                if shown.get("inflight") == 3 and shown.get("queued") == 5:
                    break
                await asyncio.sleep(0.01)
            sent = time.monotonic()
            async with session.post(f"{sluice.admin}/admin/runs/{run}/cancel",
                                    headers={"Authorization": f"Bearer {token}"}) as r:
                assert r.status == 200
            ends = await asyncio.gather(*calls)
            return (max(ends) - sent) * 1e3

        async def main() -> list[float]:
            async with aiohttp.ClientSession() as session:
                return [await one(session, f"bench-run-{i}") for i in range(rounds)]

        quiet = asyncio.run(main())
    return (f"cancel-to-quiet (3 in flight + 5 queued, one replica, {rounds} runs): "
            f"p50 {pct(quiet, .5):.1f} ms, p95 {pct(quiet, .95):.1f} ms, max {max(quiet):.1f} ms"
            ), quiet
