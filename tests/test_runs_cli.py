"""``sluice runs`` against admin ports that misbehave (a hostile trial): a token that cannot
be sent, a redirect, a trickle, an answer of another shape, a password in ``--admin``.
Each hostile port is a real socket server on loopback; the CLI is run as in test_runs.py."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import yaml

from proxy.cli import main as cli_main
from tests.conftest import route

SECRET = "TOPSECRET-admin-token"


def test_a_token_file_with_a_second_line_is_a_config_error_quoting_no_token(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It passed check-config, then `runs cancel` printed it in http.client's refusal."""
    (tmp_path / "token.txt").write_text(f"{SECRET}\n# rotated 2026-12-01\n")
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"listen": "127.0.0.1:8080", "admin_listen": "127.0.0.1:9901"},
        "admin": {"token_file": "token.txt"},
        "routes": [route("a", "http://127.0.0.1:9", "http")]}))
    assert cli_main(["check-config", str(config)]) != 0
    said = capsys.readouterr()
    assert "admin.token_file: the file it names holds whitespace or a control character" in \
        said.err + said.out
    assert SECRET not in said.err + said.out


async def test_the_server_refuses_cancels_when_its_env_token_holds_a_newline(
        upstream, start_sluice) -> None:
    sluice = await start_sluice({"routes": [route("tools", upstream.url, "http")]},
                                env={"SLUICE_ADMIN_TOKEN": f"{SECRET}\nx"})
    async with aiohttp.ClientSession() as s, s.post(
            f"{sluice.admin_url}/admin/runs/r/cancel",
            headers={"Authorization": f"Bearer {SECRET}"}) as r:
        error = (await r.json())["error"]
    assert r.status == 403
    assert error.startswith("SLUICE_ADMIN_TOKEN holds whitespace or a control character")
    assert SECRET not in error
