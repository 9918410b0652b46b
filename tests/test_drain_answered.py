"""A drain ends a stream whose answer has gone out (``Call.relaying``,
``Runtime.end_answered``) rather than waiting for its upstream: around reloads, beside a
stream still mid-answer, with a run's cancel on the same call, a second stop signal, a twin
waiting on the answer's key; and the note it keeps on the call holds nothing alive. From a
hostile review of that change (tests/test_answered_callers.py has the plain cases).
"""

from __future__ import annotations

import asyncio
import gc
import signal

import aiohttp
import pytest
import yaml

from policies.pipeline import Call
from tests import test_answered_callers
from tests.conftest import open_runtime, route, serve_runtime, wait_until
from tests.test_answered_callers import TOKEN, cancel_run, openai_route, read_to_the_end
from tests.test_mcp_left_callers import CALL, HEADERS, mcp_route

holding = test_answered_callers.holding  # the fixture: an MCP upstream holding streams open


def _calls() -> list[Call]:
    return [o for o in gc.get_objects() if isinstance(o, Call)]


async def test_a_caller_closing_after_done_leaves_no_call_for_the_collector(upstream):
    """The OpenAI sync SDK closes its stream at [DONE]. The handler task then ends
    cancelled, and a cycle (its CancelledError's traceback, ``_serve``'s frame, ``call``,
    whose ``relaying`` holds the task) would keep every such call (its body, headers,
    request, response) alive until a cyclic collection, which the server puts off
    (``tune_gc``). None is left with the collector off."""
    upstream.done_linger = 30.0
    runtime = await open_runtime(route("openai", upstream.url))
    runner, port = await serve_runtime(runtime)
    gc.collect()
    gc.disable()
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                async with http.post(
                        f"http://127.0.0.1:{port}/openai/v1/chat/completions",
                        json={"model": "gpt-test", "stream": True,
                              "messages": [{"role": "user", "content": "x" * 50_000}]}) as r:
                    await asyncio.wait_for(r.content.readuntil(b"data: [DONE]\n\n"), 10)
                    r.close()
        await wait_until(lambda: runtime.inflight == 0 and runtime.present == 0,
                         what="the calls ended")
        await asyncio.sleep(0.2)
        left = len(_calls())
    finally:
        gc.enable()
        await runner.cleanup()
        await runtime.close()
    gc.collect()
    assert (left, len(_calls())) == (0, 0)


# -- through the process: reloads, mixed drains -------------------------------------------------


CHAT = {"model": "gpt-test", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def _completed(sluice) -> list[dict]:
    return [e for e in sluice.events() if e["event"] == "completed"]


async def _reload(sluice, change) -> None:
    data = yaml.safe_load(sluice.config_path.read_text())
    change(data)
    sluice.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    sluice.signal(signal.SIGHUP)
    await sluice.wait_metric("sluice_config_reloads_total", 1, timeout=20)


async def _held_after_done(upstream, start_sluice, change) -> None:
    """An OpenAI stream held open by its upstream after [DONE], its route changed by a
    reload (``change``, on the config as a dict), then SIGTERM: the stream ends at once,
    cleanly, ``2xx``."""
    upstream.done_linger = 60.0
    other = {"name": "other", "path_prefix": "/other/", "upstream": upstream.url,
             "protocol": "openai"}
    sluice = await start_sluice({"server": {"drain_timeout": "60s"},
                                 "routes": [openai_route(upstream), other]})
    async with aiohttp.ClientSession() as http, http.post(
            sluice.url + "/openai/v1/chat/completions", json=CHAT) as r:
        await asyncio.wait_for(r.content.readuntil(b"data: [DONE]\n\n"), 10)
        await _reload(sluice, change)
        sluice.signal(signal.SIGTERM)
        assert await read_to_the_end(r) == b""  # ended, not cut
        assert await sluice.wait_exit(timeout=20) == 0  # well before drain_timeout
    [completed] = _completed(sluice)
    assert (completed["outcome"], completed["status"]) == ("2xx", 200)
    assert "ending 1 stream(s) whose answer has gone out" in sluice.stderr()


async def test_a_route_removed_by_a_reload_still_has_its_answered_stream_ended(upstream,
                                                                               start_sluice):
    """Its call is on a route the config no longer has (``Runtime.removed``)."""
    await _held_after_done(upstream, start_sluice,
                           lambda d: d.update(routes=[r for r in d["routes"]
                                                      if r["name"] != "openai"]))


async def test_a_route_replaced_by_a_reload_still_has_its_answered_stream_ended(upstream,
                                                                                start_sluice):
    """Its call is on the route object a reload replaced (``Route.retired``)."""
    def change(d):
        d["routes"][0]["timeouts"] = {"total": "120s"}
    await _held_after_done(upstream, start_sluice, change)


async def test_the_drain_ends_the_answered_stream_and_waits_for_the_other(upstream,
                                                                         start_sluice):
    """One stream past [DONE] held open by its upstream, one still mid-answer: SIGTERM ends
    the first at once and waits for the second, which then ends as it came."""
    upstream.done_linger = 60.0
    sluice = await start_sluice({"server": {"drain_timeout": "60s"},
                                 "routes": [openai_route(upstream)]})
    async with aiohttp.ClientSession() as http:
        done = await http.post(sluice.url + "/openai/v1/chat/completions", json=CHAT)
        await asyncio.wait_for(done.content.readuntil(b"data: [DONE]\n\n"), 10)
        upstream.stream_hold = hold = asyncio.Event()
        mid = await http.post(sluice.url + "/openai/v1/chat/completions", json=CHAT)
        await asyncio.wait_for(mid.content.readuntil(b"\n\n"), 10)
        sluice.signal(signal.SIGTERM)
        assert await read_to_the_end(done) == b""
        await asyncio.sleep(1.0)
        assert sluice.proc.poll() is None  # still draining: it waits for the other
        upstream.done_linger = 0.0
        hold.set()
        rest = await read_to_the_end(mid)
        assert rest.endswith(b"data: [DONE]\n\n")
        assert await sluice.wait_exit(timeout=20) == 0
    ends = _completed(sluice)
    assert sorted((e["outcome"], e["status"]) for e in ends) == [("2xx", 200)] * 2


@pytest.mark.parametrize("idempotency", ["forward", "dedup"])
async def test_a_runs_cancel_and_the_drain_on_one_answered_call(holding, start_sluice,
                                                                idempotency):
    """SIGTERM and the run's cancel land together on an answered MCP call held open: the
    stream ends once, cleanly; the call is 2xx; nothing is left held."""
    sluice = await start_sluice({"server": {"drain_timeout": "60s"},
                                 "routes": [mcp_route(holding.url,
                                                      idempotency={"mode": idempotency})]},
                                env={"SLUICE_ADMIN_TOKEN": TOKEN})
    async with aiohttp.ClientSession() as http, http.post(
            sluice.url + "/tools/mcp", json=CALL,
            headers={**HEADERS, "X-Run-ID": "job", "Idempotency-Key": "k-1"}) as r:
        await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
        sluice.signal(signal.SIGTERM)
        await cancel_run(sluice, "job")
        assert await read_to_the_end(r) == b""
        assert await sluice.wait_exit(timeout=20) == 0
    [completed] = _completed(sluice)
    assert (completed["outcome"], completed["status"]) == ("2xx", 200)


async def test_a_second_sigterm_still_cuts_a_stream_mid_answer(upstream, start_sluice):
    """The cut's ``end_answered`` ends only answered streams: a second SIGTERM cuts one still
    mid-answer, ``drain_cut``, as before."""
    upstream.done_linger = 60.0
    sluice = await start_sluice({"server": {"drain_timeout": "60s"},
                                 "routes": [openai_route(upstream)]})
    async with aiohttp.ClientSession() as http:
        upstream.stream_hold = asyncio.Event()
        mid = await http.post(sluice.url + "/openai/v1/chat/completions", json=CHAT)
        await asyncio.wait_for(mid.content.readuntil(b"\n\n"), 10)
        sluice.signal(signal.SIGTERM)
        await asyncio.sleep(1.3)
        sluice.signal(signal.SIGTERM)
        with pytest.raises(aiohttp.ClientPayloadError):
            await read_to_the_end(mid)
        assert await sluice.wait_exit(timeout=20) == 0
    [completed] = _completed(sluice)
    assert completed["outcome"] == "drain_cut"


async def test_a_twin_waiting_on_an_answered_call_gets_its_answer_at_the_drain(holding,
                                                                              start_sluice):
    """A retry with the same key waits for the in-flight call (dedup). SIGTERM ends the
    answered call's held stream: the twin is answered with its replay, not cut or 503."""
    sluice = await start_sluice({"server": {"drain_timeout": "60s"},
                                 "routes": [mcp_route(holding.url)]})
    async with aiohttp.ClientSession() as http:
        first = await http.post(sluice.url + "/tools/mcp", json=CALL,
                                headers={**HEADERS, "Idempotency-Key": "k-1"})
        await asyncio.wait_for(first.content.readuntil(b"\n\n"), 10)
        twin = asyncio.ensure_future(http.post(sluice.url + "/tools/mcp", json=CALL,
                                               headers={**HEADERS, "Idempotency-Key": "k-1"}))
        await sluice.wait_metric("sluice_idempotency_waiting", 1, route="tools")
        sluice.signal(signal.SIGTERM)
        assert await read_to_the_end(first) == b""
        second = await asyncio.wait_for(twin, 20)
        body = await read_to_the_end(second)
        assert second.status == 200 and b"done #1" in body, (second.status, body)
        assert await sluice.wait_exit(timeout=20) == 0
