"""Fallback load generator for ``bench/overhead.py`` when ``wrk`` is not installed.

One process (uvloop) keeps ``--connections`` keep-alive connections busy for ``--duration``
seconds, each sending the POST back to back (a closed loop, as wrk does), and prints one JSON
line: ``{"requests", "errors", "status_errors", "duration_s", "latencies_us"}``. The driver
runs one such process per "thread" and merges them.

It is much slower than wrk (it spends several hundred us of CPU per request itself, on the
same cores as the proxy under test), so the proxy runs at a lower rate and even its CPU time per
request (higher when fewer requests share a loop turn) does not compare with wrk's figures.
Install wrk for the real figures: ``apt-get install -y wrk``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import uvloop


async def run(url: str, body: bytes, headers: dict[str, str], connections: int,
              duration_s: float) -> dict[str, object]:
    """Drive the load; returns the JSON record described in the module docstring."""
    latencies: list[int] = []
    errors = 0
    status_errors = 0
    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        started = time.perf_counter()
        deadline = started + duration_s

        async def worker() -> None:
            nonlocal errors, status_errors
            while True:
                t0 = time.perf_counter()
                if t0 >= deadline:
                    return
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                        if response.status >= 400:
                            status_errors += 1
                except aiohttp.ClientError:
                    errors += 1
                    continue
                latencies.append(int((time.perf_counter() - t0) * 1e6))

        await asyncio.gather(*(worker() for _ in range(connections)))
        elapsed = time.perf_counter() - started
    return {"requests": len(latencies), "errors": errors, "status_errors": status_errors,
            "duration_s": elapsed, "latencies_us": latencies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", required=True)
    parser.add_argument("--header", action="append", default=[], help="NAME: VALUE")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    args = parser.parse_args()
    headers = dict(h.split(": ", 1) for h in args.header)
    record = uvloop.run(run(args.url, args.body.encode(), headers, args.connections,
                            args.duration))
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
