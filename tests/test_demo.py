"""``sluice demo --quick``: the whole demo as a user runs it, on its shortened schedule."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import pytest
from aiohttp import web

from proxy.demo import fakellm
from proxy.demo.cli import NO_PLOT
from proxy.demo.fleet import ABANDONED, Fleet, FleetRun
from proxy.demo.report import answers_line
from proxy.demo.storm import ModeResult
from tests.conftest import REPO, serve_app

README = (REPO / "README.md").read_text()


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
                  "p99 time to complete, s (completed steps only)", "tokens wasted",
                  "duplicate side effects"):
        row = next(line for line in text.splitlines() if line.startswith(label))
        assert len(row[len(label):].split()) >= 2, row
    # What the requests got back: every request the agents sent, in exactly one row (seen in
    # a new user's trial: those cut at a step's deadline were left out, 593 of 694 shown).
    sent = next(line for line in text.splitlines()
                if line.startswith("requests the agents sent")).split()[-2:]
    for title, total in zip(("direct", "through Sluice"), sent, strict=True):
        line = next(line.strip() for line in text.splitlines()
                    if line.strip().startswith(f"{title}, ") and " requests: " in line)
        shown, rows = line.removeprefix(f"{title}, ").split(" requests: ")
        counts = [int(row.rsplit(" (", 1)[0].rsplit(" ", 1)[1].replace(",", ""))
                  for row in rows.split(", ")]
        assert shown == total and sum(counts) == int(total.replace(",", "")), (line, total)
    assert "Upstream attempts per unit of work:" in text
    assert f"Full record: {record}" in text
    assert f"Plot: {plot}" in text or NO_PLOT in text
    if f"Plot: {plot}" in text:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    modes = json.loads(record.read_text())["modes"]
    direct, sluice = modes["direct"]["summary"], modes["sluice"]["summary"]
    assert direct["units"] == sluice["units"] > 0
    for mode in ("direct", "sluice"):
        answers = modes[mode]["answers"]
        assert sum(answers.values()) == modes[mode]["summary"]["agent_requests"], (mode, answers)
    assert sluice["amplification"] < direct["amplification"]
    # Its working files (configs, logs, event log, dead letters) are gone.
    assert list(scratch.iterdir()) == []


def test_the_no_plot_hint_gives_the_readmes_install_command():
    """Seen (new-user trial): the hint said ``pip install '.[bench]'``, the README's demo
    section ``.venv/bin/pip install -e '.[bench]'``."""
    demo = README.split("\n## See it work: `sluice demo`\n", 1)[1].split("\n## ", 1)[0]
    (said,) = re.findall(r"`([^`]*pip install[^`]*)`", demo)
    command = NO_PLOT.split("repository: ", 1)[1].split(";", 1)[0]
    assert command == said


def test_the_fake_providers_docstring_names_the_options_it_takes(capsys):
    """Seen (new-user trial): its docstring said ``--schedule JSON``; the code takes
    ``--provider``."""
    with pytest.raises(SystemExit):
        fakellm.main(["--help"])
    usage = capsys.readouterr().out
    named = re.findall(r"(--[a-z-]+)", fakellm.__doc__ or "")
    assert named and all(option in usage for option in named), (named, usage)


async def test_a_request_cut_at_its_steps_deadline_is_counted_once_as_abandoned():
    """Each step's first request gets a 503 the SDK retries at once; the retry is never
    answered, so the step's deadline cuts it: both requests are counted, the second as
    abandoned, and the report's rows sum to the requests sent."""
    seen: dict[str, int] = {}
    release = asyncio.Event()

    async def provider(request: web.Request) -> web.Response:
        await request.read()
        key = request.headers["Idempotency-Key"]
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 1:
            return web.Response(status=503, headers={"retry-after-ms": "1"})
        await release.wait()
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", provider)
    runner, port = await serve_app(app, handler_cancellation=True)
    try:
        fleet = Fleet(rate=10, arrivals_s=0.3, deadline_s=0.5, timeout_s=30, agents=1)
        run = FleetRun(fleet, f"http://127.0.0.1:{port}/v1/chat/completions")
        units = await run.run()
    finally:
        release.set()
        await runner.cleanup()
    assert len(units) == 3 and run.completed == 0
    assert [u.requests for u in units] == [2, 2, 2]
    assert dict(run.answers) == {"503": 3, ABANDONED: 3}
    line = answers_line(ModeResult("direct", units, dict(run.answers), upstream={}))
    assert line == ("direct, 6 requests: 503 3 (50%), "
                    "abandoned at the step deadline 3 (50%)")


def test_a_record_path_it_cannot_write_is_refused_before_the_run(tmp_path: Path, capsys):
    # A hostile trial: the whole demo ran (18 s quick, ~40 s full), then lost its record to a
    # FileNotFoundError traceback.
    from proxy.cli import main

    missing = tmp_path / "missing" / "record.json"
    assert main(["demo", "--quick", "--no-plot", "--json", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {str(missing)!r}: the directory" in err and "Traceback" not in err
