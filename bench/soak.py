"""Memory under a long run: every call a new tenant, run and idempotency key.

A real Sluice (``python -m proxy serve``) sits in front of ``bench/upstream.py`` (answers at
once); wrk sends POST chat completions back to back over keep-alive connections, each with a
``X-Tenant-ID``, ``X-Run-ID`` and ``Idempotency-Key`` never used before. The route carries
every policy that keeps state per tenant, run or key: a per-tenant concurrency limit, a
per-tenant request rate, a per-tenant token budget per day, a per-run token budget in total,
and idempotency in ``dedup`` mode (each answer stored). The event log goes to ``/dev/null``
(a million calls would write ~0.5 GB of it).

The Sluice process's resident memory (``VmRSS`` in ``/proc/PID/status``) is sampled every
``--sample`` seconds, with the calls answered so far (``/metrics``). The sample at the end of
the warm-up (``--warmup``, a fifth of the run by default) is the baseline; growth is the last
sample over it. A bounded process levels off after the warm-up; unbounded per-tenant or
per-run state keeps rising with the calls.

The table goes to stdout, the record to ``bench/results/soak-<UTC time>.json`` and a plot of
RSS over time beside it (with matplotlib). Needs wrk.

    python -m bench soak                # 30 minutes
    python -m bench soak --quick        # 2 minutes
    python -m bench soak --duration 600 --connections 64
    python -m bench soak --quick --leave-out budget   # the route without its budget blocks
    python -m bench soak --quick --max-budget-counters 100000   # the cap reached in the run
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.common import REQUEST_BODY

# wrk script: every request gets a tenant, run and key of its own (thread id + counter), and
# the done() hook of common.WRK_DONE prints the summary line.
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [[%(body)s]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench-not-a-real-key"
local nonce = "%(nonce)s"
local threads = 0
function setup(thread)
  thread:set("thread_id", threads)
  threads = threads + 1
end
local n = 0
function request()
  n = n + 1
  local id = nonce .. "-" .. (thread_id or 0) .. "-" .. n
  wrk.headers["X-Tenant-ID"] = "t-" .. id
  wrk.headers["X-Run-ID"] = "r-" .. id
  wrk.headers["Idempotency-Key"] = "k-" .. id
  return wrk.format(nil, nil, wrk.headers, nil)
end
"""


#: The route's policy blocks ``--leave-out`` can drop, to tell one's growth from another's.
POLICIES = ("concurrency", "rate", "budget", "idempotency")


def config(upstream_url: str, tmp: Path, leave_out: tuple[str, ...] = (),
           max_budget_counters: int | None = None) -> dict:
    """One route with every per-tenant, per-run and per-key policy, none of them binding,
    less the blocks named in ``leave_out``; ``max_budget_counters`` sets
    ``state.max_budget_counters`` (else its default)."""
    config: dict = {
        "events": {"path": os.devnull},
        "dead_letter": {"path": str(tmp / "soak-dlq.sqlite")},
        "routes": [{
            "name": "soak", "path_prefix": "/openai/", "upstream": upstream_url,
            "protocol": "openai",
            "concurrency": {"limit": 256, "queue": 256, "max_wait": "5s", "per_tenant": 4},
            "rate": {"requests": "10000000/min", "per_tenant": {"requests": "600/min"}},
            "budget": [{"tokens": "1000000/day", "per": "tenant"},
                       {"tokens": "100000/total", "per": "run"}],
            "idempotency": {"mode": "dedup"},
        }],
    }
    for block in leave_out:
        del config["routes"][0][block]
    if max_budget_counters is not None:
        config["state"] = {"max_budget_counters": max_budget_counters}
    return config


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid``, MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def answered(admin: str) -> int:
    """Calls Sluice has finished so far, whatever their outcome."""
    counts = common.sluice_counters(admin)
    return int(sum(v for k, v in counts.items() if k.startswith("outcome:")))


def main(argv: list[str]) -> int:
    p = common.parser("soak", __doc__)
    p.add_argument("--quick", action="store_true", help="2 minutes instead of 30")
    p.add_argument("--duration", type=float, help="seconds of load (1800; --quick 120)")
    p.add_argument("--warmup", type=float,
                   help="seconds before the baseline sample (a fifth of the duration)")
    p.add_argument("--sample", type=float, help="seconds between samples (10; --quick 2)")
    p.add_argument("--connections", type=int, default=32, help="wrk connections (32)")
    p.add_argument("--threads", type=int, default=2, help="wrk threads (2)")
    p.add_argument("--leave-out", action="append", choices=POLICIES, default=[],
                   metavar="POLICY", help=f"drop this policy block from the route (one of "
                   f"{', '.join(POLICIES)}; repeatable)")
    p.add_argument("--max-budget-counters", type=int, metavar="N",
                   help="state.max_budget_counters (default 1,000,000): a small one shows the "
                   "cap holding memory within a short run (new tenants then get 503)")
    p.add_argument("--output", type=Path, help="record path (default bench/results/...)")
    args = p.parse_args(argv)
    leave_out = tuple(args.leave_out)
    duration = args.duration or (120.0 if args.quick else 1800.0)
    warmup = args.warmup if args.warmup is not None else duration / 5
    every = args.sample or (2.0 if args.quick else 10.0)
    wrk = common.find_wrk()
    if wrk is None:
        print("python -m bench soak needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    started = common.utcnow()
    info = common.versions()
    title = f"soak: {duration:g}s of distinct tenants, runs and keys"
    if leave_out:
        title += f" (without {', '.join(leave_out)})"
    for line in common.machine_lines(title, started, info):
        print(line)
    samples: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp_name, common.stopping() as live:
        tmp = Path(tmp_name)
        upstream = common.start_upstream(tmp)
        live.append(upstream)
        sluice = common.start_sluice(tmp, config(upstream.url, tmp, leave_out,
                                                args.max_budget_counters))
        live.append(sluice)
        script = tmp / "soak.lua"
        script.write_text(WRK_SCRIPT % {"body": REQUEST_BODY, "nonce": os.urandom(4).hex()}
                          + common.WRK_DONE)
        load = subprocess.Popen(
            [wrk, f"-t{args.threads}", f"-c{args.connections}", f"-d{duration:g}s",
             "--timeout", "10s", "-s", str(script), sluice.url + common.UPSTREAM_PATH],
            stdout=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while load.poll() is None:
            elapsed = time.monotonic() - t0
            samples.append({"t_s": round(elapsed, 1), "rss_mb": round(rss_mb(sluice.pid), 1),
                            "calls": answered(sluice.admin)})
            time.sleep(max(0.0, every - (time.monotonic() - t0 - elapsed)))
        out = load.communicate()[0]
        final = {"t_s": round(time.monotonic() - t0, 1), "rss_mb": round(rss_mb(sluice.pid), 1),
                 "calls": answered(sluice.admin)}
        samples.append(final)
        counts = common.sluice_counters(sluice.admin)
    line = next((ln for ln in out.splitlines() if ln.startswith("BENCH_JSON ")), None)
    summary = json.loads(line.removeprefix("BENCH_JSON ")) if line else {}
    base = next((s for s in samples if s["t_s"] >= warmup), samples[-1])
    growth = (final["rss_mb"] - base["rss_mb"]) / base["rss_mb"] * 100
    rows = [["t (s)", "calls", "RSS (MiB)"]]
    step = max(1, len(samples) // 20)
    rows += [[f"{s['t_s']:.0f}", f"{s['calls']:,}", f"{s['rss_mb']:.1f}"]
             for i, s in enumerate(samples) if i % step == 0 or s is final]
    print()
    print(common.table(rows, left=0))
    errors = {k: v for k, v in summary.items()
              if k in ("connect", "read", "write", "status", "timeout") and v}
    outcomes = {k.removeprefix("outcome:"): int(v) for k, v in counts.items()
                if k.startswith("outcome:") and v}
    print(f"\ncalls: {final['calls']:,} in {final['t_s']:.0f}s "
          f"({final['calls'] / max(final['t_s'], 1e-9):,.0f}/s); outcomes {outcomes}; "
          f"wrk errors {errors or 'none'}")
    print(f"RSS: {samples[0]['rss_mb']:.1f} MiB at start, {base['rss_mb']:.1f} MiB after the "
          f"{warmup:g}s warm-up ({base['calls']:,} calls), {final['rss_mb']:.1f} MiB at the end, "
          f"peak {max(s['rss_mb'] for s in samples):.1f} MiB: growth after warm-up "
          f"{growth:+.1f}%")
    record = {"benchmark": "soak", "started": started.isoformat(), "versions": info,
              "duration_s": duration, "warmup_s": warmup, "left_out": leave_out,
              "max_budget_counters": args.max_budget_counters,
              "connections": args.connections,
              "samples": samples, "baseline": base, "final": final, "growth_pct": growth,
              "outcomes": outcomes, "wrk": summary}
    path = common.write_record(common.result_path("soak", started, output=args.output), record)
    print(f"record: {path}")
    plt = common.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([s["t_s"] for s in samples], [s["rss_mb"] for s in samples])
        ax.axvline(warmup, linestyle=":", color="grey")
        ax.set_xlabel("seconds")
        ax.set_ylabel("Sluice RSS (MiB)")
        ax.set_title("soak: distinct tenants, runs and keys per call")
        print(f"plot: {common.save_plot(plt, fig, path.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
