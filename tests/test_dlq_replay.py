"""``sluice dlq replay`` sends a dead letter at most once unless told otherwise: two commands
started at once, a replay already answered, and (Redis) a key the caller's own retry got an
answer for since. Real Sluice processes, the real CLI in subprocesses, the fake upstream."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import sqlite3
import time

import aiohttp
import pytest

from policies.deadletter import CLAIMED, DeadLetter, ReplayClaim, answered
from policies.state import StateUnavailable
from proxy import dlq
from proxy.config import parse_config
from tests import mcp_servers
from tests.conftest import REPO, SluiceProcess, route, wait_until
from tests.redis_servers import delete_prefix, new_prefix, require_redis
from tests.sluice_child import ForkedCli
from tests.sluice_child import ended as outcome

mcp_stateless = mcp_servers.mcp_stateless

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
FAST_BACKOFF = {"base": "10ms", "max": "20ms"}


async def cli(*args: str) -> ForkedCli:
    """``sluice ARGS`` from the clone, forked warm (:class:`tests.sluice_child.ForkedCli`)."""
    return ForkedCli(list(args), str(REPO))


async def dead_letter(sluice, upstream, key: str) -> str:
    """One call that fails every attempt, so it is dead-lettered; returns the letter's id."""
    upstream.status = 503
    async with aiohttp.ClientSession() as s, s.post(
            sluice.url + "/openai" + CHAT, json=BODY,
            headers={"X-Tenant-ID": "acme", "Idempotency-Key": key}) as r:
        await r.read()
        assert r.status == 503
        letter = r.headers["X-Sluice-Dead-Letter"]
    upstream.status = None
    return letter


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest, tmp_path):
    if request.param == "memory":
        yield {"dead_letter": {"path": str(tmp_path / "dlq.sqlite")}}
        return
    url = require_redis()
    prefix = new_prefix()
    try:
        yield {"state": {"backend": "redis", "redis_url": url, "key_prefix": prefix,
                         "timeout": "2s"}}
    finally:
        delete_prefix(url, prefix)


async def held_replay(start_sluice, upstream, state: dict, key: str
                      ) -> tuple[SluiceProcess, str, ForkedCli]:
    """A Sluice on ``state`` whose route retries, one dead letter of it under ``key``, and
    ``sluice dlq replay`` of it running, its send held at the upstream (``upstream.hold``,
    set by the test): the Sluice, the letter's id and the replay's process."""
    sluice = await start_sluice({**state, "routes": [route(
        "openai", upstream.url, retry={"attempts": 2, "backoff": FAST_BACKOFF})]})
    letter = await dead_letter(sluice, upstream, key)
    upstream.hold = asyncio.Event()
    sent = len(upstream.requests)
    proc = await cli("dlq", "replay", letter, "--config", str(sluice.config_path))
    await wait_until(lambda: len(upstream.requests) == sent + 1, timeout=30)
    return sluice, letter, proc


async def test_two_replays_started_at_once_send_the_letter_once(upstream, start_sluice, state):
    """The check "was it replayed already?" and the send were two steps: two operators (or a
    retried cron job) replaying one letter at once both passed the check and both sent it.
    Now each replay holds its letter until its result is stored; the other is refused."""
    sluice = await start_sluice({**state, "routes": [route(
        "openai", upstream.url, retry={"attempts": 2, "backoff": FAST_BACKOFF})]})
    letter = await dead_letter(sluice, upstream, "pay-42")
    sent_before = len(upstream.requests)
    config = str(sluice.config_path)
    upstream.hold = asyncio.Event()  # the replay that is sent waits here
    replays = [asyncio.ensure_future(outcome(await cli("dlq", "replay", letter, "--config",
                                                       config))) for _ in range(2)]
    # One of them finds the letter held and ends at once, while the other's send is held.
    done, pending = await asyncio.wait(replays, return_when=asyncio.FIRST_COMPLETED,
                                       timeout=60)
    refused = done.pop().result()
    assert refused[0] == 1 and "is being replayed by another command" in refused[2], refused
    await wait_until(lambda: len(upstream.requests) == sent_before + 1)
    upstream.hold.set()
    code, out, err = await pending.pop()
    assert code == 0 and "HTTP 200" in out, err
    assert len(upstream.requests) == sent_before + 1
    assert upstream.requests[-1].headers["Idempotency-Key"] == "pay-42"

    # Its result is stored and the hold ended: a third replay is told it was answered, and
    # --again sends it (holding it as well).
    code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
    assert code == 1 and "already replayed" in err and "--again" in err
    code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config,
                                             "--again"))
    assert code == 0, err
    assert len(upstream.requests) == sent_before + 2
    code, out, _ = await outcome(await cli("dlq", "show", letter, "--config", config))
    assert [r["status"] for r in json.loads(out)["replays"]] == [200, 200]


async def test_delete_removes_one_letter_and_its_replays_and_leaves_the_others(
        upstream, start_sluice, state):
    sluice = await start_sluice({**state, "routes": [route(
        "openai", upstream.url, retry={"attempts": 2, "backoff": FAST_BACKOFF})]})
    first = await dead_letter(sluice, upstream, "del-1")
    second = await dead_letter(sluice, upstream, "del-2")
    config = str(sluice.config_path)
    code, _, err = await outcome(await cli("dlq", "replay", first, "--config", config))
    assert code == 0, err
    code, out, err = await outcome(await cli("dlq", "delete", first, "--config", config))
    assert (code, err) == (0, "") and out.startswith(f"deleted dead letter {first} from ")
    code, _, err = await outcome(await cli("dlq", "show", first, "--config", config))
    assert code == 1 and f"no dead letter {first}" in err
    code, out, _ = await outcome(await cli("dlq", "list", "--config", config))
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[1:]] == [second]
    # Once more: nothing to delete, said and exit status 1.
    code, out, err = await outcome(await cli("dlq", "delete", first, "--config", config))
    assert (code, out) == (1, "") and f"no dead letter {first} in " in err


async def test_a_letter_deleted_while_it_is_replayed_keeps_no_replay(
        upstream, start_sluice, state):
    """``dlq delete`` while a replay of the letter is at the upstream: the replay's result
    is stored nowhere, and the replay says so. With the SQLite file it was stored for the
    deleted letter (a row no delete or purge removes) and nothing was said (a review); the
    Redis store already refused it."""
    sluice, letter, replay = await held_replay(start_sluice, upstream, state, "del-3")
    config = str(sluice.config_path)
    try:
        code, out, err = await outcome(await cli("dlq", "delete", letter, "--config", config))
        assert code == 0 and out.startswith(f"deleted dead letter {letter} "), err
    finally:
        upstream.hold.set()
    code, out, err = await outcome(replay)
    assert code == 0 and "HTTP 200" in out, err  # the upstream's answer, still printed
    assert (f"WARNING: dead letter {letter} was deleted or purged (or dropped for "
            "dead_letter.max_records) during this replay, so its result is not stored") in err
    code, _, err = await outcome(await cli("dlq", "show", letter, "--config", config))
    assert code == 1 and f"no dead letter {letter}" in err
    if "dead_letter" in state:
        with contextlib.closing(sqlite3.connect(state["dead_letter"]["path"])) as db:
            assert db.execute("SELECT COUNT(*) FROM replays").fetchone()[0] == 0


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
async def test_a_replay_stopped_mid_send_leaves_its_result_and_needs_again(
        upstream, start_sluice, state, sig, code):
    """Ctrl-C, or SIGTERM from a supervisor or `timeout`, during the send: the replay is
    recorded as interrupted after its request was sent, with one line said, not a
    traceback. SIGTERM ended the process where it stood and held the letter for the
    route's whole timeout (a new user's trial). The request reached the upstream, so the
    work may be done: the letter was freed and the next replay, without ``--again``, sent it
    a second time (a hostile trial); it now needs ``--again``, as after an answer."""
    sluice, letter, proc = await held_replay(start_sluice, upstream, state, "pay-43")
    config = str(sluice.config_path)
    proc.send_signal(sig)
    got, _, err = await outcome(proc)
    assert got == code and "Traceback" not in err, err
    assert "interrupted after its request was sent" in err and "--again" in err, err
    upstream.hold.set()
    _, out, _ = await outcome(await cli("dlq", "show", letter, "--config", config))
    assert [(r["status"], r["error"]) for r in json.loads(out)["replays"]] == [
        (None, "interrupted_after_send")]
    sent = len(upstream.requests)
    got, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
    assert got == 1 and "interrupted after its request was sent" in err, (out, err)
    assert "pass --again" in err and len(upstream.requests) == sent, err
    got, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config,
                                            "--again"))
    assert got == 0 and "HTTP 200" in out, err
    assert len(upstream.requests) == sent + 1


@pytest.mark.parametrize("args,said", [
    (["-H", "X-Note: a\r\nInjected: 1"], "may not hold CR, LF or NUL"),
    (["-H", "Bad Name: v"], "is not 'NAME: VALUE'"),
    (["--header-from-env", "Authorization"], "is not NAME=ENVVAR"),
    (["--output", "/nonexistent-dir/answer.json"], "directory is missing or not writable"),
])
async def test_replay_arguments_that_cannot_work_are_refused_before_sending(
        upstream, start_sluice, tmp_path, args, said):
    """Each was found by a new user's trial to send the letter (or hold it) and then fail:
    a header aiohttp refuses at send time, a header name with a space sent as is, an
    --output path the answer was lost to after the work was done."""
    sluice = await start_sluice({"dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
                                 "routes": [route("openai", upstream.url, retry={
                                     "attempts": 2, "backoff": FAST_BACKOFF})]})
    letter = await dead_letter(sluice, upstream, "pay-46")
    sent = len(upstream.requests)
    config = str(sluice.config_path)
    got, _, err = await outcome(await cli("dlq", "replay", letter, "--config", config, *args))
    assert got == 1 and said in err and "Traceback" not in err, err
    assert len(upstream.requests) == sent
    _, out, _ = await outcome(await cli("dlq", "show", letter, "--config", config))
    assert json.loads(out)["replays"] == []
    # A letter id only in ASCII digits: int() read "0_1" as 1 and Arabic-Indic digits too.
    for typo in ("0_1", "\u0661"):
        got, _, err = await outcome(await cli("dlq", "show", typo, "--config", config))
        assert got == 2 and "is not a whole number" in err


async def test_a_replay_is_sent_and_held_under_its_models_own_timeouts(upstream, start_sluice,
                                                                       tmp_path):
    """A model's (tool's, endpoint's) ``timeouts`` block replaces its route's for its calls,
    and so for the replay of its dead letters. The replay used the route's: here 1 s, so a
    replay the upstream answers after 1.5 s was cut (the work done, its answer lost), and the
    letter was held for the route's timeouts, not as long as its send may take."""
    sluice = await start_sluice({
        "dead_letter": {"path": str(tmp_path / "dlq.sqlite")},
        "routes": [route("openai", upstream.url, timeouts={"total": "1s"},
                         models={"gpt-test": {"timeouts": {"total": "60s"}}},
                         retry={"attempts": 2, "backoff": FAST_BACKOFF})]})
    config = str(sluice.config_path)
    letter = await dead_letter(sluice, upstream, "pay-47")
    sent = len(upstream.requests)
    upstream.hold = asyncio.Event()
    replay = await cli("dlq", "replay", letter, "--config", config)
    await wait_until(lambda: len(upstream.requests) == sent + 1, timeout=30)
    reached = time.monotonic()
    # Held for the model's total and connect timeouts and the margin (75 s), not the
    # route's (16 s).
    code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
    assert code == 1 and "is being replayed by another command" in err, err
    held = re.search(r"lapses in (\d+)s", err)
    assert held is not None and int(held[1]) > 60, err
    await asyncio.sleep(max(0.0, reached + 1.5 - time.monotonic()))  # past the route's total
    upstream.hold.set()
    code, out, err = await outcome(replay)
    assert code == 0 and "HTTP 200" in out, (out, err)
    assert len(upstream.requests) == sent + 1


def redis_dedup_config(url: str, prefix: str, upstream_url: str) -> dict:
    """A Sluice on Redis whose route stores answers for keys and retries (dead-letters)."""
    return {"state": {"backend": "redis", "redis_url": url, "key_prefix": prefix,
                      "timeout": "2s"},
            "routes": [route("openai", upstream_url, idempotency={"mode": "dedup"},
                             retry={"attempts": 2, "backoff": FAST_BACKOFF})]}


@pytest.mark.parametrize("sent", ["pay-44", '"pay-44"'], ids=["bare", "quoted"])
async def test_a_key_the_callers_retry_got_an_answer_for_is_not_replayed_without_again(
        upstream, start_sluice, sent):
    """With Redis, the CLI reads the route's shared idempotency records: the letter's key was
    answered since (the caller retried with it once the upstream was back), so a replay
    would do the work a second time; it needs --again."""
    url = require_redis()
    prefix = new_prefix()
    try:
        sluice = await start_sluice(redis_dedup_config(url, prefix, upstream.url))
        # The letter keeps the header as sent; a quoted key (RFC 8941, the draft's form) was
        # looked up quoted and never found (a review).
        letter = await dead_letter(sluice, upstream, sent)
        async with aiohttp.ClientSession() as s, s.post(
                sluice.url + "/openai" + CHAT, json=BODY,
                headers={"X-Tenant-ID": "acme", "Idempotency-Key": "pay-44"}) as r:
            assert r.status == 200  # the caller's retry: the work is done
            await r.read()
        sent = len(upstream.requests)
        config = str(sluice.config_path)
        code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
        assert code == 1 and "was answered HTTP 200 since" in err and "--again" in err
        assert len(upstream.requests) == sent
        code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", config,
                                               "--again"))
        assert code == 0 and len(upstream.requests) == sent + 1, err
    finally:
        delete_prefix(url, prefix)


async def test_a_replayed_letter_is_the_answer_to_its_keys_later_retry(upstream, start_sluice):
    """With Redis, a replay is a use of the letter's key like any other: a caller's retry
    with that key after a replay that was answered gets that answer replayed, and a replay
    while a request with the key is in flight is refused. Both ran the work a second time
    (a hostile trial): the replay neither held the key nor stored its answer."""
    url = require_redis()
    prefix = new_prefix()
    try:
        sluice = await start_sluice(redis_dedup_config(url, prefix, upstream.url))
        config = str(sluice.config_path)
        headers = {"X-Tenant-ID": "acme", "Idempotency-Key": "pay-45"}
        letter = await dead_letter(sluice, upstream, "pay-45")
        code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
        assert code == 0 and "HTTP 200" in out, err
        sent = len(upstream.requests)
        async with aiohttp.ClientSession() as s, s.post(
                sluice.url + "/openai" + CHAT, json=BODY, headers=headers) as r:
            assert r.status == 200
            assert r.headers.get("Idempotent-Replayed") == "true"
            await r.read()
        assert len(upstream.requests) == sent

        letter = await dead_letter(sluice, upstream, "pay-46")
        sent = len(upstream.requests)
        # The retry stays at the upstream until the replay has been refused: a fixed delay
        # was outrun by the CLI's start on a loaded machine (the retry had been answered).
        upstream.hold = asyncio.Event()
        async with aiohttp.ClientSession() as s:
            retry = asyncio.create_task(s.post(
                sluice.url + "/openai" + CHAT, json=BODY,
                headers={**headers, "Idempotency-Key": "pay-46"}))
            await wait_until(lambda: len(upstream.requests) == sent + 1)
            try:
                code, _, err = await outcome(
                    await cli("dlq", "replay", letter, "--config", config))
            finally:
                upstream.hold.set()
            async with await retry as r:
                assert r.status == 200
                await r.read()
        assert code == 1 and "in flight" in err, err
        assert len(upstream.requests) == sent + 1
    finally:
        delete_prefix(url, prefix)


async def test_a_key_sluice_derived_is_replayed_under_and_said_to_be_derived(
        upstream, start_sluice):
    """A call keyed by ``derive_from`` (a digest with the caller's credentials in it) is
    handled under that key, and so is its letter's replay: refused once the caller's retry
    was answered, the answer to the caller's retry when replayed first. The letter says the
    key was derived; the command's messages name it so and never print it, nor the
    credentials (only their name is kept)."""
    url = require_redis()
    prefix = new_prefix()
    config = redis_dedup_config(url, prefix, upstream.url)
    config["routes"][0]["idempotency"]["derive_from"] = ["X-Run-ID", "X-Step-ID"]
    try:
        sluice = await start_sluice(config)
        path = str(sluice.config_path)

        async def call(step: str, status: int) -> aiohttp.ClientResponse:
            upstream.status = None if status == 200 else status
            async with aiohttp.ClientSession() as s, s.post(
                    sluice.url + "/openai" + CHAT, json=BODY, headers={
                        "X-Tenant-ID": "acme", "X-Run-ID": "run-9", "X-Step-ID": step,
                        "Authorization": "Bearer sk-test-secret"}) as r:
                await r.read()
                assert r.status == status
                upstream.status = None
                return r

        letter = (await call("s1", 503)).headers["X-Sluice-Dead-Letter"]
        _, out, _ = await outcome(await cli("dlq", "show", letter, "--config", path))
        shown = json.loads(out)
        # Named as the event log names it, not as the quoted header value it went with.
        assert shown["key_origin"] == "derived" and shown["idempotency_key"].startswith(
            "sluice-d-")
        # The event log is written off the event loop: its line may come a moment later.
        await wait_until(lambda: any(event["request_id"] == shown["request_id"]
                                     for event in sluice.events()), what="the call's events")
        assert shown["idempotency_key"] in {event["idempotency_key"] for event in
                                            sluice.events() if event["request_id"] ==
                                            shown["request_id"]}
        assert "sk-test-secret" not in out and shown["redacted_headers"] == ["Authorization"]
        await call("s1", 200)  # the caller's own retry: the work is done
        sent = len(upstream.requests)
        code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", path))
        assert code == 1 and "the key Sluice derived for it was answered HTTP 200" in err, err
        assert "sluice-d-" not in err and len(upstream.requests) == sent

        letter = (await call("s2", 503)).headers["X-Sluice-Dead-Letter"]
        code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", path))
        assert code == 0 and "HTTP 200" in out, err
        sent = len(upstream.requests)
        assert (await call("s2", 200)).headers.get("Idempotent-Replayed") == "true"
        assert len(upstream.requests) == sent
    finally:
        delete_prefix(url, prefix)


async def test_a_dead_letter_keeps_no_credential_valued_query_field(upstream, start_sluice,
                                                                     state):
    """A value that looks like a credential (``sk-``, ``AIza``...) is one whatever its name
    (policies/secrets.py), in the query as in a header: an OpenAI key in ``?k=`` and a
    Google key in ``?q=`` were kept in the letter and printed by ``dlq show`` and ``dlq
    list``, while the same key in ``X-Echo`` was redacted (a hostile trial). Their names are
    kept, as a credential's by its name is; the rest of the query stays."""
    sluice = await start_sluice({**state, "routes": [route(
        "h", upstream.url, protocol="http", idempotent=True,
        retry={"attempts": 2, "backoff": FAST_BACKOFF, "on": [503]})]})
    upstream.status = 503
    async with aiohttp.ClientSession() as s, s.post(
            sluice.url + "/h/v1/x?k=sk-proj-HOSTILE1&q=AIzaHOSTILE2&page=2", data=b"{}",
            headers={"Content-Type": "application/json",
                     "X-Echo": "sk-proj-HOSTILE3"}) as r:
        await r.read()
        letter = r.headers["X-Sluice-Dead-Letter"]
    assert upstream.requests[-1].raw_path == "/v1/x?k=sk-proj-HOSTILE1&q=AIzaHOSTILE2&page=2"
    config = str(sluice.config_path)
    code, shown, err = await outcome(await cli("dlq", "show", letter, "--config", config))
    assert code == 0, err
    assert "HOSTILE" not in shown
    record = json.loads(shown)
    assert record["path"] == "/v1/x?page=2"
    assert record["redacted_headers"] == ["X-Echo", "?k", "?q"]
    code, listed, err = await outcome(await cli("dlq", "list", "--config", config))
    assert code == 0 and "/v1/x?page=2" in listed and "HOSTILE" not in listed, err
    await wait_until(lambda: any(e["event"] == "dead_lettered" for e in sluice.events()))
    assert "HOSTILE" not in json.dumps(sluice.events())
    # Replayed without them, and said so (a new user's replay printed only its status).
    upstream.status = 200
    code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", config,
                                           "-H", "X-Echo: given-again"))
    assert code == 0, err
    assert upstream.requests[-1].raw_path == "/v1/x?page=2"
    assert "without its query field(s) ?k, ?q" in err and "X-Echo" not in err, err
    code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", config,
                                           "--again"))
    assert code == 0, err
    assert "replayed without X-Echo, removed as credentials" in err, err
    # Refused as answered already, it says nothing of a send that never happens.
    code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
    assert code == 1 and "already replayed" in err and "X-Echo" not in err, err


async def test_a_callers_key_the_route_keeps_from_the_upstream_is_still_the_letters(
        upstream, start_sluice):
    """With ``Idempotency-Key`` in ``request_headers_to_remove`` the upstream never sees the
    caller's key, but Sluice handles the call under it. The letter recorded the key the
    upstream got (none), so its replay sent the work again after the caller's retry with
    that key was answered."""
    url = require_redis()
    prefix = new_prefix()
    config = redis_dedup_config(url, prefix, upstream.url)
    config["routes"][0]["request_headers_to_remove"] = ["Idempotency-Key"]
    try:
        sluice = await start_sluice(config)
        path = str(sluice.config_path)
        letter = await dead_letter(sluice, upstream, "pay-48")
        assert "Idempotency-Key" not in upstream.requests[-1].headers
        async with aiohttp.ClientSession() as s, s.post(
                sluice.url + "/openai" + CHAT, json=BODY,
                headers={"X-Tenant-ID": "acme", "Idempotency-Key": "pay-48"}) as r:
            assert r.status == 200  # the caller's retry: the work is done
            await r.read()
        sent = len(upstream.requests)
        code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", path))
        assert code == 1 and "its Idempotency-Key 'pay-48' was answered HTTP 200" in err, err
        assert len(upstream.requests) == sent
        _, out, _ = await outcome(await cli("dlq", "show", letter, "--config", path))
        shown = json.loads(out)
        assert (shown["idempotency_key"], shown["key_origin"]) == ("pay-48", "caller")
        assert ["Idempotency-Key", "pay-48"] not in shown["headers"]  # it is not sent
    finally:
        delete_prefix(url, prefix)


async def test_a_result_the_store_cannot_take_is_said_and_the_answer_still_kept(
        upstream, tmp_path, capsys):
    """Redis failing as the result is stored replaced the upstream's 200 by "the dead
    letters are unavailable" (exit 1, no --output) though the letter had been sent (a
    review): the answer is kept and printed, with a warning that nothing was recorded."""
    class FailingStore:
        async def claim_replay(self, letter_id, token, hold_s, again=False):
            return ReplayClaim(CLAIMED)

        async def add_replay(self, letter_id, status, error, duration_s, token=None):
            raise StateUnavailable("connection refused")

    config = parse_config(f"routes:\n  - {{name: openai, path_prefix: /openai/, "
                          f"upstream: '{upstream.url}', protocol: openai}}\n")
    letter = DeadLetter(route="openai", tenant="acme", run=None, idempotency_key=None,
                        request_id="q", method="POST", path=CHAT, headers=[], redacted=[],
                        body=b"{}", body_size=2, attempts=[], reason="attempts_exhausted",
                        id=7)
    out = tmp_path / "answer.json"
    args = argparse.Namespace(again=False, header=[], header_from_env=[], output=str(out))
    assert await dlq._replay(config, FailingStore(), letter, args) == 0
    printed = capsys.readouterr()
    assert "HTTP 200" in printed.out
    assert "was not stored (connection refused)" in printed.err
    assert out.read_bytes() and len(upstream.requests) == 1


# -- a tool's own idempotency block ------------------------------------------------------------


async def call_tool(sluice, key: str, tool: str = "send", fails: bool = False,
                    **arguments: object) -> tuple[int, str | None, str]:
    """One ``tools/call`` with ``Idempotency-Key: key``: its status, ``Idempotent-Replayed``
    and body; with ``fails``, the id of the dead letter it left instead of the last two."""
    call = mcp_servers.tool_call(1, tool, **(arguments or {"to": "ops@example.com"}))
    headers = {"Accept": "application/json, text/event-stream", "X-Tenant-ID": "acme",
               "MCP-Protocol-Version": "2025-06-18", "Idempotency-Key": key}
    async with aiohttp.ClientSession() as s, s.post(
            sluice.url + "/tools/mcp", json=call, headers=headers) as r:
        text = await r.text()
        if fails:
            assert r.status == 503, text
            return r.status, None, r.headers["X-Sluice-Dead-Letter"]
        return r.status, r.headers.get("Idempotent-Replayed"), text


def mcp_config(url: str, prefix: str, upstream_url: str, **policies: object) -> dict:
    """A Sluice on Redis with an ``mcp`` route ``tools`` that dead-letters failed calls."""
    return {"state": {"backend": "redis", "redis_url": url, "key_prefix": prefix,
                      "timeout": "2s"},
            "routes": [route("tools", upstream_url, "mcp",
                             retry={"attempts": 2, "backoff": FAST_BACKOFF}, **policies)]}


async def test_a_replay_reads_and_writes_its_tools_own_idempotency_records(
        mcp_stateless, start_sluice):
    """A tool's ``idempotency`` block replaces its route's for its calls (``tools:``), and so
    for the replay of its dead letters. The replay read and wrote the route's records
    instead: with ``send`` deduplicating on a route that does not, a letter whose key the
    caller's retry got an answer for was sent again (the mail went twice), and a caller's
    retry after a replay ran the tool once more."""
    url = require_redis()
    prefix = new_prefix()
    gate = await mcp_servers.McpGateway(mcp_stateless.base_url).start()
    try:
        sluice = await start_sluice(mcp_config(url, prefix, gate.url, tools={
            "send": {"idempotency": {"mode": "dedup", "ttl": "1h"}}}))
        config = str(sluice.config_path)
        gate.refusing = True
        _, _, letter = await call_tool(sluice, "mail-1", fails=True)
        gate.refusing = False
        status, replayed, _ = await call_tool(sluice, "mail-1")  # the caller's own retry
        assert (status, replayed, mcp_stateless.sends()) == (200, None, 1)
        code, _, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
        assert code == 1 and "was answered HTTP 200 since" in err, err
        assert mcp_stateless.sends() == 1

        # Replayed first: the replay's answer is the answer to the caller's retry.
        gate.refusing = True
        _, _, letter = await call_tool(sluice, "mail-2", fails=True)
        gate.refusing = False
        code, out, err = await outcome(await cli("dlq", "replay", letter, "--config", config))
        assert code == 0 and "HTTP 200" in out, err
        assert mcp_stateless.sends() == 2
        status, replayed, text = await call_tool(sluice, "mail-2")
        assert (status, replayed) == (200, "true") and "sent #2" in text
        assert mcp_stateless.sends() == 2
    finally:
        await gate.stop()
        delete_prefix(url, prefix)


async def test_a_replay_of_a_tool_with_idempotency_off_ignores_the_routes_records(
        mcp_stateless, start_sluice):
    """``send`` has ``idempotency: {mode: off}`` on a ``dedup`` route: its calls are keyed by
    nothing, whatever the route's records hold for their key (here another tool's answer
    for the same key, as an agent that keys every call of a step alike sends). Its letter's
    replay was refused as "answered since", by the route's records."""
    url = require_redis()
    prefix = new_prefix()
    gate = await mcp_servers.McpGateway(mcp_stateless.base_url).start()
    try:
        sluice = await start_sluice(mcp_config(
            url, prefix, gate.url, idempotency={"mode": "dedup"},
            tools={"send": {"idempotency": {"mode": "off"}}}))
        status, _, text = await call_tool(sluice, "step-7", "add", a=1, b=2)
        assert status == 200 and '"3"' in text
        gate.refusing = True
        _, _, letter = await call_tool(sluice, "step-7", fails=True)
        gate.refusing = False
        code, out, err = await outcome(await cli("dlq", "replay", letter, "--config",
                                                 str(sluice.config_path)))
        assert code == 0 and "HTTP 200" in out, err
        assert mcp_stateless.sends() == 1
    finally:
        await gate.stop()
        delete_prefix(url, prefix)


@pytest.mark.parametrize(("key", "origin", "named"), [
    ('"sluice-d-0123456789abcdef0123456789abcdef"', "derived", "the key Sluice derived"),
    # Written before key_origin was kept: its form tells a key Sluice derived.
    ('"sluice-d-0123456789abcdef0123456789abcdef"', None, "the key Sluice derived"),
    ('"sluice-t-0123456789abcdef0123456789abcdef"', None, "the key Sluice derived"),
    ("pay-47", "caller", "its Idempotency-Key 'pay-47'"),
    ("pay-47", None, "its Idempotency-Key 'pay-47'"),
])
def test_a_derived_key_is_named_not_printed(key: str, origin: str | None, named: str) -> None:
    """From a review: the command's messages name a key Sluice derived (it holds a digest of
    the caller's credentials) without printing it, by the letter's ``key_origin``; a letter
    written before that was kept has none, and its derived key was printed whole."""
    letter = DeadLetter(route="openai", tenant="acme", run=None, idempotency_key=key,
                        key_origin=origin, request_id="q", method="POST", path=CHAT,
                        headers=[], redacted=[], body=b"{}", body_size=2, attempts=[],
                        reason="attempts_exhausted", id=7)
    said = dlq._key_named(letter)
    assert said.startswith(named)
    assert "sluice-d-" not in said and "sluice-t-" not in said


def test_only_an_interruption_after_the_send_counts_as_possibly_done() -> None:
    """A replay interrupted before anything was sent frees its letter; one interrupted after
    its request may have been written counts as answered (the next replay needs --again)."""
    before = {"at": 1.0, "status": None, "error": "interrupted", "duration_s": 0.0}
    after = {"at": 2.0, "status": None, "error": "interrupted_after_send", "duration_s": 1.0}
    failed = {"at": 3.0, "status": 503, "error": None, "duration_s": 0.1}
    assert answered([before]) is None
    assert answered([before, after, failed]) == after
