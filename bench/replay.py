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
upstream is an aiohttp + uvloop app in its own process (``bench/replay.py upstream``) answering
a ~480-byte chat completion.

"Sluice CPU us/req" is the Sluice process's user+system CPU time (``/proc/PID/stat``) over the
measured run divided by the requests completed; it is the figure that stays stable on a shared
machine. Every process shares the machine's cores, so compare figures from the same run only.
Sluice's own counters (replays, upstream attempts) are read before and after each case to check
the case did what its name says.

    python bench/replay.py                   # 8 s per case
    python bench/replay.py --duration 4 --connections 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent

REQUEST_BODY = (
    '{"model":"gpt-4o-mini","messages":[{"role":"user","content":'
    '"Say hello in one short sentence, please."}],"max_tokens":16,"temperature":0}'
)
COMPLETION = (
    b'{"id":"chatcmpl-bench0000000000000000000000000","object":"chat.completion",'
    b'"created":1760000000,"model":"gpt-4o-mini-2024-07-18","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"Hello! How can I help you today?",'
    b'"refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":19,"completion_tokens":9,"total_tokens":28,'
    b'"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},'
    b'"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,'
    b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},'
    b'"service_tier":"default","system_fingerprint":"fp_bench"}'
)
UPSTREAM_PATH = "/v1/chat/completions"

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


# --- the upstream (run as `bench/replay.py upstream`) ----------------------------------------

def serve_upstream(port: int, delay_s: float) -> None:
    """Answer every POST with :data:`COMPLETION` after ``delay_s`` seconds."""
    import uvloop
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        if delay_s:
            await asyncio.sleep(delay_s)
        return web.Response(body=COMPLETION, content_type="application/json")

    app = web.Application()
    app.router.add_post(UPSTREAM_PATH, answer)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# --- the driver ----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not come up") from None
            time.sleep(0.05)


@contextlib.contextmanager
def process(args: list[str], **kwargs) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, **kwargs)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counters(admin_url: str, route: str) -> dict[str, float]:
    with urllib.request.urlopen(admin_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("route") == route and sample.name in (
                    "sluice_idempotent_replays_total", "sluice_upstream_attempts_total"):
                out[sample.name] = sample.value
    return out


@dataclass
class Result:
    target: str
    case: str
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    cpu_us: float | None = None
    replays: float | None = None
    attempts: float | None = None


_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def run_wrk(url: str, mode: str, nonce: str, args: argparse.Namespace, connections: int,
            duration_s: int) -> dict[str, float]:
    script = WRK_SCRIPT % {"body": REQUEST_BODY, "mode": mode, "nonce": nonce}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        out = subprocess.run(
            ["wrk", "-t", str(args.threads), "-c", str(connections),
             "-d", f"{duration_s}s", "--latency", "-s", f.name, url],
            capture_output=True, text=True, timeout=duration_s + 30,
        )
        if out.returncode:
            raise SystemExit(f"wrk failed: {out.stderr or out.stdout}")
        out = out.stdout
    finally:
        os.unlink(f.name)
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    pct = {m.group(1): float(m.group(2)) * _UNITS_MS[m.group(3)]
           for m in re.finditer(r"\s(50|99)%\s+([\d.]+)(us|ms|s)\b", out)}
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    if errors:
        print(f"  wrk socket errors: {errors.group(1)}", file=sys.stderr)
    return {"requests": requests, "rps": rps, "p50": pct.get("50", 0.0),
            "p99": pct.get("99", 0.0), "non_2xx": int(non_2xx.group(1)) if non_2xx else 0}


def measure(target: str, case: str, url: str, mode: str, args: argparse.Namespace,
            connections: int, sluice: subprocess.Popen | None = None,
            admin_url: str | None = None, route: str = "bench") -> Result:
    nonce = f"bench-{os.urandom(6).hex()}"
    # The warm-up stores the "same" key; distinct keys must not repeat in the measured run.
    warm_nonce = nonce if mode == "same" else f"{nonce}-warm"
    run_wrk(url, mode, warm_nonce, args, connections, args.warmup)
    before_cpu = cpu_seconds(sluice.pid) if sluice else 0.0
    before = counters(admin_url, route) if admin_url else {}
    w = run_wrk(url, mode, nonce, args, connections, args.duration)
    result = Result(target, case, int(w["requests"]), w["rps"], w["p50"], w["p99"],
                    int(w["non_2xx"]))
    if sluice is not None and admin_url is not None:
        result.cpu_us = (cpu_seconds(sluice.pid) - before_cpu) / max(result.requests, 1) * 1e6
        after = counters(admin_url, route)
        result.replays = after["sluice_idempotent_replays_total"] - before[
            "sluice_idempotent_replays_total"]
        result.attempts = after["sluice_upstream_attempts_total"] - before[
            "sluice_upstream_attempts_total"]
    return result


def scenario(name: str, delay_s: float, connections: int, args: argparse.Namespace,
             workdir: Path) -> list[Result]:
    up_port, port, admin_port = free_port(), free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "admin_listen": f"127.0.0.1:{admin_port}"},
        "events": {"path": str(workdir / f"events-{name}.jsonl")},
        "routes": [{"name": "bench", "path_prefix": "/openai/",
                    "upstream": f"http://127.0.0.1:{up_port}", "protocol": "openai",
                    "idempotency": {"mode": "dedup"}},
                   {"name": "plain", "path_prefix": "/plain/",
                    "upstream": f"http://127.0.0.1:{up_port}", "protocol": "openai"}],
    }
    config_path = workdir / f"sluice-{name}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    with process([sys.executable, __file__, "upstream", "--port", str(up_port),
                  "--delay", str(delay_s)]), \
         process([sys.executable, "-m", "proxy", "serve", "--config", str(config_path)],
                 cwd=REPO, stderr=(workdir / f"sluice-{name}.stderr").open("wb")) as sluice:
        admin_url = f"http://127.0.0.1:{admin_port}"
        wait_http(f"http://127.0.0.1:{up_port}/")
        wait_http(admin_url + "/readyz")
        direct = f"http://127.0.0.1:{up_port}{UPSTREAM_PATH}"
        via = f"http://127.0.0.1:{port}/openai{UPSTREAM_PATH}"
        plain = f"http://127.0.0.1:{port}/plain{UPSTREAM_PATH}"
        c = connections
        return [
            measure(name, "direct", direct, "none", args, c),
            measure(name, "forwarded, no policy", plain, "none", args, c, sluice, admin_url,
                    "plain"),
            measure(name, "forwarded, no key", via, "none", args, c, sluice, admin_url),
            measure(name, "forwarded, new key", via, "distinct", args, c, sluice, admin_url),
            measure(name, "replayed", via, "same", args, c, sluice, admin_url),
        ]


def print_table(results: list[Result]) -> None:
    header = (f"{'upstream':<22} {'case':<20} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'Sluice CPU us/req':>18} {'replays':>9} {'upstream':>9} {'non-2xx':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        cpu = f"{r.cpu_us:.0f}" if r.cpu_us is not None else "-"
        replays = f"{r.replays:.0f}" if r.replays is not None else "-"
        # Without Sluice's counters (direct), every completed request reached the upstream.
        attempts = f"{r.attempts:.0f}" if r.attempts is not None else f"{r.requests}"
        print(f"{r.target:<22} {r.case:<20} {r.rps:>9.0f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f} "
              f"{cpu:>18} {replays:>9} {attempts:>9} {r.non_2xx:>8}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "upstream":
        parser = argparse.ArgumentParser(prog="replay.py upstream")
        parser.add_argument("upstream")
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--delay", type=float, default=0.0)
        a = parser.parse_args()
        serve_upstream(a.port, a.delay)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=8, help="seconds per case")
    parser.add_argument("--warmup", type=int, default=1, help="seconds before each case")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--connections", type=int, default=16, help="fast-upstream connections")
    parser.add_argument("--slow-delay", type=float, default=0.05, help="slow upstream, seconds")
    parser.add_argument("--slow-connections", type=int, default=64)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install -y wrk")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        results = scenario("fast (answers at once)", 0.0, args.connections, args, workdir)
        results += scenario(f"slow ({args.slow_delay * 1000:g} ms)", args.slow_delay,
                            args.slow_connections, args, workdir)
    print(f"\nwrk {args.threads} threads; fast: {args.connections} connections, slow: "
          f"{args.slow_connections}; {args.duration} s per case; load average "
          f"{os.getloadavg()[0]:.2f}\n")
    print_table(results)


if __name__ == "__main__":
    main()
