"""Throughput of replayed answers against forwarded ones, in one run.

The same closed-loop load (wrk, keep-alive, POST of a ~130-byte chat-completion request) goes
to, in turn:

* ``direct``: straight to the upstream (the baseline of this run);
* ``forwarded, no policy``: through Sluice on a route with no ``idempotency`` block (what
  Sluice costs without this policy, in the same run);
* ``forwarded, new key``: through Sluice with a distinct ``Idempotency-Key`` per request, so
  every request is looked up, forwarded, captured and stored (the store at its default cap,
  evicting);
* ``forwarded, no key``: through Sluice without a key (a fresh key is injected; nothing is
  stored);
* ``replayed``: through Sluice with one key for every request: after the first, each is
  answered from the store, without admission or upstream.

It runs for a fast upstream (answers at once) and a slow one (``--slow-delay``, 50 ms), where
forwarded throughput is bounded by the upstream and replays are not. Sluice is a real
``python -m proxy serve`` subprocess with one route in ``dedup`` mode and no other policy; the
upstream is ``bench/upstream.py`` (aiohttp + uvloop) in its own process, answering a ~480-byte
chat completion.

"Sluice CPU us/req" is the Sluice process's user+system CPU time (``/proc/PID/stat``) over the
measured run divided by the requests completed; it is the figure that stays stable on a shared
machine. Every process shares the machine's cores, so compare figures from the same run only.
Sluice's own counters (replays, upstream attempts) are read before and after each case to check
the case did what its name says.

The table goes to stdout, the record to ``bench/results/replay-<UTC time>.json`` and a plot
of req/s and CPU per request beside it (with matplotlib). Needs wrk.

    python -m bench replay                   # 8 s per case
    python -m bench replay --duration 4 --connections 32
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import common
from bench.common import REQUEST_BODY, UPSTREAM_PATH

# wrk script: POST the body; KEY_MODE "distinct" sends a new key per request, "same" one key,
# "none" no key. Each wrk thread runs its own copy, so the thread id keeps keys distinct.
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [[%(body)s]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench-not-a-real-key"
local mode = "%(mode)s"
local nonce = "%(nonce)s"
local threads = 0
function setup(thread)
  thread:set("thread_id", threads)
  threads = threads + 1
end
local n = 0
function request()
  n = n + 1
  if mode == "distinct" then
    wrk.headers["Idempotency-Key"] = nonce .. "-" .. (thread_id or 0) .. "-" .. n
  elseif mode == "same" then
    wrk.headers["Idempotency-Key"] = nonce
  end
  return wrk.format(nil, nil, wrk.headers, nil)
end
"""
COUNTERS = ("replays", "upstream_attempts")


@dataclass
class Result:
    target: str
    case: str
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_us: float | None = None
    replays: float | None = None
    attempts: float | None = None


def route_counters(admin_url: str, route: str) -> dict[str, float]:
    """The route's replays and upstream attempts so far (``/metrics``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    names = {"sluice_idempotent_replays_total": "replays",
             "sluice_upstream_attempts_total": "upstream_attempts"}
    with urllib.request.urlopen(admin_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("route") == route and sample.name in names:
                out[names[sample.name]] = sample.value
    return out


def measure(args: argparse.Namespace, tmp: Path, target: str, case: str, url: str, mode: str,
            connections: int, sluice: common.Service | None = None,
            route: str = "bench") -> Result:
    nonce = f"bench-{os.urandom(6).hex()}"
    # The warm-up stores the "same" key; distinct keys must not repeat in the measured run.
    warm_nonce = nonce if mode == "same" else f"{nonce}-warm"

    def wrk(key_nonce: str, duration: float) -> common.Load:
        script = WRK_SCRIPT % {"body": REQUEST_BODY, "mode": mode, "nonce": key_nonce}
        return common.run_wrk(args.wrk, url, args.threads, connections, duration, tmp,
                              script=script)

    wrk(warm_nonce, args.warmup)
    cpu0 = common.cpu_seconds(sluice.pid) if sluice else 0.0
    before = route_counters(sluice.admin, route) if sluice else {}
    load = wrk(nonce, args.duration)
    result = Result(target, case, load.requests, load.rps, load.p50_ms, load.p99_ms,
                    load.errors)
    if sluice is not None:
        result.cpu_us = (common.cpu_seconds(sluice.pid) - cpu0) / max(load.requests, 1) * 1e6
        after = route_counters(sluice.admin, route)
        result.replays = after["replays"] - before["replays"]
        result.attempts = after["upstream_attempts"] - before["upstream_attempts"]
    print(f"  {target:<22} {case:<20} {result.rps:,.0f} req/s", file=sys.stderr, flush=True)
    return result


def scenario(name: str, delay_s: float, connections: int, args: argparse.Namespace,
             tmp: Path) -> list[Result]:
    with common.stopping() as live:
        upstream = common.start_upstream(tmp, delay_s, name=f"upstream-{delay_s:g}s")
        live.append(upstream)
        config = {"routes": [
            {"name": "bench", "path_prefix": "/openai/", "upstream": upstream.url,
             "protocol": "openai", "idempotency": {"mode": "dedup"}},
            {"name": "plain", "path_prefix": "/plain/", "upstream": upstream.url,
             "protocol": "openai"}]}
        sluice = common.start_sluice(tmp, config, name=f"sluice-{delay_s:g}s")
        live.append(sluice)
        direct = upstream.url + UPSTREAM_PATH
        via = sluice.url + UPSTREAM_PATH
        plain = sluice.url.replace("/openai", "/plain") + UPSTREAM_PATH
        c = connections
        return [
            measure(args, tmp, name, "direct", direct, "none", c),
            measure(args, tmp, name, "forwarded, no policy", plain, "none", c, sluice, "plain"),
            measure(args, tmp, name, "forwarded, no key", via, "none", c, sluice),
            measure(args, tmp, name, "forwarded, new key", via, "distinct", c, sluice),
            measure(args, tmp, name, "replayed", via, "same", c, sluice),
        ]


def table(results: list[Result]) -> str:
    rows = [("upstream", "case", "req/s", "p50 ms", "p99 ms", "Sluice CPU us/req", "replays",
             "upstream", "errors")]
    for r in results:
        # Without Sluice's counters (direct), every completed request reached the upstream.
        rows.append((r.target, r.case, f"{r.rps:,.0f}", f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}",
                     common.fmt(r.cpu_us, ".0f"), common.fmt(r.replays, ",.0f"),
                     f"{r.attempts:,.0f}" if r.attempts is not None else f"{r.requests:,}",
                     str(r.errors)))
    return common.table(rows)


def plot(results: list[Result], path: Path) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    targets = list(dict.fromkeys(r.target for r in results))
    cases = list(dict.fromkeys(r.case for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(targets)
    for n, target in enumerate(targets):
        by_case = {r.case: r for r in results if r.target == target}
        xs = [i + n * width for i in range(len(cases))]
        axes[0].bar(xs, [by_case[c].rps for c in cases], width, label=target)
        axes[1].bar(xs, [by_case[c].cpu_us or 0 for c in cases], width, label=target)
    for ax, title in zip(axes, ("requests/s", "Sluice CPU per request, us"), strict=True):
        ax.set_xticks([i + width * (len(targets) - 1) / 2 for i in range(len(cases))], cases,
                      rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return common.save_plot(plt, fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.parser("replay", __doc__)
    p.add_argument("--duration", type=float, default=8, help="seconds per case (8)")
    p.add_argument("--warmup", type=float, default=1, help="seconds before each case (1)")
    p.add_argument("--threads", type=int, default=2, help="wrk threads (2)")
    p.add_argument("--connections", type=int, default=16, help="fast-upstream connections")
    p.add_argument("--slow-delay", type=float, default=0.05, help="slow upstream, seconds")
    p.add_argument("--slow-connections", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="3 s per case")
    p.add_argument("--output", type=Path, help="JSON result path (bench/results/...)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.wrk = common.find_wrk()
    if args.wrk is None:
        print("NOTE: the replay benchmark needs wrk (apt-get install -y wrk): skipped.",
              file=sys.stderr)
        return 0
    started = common.utcnow()
    info = common.versions()
    header = [*common.machine_lines("Sluice replay benchmark", started, info),
              f"wrk {args.threads} threads; fast: {args.connections} connections, slow "
              f"({args.slow_delay * 1e3:g} ms): {args.slow_connections}; {args.duration:g} s "
              "per case"]
    print("\n".join(header), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        workdir = Path(tmp)
        results = scenario("fast (answers at once)", 0.0, args.connections, args, workdir)
        results += scenario(f"slow ({args.slow_delay * 1000:g} ms)", args.slow_delay,
                            args.slow_connections, args, workdir)
    load1 = common.loadavg()
    print("\n".join([*header, f"load average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at "
                     "end", "", table(results)]), flush=True)
    out = common.result_path("replay", started, output=args.output)
    common.write_record(out, {"started": started.isoformat(), "versions": info,
                              "settings": {k: v for k, v in vars(args).items() if k != "output"},
                              "load_average_end": load1,
                              "results": [asdict(r) for r in results], "table": table(results)})
    print(f"\nfull record: {out}", file=sys.stderr)
    png = plot(results, out.with_suffix(".png"))
    if png:
        print(f"plot: {png}", file=sys.stderr)
    return 0
