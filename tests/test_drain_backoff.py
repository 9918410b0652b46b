"""SIGTERM while a call waits out its retry back-off (a hostile trial): such a call is neither
at the upstream nor sending its body, so the drain does not cut it. One whose back-off would
end only after the drain (its deadline, or a second stop signal) stops retrying: its caller
gets the upstream's last failure at once and the work is dead-lettered, reason ``draining``.
One whose back-off ends within the drain still retries.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp

from proxy.server import SECOND_SIGNAL_AFTER_S
from tests.conftest import route, wait_until
from tests.sluice_child import sluice_cli

BODY = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
RETRY = {"attempts": 3, "on": [503], "backoff": {"base": "10ms", "max": "50ms"}}


async def _sluice(start_sluice, upstream, tmp_path, drain_timeout: str):
    sluice = await start_sluice({
        "server": {"drain_timeout": drain_timeout},
        "dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
        "routes": [route("openai", upstream.url, retry=RETRY)],
    })
    return sluice, sluice.url + "/openai/v1/chat/completions"


async def _post(session: aiohttp.ClientSession, url: str, key: str, **headers: str
                ) -> tuple[int, dict[str, str], dict, float]:
    """POST a chat call with ``Idempotency-Key: key``: its status, headers, JSON body, and
    the monotonic time its answer was read."""
    async with session.post(url, json=BODY, headers={"Idempotency-Key": key, **headers}) as r:
        body = await r.json(content_type=None)
        return r.status, dict(r.headers), body, time.monotonic()


async def _letters(sluice) -> list[dict]:
    """Every dead letter the stopped Sluice wrote, as ``dlq show`` prints it."""
    config = str(sluice.config_path)
    code, out, err = await sluice_cli("dlq", "list", "--config", config)
    assert code == 0, err
    letters = []
    for row in out.splitlines()[1:]:
        code, shown, err = await sluice_cli("dlq", "show", row.split()[0], "--config", config)
        assert code == 0, err
        letters.append(json.loads(shown))
    return letters


def _retried(sluice) -> list[dict]:
    return [e for e in sluice.events() if e["event"] == "retried"]


def _outcomes(sluice) -> list[tuple[str, int]]:
    """``(outcome, status)`` of each call, in the order their back-offs began."""
    completed = {e["request_id"]: e for e in sluice.events() if e["event"] == "completed"}
    return [(completed[e["request_id"]]["outcome"], completed[e["request_id"]]["status"])
            for e in _retried(sluice)]


async def test_a_call_whose_back_off_outlives_the_drain_is_answered_and_dead_lettered(
        upstream, start_sluice, tmp_path):
    """The trial's repro, with a second call beside it whose back-off fits in the drain.
    Before: the first caller was held the whole ``drain_timeout`` and cut with no answer,
    outcome ``drain_cut``, and nothing was dead-lettered."""
    sluice, url = await _sluice(start_sluice, upstream, tmp_path, "3s")
    upstream.status = 200
    async with aiohttp.ClientSession() as session:
        upstream.statuses = [503]
        upstream.error_headers = {"Retry-After": "10"}
        long = asyncio.create_task(_post(session, url, "k1"))
        await wait_until(lambda: len(_retried(sluice)) == 1, what="k1's back-off")
        upstream.statuses = [503]
        upstream.error_headers = {"Retry-After": "1"}
        short = asyncio.create_task(_post(session, url, "k2"))
        await wait_until(lambda: len(_retried(sluice)) == 2, what="k2's back-off")
        sluice.signal(signal.SIGTERM)
        signalled = time.monotonic()
        status, headers, body, answered = await asyncio.wait_for(long, 10)
        # Answered at once with the upstream's last failure, not held to the drain's end.
        assert answered - signalled < 1.5
        assert status == 503 and headers["Retry-After"] == "10"
        assert headers["x-should-retry"] == "false"  # Sluice took it on: the SDK adds none
        letter_id = headers["X-Sluice-Dead-Letter"]
        assert body["error"]["message"] == "fake upstream status 503"  # its own body
        # The back-off that ends within the drain is waited out and its retry served.
        status, headers, body, _ = await asyncio.wait_for(short, 10)
        assert status == 200 and "X-Sluice-Dead-Letter" not in headers
        assert body["choices"][0]["message"]["content"] == "hello from fake"
    assert await sluice.wait_exit(timeout=20) == 0
    assert [header_of(seen, "Idempotency-Key") for seen in upstream.requests] == [
        "k1", "k2", "k2"]  # k1 was not sent again
    assert _outcomes(sluice) == [("5xx", 503), ("2xx", 200)]  # k1 not drain_cut
    [letter] = await _letters(sluice)
    assert (str(letter["id"]), letter["reason"], letter["idempotency_key"]) == (
        letter_id, "draining", "k1")
    assert [a["status"] for a in letter["attempts"]] == [503]
    [lettered] = [e for e in sluice.events() if e["event"] == "dead_lettered"]
    assert (lettered["reason"], lettered["dead_letter_id"]) == ("draining", int(letter_id))


async def test_a_failure_during_the_drain_is_not_retried_past_it(upstream, start_sluice,
                                                                  tmp_path):
    """The drain has begun when the attempt fails and asks for a wait longer than the drain
    has left: no retry is begun (no ``retried`` event), the failure goes back at once.
    Before: the call slept into the drain's end and was cut."""
    sluice, url = await _sluice(start_sluice, upstream, tmp_path, "3s")
    upstream.hold = asyncio.Event()
    upstream.statuses = [503]
    upstream.error_headers = {"Retry-After": "10"}
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(_post(session, url, "k1"))
        await wait_until(lambda: upstream.inflight == 1, what="the call at the upstream")
        sluice.signal(signal.SIGTERM)
        await wait_until(lambda: "draining:" in sluice.stderr(), what="the drain begun")
        failed = time.monotonic()
        upstream.hold.set()
        status, headers, _, answered = await asyncio.wait_for(call, 10)
    assert answered - failed < 5  # at once, not after the 10 s it asked for
    assert (status, headers["Retry-After"], headers["x-should-retry"]) == (503, "10", "false")
    assert "X-Sluice-Dead-Letter" in headers
    assert await sluice.wait_exit(timeout=20) == 0
    assert len(upstream.requests) == 1 and _retried(sluice) == []
    [letter] = await _letters(sluice)
    assert letter["reason"] == "draining"


async def test_a_second_sigterm_answers_a_call_in_back_off(upstream, start_sluice, tmp_path):
    """A back-off that fits in the drain is waited out, until a second stop signal ends the
    drain: the call then gets the upstream's last failure and is dead-lettered, not cut
    (it was at no upstream). Before: cut with no answer, ``drain_cut``."""
    sluice, url = await _sluice(start_sluice, upstream, tmp_path, "60s")
    upstream.statuses = [503]
    upstream.error_headers = {"Retry-After": "8"}
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(_post(session, url, "k1"))
        await wait_until(lambda: len(_retried(sluice)) == 1, what="the back-off")
        sluice.signal(signal.SIGTERM)
        await wait_until(lambda: "draining:" in sluice.stderr(), what="the drain begun")
        # A second signal counts only SECOND_SIGNAL_AFTER_S after the first was handled.
        await asyncio.sleep(SECOND_SIGNAL_AFTER_S + 0.3)
        assert not call.done()  # its back-off ends within the drain: waited for
        sluice.signal(signal.SIGTERM)
        status, headers, _, _ = await asyncio.wait_for(call, 10)
    assert (status, headers["Retry-After"], headers["x-should-retry"]) == (503, "8", "false")
    assert await sluice.wait_exit(timeout=20) == 0
    assert len(upstream.requests) == 1
    assert _outcomes(sluice) == [("5xx", 503)]  # not drain_cut
    [letter] = await _letters(sluice)
    assert (str(letter["id"]), letter["reason"]) == (headers["X-Sluice-Dead-Letter"],
                                                     "draining")


def header_of(seen, name: str) -> str | None:
    return {k.lower(): v for k, v in seen.headers.items()}.get(name.lower())
