"""Overhead of Sluice on streamed (SSE) LLM answers: direct vs through Sluice, in one run.

Three processes share the machine: a fake OpenAI upstream (its own process, so it is never the
client's bottleneck), Sluice (a real ``python -m proxy serve``), and this script as the client.
Each target is measured in the same run, so the figures compare only with each other:

* ``direct``: the client talks to the upstream itself (the baseline);
* ``sluice, http route``: Sluice forwarding bytes only (no usage parsing);
* ``sluice, openai route, metering only``: usage read (and the usage chunk asked for and
  stripped) for metrics and the event log, no limits;
* ``sluice, accounting``: an ``openai`` route with a token budget and a token rate limit, so
  every stream is reserved, parsed on the fly, stripped of the injected usage chunk and settled.
* ``sluice, accounting, client asks usage``: the same, but the client asked for the usage
  chunk itself, so no event is held back or stripped.

Two workloads:

* ``burst``: one stream of ``--events`` SSE events written back to back; reports events per
  second seen by the client and time to first byte.
* ``paced``: ``--concurrency`` streams at once, each event its own write ``--gap-ms`` apart (how
  LLM tokens arrive); reports time to first byte and Sluice's CPU time per event (user + system
  from ``/proc``), the figure that stays meaningful on a busy machine.

Targets are measured in rounds, each round visiting every target in turn, and the table gives
the median over the rounds, so load from other processes falls on every target alike.

Run: ``.venv/bin/python bench/streaming.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- the upstream (runs in its own process) ----------------------------------------------------

def _chunk(model: str, i: int) -> bytes:
    body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1,
            "model": model, "system_fingerprint": "fp_bench",
            "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "logprobs": None,
                         "finish_reason": None}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def _stream(request: web.Request) -> web.StreamResponse:
    payload = await request.json()
    events = int(request.headers.get("x-bench-events", "100"))
    gap = float(request.headers.get("x-bench-gap-ms", "0")) / 1000
    model = payload.get("model", "gpt-bench")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(events):
        await response.write(_chunk(model, i))
        if gap:
            await asyncio.sleep(gap)
    if (payload.get("stream_options") or {}).get("include_usage"):
        usage = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1,
                 "model": model, "choices": [],
                 "usage": {"prompt_tokens": 10, "completion_tokens": events,
                           "total_tokens": 10 + events}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def run_upstream(port: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _stream)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# -- helpers ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


async def wait_ready(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not come up")
            await asyncio.sleep(0.05)


def sluice_config(upstream: str, port: int, admin: int, events: str) -> str:
    return f"""
server: {{listen: "127.0.0.1:{port}", admin_listen: "127.0.0.1:{admin}"}}
events: {{path: "{events}"}}
routes:
  - name: plain
    path_prefix: /plain/
    upstream: {upstream}
    protocol: http
  - name: obs
    path_prefix: /obs/
    upstream: {upstream}
    protocol: openai
  - name: acct
    path_prefix: /acct/
    upstream: {upstream}
    protocol: openai
    usage: {{default_max_tokens: 100000}}
    rate: {{tokens: 1000000000/min}}
    budget: {{tokens: 1000000000000/day, per: tenant}}
"""


# -- the client -------------------------------------------------------------------------------

async def one_stream(session: aiohttp.ClientSession, url: str, events: int, gap_ms: float,
                     ask_usage: bool) -> tuple[float, int, float]:
    """(time to first byte, events received, total seconds) of one streamed request."""
    body: dict = {"model": "gpt-bench", "stream": True, "max_tokens": events + 10,
                  "messages": [{"role": "user", "content": "count for me"}]}
    if ask_usage:
        body["stream_options"] = {"include_usage": True}
    headers = {"x-bench-events": str(events), "x-bench-gap-ms": str(gap_ms),
               "Authorization": "Bearer sk-bench"}
    start = time.perf_counter()
    ttfb = 0.0
    received = 0
    carry = b""  # an event's start may straddle two chunks
    async with session.post(url, json=body, headers=headers) as r:
        assert r.status == 200, (r.status, await r.text())
        async for chunk in r.content.iter_any():
            if not ttfb:
                ttfb = time.perf_counter() - start
            data = carry + chunk
            received += data.count(b"data: {")
            carry = data[-6:]
    return ttfb, received, time.perf_counter() - start


async def round_of(session: aiohttp.ClientSession, url: str, pid: int | None,
                   args: argparse.Namespace, ask_usage: bool) -> dict:
    """One burst stream and one batch of paced streams against one target."""
    expected = args.events + (1 if ask_usage else 0)
    ttfb, received, total = await one_stream(session, url, args.events, 0, ask_usage)
    assert received == expected, (received, expected)
    cpu0 = cpu_seconds(pid) if pid else 0.0
    results = await asyncio.gather(*(
        one_stream(session, url, args.paced_events, args.gap_ms, ask_usage)
        for _ in range(args.concurrency)
    ))
    cpu1 = cpu_seconds(pid) if pid else 0.0
    paced_ttfb = sorted(r[0] for r in results)
    paced_events = sum(r[1] for r in results)
    assert paced_events == args.concurrency * (args.paced_events + (1 if ask_usage else 0))
    return {
        "burst_events_per_s": received / total,
        "burst_ttfb_ms": ttfb * 1000,
        "paced_ttfb_p50_ms": paced_ttfb[len(paced_ttfb) // 2] * 1000,
        "cpu_us_per_event": (cpu1 - cpu0) / paced_events * 1e6 if pid else None,
    }


async def measure(targets: list[tuple[str, str, int | None, bool]],
                  args: argparse.Namespace) -> dict[str, dict]:
    """Rounds over all targets in turn (so load from other processes hits each alike);
    the median of each figure over the rounds."""
    samples: dict[str, list[dict]] = {name: [] for name, *_ in targets}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
    ) as session:
        for _name, url, _, ask in targets:  # warm up: connections, caches, imports
            await asyncio.gather(*(one_stream(session, url, 20, 0, ask)
                                   for _ in range(args.concurrency)))
        for _ in range(args.rounds):
            for name, url, pid, ask in targets:
                samples[name].append(await round_of(session, url, pid, args, ask))
    return {
        name: {key: (None if rows[0][key] is None
                     else statistics.median(row[key] for row in rows))
               for key in rows[0]}
        for name, rows in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000, help="events per burst stream")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over all targets")
    parser.add_argument("--concurrency", type=int, default=32, help="paced streams at once")
    parser.add_argument("--paced-events", type=int, default=200, help="events per paced stream")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="gap between paced events")
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream:
        run_upstream(args.upstream)
    else:
        asyncio.run(run(args))


async def run(args: argparse.Namespace) -> None:
    up_port, port, admin = free_port(), free_port(), free_port()
    upstream_url = f"http://127.0.0.1:{up_port}"
    procs = [subprocess.Popen([sys.executable, __file__, "--upstream", str(up_port)])]
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "sluice.yaml")
        config.write_text(sluice_config(upstream_url, port, admin, str(Path(tmp, "ev.jsonl"))))
        sluice = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(config)], cwd=REPO,
            stderr=subprocess.DEVNULL,
        )
        procs.append(sluice)
        try:
            await wait_ready(upstream_url + "/")
            await wait_ready(f"http://127.0.0.1:{admin}/readyz")
            base = f"http://127.0.0.1:{port}"
            targets = [
                ("direct", upstream_url + "/v1/chat/completions", None, False),
                ("sluice, http route", base + "/plain/v1/chat/completions", sluice.pid, False),
                ("sluice, openai route, metering only", base + "/obs/v1/chat/completions",
                 sluice.pid, False),
                ("sluice, accounting", base + "/acct/v1/chat/completions", sluice.pid, False),
                ("sluice, accounting, client asks usage", base + "/acct/v1/chat/completions",
                 sluice.pid, True),
            ]
            rows = await measure(targets, args)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    print(f"\n{args.rounds} rounds, medians. burst: 1 stream of {args.events} events written "
          f"back to back; paced: {args.concurrency} concurrent streams x {args.paced_events} "
          f"events, {args.gap_ms:g} ms apart\n")
    header = ("target", "burst events/s", "burst TTFB ms", "paced TTFB p50 ms",
              "Sluice CPU us/event (paced)")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for name, m in rows.items():
        cpu = "-" if m["cpu_us_per_event"] is None else f"{m['cpu_us_per_event']:.1f}"
        print(f"| {name} | {m['burst_events_per_s']:,.0f} | {m['burst_ttfb_ms']:.2f} | "
              f"{m['paced_ttfb_p50_ms']:.2f} | {cpu} |")


if __name__ == "__main__":
    main()
