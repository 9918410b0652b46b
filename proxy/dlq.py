"""``sluice dlq``: inspect and replay dead-lettered work (SPEC, "Command line").

* ``list``: one line per record (the newest ``--limit``, 100 by default, oldest first): id,
  time (UTC), route, tenant, method and path, attempts, why retries ended, and the last
  replay's status; a last line says how many older records were left out.
* ``show ID``: the whole record as JSON, with its attempts and replays.
* ``replay ID``: send the recorded request once, straight to its route's upstream as the
  config names it now, with the recorded method, path, headers, body and idempotency key; the
  result is stored with the record. Credentials were removed when recording, so give them
  again with ``-H 'Authorization: Bearer ...'`` or ``--header-from-env NAME=ENVVAR`` (the
  latter keeps the secret out of the process list); ``--output FILE`` keeps the upstream's
  answer. Exit status 0 when the upstream answered below 400, 1 otherwise.
* ``purge``: delete every record.

Each reads the dead-letter file that ``dead_letter.path`` in ``--config`` names; the server
may be running meanwhile (the file is in WAL mode).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import orjson
from multidict import CIMultiDict

from policies.config import Config, RouteConfig
from policies.deadletter import DeadLetter, DeadLetterFile
from proxy.client import upstream_session
from proxy.forward import upstream_url

EXIT_FAILED = 1


def run(config: Config, args: argparse.Namespace) -> int:
    """Run ``sluice dlq <command>``; returns the exit status."""
    path = config.dead_letter.path
    if not Path(path).exists() and args.dlq_command != "purge":
        if args.dlq_command == "list":
            print(f"no dead letters ({path} does not exist)")
            return 0
        print(f"no dead letter {args.id} ({path} does not exist)", file=sys.stderr)
        return EXIT_FAILED
    store = DeadLetterFile(path)
    try:
        if args.dlq_command == "list":
            _list(store, args.limit)
            return 0
        if args.dlq_command == "purge":
            print(f"purged {store.purge()} record(s) from {path}")
            return 0
        letter = store.get(args.id)
        if letter is None:
            print(f"no dead letter {args.id} in {path}", file=sys.stderr)
            return EXIT_FAILED
        if args.dlq_command == "show":
            sys.stdout.buffer.write(orjson.dumps(letter.as_dict(), option=orjson.OPT_INDENT_2))
            sys.stdout.write("\n")
            return 0
        return _replay(config, store, letter, args)
    finally:
        store.close()


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _list(store: DeadLetterFile, limit: int) -> None:
    rows = store.list(limit)
    total = sum(store.depth().values())
    print(f"{'ID':>6}  {'CREATED (UTC)':20}  {'ROUTE':12}  {'TENANT':12}  {'ATTEMPTS':>8}  "
          f"{'REASON':20}  {'REPLAY':8}  REQUEST")
    for r in rows:
        replay = "-" if r["last_replay"] is None else str(r["last_replay"])
        print(f"{r['id']:>6}  {_when(r['created_at']):20}  {r['route']:12}  {r['tenant']:12}  "
              f"{r['attempts']:>8}  {r['reason']:20}  {replay:8}  {r['method']} {r['path']}")
    if total > len(rows):
        print(f"(the newest {len(rows)} of {total} records; {total - len(rows)} older ones left "
              f"out: --limit {total} lists them all)")


def _replay(config: Config, store: DeadLetterFile, letter: DeadLetter,
            args: argparse.Namespace) -> int:
    route = next((r for r in config.routes if r.name == letter.route), None)
    if route is None:
        print(f"dead letter {letter.id}: route {letter.route!r} is not in the config",
              file=sys.stderr)
        return EXIT_FAILED
    if letter.truncated:
        print(f"dead letter {letter.id}: its body was cut at {len(letter.body)} of "
              f"{letter.body_size} bytes (dead_letter.max_body_bytes), so it cannot be replayed",
              file=sys.stderr)
        return EXIT_FAILED
    headers: CIMultiDict[str] = CIMultiDict(letter.headers)
    try:
        for item in args.header:
            name, sep, value = item.partition(":")
            if not sep or not name.strip():
                raise ValueError(f"--header {item!r} is not 'NAME: VALUE'")
            headers[name.strip()] = value.strip()
        for item in args.header_from_env:
            name, sep, var = item.partition("=")
            if not sep or var not in os.environ:
                raise ValueError(f"--header-from-env {item!r}: no environment variable {var!r}")
            headers[name.strip()] = os.environ[var]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    started = time.monotonic()
    status, error, answer = asyncio.run(_send(route, letter, headers))
    duration = time.monotonic() - started
    store.add_replay(letter.id or 0, status, error, duration)
    if args.output and status is not None:
        Path(args.output).write_bytes(answer)
    result = f"HTTP {status}, {len(answer)} bytes" if status is not None else f"failed: {error}"
    print(f"replayed dead letter {letter.id} to {route.upstream}{letter.path}: {result} "
          f"in {duration:.3f}s")
    return 0 if status is not None and status < 400 else EXIT_FAILED


async def _send(route: RouteConfig, letter: DeadLetter,
                headers: CIMultiDict[str]) -> tuple[int | None, str | None, bytes]:
    """One attempt: ``(status, None, answer body)`` or ``(None, error kind, b"")``."""
    timeout = aiohttp.ClientTimeout(total=route.timeouts.total, connect=route.timeouts.connect)
    async with upstream_session() as session:
        try:
            async with session.request(
                letter.method, upstream_url(route.upstream, letter.path), headers=headers,
                data=letter.body or None, allow_redirects=False, timeout=timeout,
            ) as response:
                return response.status, None, await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return None, type(exc).__name__, b""
