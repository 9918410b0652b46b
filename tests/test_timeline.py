"""``sluice timeline``: a run's story rebuilt from the event log of a real Sluice."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson

from proxy.timeline import read_run
from tests.conftest import REPO, route
from tests.test_reload import CHAT, until


def timeline(*args: str, stdin: str | None = None,
             cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", "timeline", *args], cwd=cwd,
                          capture_output=True, text=True, input=stdin, timeout=60)


def timeline_of(tmp_path: Path, lines: list[str]) -> subprocess.CompletedProcess[str]:
    """``sluice timeline a`` over an event log of ``lines``."""
    log = tmp_path / "events.jsonl"
    log.write_text("\n".join(lines) + "\n")
    return timeline("a", "--events", str(log))


def rows(output: str, first_column: str) -> dict[str, list[str]]:
    """The per-request table: request id -> its columns."""
    table = output.split("\n\n")[-1].splitlines()
    assert table[0].split()[0] == first_column
    return {line.split()[0]: line.split() for line in table[2:] if line.strip()}


async def test_queued_rejected_and_retried_requests_are_rebuilt(upstream, start_sluice):
    upstream.hold = asyncio.Event()
    upstream.statuses = [503]  # the first attempt fails once released; Sluice retries it
    sluice = await start_sluice({"routes": [
        route("llm", upstream.url, concurrency={"limit": 1, "queue": 1, "max_wait": "30s"},
              retry={"attempts": 2, "backoff": {"base": "10ms", "max": "20ms"}})]})
    run = {"X-Run-ID": "run-7", "X-Tenant-ID": "acme"}
    async with aiohttp.ClientSession() as session:
        url = sluice.url + "/llm/v1/chat/completions"

        def send(request_id: str) -> asyncio.Task:
            # The key makes a POST safe for Sluice to retry (RFC 9110 §9.2.2).
            return asyncio.create_task(session.post(url, json=CHAT, headers={
                **run, "X-Request-ID": request_id, "Idempotency-Key": request_id}))

        first = send("req-first")
        await until(lambda: upstream.inflight == 1)
        queued = send("req-queued")
        await sluice.wait_metric("sluice_queue_depth", 1, route="llm")
        refused = {**run, "X-Request-ID": "req-refused"}
        async with session.post(url, json=CHAT, headers=refused) as r:
            assert r.status == 503 and r.headers["X-Sluice-Reason"] == "queue_full"
        # Another run's event, which must not show (the same tenant's: another tenant's call,
        # within its fair share, would take req-queued's place in the full queue).
        async with session.post(url, json=CHAT, headers={"X-Run-ID": "other-run",
                                                         "X-Tenant-ID": "acme"}) as r:
            assert r.status == 503
        upstream.hold.set()
        for response in await asyncio.gather(first, queued):
            assert response.status == 200
            response.release()
    await until(lambda: sum(e["event"] == "completed" for e in sluice.events()) == 2)

    with sluice.events_path.open("a") as log:
        log.write("not json: a log line in between\n")

    result = timeline("run-7", "--config", str(sluice.config_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("run run-7: 3 request(s), 7 event(s) over ")
    events = [line.split()[:5] for line in out.split("\n\n")[1].splitlines()[2:]]
    assert [(e[1], e[4]) for e in events] == [
        ("req-first", "admitted"), ("req-queued", "enqueued"), ("req-refused", "rejected"),
        ("req-first", "retried"), ("req-first", "completed"),
        ("req-queued", "admitted"), ("req-queued", "completed"),
    ]
    assert events[0][0] == "+0.000s" and all(e[2:4] == ["llm", "acme"] for e in events)
    assert "other-run" not in out and "not json" not in out
    assert "queue depth 1" in out and "attempt=2, after=503" in out
    assert "queue_full, Retry-After" in out

    story = rows(out, "request")
    assert story["req-first"][-2:] == ["200", "2xx"] and story["req-first"][6] == "1"
    assert story["req-queued"][4] != "-" and story["req-queued"][-2:] == ["200", "2xx"]
    assert story["req-refused"][-2:] == ["rejected", "queue_full"]
    assert story["req-refused"][5] == "-"  # never reached the upstream

    # The same story from standard input, as from `kubectl logs ... | sluice timeline -`.
    piped = timeline("run-7", "--events", "-", stdin=sluice.events_path.read_text())
    assert piped.returncode == 0 and piped.stdout == out


def test_unknown_run_and_stdout_events(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text('{"ts": 1, "event": "admitted", "run": "a", "request_id": "x"}\n')
    missing = timeline("nope", "--events", str(log))
    assert missing.returncode == 1 and "no events for run 'nope'" in missing.stderr
    config = tmp_path / "sluice.yaml"
    config.write_text("events: {path: null}\nroutes:\n  - {name: r, path_prefix: /r/, "
                      "upstream: 'http://127.0.0.1:1'}\n")
    stdout_events = timeline("a", "--config", str(config))
    assert stdout_events.returncode == 2 and "--events -" in stdout_events.stderr


def test_tenant_picks_one_tenants_run_of_an_id(tmp_path):
    """A run is a tenant's run id: two tenants' run-1 are read together by default, and
    apart with ``--tenant``."""
    log = tmp_path / "events.jsonl"
    log.write_text("".join(
        json.dumps({"ts": ts, "event": "admitted", "run": "run-1", "tenant": tenant,
                    "request_id": f"{tenant}-{ts}"}) + "\n"
        for ts, tenant in ((1, "team-a"), (2, "team-b"), (3, "team-a"))))
    both = timeline("run-1", "--events", str(log))
    assert both.returncode == 0 and "3 event(s)" in both.stdout, both.stderr
    # Said, as a new user read three tenants' run as one run's summary (a README trial).
    assert ("note: 2 tenants have a run 'run-1' (team-a, team-b): their events are shown "
            "together; --tenant NAME shows one") in both.stderr
    one = timeline("run-1", "--tenant", "team-b", "--events", str(log))
    assert one.returncode == 0 and "1 event(s)" in one.stdout, one.stderr
    assert "team-a" not in one.stdout and "note:" not in one.stderr
    none = timeline("run-1", "--tenant", "team-c", "--events", str(log))
    assert none.returncode == 1 and "no events for run 'run-1' of tenant 'team-c'" in (
        none.stderr)


def test_a_rotated_log_is_read_across_its_files_plain_and_gzipped(tmp_path):
    # logrotate leaves a run's events in events.jsonl.2.gz, events.jsonl.1 and events.jsonl:
    # the tool read one file, so a run spanning a rotation lost its start.
    import gzip

    def event(ts: int, name: str, **more: object) -> str:
        return json.dumps({"ts": ts, "event": name, "run": "a", "request_id": f"r{ts}",
                           **more}) + "\n"

    with gzip.open(tmp_path / "events.jsonl.2.gz", "wt") as old:
        old.write(event(10, "admitted"))
    (tmp_path / "events.jsonl.1").write_text(event(11, "completed", status=200))
    (tmp_path / "events.jsonl").write_text(event(12, "rejected", reason="queue_full"))
    files = [str(tmp_path / name) for name in
             ("events.jsonl", "events.jsonl.2.gz", "events.jsonl.1")]  # any order
    shown = timeline("a", *[arg for f in files for arg in ("--events", f)])
    assert shown.returncode == 0, shown.stderr
    assert "3 event(s)" in shown.stdout
    lines = [line.split()[0] for line in shown.stdout.splitlines() if line.startswith("+")]
    assert lines == ["+0.000s", "+1.000s", "+2.000s"]  # ordered by ts, not by file
    (tmp_path / "bad.gz").write_bytes(b"not gzip\n")
    # Cut short, as logrotate leaves one it is still compressing: a traceback (a review).
    (tmp_path / "cut.gz").write_bytes((tmp_path / "events.jsonl.2.gz").read_bytes()[:30])
    for bad in ("bad.gz", "cut.gz", "missing.jsonl"):
        refused = timeline("a", "--events", files[0], "--events", str(tmp_path / bad))
        assert refused.returncode == 2 and "Traceback" not in refused.stderr
        assert f"cannot read the event log {tmp_path / bad}: " in refused.stderr


def test_a_relative_events_path_not_found_says_where_it_was_looked_for(tmp_path: Path) -> None:
    """``events.path: sluice-events.jsonl`` is where Sluice runs; the timeline run from
    another directory found no log, and said only that (a new user's trial)."""
    config = tmp_path / "my-sluice.yaml"
    config.write_text("events: {path: sluice-events.jsonl}\n"
                      "routes:\n  - {name: r, path_prefix: /r/, upstream: 'http://127.0.0.1:9'}\n")
    # Run from a directory of its own: the README's trace walk-through leaves a
    # sluice-events.jsonl in the clone, and this found it (a new user's trial).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    refused = timeline("run-42", "--config", str(config), cwd=elsewhere)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert (f"(events.path in {config}, relative to the working directory {elsewhere}: run this "
            "where Sluice runs, or pass --events FILE)") in refused.stderr, refused.stderr


def test_tool_costs_count_in_the_runs_spend_and_events_name_the_operation() -> None:
    from proxy.timeline import render

    base = {"request_id": "r1", "route": "tools", "tenant": "t", "run": "run-1",
            "idempotency_key": None, "operation": "send"}
    events = [{**base, "ts": 10.0, "event": "admitted"},
              {**base, "ts": 10.5, "event": "completed", "status": 200, "outcome": "2xx",
               "duration_s": 0.5, "operation_cost_usd": 0.02}]
    text = render("run-1", events)
    assert "spend 0 tokens, $0.020000" in text
    assert "operation=send" in text


def test_a_call_refused_from_a_queue_shows_how_long_it_waited() -> None:
    """A queued call the drain answered 503 draining (or a cancel, or a better call taking
    its place) logs `enqueued` then `rejected`, with no `waited_s`: its story said `-` queued,
    as if it had been refused on arrival."""
    from proxy.timeline import stories

    base = {"request_id": "r1", "route": "openai", "tenant": "t", "run": "run-1",
            "idempotency_key": None}
    queued_then_refused = [{**base, "ts": 10.0, "event": "enqueued", "queue_depth": 1},
                           {**base, "ts": 12.5, "event": "rejected", "reason": "draining"}]
    [story] = stories(queued_then_refused)
    assert story.queued_s == 2.5 and story.result == "rejected draining"
    [refused_on_arrival] = stories(queued_then_refused[1:])
    assert refused_on_arrival.queued_s is None


def test_a_held_mcp_cancel_ends_its_story_and_names_the_call_it_let_run() -> None:
    """A client's cancel Sluice answered itself (``cancel_held``) has no `completed` event: its
    story said `in flight` for ever."""
    from proxy.timeline import describe, stories

    base = {"route": "tools", "tenant": "t", "run": "run-1", "idempotency_key": "sluice-t-1"}
    events = [{**base, "request_id": "r1", "ts": 10.0, "event": "admitted",
               "operation": "send"},
              {**base, "request_id": "r2", "ts": 10.5, "event": "cancel_held", "status": 202,
               "call_request_id": "r1", "operation": "send"}]
    call, held = stories(events)
    assert (call.result, held.result) == ("in flight", "202 cancel held")
    assert describe(events[1]) == ("status=202, call_request_id=r1, operation=send, "
                                   "key=sluice-t-1")


def test_a_cancel_that_ended_a_queued_mcp_call_ends_both_stories() -> None:
    """A client's cancel that ended its call in the queue (``cancel_applied``) says so, and
    the call's story ends with its ``client_cancelled`` outcome and its time queued."""
    from proxy.timeline import stories

    base = {"route": "tools", "tenant": "t", "run": None, "idempotency_key": None}
    events = [{**base, "request_id": "r1", "ts": 10.0, "event": "enqueued",
               "operation": "send", "queue_depth": 1},
              {**base, "request_id": "r2", "ts": 10.5, "event": "cancel_applied", "status": 202,
               "call_request_id": "r1", "operation": "send"},
              {**base, "request_id": "r1", "ts": 10.5, "event": "completed", "status": 200,
               "outcome": "client_cancelled", "waited_s": 0.5, "operation": "send"}]
    call, applied = stories(events)
    assert (call.result, call.queued_s) == ("200 client_cancelled", 0.5)
    assert applied.result == "202 cancel applied"


def test_tokens_of_a_model_without_pricing_are_not_shown_as_free() -> None:
    """With the default config's empty `pricing`, a run's calls have `cost_usd: null`: the
    summary said `$0.000000`, as if they had cost nothing."""
    from proxy.timeline import summary

    base = {"request_id": "r1", "route": "openai", "tenant": "t", "run": "run-1",
            "idempotency_key": None, "event": "completed", "input_tokens": 12,
            "output_tokens": 8}
    unpriced = [{**base, "cost_usd": None}]
    assert summary(unpriced, []).endswith(
        "spend 20 tokens, cost unknown (1 call of a model without pricing)")
    mixed = [*unpriced, {**base, "request_id": "r2", "cost_usd": 0.000008}]
    assert summary(mixed, []).endswith(
        "spend 40 tokens, $0.000008 + unknown (1 call of a model without pricing)")
    assert summary([{**base, "cost_usd": 0.000008}], []).endswith("$0.000008")


def test_token_counts_that_overflow_when_summed_are_said_so() -> None:
    # A hostile trial: two lines of 1e308 input tokens summed to inf, and int(inf) raised.
    from proxy.timeline import summary

    line = {"request_id": "r1", "route": "openai", "tenant": "t", "run": "run-1",
            "idempotency_key": None, "event": "completed", "input_tokens": 1e308,
            "output_tokens": 0, "cost_usd": 0.0}
    assert "more tokens than can be counted" in summary([line, {**line, "request_id": "r2"}],
                                                        [])


def test_json_lines_that_are_not_our_events_are_skipped_not_fatal(tmp_path):
    # Seen by a new user: `kubectl logs ... | sluice timeline RUN --events -` may carry other
    # programs' JSON; a string `ts`, no `ts`, a numeric request id or a string token count
    # each ended the command with a traceback.
    shown = timeline_of(tmp_path, [
        '{"event": "admitted", "run": "a", "ts": "n"}',
        '{"event": "admitted", "run": "a"}',
        '{"event": "completed", "run": "a", "ts": 1, "request_id": 5}',
        '{"event": "completed", "run": "a", "ts": 1e300, "request_id": "y"}',
        '{"event": 7, "run": "a", "ts": 1, "request_id": "y"}',
        '{"ts": 10, "event": "admitted", "run": "a", "request_id": "x"}',
        '{"ts": 11, "event": "completed", "run": "a", "request_id": "x", "status": 200,'
        ' "input_tokens": "9", "output_tokens": 4, "duration_s": "slow", "cost_usd": true}',
    ])
    assert shown.returncode == 0, shown.stderr
    assert "Traceback" not in shown.stderr
    assert "1 request(s), 2 event(s)" in shown.stdout
    assert "spend 4 tokens, cost unknown" in shown.stdout
    assert "None" not in shown.stdout  # no route or tenant in these events: "-" (a trial)


def test_cut_lines_are_counted_on_stderr_and_a_copytruncates_nuls_passed_over(tmp_path):
    """A hostile trial: a line a full disk cut (here a ``dead_letter_lost``, so the work's
    loss was hidden) and an event behind a run of NULs (a copytruncate's hole) were dropped
    without a word. The cut ones are named on stderr, file and line; the event after the
    NULs is read; log lines and other runs' whole events are still skipped quietly."""
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"\n".join([
        b'{"ts": 10, "event": "admitted", "run": "run-7", "request_id": "x"}',
        b'{"ts": 11, "event": "dead_letter_lost", "run": "run-7", "request_id": "x", "rou',
        b'{"ts": 11.5, "event": "dead_letter_lost", "reque',  # cut before naming its run
        b"2026-12-07 00:00:00,000 WARNING sluice: run run-7: a log line, not an event",
        b'{"ts": 12, "event": "admitted", "run": "other", "request_id": "z"}',
        b'\0' * 8 + b'{"ts": 13, "event": "admitted", "run": "run-7", "request_id": "y"}',
    ]) + b"\n")
    shown = timeline("run-7", "--events", str(log))
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == (f"{log}: skipped 2 unreadable lines (JSON cut short or damaged; "
                            "an event of this run may be among them): line(s) 2, 3\n")
    assert "2 request(s), 2 event(s)" in shown.stdout
    assert set(rows(shown.stdout, "request")) == {"x", "y"}


def test_cut_lines_and_the_runs_events_are_found_among_many_lines_of_other_runs() -> None:
    """Lines of other runs are passed over by the block (see the next test); what the block
    holds is still found, at its line number, wherever it falls."""
    def event(ts: int, run: str) -> bytes:
        return orjson.dumps({"ts": ts, "event": "admitted", "run": run,
                             "request_id": f"r{ts}"}) + b"\n"
    lines = [event(n, "other") for n in range(1, 1001)]
    mine = {1, 256, 257, 512, 700}
    cut = {2, 255, 258, 513, 999}
    for n in mine:
        lines[n - 1] = (b"\0" * 4 if n == 700 else b"") + event(n, "run-7")
    for n in cut:
        lines[n - 1] = event(n, "other")[:20] + b"\n"
    lines[599] = b"2026-12-07 00:00:00,000 WARNING sluice: a log line\n"
    lines[799] = event(800, "other").replace(b"\n", b"\r\n")
    lines[-1] = lines[-1].rstrip(b"\n")  # a last line without its newline: whole
    unreadable: list[int] = []
    events = read_run(lines, "run-7", None, unreadable)
    assert [e["ts"] for e in events] == sorted(mine)
    assert unreadable == sorted(cut)
    as_text = [line.decode() for line in lines]
    assert read_run(as_text, "run-7") == events


def test_control_characters_callers_chose_are_printed_as_escapes(tmp_path):
    """A model, tenant or path a caller chose reached the operator's terminal raw: ESC and
    OSC sequences could clear it or retitle it, and a CR LF fake a line (a hostile trial)."""
    shown = timeline_of(tmp_path, [
        '{"ts": 10, "event": "admitted", "run": "a", "request_id": "x",'
        ' "tenant": "t\\u001b[2J"}',
        '{"ts": 11, "event": "completed", "run": "a", "request_id": "x", "status": 200,'
        ' "model": "m\\u001b]0;owned\\u0007\\r\\nfake line", "tenant": "t\\u009b"}',
    ])
    assert shown.returncode == 0, shown.stderr
    assert not any(ch in shown.stdout for ch in "\x1b\x07\r\x9b")
    assert "\\x1b[2J" in shown.stdout
    assert "fake line" not in shown.stdout.splitlines()[-1]


def test_bidi_controls_callers_chose_are_printed_as_escapes(tmp_path):
    """A bidi override (U+202E) or isolate (U+2066) in a tenant or model showed the rest of
    its line reversed, so a row read as another: written as escapes like the controls."""
    shown = timeline_of(tmp_path, [
        '{"ts": 10, "event": "admitted", "run": "a", "request_id": "x",'
        ' "tenant": "t\\u202egpj.exe"}',
        '{"ts": 11, "event": "completed", "run": "a", "request_id": "x", "status": 200,'
        ' "model": "m\\u2066x\\u2069"}',
    ])
    assert shown.returncode == 0, shown.stderr
    assert not any(ch in shown.stdout for ch in "\u202e\u2066\u2069")
    assert "\\u202e" in shown.stdout and "\\u2066" in shown.stdout


async def test_a_caller_that_leaves_while_queued_ends_its_story(upstream, start_sluice):
    # Seen in a hostile trial: such a call logged only `enqueued` (while the metrics counted
    # it client_disconnected), so the timeline showed it in flight forever.
    upstream.hold = asyncio.Event()
    sluice = await start_sluice({"routes": [
        route("llm", upstream.url, concurrency={"limit": 1, "queue": 1, "max_wait": "60s"})]})
    url = sluice.url + "/llm/v1/chat/completions"
    run = {"X-Run-ID": "run-left", "X-Tenant-ID": "acme"}
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(session.post(url, json=CHAT, headers={
            **run, "X-Request-ID": "req-held"}))
        await until(lambda: upstream.inflight == 1, what="the first call at the upstream")
        # A caller that gives up while it waits in the queue (its own timeout, say: the
        # client closes the connection). Cancelled once queued, not on a timer that a loaded
        # machine could let run out before the call got there.
        leaving = asyncio.create_task(session.post(url, json=CHAT, headers={
            **run, "X-Request-ID": "req-left"}))
        await sluice.wait_metric("sluice_queue_depth", 1, route="llm")
        leaving.cancel()
        await sluice.wait_metric("sluice_requests_total", 1, route="llm",
                                 outcome="client_disconnected")
        await until(lambda: any(e["event"] == "completed" and e["request_id"] == "req-left"
                                for e in sluice.events()), what="the left call's event")
        upstream.hold.set()
        (await first).release()
    await until(lambda: sum(e["event"] == "completed" for e in sluice.events()) == 2)

    left = [e for e in sluice.events() if e.get("request_id") == "req-left"]
    assert [e["event"] for e in left] == ["enqueued", "completed"]
    assert left[1]["status"] == 0 and left[1]["outcome"] == "client_disconnected"
    assert left[1]["waited_s"] > 0 and "duration_s" not in left[1]  # never at the upstream
    assert len(upstream.requests) == 1

    result = timeline("run-left", "--config", str(sluice.config_path))
    assert result.returncode == 0, result.stderr
    story = rows(result.stdout, "request")
    assert story["req-left"][-1] == "client_disconnected"
    assert story["req-left"][4] != "-" and story["req-left"][5] == "-"  # queued, no upstream
    assert "in flight" not in result.stdout
    assert "client_disconnected, after " in result.stdout


def test_two_tenants_requests_of_one_id_are_two_stories() -> None:
    """A hostile trial: two tenants' runs of one id, their requests sending the same
    ``X-Request-ID``, were read as one request (amplification 2.00, one row, the first
    tenant's): a caller could distort another tenant's run report."""
    from proxy.timeline import stories, summary

    events = [{"request_id": "r1", "route": "openai", "tenant": tenant, "run": "run-1",
               "idempotency_key": None, "ts": ts + at, "event": kind,
               **({"status": 200, "outcome": "2xx"} if kind == "completed" else {})}
              for tenant, ts in (("team-a", 10.0), ("team-b", 11.0))
              for at, kind in ((0.0, "admitted"), (0.5, "completed"))]
    told = stories(events)
    assert [(s.request_id, s.tenant) for s in told] == [("r1", "team-a"), ("r1", "team-b")]
    assert summary(events, told).startswith("amplification 1.00 (2 upstream attempt(s) for 2 ")
