"""``python -m bench NAME [options]``: run one benchmark, or ``all`` of them.

Benchmarks (``python -m bench NAME --help`` for each one's options):

* ``overhead``: CPU per request and added latency: direct vs Sluice vs a bare aiohttp proxy
  (and HAProxy when installed), on a fast and on a 50 ms upstream;
* ``instructions``: user-space instructions per request (callgrind) of Sluice and the bare
  proxy: the overhead figure the machine's load does not move;
* ``opcodes``: Python bytecodes per request, by function: where that figure goes;
* ``overload``: offered load 0.5x to 10x an upstream's capacity: goodput, latency of admitted
  requests, latency of refusals;
* ``storm``: a retry storm on a degrading fake LLM provider (the ``sluice demo`` scenario):
  amplification, completion within a deadline, wasted tokens, duplicate side effects;
* ``fairness``: one noisy tenant and quiet ones, with and without ``per_tenant``;
* ``replay``: idempotent replays against forwarded requests;
* ``soak``: Sluice's memory over a long run (30 minutes, ``--quick`` 2) in which every call
  has a new tenant, run and idempotency key.
* ``mcp_refusals``: how the official MCP clients take a refused ``tools/call`` (docs/mcp.md).

Each prints its table (with the machine's core count and load average), and writes a JSON
record and, with matplotlib installed (``.venv/bin/pip install -e '.[bench]'``), a PNG plot under
``bench/results/``. ``all [--quick]`` runs every one with its defaults (or its ``--quick``).
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ("overhead", "instructions", "opcodes", "overload", "storm", "fairness", "replay",
              "soak", "mcp_refusals")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "all":
        if set(rest) - {"--quick"}:
            print("python -m bench all takes only --quick", file=sys.stderr)
            return 2
        status = 0
        for each in BENCHMARKS:
            print(f"\n=== {each} ===", flush=True)
            status |= importlib.import_module(f"bench.{each}").main(rest)
        return status
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}; one of: {', '.join(BENCHMARKS)}, all",
              file=sys.stderr)
        return 2
    return importlib.import_module(f"bench.{name}").main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
