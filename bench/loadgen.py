"""A Python load generator for the benchmarks: closed loop (wrk's stand-in) or open loop.

Closed loop (``--connections N``): one process (uvloop) keeps N keep-alive connections busy for
``--duration`` seconds, each sending the POST back to back, as wrk does, and prints one JSON
line: ``{"requests", "errors", "status_errors", "duration_s", "latencies_us"}``. The overhead
benchmark runs one such process per "thread" when wrk is not installed. It is much slower than
wrk (several hundred us of CPU per request, on the same cores as the proxy under test), so its
figures compare only with each other. Install wrk for the real figures: ``apt-get install -y
wrk``.

Open loop (``--rate R``): a request is due every ``1/R`` seconds for ``--duration`` seconds,
sent when due whatever became of the earlier ones (the offered load does not drop when the
target slows down, unlike a closed loop), each with its own ``--timeout``. ``--processes P``
splits the due times round-robin over P worker processes started together. Prints one JSON
object: ``{"sent": [[due_s, lag_s, latency_s, status, outcome], ...]}``, where ``lag_s`` is how
late the request left (the generator's own shortfall), ``status`` is 0 without an answer, and
``outcome`` is ``ok``, the answer's ``X-Sluice-Reason``, ``status:N``, ``timeout`` or ``error``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time

import aiohttp
import uvloop


async def closed_loop(url: str, body: bytes, headers: dict[str, str], connections: int,
                      duration_s: float) -> dict[str, object]:
    """Drive the closed-loop load; returns the JSON record described in the module docstring."""
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


async def open_loop(url: str, body: bytes, headers: dict[str, str], rate: float,
                    duration_s: float, timeout_s: float, start_epoch: float, worker: int,
                    workers: int) -> list[list[object]]:
    """Send this worker's share of the due requests; returns their rows (module docstring)."""
    rows: list[list[object]] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # No pool limit: an open loop never waits for a free connection.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        start = time.perf_counter() + (start_epoch - time.time())

        async def one(due: float) -> None:
            sent = time.perf_counter()
            status, outcome = 0, "error"
            try:
                async with session.post(url, data=body, headers=headers,
                                        timeout=timeout) as response:
                    await response.read()
                    status = response.status
                    outcome = ("ok" if status < 400 else
                               response.headers.get("X-Sluice-Reason") or f"status:{status}")
            except TimeoutError:
                outcome = "timeout"
            except aiohttp.ClientError:
                outcome = "error"
            rows.append([round(due, 6), round(sent - start - due, 6),
                         round(time.perf_counter() - sent, 6), status, outcome])

        tasks = []
        for n in range(worker, int(rate * duration_s), workers):
            due = n / rate
            wait = start + due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(due)))
        await asyncio.gather(*tasks)
    return rows


def _open_worker(args: argparse.Namespace, headers: dict[str, str], start_epoch: float,
                 worker: int, queue: multiprocessing.Queue) -> None:
    rows = uvloop.run(open_loop(args.url, args.body.encode(), headers, args.rate,
                                args.duration, args.timeout, start_epoch, worker,
                                args.processes))
    queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", required=True)
    parser.add_argument("--header", action="append", default=[], help="NAME: VALUE")
    parser.add_argument("--connections", type=int, default=8, help="closed loop (8)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    parser.add_argument("--rate", type=float, help="open loop: requests due per second")
    parser.add_argument("--timeout", type=float, default=10.0, help="open loop: s per request")
    parser.add_argument("--processes", type=int, default=1, help="open loop: worker processes")
    args = parser.parse_args()
    headers = dict(h.split(": ", 1) for h in args.header)
    if args.rate is None:
        record = uvloop.run(closed_loop(args.url, args.body.encode(), headers,
                                        args.connections, args.duration))
        print(json.dumps(record), flush=True)
        return
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    start_epoch = time.time() + 0.3  # every worker starts on the same instant
    workers = [context.Process(target=_open_worker, args=(args, headers, start_epoch, i, queue))
               for i in range(args.processes)]
    for w in workers:
        w.start()
    rows = [row for _ in workers for row in queue.get()]
    for w in workers:
        w.join()
    rows.sort(key=lambda row: row[0])
    print(json.dumps({"sent": rows}), flush=True)


if __name__ == "__main__":
    main()
