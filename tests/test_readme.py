"""The README's copy-paste commands, run as a user would against a live Sluice.

Each ``sh`` block of the sections below is run with bash (``set -e``), with the README's
default addresses and ``my-sluice.yaml`` replaced by the test's own, and the virtualenv's
``bin`` (``sluice``, ``hadolint``, ``kubernetes-validate``) on ``PATH``. A block preceded by a
``<!-- not run by tests: REASON -->`` line is skipped (it needs a cluster or a Docker engine).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proxy.config import StrictLoader, parse_config
from tests.conftest import REPO, SluiceProcess, route
from tests.test_deploy import tool

README = (REPO / "README.md").read_text()
TESTED_SECTIONS = ("Trace an agent run", "Tune limits while it runs",
                   "Deploy as a Kubernetes sidecar", "Read the dashboard and alerts")


def blocks(section: str) -> list[str]:
    """The runnable ``sh`` blocks of a ``## section`` of the README."""
    body = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"(<!-- not run by tests: [^>]+ -->\n)?```sh\n(.*?)```", body, re.S)
    return [code for skip, code in found if not skip]


def run_block(code: str, sluice: SluiceProcess | None = None) -> str:
    """Run one README block as bash; its standard output."""
    if sluice is not None:
        code = (code.replace("127.0.0.1:8080", f"127.0.0.1:{sluice.port}")
                .replace("127.0.0.1:9901", f"127.0.0.1:{sluice.admin_port}")
                .replace("my-sluice.yaml", str(sluice.config_path)))
    env = {**os.environ, "OPENAI_API_KEY": "sk-readme-test",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"README block failed:\n{code}\n{result.stdout}{result.stderr}"
    return result.stdout


def test_every_runnable_block_is_in_a_tested_section():
    sections = re.findall(r"^## (.+)$", README, re.M)
    new = sections[sections.index(TESTED_SECTIONS[0]):]
    assert [s for s in new if blocks(s)] == list(TESTED_SECTIONS)


async def test_trace_an_agent_run(upstream, start_sluice, tmp_path):
    sluice = await start_sluice({
        "events": {"path": str(tmp_path / "sluice-events.jsonl")},
        "routes": [route("openai", upstream.url)]},
        config_path=tmp_path / "my-sluice.yaml")
    (code,) = blocks("Trace an agent run")
    curl, timeline = code.split("\nsluice timeline")
    out = await asyncio.to_thread(run_block, curl, sluice)
    assert json.loads(out)["choices"][0]["message"]["content"] == "hello from fake"
    assert upstream.requests[0].headers["Authorization"] == "Bearer sk-readme-test"
    deadline = asyncio.get_running_loop().time() + 10
    while "completed" not in (tmp_path / "sluice-events.jsonl").read_text():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    story = await asyncio.to_thread(run_block, "sluice timeline" + timeline, sluice)
    assert story.startswith("run run-42: 1 request(s), 2 event(s)")
    assert re.search(r"openai\s+team-a\s+\+0\.000s\s+-\s+\S+\s+0\s+200 2xx", story)


async def test_tune_limits_while_it_runs(upstream, start_sluice, tmp_path):
    sluice = await start_sluice(
        {"routes": [route("openai", upstream.url,
                          concurrency={"limit": 32, "queue": 128, "max_wait": "5s"})]},
        config_path=tmp_path / "my-sluice.yaml")
    data = yaml.load(sluice.config_path.read_text(), Loader=StrictLoader)
    data["routes"][0]["concurrency"]["limit"] = 64
    sluice.config_path.write_text(yaml.safe_dump(data, sort_keys=False))  # as an editor saves
    await sluice.wait_metric("sluice_concurrency_limit", 64, route="openai")
    (code,) = blocks("Tune limits while it runs")
    out = await asyncio.to_thread(run_block, code, sluice)
    assert out.startswith(f"{sluice.config_path}: ok (1 route(s))\n")
    assert '"concurrency": {"limit": 64, "inflight": 0, "queue": 128' in out
    assert "sluice_config_reloads_total 1.0" in out
    assert "sluice_config_last_reload_successful 1.0" in out


def test_deploy_as_a_sidecar_checks():
    tool("hadolint")
    tool("kubernetes-validate")
    (code,) = blocks("Deploy as a Kubernetes sidecar")
    out = run_block(code)
    assert out.count("passed for resource") == 4


async def test_read_the_dashboard_and_alerts(upstream, start_sluice):
    tool("promtool")
    sluice = await start_sluice({"routes": [route("openai", upstream.url)]})
    (code,) = blocks("Read the dashboard and alerts")
    out = await asyncio.to_thread(run_block, code, sluice)
    assert "SUCCESS: 19 rules found" in out and "SUCCESS" in out.split("Unit Testing")[1]


@pytest.mark.parametrize("section", TESTED_SECTIONS)
def test_sections_name_real_files(section):
    body = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    for path in re.findall(r"`((?:deploy|config)/[\w./-]+|Dockerfile)`", body):
        assert (REPO / path).exists(), path


def test_shared_state_section(monkeypatch):
    """Its config block is a valid ``state`` block; the files it names exist."""
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://sluice-redis:6379/0")  # read at load
    body = README.split("\n## Shared state (Redis)\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```yaml\n(.*?)```", body, re.S)
    routes = yaml.safe_dump({"routes": [route("openai", "https://api.openai.com")]})
    config = parse_config(block + routes, "README.md")
    assert config.state.backend == "redis" and config.state.redis_url == "env:SLUICE_REDIS_URL"
    assert config.state.on_unavailable == "local" and config.state.replicas == 3
    for mode in ("`local`", "`reject`", "`state_unavailable`", "`sluice-redis`"):
        assert mode in body
    for path in re.findall(r"`(deploy/[\w./-]+)`", body):
        assert (REPO / path).exists(), path
