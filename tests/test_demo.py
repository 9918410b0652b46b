"""``sluice demo --quick``: the whole demo as a user runs it, on its shortened schedule."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import pytest

from proxy.demo import fakellm
from tests.conftest import REPO


async def test_demo_quick_prints_the_comparison_and_sluice_cuts_amplification(tmp_path: Path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    record = tmp_path / "demo.json"
    plot = tmp_path / "demo.png"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "demo", "--quick", "--plot", str(plot), "--json",
        str(record), cwd=REPO, env={**os.environ, "TMPDIR": str(scratch)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=110)
    text = out.decode()
    assert proc.returncode == 0, err.decode()

    # The side-by-side table, with both columns, and the sentences under it.
    header = next(line for line in text.splitlines() if "through Sluice" in line
                  and line.strip().startswith("direct"))
    assert header.split() == ["direct", "through", "Sluice"]
    for label in ("units of work", "upstream attempts per unit of work", "completed within",
                  "p99 time to complete, s", "tokens wasted", "duplicate side effects"):
        row = next(line for line in text.splitlines() if line.startswith(label))
        assert len(row[len(label):].split()) >= 2, row
    assert "Upstream attempts per unit of work:" in text
    assert f"Full record: {record}" in text
    assert f"Plot: {plot}" in text or "No plot: matplotlib is not installed" in text
    if f"Plot: {plot}" in text:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    modes = json.loads(record.read_text())["modes"]
    direct, sluice = modes["direct"]["summary"], modes["sluice"]["summary"]
    assert direct["units"] == sluice["units"] > 0
    assert sluice["amplification"] < direct["amplification"]
    # Its working files (configs, logs, event log, dead letters) are gone.
    assert list(scratch.iterdir()) == []


def test_the_fake_providers_docstring_names_the_options_it_takes(capsys):
    """Seen (new-user trial): its docstring said ``--schedule JSON``; the code takes
    ``--provider``."""
    with pytest.raises(SystemExit):
        fakellm.main(["--help"])
    usage = capsys.readouterr().out
    named = re.findall(r"(--[a-z-]+)", fakellm.__doc__ or "")
    assert named and all(option in usage for option in named), (named, usage)
