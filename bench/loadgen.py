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
target slows down, unlike a closed loop), each with its own ``--timeout``, over keep-alive
connections opened as needed (see :class:`_Exchange` for why not aiohttp's client).
``--processes P`` splits the due times round-robin over P worker processes started together.
Prints one JSON object: ``{"sent": [[due_s, lag_s, latency_s, status, outcome], ...]}``,
where ``lag_s`` is how late the request left (the generator's own shortfall), ``status`` is 0
without an answer, and ``outcome`` is ``ok``, the answer's ``X-Sluice-Reason``, ``status:N``,
``timeout`` or ``error``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time

import aiohttp
import uvloop
from yarl import URL


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


class _Exchange(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that carries one request at a time.

    The open loop's client. aiohttp's costs ~300 us of CPU per request, as much as the proxy
    under test: at 1,600 requests/s the generator then fell behind its schedule and its own
    event-loop delays were measured as the proxy's latency. This one writes prebuilt request
    bytes and reads only the status line, ``Content-Length``, ``X-Sluice-Reason`` and
    ``Connection`` (a chunked body is read to its last chunk): ~10x cheaper.
    """

    def __init__(self, idle: list[_Exchange]) -> None:
        self.idle = idle
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, str]] | None = None
        self.closed = False
        self.keep = True
        self.status = 0
        self.reason = ""
        self.body_end = -1  # buffer offset where the body ends, once the head is parsed
        self.chunked = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))

    def send(self, data: bytes) -> asyncio.Future[tuple[int, str]]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.buffer.clear()
        self.body_end = -1
        self.transport.write(data)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.body_end < 0:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            lines = bytes(self.buffer[:head_end]).split(b"\r\n")
            self.status = int(lines[0].split(b" ", 2)[1])
            length, self.reason, self.keep, self.chunked = 0, "", True, False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"x-sluice-reason":
                    self.reason = value.strip().decode()
                elif name == b"connection" and value.strip().lower() == b"close":
                    self.keep = False
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    self.chunked = True
            self.body_end = head_end + 4 + length
        done = (self.buffer.endswith(b"0\r\n\r\n") if self.chunked
                else len(self.buffer) >= self.body_end)
        if done and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.status, self.reason))
            if self.keep:
                self.idle.append(self)
            elif self.transport is not None:
                self.transport.close()


async def open_loop(url: str, body: bytes, headers: dict[str, str], rate: float,
                    duration_s: float, timeout_s: float, start_epoch: float, worker: int,
                    workers: int) -> list[list[object]]:
    """Send this worker's share of the due requests; returns their rows (module docstring)."""
    target = URL(url)
    host, port = target.host or "127.0.0.1", target.port or 80
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    request = (f"POST {target.raw_path_qs} HTTP/1.1\r\nHost: {host}:{port}\r\n{head}"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    idle: list[_Exchange] = []
    rows: list[list[object]] = []
    start = time.perf_counter() + (start_epoch - time.time())

    async def one(due: float) -> None:
        sent = time.perf_counter()
        status, outcome = 0, "error"
        exchange = None
        try:
            async with asyncio.timeout(timeout_s):
                while idle:
                    candidate = idle.pop()
                    if not candidate.closed:
                        exchange = candidate
                        break
                if exchange is None:  # an open loop never waits for a free connection
                    _, exchange = await loop.create_connection(lambda: _Exchange(idle), host,
                                                               port)
                status, reason = await exchange.send(request)
                outcome = "ok" if status < 400 else reason or f"status:{status}"
        except TimeoutError:
            outcome = "timeout"
            if exchange is not None and exchange.transport is not None:
                exchange.transport.abort()
        except OSError:
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
    for exchange in idle:
        if exchange.transport is not None:
            exchange.transport.close()
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
