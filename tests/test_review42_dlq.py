"""Review 42 of the locked/damaged dead-letter work (82745db..5e2223c): its findings, each
a test of what Sluice does now, saying what the first cut did."""

from __future__ import annotations

import signal

import aiohttp

from tests.conftest import route
from tests.test_dlq_locked import exclusive, stored


async def _one_held_letter(sluice) -> None:
    url = sluice.url + "/openai/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json={"n": 0}, headers={"x-fake-status": "502"}) as r:
            await r.read()
            assert r.status == 502 and "X-Sluice-Dead-Letter" not in r.headers


async def test_a_letter_lost_at_shutdown_is_a_dead_letter_lost_event_on_the_log(
        upstream, start_sluice, tmp_path):
    """README: a lost letter is "put on the event log as a dead_letter_lost event";
    those still held at shutdown are lost. (The first cut did this already: kept as a
    guard for the shutdown's changes below.)"""
    path = tmp_path / "dlq.sqlite"
    sluice = await start_sluice({
        "server": {"drain_timeout": "1s"},
        "dead_letter": {"path": str(path)},
        "routes": [route("openai", upstream.url, retry={"attempts": 1})]})
    with exclusive(path):
        await _one_held_letter(sluice)
        sluice.signal(signal.SIGTERM)
        await sluice.wait_exit(timeout=20.0)
    assert "held for it are lost" in sluice.stderr()
    lost = [e for e in sluice.events() if e["event"] == "dead_letter_lost"]
    assert len(lost) == 1, sluice.events()
    assert stored(path) == []


async def test_a_file_damaged_in_its_schema_page_is_named_damaged_by_the_commands(tmp_path):
    """README: a damaged file ("database disk image is malformed") is named as damaged, with
    how to recover it, exit status 1. Damage in page 1 past its 100-byte header (the schema)
    fails the read-only check that runs before ``DeadLetterFile`` opens it
    (``check_dead_letter_file``); the commands now ask ``corrupt()`` there too. The first
    cut printed "unavailable: database disk image is malformed", with no hint."""
    from tests.sluice_child import sluice_cli
    from tests.test_dlq_damaged import damaged_file, says_damaged

    path = tmp_path / "dlq.sqlite"
    damaged_file(path)  # page 2 damaged, as the landed tests do
    with open(path, "r+b") as raw:  # and page 1's schema too
        raw.seek(100)
        raw.write(b"\xff" * (4096 - 100))
    for command in (("list",), ("show", "2")):
        code, out, err = await sluice_cli("dlq", *command, "--file", str(path))
        assert code == 1 and says_damaged(err, path), (command, out, err)
