"""Regressions found by the adversarial review of the CPU-optimised request path
(57359db..80d76e3), each through the real proxy in this process (as
``tests/test_pipeline_regressions.py`` does) or on the policy objects themselves."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import orjson
import pytest

from policies import breaker as brk
from policies import mcp
from policies.concurrency import ConcurrencyLimiter
from policies.config import CircuitBreakerConfig
from policies.pipeline import Call
from policies.reasons import Reason, Rejected
from policies.retry import upstream_retry_after
from policies.state import memory_backends
from policies.state.breaker import OPEN, MemoryBreakerStates
from policies.state.rate import Take
from proxy import attempts, handler
from proxy.config import parse_config
from tests.conftest import raw_request
from tests.fakeupstream import FakeUpstream, RawUpstream
from tests.test_pipeline_regressions import post, proxy
from tests.test_resilience_units import Clock

# -- Content-Length with more digits than int() reads -------------------------------------------

#: A Content-Length of 1 written with 5,000 leading zeros: RFC 9110 §8.6 allows any number of
#: digits, llhttp reads it as 1, but Python's int() refuses a string of more than 4,300 digits
#: (``sys.int_max_str_digits``).
ZERO_PADDED_ONE = "0" * 5000 + "1"


async def test_a_zero_padded_content_length_is_read_not_a_500(upstream: FakeUpstream) -> None:
    # Seen: the edge read Content-Length with int() on the header's text (the request's
    # content_length property before, the header itself since the edge reads it) and a
    # 5,001-digit value raised ValueError outside the handler: 500 internal_error, and a
    # traceback logged for each such request.
    config = f"""
routes:
  - name: r
    path_prefix: /r/
    upstream: {upstream.url}
    protocol: http
"""
    async with proxy(config) as sluice:
        answer = await raw_request(
            sluice.port,
            (f"POST /r/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {ZERO_PADDED_ONE}"
             "\r\nConnection: close\r\n\r\nx").encode())
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert len(upstream.requests) == 1 and upstream.requests[0].body == b"x"


async def test_an_upstreams_zero_padded_content_length_is_relayed() -> None:
    # The relay read the upstream's Content-Length the same way: a 5,001-digit one raised
    # ValueError in the relay, logged as a "proxy error" with its traceback, and the caller
    # got 502 for a well-formed 2-byte answer.
    raw = RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                      + ZERO_PADDED_ONE.encode()[:-1] + b"2\r\nConnection: close\r\n\r\nok")
    await raw.start()
    config = f"""
routes:
  - name: r
    path_prefix: /r/
    upstream: {raw.url}
    protocol: http
"""
    try:
        async with proxy(config) as sluice, aiohttp.ClientSession() as session:
            async with session.get(sluice.url("/r/x")) as response:
                assert (response.status, await response.read()) == (200, b"ok")
    finally:
        await raw.stop()


# -- a half-open probe that outlives its lease ------------------------------------------------


async def test_a_probe_past_its_lease_no_longer_refuses_every_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen: on a memory route a probe whose upstream is slow to answer (timeouts.total is 600 s
    # by default) keeps the view "half-open, a probe in flight" until it ends, so the
    # pipeline's check() refuses every call 503 circuit_open for that long. The state itself
    # lets another call probe once the probe's lease (state.lease) has lapsed, as it does when
    # its renewal stops (the probing replica died; here no loop time passes for it to run),
    # the sibling of ef19128, a probe whose caller left.
    clock = Clock()
    monkeypatch.setattr(brk.time, "monotonic", clock)
    backends = memory_backends()
    backends.breakers = MemoryBreakerStates(clock)
    breaker = brk.Breaker(CircuitBreakerConfig(fail_max=1, reset_timeout="5s"), "r",
                          lambda *a, **k: None, backends)
    await breaker.record(await breaker.attempt(), brk.FAILURE)
    clock.now += 5
    breaker.check()
    await breaker.attempt()  # the probe: its upstream does not answer
    with pytest.raises(Rejected):
        breaker.check()  # while its lease holds, the others wait for its verdict
    clock.now += backends.lease_s + 1
    breaker.check()  # the lease lapsed: the next caller may probe
    second = await breaker.attempt()
    assert second.ticket.probe is not None
    await breaker.record(second, brk.SUCCESS)
    assert breaker.current == "closed"


# -- a reload between a call's rate step and its accounting step --------------------------------


def _twin_route(upstream_url: str, budget: bool) -> str:
    return f"""
routes:
  - name: r
    path_prefix: /r/
    upstream: {upstream_url}
    protocol: openai
    rate: {{per_tenant: {{requests: 2/min}}}}
    idempotency: {{mode: dedup, derive_from: [X-Step]}}
""" + ("    budget: {tokens: 100000/day}\n" if budget else "")


@pytest.mark.parametrize("budget_before", [False, True])
async def test_a_reload_while_a_call_waits_for_its_twin_keeps_its_rate_limit(
        upstream: FakeUpstream, budget_before: bool) -> None:
    # Seen: which step takes a metered call's request units (the rate step, or the
    # accounting step with its tokens and budget holds) is a flag on the route's rate limiter,
    # which a reload keeps and sets from the *new* blocks, while a call already past the
    # reload's swap runs the *old* plan's accounting step. A call that waited for its twin
    # across a reload adding a budget skipped the rate step (the flag said "the accounting
    # takes them") and the old accounting step took nothing (no budget in its blocks): it
    # reached the upstream without spending its unit of the tenant's 2/min. A reload removing
    # the budget made the call pay its unit twice: refused 429 with one unit still free.
    upstream.hold = asyncio.Event()
    async with proxy(_twin_route(upstream.url, budget_before)) as sluice, \
            aiohttp.ClientSession() as session:
        url = sluice.url("/r/v1/chat/completions")
        first = asyncio.create_task(post(session, url, **{"X-Step": "1"}))
        while upstream.inflight < 1:
            await asyncio.sleep(0.01)
        twin = asyncio.create_task(post(session, url, **{"X-Step": "1"}))
        while sluice.route().idempotency.waiting < 1:
            await asyncio.sleep(0.01)
        sluice.runtime.configure(parse_config(_twin_route(upstream.url, not budget_before)))
        # Its caller leaves (it reached the upstream: its unit is spent), and the key goes
        # to the waiting twin. (A failure of the call would be given to the twin instead.)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        while upstream.cancelled < 1:
            await asyncio.sleep(0.01)
        upstream.hold.set()
        status, headers, _ = await twin
        assert (status, headers.get("X-Sluice-Reason")) == (200, None)
        assert len(upstream.requests) == 2
        # Each call spent one unit of the tenant's two, no more, no less.
        buckets = sluice.runtime.state.rates
        (left,) = await buckets.available("r", [Take("tenant:default", 2, 60.0)])
        assert left == 0
        with_key = await post(session, url)
        assert (with_key[0], with_key[1].get("X-Sluice-Reason")) == (429, "rate_limited")


# -- a caller leaving while an attempt's outcome is recorded to its first breaker -------------


class _SlowRecordStates(MemoryBreakerStates):
    """Memory breaker states whose record suspends, as a Redis round trip does."""

    async def record(self, *args, **kwargs):
        await asyncio.sleep(0.05)
        return await super().record(*args, **kwargs)


async def test_a_caller_leaving_during_the_first_breakers_record_still_reports_to_the_rest():
    # Seen (review): the attempt recorded to each of its breakers (the route's, the tool's)
    # in turn; a cancellation surfacing at the first record (shielded: it runs to its end)
    # skipped the others, whose tickets were never recorded nor released; a half-open
    # probe's lease stayed held until PROBE_LEASE_S.
    def breaker(states) -> brk.Breaker:
        backends = memory_backends()
        backends.breakers = states
        return brk.Breaker(CircuitBreakerConfig(fail_max=1, reset_timeout="30s"), "r",
                           lambda *a, **k: None, backends)

    states = _SlowRecordStates(), MemoryBreakerStates()
    first, second = breaker(states[0]), breaker(states[1])
    tickets = [(first, await first.attempt()), (second, await second.attempt())]
    task = asyncio.create_task(attempts._record_each(tickets, brk.FAILURE))
    await asyncio.sleep(0.01)  # inside the first breaker's record
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)  # the handed-over record lands
    # (The first record itself is shielded on Redis, the only states that suspend; this
    # stand-in is not, so what it counted is not asserted.)
    assert (await states[1].view("r")).state == OPEN



def route_entry(upstream: str, protocol: str, blocks: str = "", name: str = "r") -> str:
    """A ``routes:`` item: route ``name`` at ``/name/`` in front of ``upstream``; ``blocks``:
    its policy blocks as YAML flow lines (``"circuit_breaker: {fail_max: 1}"``)."""
    lines = "".join(f"\n    {line}" for line in blocks.splitlines() if line)
    return (f"  - name: {name}\n    path_prefix: /{name}/\n    upstream: {upstream}"
            f"\n    protocol: {protocol}{lines}\n")


def one_route(upstream: str, protocol: str, blocks: str = "", name: str = "r") -> str:
    """A config of that one route (see :func:`route_entry`)."""
    return "routes:\n" + route_entry(upstream, protocol, blocks, name)


def json_upstream(answer: bytes) -> RawUpstream:
    """An upstream answering every request 200 with the JSON ``answer``."""
    return RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                       + str(len(answer)).encode() + b"\r\nConnection: close\r\n\r\n" + answer)


# -- JSON nested deeper than orjson writes (it reads 1,024 levels, writes 254) -----------------


def _nested(depth: int) -> object:
    node: object = "x"
    for _ in range(depth):
        node = {"a": node}
    return node


MCP_HEADERS = {"Content-Type": "application/json",
               "Accept": "application/json, text/event-stream", "Idempotency-Key": "k1"}
MCP_CALL = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "t", "arguments": {"x": 1}}}


@pytest.mark.parametrize("fault", ["too deep", "any exception"])
async def test_an_mcp_answer_too_deep_to_rewrite_frees_its_idempotency_key(
        fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen (review): storing the answer rewrites its JSON-RPC id, orjson refused to write it
    # back (TypeError), and the key's release died half way: the key stayed "in flight" for
    # the life of the process, every later use waiting max_wait for a 409. Now an answer
    # that cannot be kept for any reason leaves the key free.
    if fault == "any exception":
        def broken(*args: object) -> bytes:
            raise RuntimeError("a fault while keeping the answer")

        monkeypatch.setattr(mcp, "rewrite_id", broken)
    answer = (b'{"jsonrpc":"2.0","id":1,"result":{"content":[],"structuredContent":'
              + b'{"a":' * 300 + b'"x"' + b"}" * 300 + b"}}")
    raw = await json_upstream(answer).start()
    config = one_route(raw.url, "mcp", "idempotency: {mode: dedup, max_wait: 2s}", "tools")
    try:
        async with proxy(config) as sluice, aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{sluice.port}/tools/mcp"
            for attempt in range(1, 3):
                status, headers, body = await post(session, url, MCP_CALL, **MCP_HEADERS)
                assert status == 200, (attempt, headers.get("X-Sluice-Reason"), body[:200])
                assert body == answer
            # Not kept (it cannot be replayed), so the retry ran again, after the key was
            # given back rather than left in flight.
            assert len(raw.requests) == 2
            assert sluice.route("tools").idempotency.in_flight == 0
    finally:
        await raw.stop()


async def test_a_request_too_deep_to_rewrite_or_fingerprint_is_refused_400(
        upstream: FakeUpstream) -> None:
    # Seen (review): a stream request with its own stream_options (rewritten whole to add
    # include_usage) or an MCP call's arguments (fingerprinted as canonical JSON) nested
    # past 254 levels got 502 "proxy error" and a traceback instead of a 4xx.
    config = ("routes:\n"
              + route_entry(upstream.url, "openai", "rate: {tokens: 1000000/min}", "llm")
              + route_entry(upstream.url, "openai", name="plain")
              + route_entry(upstream.url, "mcp", "idempotency: {mode: dedup}", "tools"))
    deep_chat = {"model": "m", "stream": True, "stream_options": {},
                 "messages": [{"role": "user", "content": "hi", "extra": _nested(300)}]}
    deep_call = (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t",'
                 b'"arguments":' + b'{"a":' * 300 + b"1" + b"}" * 300 + b"}}")
    async with proxy(config) as sluice, aiohttp.ClientSession() as session:
        base = f"http://127.0.0.1:{sluice.port}"
        status, headers, body = await post(session, base + "/llm/v1/chat/completions",
                                           deep_chat)
        assert (status, headers.get("X-Sluice-Reason")) == (400, "bad_request"), body[:300]
        assert b"nested too deeply" in body
        async with session.post(base + "/tools/mcp", data=deep_call, headers=MCP_HEADERS) as r:
            assert (r.status, r.headers.get("X-Sluice-Reason")) == (400, "bad_request")
            body = await r.read()
        assert orjson.loads(body)["id"] == 1 and b"nested too deeply" in body
        # An id that is no id (a list 300 deep) made the refusal itself fail: 500.
        deep_id = (b'{"jsonrpc":"2.0","id":' + b"[" * 300 + b"]" * 300
                   + b',"method":"tools/call","params":{"name":"t","arguments":{}}}')
        async with session.post(base + "/tools/mcp", data=deep_id, headers=MCP_HEADERS) as r:
            assert (r.status, r.headers.get("X-Sluice-Reason")) == (400, "bad_request")
            assert (await r.json())["id"] is None
        assert upstream.requests == []
        # Where tokens are not limited the body is not Sluice's to read: passed untouched.
        status, _, _ = await post(session, base + "/plain/v1/chat/completions", deep_chat)
        assert status == 200
        assert orjson.loads(upstream.requests[0].body) == deep_chat


# -- an upstream Retry-After that overflows a date ----------------------------------------------


async def test_an_overflowing_retry_after_date_is_ignored_and_the_breaker_hears_the_failure(
        upstream: FakeUpstream) -> None:
    # Seen (review): parsedate_to_datetime raised OverflowError on a zone of +999...9, inside
    # the attempt before its breaker tickets were recorded: every caller got 502 and the
    # breaker never opened on an upstream answering 503 to everything.
    bad = "Mon, 01 Jan 2020 00:00:00 +99999999999999999999"
    assert upstream_retry_after({"Retry-After": bad}) is None
    upstream.status = 503
    upstream.error_headers = {"Retry-After": bad}
    config = one_route(upstream.url, "openai", "circuit_breaker: {fail_max: 2, reset_timeout: 60s}")
    async with proxy(config) as sluice, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{sluice.port}/r/v1/chat/completions"
        answers = [await post(session, url) for _ in range(4)]
    assert [status for status, _, _ in answers] == [503, 503, 503, 503]
    assert [headers.get("X-Sluice-Reason") for _, headers, _ in answers[2:]] == \
        ["circuit_open", "circuit_open"]
    assert len(upstream.requests) == 2


# -- max_wait: 0s --------------------------------------------------------------------------------


async def test_a_zero_max_wait_refuses_a_call_that_would_queue() -> None:
    # Seen (review): with max_wait 0 (a fanout's may be) a call without a timeout that found
    # every slot busy raised TypeError formatting its missing timeout: 502 "proxy error".
    # With a timeout (the openai SDK always sends one) it was refused deadline_unreachable,
    # blaming the caller's timeout for a queue nobody may wait in.
    limiter = ConcurrencyLimiter(1, 5, 0.0, None)
    await limiter.acquire("t")
    for timeout in (None, 30.0):
        with pytest.raises(Rejected) as refused:
            await limiter.acquire("t", caller_timeout=timeout)
        assert refused.value.reason is Reason.QUEUE_FULL
        assert "max_wait is 0s" in refused.value.detail
    assert (limiter.inflight, limiter.queued) == (1, 0)
    limiter.release("t", None)
    assert limiter.inflight == 0


async def test_an_answer_that_cannot_be_read_still_gives_the_breakers_ticket_back(
        upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    # The attempt reads its answer's status and hints under the same guard as the send, so
    # an exception there (an overflowing Retry-After date was one) gives a half-open probe's
    # ticket back: before, the probe's lease stayed held and the route refused every call
    # circuit_open for PROBE_LEASE_S (30 s).
    config = one_route(upstream.url, "openai",
                       "circuit_breaker: {fail_max: 1, reset_timeout: 200ms}")
    async with proxy(config) as sluice, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{sluice.port}/r/v1/chat/completions"
        upstream.statuses = [503, 503]
        assert (await post(session, url))[0] == 503  # opens
        await asyncio.sleep(0.25)  # half-open: the next call is the probe

        def unreadable(headers: object) -> float:
            raise RuntimeError("an answer Sluice cannot read")

        monkeypatch.setattr(attempts, "upstream_retry_after", unreadable)
        status, headers, _ = await post(session, url)
        assert (status, headers.get("X-Sluice-Reason")) == (502, "upstream_unreachable")
        monkeypatch.undo()
        status, headers, _ = await post(session, url)  # a new probe, not circuit_open
        assert status == 200, headers.get("X-Sluice-Reason")
        assert len(upstream.requests) == 3


# -- a caller's timeout counted from its arrival, in every queue and at the first attempt -----


async def test_a_queues_wait_for_a_caller_is_what_is_left_of_its_timeout() -> None:
    # Seen (review): each queue gave a call its caller's whole timeout from the moment it
    # joined, so time spent earlier (waiting for an idempotent twin, a run's fanout queue)
    # was counted twice and the call could be admitted after its caller had given up.
    limiter = ConcurrencyLimiter(1, 5, 30.0, None)
    await limiter.acquire("t")
    call = Call(request_id="q", route="r", method="POST", path="/r/", headers={}, body=b"",
                tenant="t", run=None, timeout=10.0)
    # 9.5 s of its 10 s already spent elsewhere, and Sluice's lead on the rest (0.25 s:
    # CALLER_LEAD_MAX_S), so that its refusal beats the caller's own timeout.
    call.received_at -= 9.5
    started = asyncio.get_running_loop().time()
    with pytest.raises(Rejected) as refused:
        await limiter.admit(call)
    waited = asyncio.get_running_loop().time() - started
    assert refused.value.reason is Reason.QUEUE_TIMEOUT
    assert waited < 5, waited  # ~0.25 s, not the 10 s of its whole timeout
    call.received_at -= 1.0  # past its timeout: refused at once, the queue blaming no one
    with pytest.raises(Rejected) as refused:
        await limiter.admit(call)
    assert refused.value.reason is Reason.DEADLINE_UNREACHABLE
    assert "the caller's timeout has passed" in refused.value.detail
    assert (limiter.inflight, limiter.queued) == (1, 0)


async def test_a_call_whose_timeout_passed_before_its_first_attempt_is_not_sent(
        upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen (review): the first attempt was sent under asyncio.timeout(0) and could still
    # reach the upstream on a pooled connection; the caller got 504 "within 0s".
    config = one_route(upstream.url, "openai")

    class LateCall(Call):  # its 30 s were spent before admission (in queues, say)
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)  # type: ignore[arg-type]
            self.received_at -= 30.5

    async with proxy(config) as sluice, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{sluice.port}/r/v1/chat/completions"
        assert (await post(session, url, **{"X-Request-Timeout": "30"}))[0] == 200
        monkeypatch.setattr(handler, "Call", LateCall)
        status, headers, _ = await post(session, url, **{"X-Request-Timeout": "30"})
    assert (status, headers.get("X-Sluice-Reason")) == (503, "deadline_unreachable")
    assert len(upstream.requests) == 1


async def test_mcp_arguments_differing_past_64_bits_are_different_calls() -> None:
    # Seen (review): orjson reads an integer beyond 64 bits as a float, so two calls whose
    # amounts differed in the last digit had one fingerprint: the second got the first's
    # answer, never reaching the tool.
    answer = b'{"jsonrpc":"2.0","id":1,"result":{"content":[]}}'
    raw = await json_upstream(answer).start()
    config = one_route(raw.url, "mcp", "idempotency: {mode: dedup}", "tools")
    headers = {key: value for key, value in MCP_HEADERS.items() if key != "Idempotency-Key"}
    try:
        async with proxy(config) as sluice, aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{sluice.port}/tools/mcp"
            for amount in (b"123456789012345678901234567890", b"123456789012345678901234567891",
                           b"123456789012345678901234567891"):
                body = (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":'
                        b'"pay","arguments":{"amount":' + amount + b"}}}")
                async with session.post(url, data=body, headers=headers) as r:
                    assert r.status == 200
        # Two amounts, two calls; the same amount again is replayed.
        assert len(raw.requests) == 2
    finally:
        await raw.stop()


# -- a reload changing a budget: the tenants' gauges and the admin view ------------------------


async def test_a_reloaded_budget_is_what_the_tenants_gauges_and_the_admin_view_read(
        upstream: FakeUpstream) -> None:
    # Found by a hostile trial: after a reload raising a tenant budget from 1,000 to 100,000,
    # sluice_budget_remaining{tenant="acme"} still read 982 (the old limit) until acme was
    # admitted again, and /admin/routes showed no tenants at all.
    def config(limit: int, budget: bool = True) -> str:
        blocks = f"budget: {{tokens: {limit}/day}}" if budget else ""
        return one_route(upstream.url, "openai", blocks)

    def remaining(registry) -> dict[str, float]:  # type: ignore[no-untyped-def]
        return {sample.labels["tenant"]: sample.value for metric in registry.collect()
                for sample in metric.samples if sample.name == "sluice_budget_remaining"}

    async with proxy(config(1000)) as sluice, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{sluice.port}/r/v1/chat/completions"
        assert (await post(session, url, **{"X-Tenant-ID": "acme"}))[0] == 200
        registry = sluice.runtime.metrics.registry
        spent = 1000 - remaining(registry)["acme"]
        assert 0 < spent < 1000
        sluice.runtime.configure(parse_config(config(100_000)))
        assert remaining(registry)["acme"] == 100_000 - spent
        assert sluice.route().accounting.state()["budget_remaining"]["tenants"] == {
            "acme": {"tokens": 100_000 - spent}}
        sluice.runtime.configure(parse_config(config(0, budget=False)))
        assert "acme" not in remaining(registry)  # no budget, no series reading the old one
