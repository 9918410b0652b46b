"""Run a Python program with a bytecode counter that SIGUSR1 starts and SIGUSR2 stops.

``python bench/optrace.py OUT.json -- python -m proxy serve ...`` (or ``python script.py``)
runs the program in this interpreter; between the two signals every Python bytecode executed
in the main thread is counted against its function, with the function's calls, and SIGUSR2
writes ``[[file:line:name, opcodes, calls], ...]`` to ``OUT.json``. With ``OPTRACE_LINES=1``
in its environment it also counts per source line and writes ``[[file:line, opcodes], ...]``
to ``OUT.json.lines``. ``bench/opcodes.py`` drives it.

Only frames that start while counting are counted (``sys.settrace`` applies to new frames):
the request path's coroutines and callbacks do, the event loop's own frame does not. It runs
the program ~50x slower, so it is for counting, never timing.
"""

from __future__ import annotations

import collections
import json
import os
import runpy
import signal
import sys
from types import FrameType
from typing import Any

_Key = tuple[str, int, str]


class Counter:
    """Opcodes and calls per function (``(file, first line, name)``)."""

    def __init__(self, lines: bool = False) -> None:
        self.opcodes: collections.Counter[_Key] = collections.Counter()
        self.calls: collections.Counter[_Key] = collections.Counter()
        self.lines: collections.Counter[tuple[str, int]] | None = (
            collections.Counter() if lines else None)

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            self.opcodes[(code.co_filename, code.co_firstlineno, code.co_name)] += 1
            if self.lines is not None:
                self.lines[(code.co_filename, frame.f_lineno)] += 1
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        code = frame.f_code
        self.calls[(code.co_filename, code.co_firstlineno, code.co_name)] += 1
        frame.f_trace_opcodes = True
        return self._local

    def start(self, *_: object) -> None:
        sys.settrace(self._global)

    def stop_and_write(self, path: str) -> None:
        sys.settrace(None)
        rows = [[f"{f}:{line}:{name}", self.opcodes[(f, line, name)],
                 self.calls[(f, line, name)]]
                for f, line, name in set(self.opcodes) | set(self.calls)]
        with open(path, "w") as out:
            json.dump(rows, out)
        if self.lines is not None:
            with open(path + ".lines", "w") as out:
                json.dump([[f"{f}:{line}", n] for (f, line), n in self.lines.items()], out)


def refuse_unsupported_python() -> None:
    """Exit (``SystemExit`` with the reason) on Python 3.12, whose ``sys.settrace`` never
    delivers the 'opcode' events a frame turns on from its 'call' event (CPython gh-114480,
    fixed in 3.13): every count would be 0."""
    if sys.version_info[:2] == (3, 12):
        raise SystemExit(f"optrace: Python {sys.version.split()[0]} delivers no opcode trace "
                         "events (CPython gh-114480): run it with Python 3.11 or 3.13+")


def main(argv: list[str]) -> None:
    refuse_unsupported_python()
    out, sep, *program = argv
    if sep != "--" or len(program) < 2:
        raise SystemExit("usage: optrace.py OUT.json -- python -m MODULE ARGS | python FILE ARGS")
    counter = Counter(lines=os.environ.get("OPTRACE_LINES") == "1")
    signal.signal(signal.SIGUSR1, counter.start)
    signal.signal(signal.SIGUSR2, lambda *_: counter.stop_and_write(out))
    args = program[1:]  # the interpreter named first is this one
    if args[0] == "-m":
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does: the checkout run from wins
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
