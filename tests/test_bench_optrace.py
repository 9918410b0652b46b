"""``bench/optrace.py``, the bytecode counter ``python -m bench opcodes`` runs each target under.

Seen (a trial on Python 3.12.1): every target counted 0 opcodes per request and the table
then divided by zero, as 3.12's ``sys.settrace`` drops the opcode events optrace turns on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import opcodes

REPO = Path(__file__).resolve().parents[1]
# A program that has itself counted (SIGUSR1), calls ``work`` twice and writes (SIGUSR2).
PROGRAM = """
import os, signal

def work(n):
    total = 0
    for i in range(n):
        total += i
    return total

os.kill(os.getpid(), signal.SIGUSR1)
work(10)
work(10)
os.kill(os.getpid(), signal.SIGUSR2)
"""


def test_optrace_counts_opcodes_or_refuses_a_python_that_drops_them(tmp_path):
    script, out = tmp_path / "program.py", tmp_path / "out.json"
    script.write_text(PROGRAM)
    run = subprocess.run([sys.executable, str(REPO / "bench" / "optrace.py"), str(out), "--",
                          sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    if sys.version_info[:2] == (3, 12):
        assert run.returncode == 1 and "gh-114480" in run.stderr and not out.exists()
        with pytest.raises(SystemExit, match=r"3\.11 or 3\.13\+"):  # before a target starts
            opcodes.main([])
        return
    assert run.returncode == 0, run.stderr
    counted = {where.rsplit(":", 1)[1]: ops for where, ops, _ in json.loads(out.read_text())}
    assert counted["work"] > 0


@pytest.mark.skipif(sys.version_info[:2] == (3, 12), reason="3.12 delivers no opcode events "
                    "switched on from a call event (CPython gh-114480): optrace refuses it")
def test_optrace_counts_per_line_and_opcodes_lists_the_costliest_with_their_text(tmp_path):
    """``bench opcodes --lines N``: OPTRACE_LINES=1 has optrace count per source line too, and
    ``costly_lines`` prints each row's source text, a row with no line number (``None``, a
    frame not yet on its first line) without it."""
    script, out = tmp_path / "program.py", tmp_path / "out.json"
    script.write_text(PROGRAM)
    run = subprocess.run([sys.executable, str(REPO / "bench" / "optrace.py"), str(out), "--",
                          sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, cwd=REPO, env={**os.environ, "OPTRACE_LINES": "1"})
    assert run.returncode == 0, run.stderr
    lines = {where.rsplit(":", 1)[1]: ops
             for where, ops in json.loads(Path(f"{out}.lines").read_text())}
    loop_line = str(PROGRAM.splitlines().index("        total += i") + 1)
    assert lines[loop_line] >= 20  # 10 turns of two calls
    case = {"target": "t", "lines": [["bench/optrace.py:1", 5.0], ["bench/optrace.py:None", 2.0]]}
    table = "\n".join(opcodes.costly_lines(case, 2))
    first = (REPO / "bench" / "optrace.py").read_text().splitlines()[0].strip()
    assert first[:70] in table and "bench/optrace.py:None" in table
