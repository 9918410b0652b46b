"""Budgets end to end: the official SDKs through a real Sluice, a fake upstream with known usage.

Each test checks what a user would: statuses and headers the SDK sees, requests the upstream
received, tokens charged (events, metrics), and that nothing stays reserved afterwards.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import anthropic
import openai
import pytest

from tests.conftest import completed_events, route

MSG = [{"role": "user", "content": "count for me"}]


def oai(sluice, tenant: str = "acme", retries: int = 0, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                              max_retries=retries,
                              default_headers={"X-Tenant-ID": tenant, **headers})


def claude(sluice, tenant: str = "acme") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=sluice.url + "/anthropic", api_key="sk-ant-test",
                                    max_retries=0, default_headers={"X-Tenant-ID": tenant})


#: Budgets' clock for most tests: today 12:00 UTC, so no daily window rolls over mid-test.
NOON = {"SLUICE_TEST_NOW": str(int(time.time()) // 86400 * 86400 + 43200)}


async def until(condition, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# -- the race ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tenant_seen_before", [True, False], ids=["known-tenant", "new-tenant"])
async def test_race_of_twenty_admits_exactly_ten(upstream, start_sluice, tenant_seen_before):
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, budget={"output_tokens": "1000/day", "per": "tenant"})]}, env=NOON)
    client = oai(sluice, tenant)
    if tenant_seen_before:  # a request that spends nothing, so the tenant's counters exist
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=1,
                                             extra_headers={"x-fake-tokens": "0"})
    seen_before = len(upstream.requests)
    upstream.hold = asyncio.Event()  # the upstream answers nothing until released

    async def call():
        try:
            return await client.chat.completions.create(
                model="gpt-test", messages=MSG, max_tokens=100,
                extra_headers={"x-fake-tokens": "100"})
        except openai.RateLimitError as exc:
            return exc

    tasks = [asyncio.create_task(call()) for _ in range(20)]
    await until(lambda: upstream.inflight == 10 and sum(t.done() for t in tasks) == 10,
                what="10 requests held upstream and 10 refused")
    refused = [t.result() for t in tasks if t.done()]
    assert all(isinstance(r, openai.RateLimitError) for r in refused)
    assert {r.code for r in refused} == {"budget_exhausted"}
    assert {r.response.headers["X-Sluice-Reason"] for r in refused} == {"budget_exhausted"}
    await sluice.wait_metric("sluice_budget_reserved", 1000, route="openai", tenant=tenant,
                             unit="output_tokens")

    upstream.hold.set()
    results = await asyncio.gather(*tasks)
    served = [r for r in results if not isinstance(r, Exception)]
    assert len(served) == 10
    assert len(upstream.requests) - seen_before == 10
    await sluice.wait_metric("sluice_budget_reserved", 0, route="openai", tenant=tenant,
                             unit="output_tokens")
    assert await sluice.metric("sluice_tokens_total", route="openai", tenant=tenant,
                               direction="output") == 1000
    assert await sluice.metric("sluice_budget_remaining", route="openai", tenant=tenant,
                               unit="output_tokens") == 0
    await client.close()


# -- sequential streams -----------------------------------------------------------------------

@pytest.mark.parametrize("flavour", ["openai-usage-chunk", "openai-no-usage-chunk", "anthropic"])
async def test_six_streams_of_200_against_1000_serve_five(upstream, start_sluice, flavour):
    upstream.stream_usage = flavour != "openai-no-usage-chunk"
    protocol = "anthropic" if flavour == "anthropic" else "openai"
    sluice = await start_sluice({"routes": [route(
        protocol, upstream.url, protocol,
        budget={"output_tokens": "1000/day", "per": "tenant"})]}, env=NOON)
    fast = {"x-fake-tokens": "200", "x-fake-chunk-delay": "0"}
    served = 0
    refusal = None
    for _ in range(6):
        try:
            if protocol == "openai":
                client = oai(sluice)
                stream = await client.chat.completions.create(
                    model="gpt-test", messages=MSG, max_tokens=200, stream=True,
                    extra_headers=fast)
                chunks = [chunk async for chunk in stream]
                text = [c for c in chunks if c.choices and c.choices[0].delta.content]
                assert len(text) == 200
                # Sluice asked for the usage chunk itself; the client did not, so it never sees it
                assert not [c for c in chunks if c.usage is not None or not c.choices]
            else:
                client = claude(sluice)
                async with client.messages.stream(model="claude-test", messages=MSG,
                                                  max_tokens=200, extra_headers=fast) as stream:
                    message = await stream.get_final_message()
                assert message.usage.output_tokens == 200
            served += 1
        except (openai.RateLimitError, anthropic.RateLimitError) as exc:
            refusal = exc
        await client.close()
    assert served == 5
    assert refusal is not None and refusal.response.headers["X-Sluice-Reason"] == (
        "budget_exhausted")
    # the spend alone fills the day: the wait is until 00:00 UTC (12 h after Sluice's noon),
    # too long for an SDK retry
    assert 43200 - 60 < int(refusal.response.headers["Retry-After"]) <= 43200
    assert refusal.response.headers["x-should-retry"] == "false"
    assert len(upstream.requests) == 5
    if protocol == "openai":
        sent = [r.body for r in upstream.requests]
        assert all(b'"include_usage":true' in body for body in sent)
    events = await completed_events(sluice, 5)
    expected = "reserved" if flavour == "openai-no-usage-chunk" else "reported"
    assert [(e["usage"], e["output_tokens"]) for e in events] == [(expected, 200)] * 5
    missing = await sluice.metric("sluice_usage_missing_total", route=protocol)
    assert missing == (5 if expected == "reserved" else 0)


# -- cut streams ------------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
async def test_cut_streams_release_reservations_and_charge_what_was_streamed(
        upstream, start_sluice, protocol):
    sluice = await start_sluice({"routes": [route(
        protocol, upstream.url, protocol,
        budget={"output_tokens": "100000/day", "per": "tenant"})]}, env=NOON)
    slow = {"x-fake-tokens": "100", "x-fake-chunk-delay": "0.05"}  # 5 s for the whole stream

    async def read_then_leave(keep: int) -> int:
        received = 0
        if protocol == "openai":
            client = oai(sluice)
            stream = await client.chat.completions.create(
                model="gpt-test", messages=MSG, max_tokens=100, stream=True, extra_headers=slow)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    received += 1
                if received == keep:
                    break
            await stream.close()
        else:
            client = claude(sluice)
            async with client.messages.stream(model="claude-test", messages=MSG,
                                              max_tokens=100, extra_headers=slow) as stream:
                async for event in stream:
                    if event.type == "content_block_delta":
                        received += 1
                    if received == keep:
                        break
        await client.close()
        return received

    kept = await asyncio.gather(*(read_then_leave(k) for k in (2, 5, 8, 12)))
    await sluice.wait_metric("sluice_budget_reserved", 0, route=protocol, tenant="acme",
                             unit="output_tokens")
    await until(lambda: upstream.inflight == 0, what="the upstream streams to be closed")
    events = await completed_events(sluice, 4)
    assert {e["outcome"] for e in events} == {"client_disconnected"}
    assert {e["usage"] for e in events} == {"estimated"}
    charged = sorted(e["output_tokens"] for e in events)
    for received, charge in zip(sorted(kept), charged, strict=True):
        assert received <= charge < 100
    total = await sluice.metric("sluice_tokens_total", route=protocol, tenant="acme",
                                direction="output")
    assert total == sum(charged)
    assert await sluice.metric("sluice_budget_remaining", route=protocol, tenant="acme",
                               unit="output_tokens") == 100000 - total


# -- UTC windows ------------------------------------------------------------------------------

async def test_spent_daily_budget_frees_at_the_next_utc_day(upstream, start_sluice):
    midnight = (int(time.time()) // 86400 + 1) * 86400  # the next 00:00 UTC
    sluice = await start_sluice(
        {"routes": [route("openai", upstream.url,
                          budget={"output_tokens": "100/day", "per": "tenant"})]},
        env={"SLUICE_TEST_NOW": str(midnight - 4)},  # its clock starts 4 s before 00:00 UTC
    )
    client = oai(sluice)
    spend = {"x-fake-tokens": "100"}
    await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=100,
                                         extra_headers=spend)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=100,
                                             extra_headers=spend)
    headers = refused.value.response.headers
    assert 1 <= int(headers["Retry-After"]) <= 4
    assert headers["x-should-retry"] == "true"
    await asyncio.sleep(int(headers["retry-after-ms"]) / 1000)  # as the SDKs would
    reply = await client.chat.completions.with_raw_response.create(
        model="gpt-test", messages=MSG, max_tokens=100, extra_headers=spend)
    assert reply.headers["X-Sluice-Budget-Remaining"] == "0"
    assert int(reply.headers["X-Sluice-Budget-Reset"]) > 86000  # a whole new day
    assert len(upstream.requests) == 2
    await client.close()


async def test_a_budget_refusal_says_what_is_left_below_the_request(upstream, start_sluice):
    # RateLimit's r was always 0, though a smaller call would still fit (read as "spent").
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, budget={"output_tokens": "100/day", "per": "tenant"})]})
    client = oai(sluice)
    await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=100,
                                         extra_headers={"x-fake-tokens": "60"})
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=100)
    headers = refused.value.response.headers
    name = headers["RateLimit-Policy"].split(";")[0]
    assert headers["RateLimit-Policy"] == f"{name};q=100;w=86400"
    assert headers["RateLimit"].startswith(f"{name};r=40;t="), headers["RateLimit"]
    await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=40)
    await client.close()


# -- what admitted answers and the log say ----------------------------------------------------

async def test_headers_costs_events_and_metrics(upstream, start_sluice):
    sluice = await start_sluice({
        "pricing": {"gpt-test": {"input": 1.0, "output": 2.0}},
        "routes": [route("openai", upstream.url,
                         budget={"tokens": "1000/day", "per": "tenant", "warn_at": 0.5},
                         usage={"default_max_tokens": 200})],
    }, env=NOON)
    client = oai(sluice, **{"X-Run-ID": "run-7"})
    reply = await client.chat.completions.with_raw_response.create(model="gpt-test",
                                                                   messages=MSG)
    reply.parse()
    seen = upstream.requests[-1]
    assert seen.headers["Accept-Encoding"] == "identity"  # so usage can be read on the way
    assert b'"max_completion_tokens":200' in seen.body  # the default cap, written in
    remaining = int(reply.headers["X-Sluice-Budget-Remaining"])
    assert 1000 - 200 - 50 < remaining < 1000 - 200  # this request's worst case is reserved
    assert reply.headers["X-Sluice-Budget-Policy"] == '"tokens-per-tenant-day";q=1000;w=86400'
    assert 43200 - 60 < int(reply.headers["X-Sluice-Budget-Reset"]) <= 43200  # noon to 00:00
    assert "X-Sluice-Budget-Warning" not in reply.headers

    reply = await client.chat.completions.with_raw_response.create(
        model="gpt-test", messages=MSG, max_tokens=600)
    assert reply.headers["X-Sluice-Budget-Warning"].startswith('"tokens-per-tenant-day";used=0.6')

    events = await completed_events(sluice, 2)
    assert events[0]["run"] == "run-7" and events[0]["tenant"] == "acme"
    assert {k: events[0][k] for k in ("model", "input_tokens", "output_tokens", "cost_usd",
                                      "usage")} == {
        "model": "gpt-test", "input_tokens": 11, "output_tokens": 5,
        "cost_usd": (11 * 1.0 + 5 * 2.0) / 1e6, "usage": "reported"}
    assert await sluice.metric("sluice_tokens_total", route="openai", tenant="acme",
                               direction="input") == 22
    assert await sluice.metric("sluice_cost_usd_total", route="openai",
                               tenant="acme") == pytest.approx(2 * 21e-6)
    assert await sluice.metric("sluice_budget_remaining", route="openai", tenant="acme",
                               unit="tokens") == 1000 - 32
    await client.close()


async def test_usd_budget_and_requests_that_can_never_fit(upstream, start_sluice):
    sluice = await start_sluice({
        "pricing": {"gpt-test": {"input": 1.0, "output": 10.0}},
        "routes": [route("openai", upstream.url,
                         budget={"usd": "0.01/day", "output_tokens": "1000/day"})],
    }, env=NOON)
    client = oai(sluice, retries=2)
    with pytest.raises(openai.BadRequestError) as unpriced:
        await client.chat.completions.create(model="gpt-unknown", messages=MSG, max_tokens=10)
    assert unpriced.value.code == "unpriced_model"
    with pytest.raises(openai.BadRequestError) as too_big:
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=2000)
    assert too_big.value.code == "exceeds_limit"
    assert "more than the whole output_tokens-per-tenant-day budget of 1000/day" in str(
        too_big.value)
    assert too_big.value.response.headers["x-should-retry"] == "false"
    # $0.01 buys at most 1000 output tokens at $10/M: the reservation is priced, not free
    ok = await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=900)
    assert ok.usage.completion_tokens == 5
    assert upstream.requests and len(upstream.requests) == 1
    await client.close()


async def test_run_total_budget(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, budget={"output_tokens": "150/total", "per": "run"})]}, env=NOON)
    no_run = oai(sluice)
    with pytest.raises(openai.BadRequestError) as missing:
        await no_run.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=10)
    assert "X-Run-ID" in str(missing.value)
    client = oai(sluice, retries=2, **{"X-Run-ID": "run-1"})
    await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=100,
                                         extra_headers={"x-fake-tokens": "100"})
    with pytest.raises(openai.RateLimitError) as spent:
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=100)
    headers = spent.value.response.headers
    assert headers["x-should-retry"] == "false" and "Retry-After" not in headers
    other_run = oai(sluice, **{"X-Run-ID": "run-2"})
    await other_run.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=100)
    await until(lambda: len([e for e in sluice.events() if e["event"] == "rejected"]) >= 2,
                what="rejection events")
    # the SDK (max_retries=2) did not retry the spent run: one rejection for it, no more
    rejected = [e for e in sluice.events() if e["event"] == "rejected"]
    assert [(e["run"], e["reason"]) for e in rejected] == [
        (None, "bad_request"), ("run-1", "budget_exhausted")]
    assert len(upstream.requests) == 2
    for c in (no_run, client, other_run):
        await c.close()


async def test_queue_refusal_gives_the_reservation_back(upstream, start_sluice):
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, concurrency={"limit": 1, "queue": 0},
        budget={"output_tokens": "1000/day", "per": "tenant"})]}, env=NOON)
    upstream.hold = asyncio.Event()
    client = oai(sluice)
    first = asyncio.create_task(client.chat.completions.create(
        model="gpt-test", messages=MSG, max_tokens=300))
    await sluice.wait_metric("sluice_budget_reserved", 300, route="openai", tenant="acme",
                             unit="output_tokens")
    with pytest.raises(openai.InternalServerError) as full:
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=300)
    assert full.value.response.headers["X-Sluice-Reason"] == "queue_full"
    assert await sluice.metric("sluice_budget_reserved", route="openai", tenant="acme",
                               unit="output_tokens") == 300
    upstream.hold.set()
    await first
    await sluice.wait_metric("sluice_budget_reserved", 0, route="openai", tenant="acme",
                             unit="output_tokens")
    assert await sluice.metric("sluice_budget_remaining", route="openai", tenant="acme",
                               unit="output_tokens") == 1000 - 5
    await client.close()


async def test_every_failure_path_settles(upstream, start_sluice):
    from tests.conftest import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    budget = {"output_tokens": "10000/day", "per": "tenant"}
    sluice = await start_sluice({"routes": [
        route("openai", upstream.url, budget=budget, timeouts={"total": "500ms"}),
        route("down", closed, "openai", budget=budget),
    ]}, env=NOON)
    client = oai(sluice)
    # the upstream answers an error: providers bill nothing, so nothing is charged
    upstream.statuses = [500]
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=300)
    # nobody listens: the request never left, nothing is charged
    down = oai(sluice)
    down.base_url = sluice.url + "/down/v1"
    with pytest.raises(openai.APIStatusError) as unreachable:
        await down.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=300)
    assert unreachable.value.status_code == 502
    # no answer in time: the upstream may have billed it all, so the reservation is charged
    with pytest.raises(openai.APIStatusError) as timeout:
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=300,
                                             extra_headers={"x-fake-delay": "3"})
    assert timeout.value.status_code == 504
    # the upstream dies mid-stream: what was streamed is charged
    stream = await client.chat.completions.create(
        model="gpt-test", messages=MSG, max_tokens=300, stream=True,
        extra_headers={"x-fake-tokens": "50", "x-fake-cut-after": "10"})
    received = 0
    with pytest.raises(openai.APIError):
        async for chunk in stream:
            received += bool(chunk.choices and chunk.choices[0].delta.content)
    assert received == 10

    events = await completed_events(sluice, 4)
    assert [(e["route"], e["outcome"], e["usage"]) for e in events] == [
        ("openai", "5xx", "none"), ("down", "upstream_error", "none"),
        ("openai", "upstream_timeout", "reserved"), ("openai", "upstream_error", "estimated")]
    assert [e["output_tokens"] for e in events[:3]] == [0, 0, 300]
    assert 10 <= events[3]["output_tokens"] < 50
    await sluice.wait_metric("sluice_budget_reserved", 0, route="openai", tenant="acme",
                             unit="output_tokens")
    assert await sluice.metric("sluice_budget_remaining", route="openai", tenant="acme",
                               unit="output_tokens") == 10000 - 300 - events[3]["output_tokens"]
    assert await sluice.metric("sluice_usage_missing_total", route="openai") == 2
    for c in (client, down):
        await c.close()


async def test_responses_api_and_chunked_answers_are_metered(upstream, start_sluice):
    sluice = await start_sluice({"routes": [
        route("openai", upstream.url, budget={"tokens": "10000/day"}),
        route("anthropic", upstream.url, "anthropic", budget={"tokens": "10000/day"}),
    ]}, env=NOON)
    client = oai(sluice)
    stream = await client.responses.create(model="gpt-test", input="hi", max_output_tokens=50,
                                           stream=True, extra_headers={"x-fake-tokens": "7"})
    kinds = [event.type async for event in stream]
    assert kinds[-1] == "response.completed"
    reply = await client.responses.create(model="gpt-test", input="hi", max_output_tokens=50,
                                          extra_headers={"x-fake-tokens": "8",
                                                         "x-fake-chunked": "1"})
    assert reply.usage.output_tokens == 8
    anthropic_client = claude(sluice)
    message = await anthropic_client.messages.create(
        model="claude-test", messages=MSG, max_tokens=50,
        extra_headers={"x-fake-tokens": "9", "x-fake-chunked": "1"})
    assert message.usage.output_tokens == 9
    await anthropic_client.close()
    events = await completed_events(sluice, 3)
    assert [(e["input_tokens"], e["output_tokens"], e["usage"]) for e in events] == [
        (11, 7, "reported"), (11, 8, "reported"), (11, 9, "reported")]
    await client.close()


async def test_budget_counters_cap_refuses_new_tenants_and_serves_known_ones(
        upstream, start_sluice):
    """``state.max_budget_counters``: beyond it a new tenant is refused 503
    ``budget_counters_full`` (never retried by the SDK) and counted; tenants already counted
    are served up to their own budgets; nothing reaches the upstream for the refused."""
    sluice = await start_sluice({"state": {"max_budget_counters": 3}, "routes": [route(
        "openai", upstream.url, budget={"tokens": "1000/day", "per": "tenant"})]}, env=NOON)
    for tenant in ("a", "b", "c"):
        await oai(sluice, tenant).chat.completions.create(model="gpt-4o-mini", messages=MSG,
                                                          max_tokens=10)
    seen = len(upstream.requests)
    with pytest.raises(openai.APIStatusError) as refused:
        await oai(sluice, "d", retries=2).chat.completions.create(
            model="gpt-4o-mini", messages=MSG, max_tokens=10)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["X-Sluice-Reason"] == "budget_counters_full"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert "state.max_budget_counters" in refused.value.response.text
    assert len(upstream.requests) == seen  # and the SDK did not retry it
    await oai(sluice, "b").chat.completions.create(model="gpt-4o-mini", messages=MSG,
                                                   max_tokens=10)
    assert len(upstream.requests) == seen + 1
    assert await sluice.metric("sluice_rejections_total", route="openai",
                               reason="budget_counters_full") == 1


async def test_an_answer_whose_usage_object_is_empty_is_charged_its_reservation(
        upstream, start_sluice):
    # Seen by a new user: "usage": {} was read as a report of 0 tokens, so such answers
    # spent no budget at all and were not counted as missing usage.
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, "openai", budget={"tokens": "1000/day", "per": "tenant"})]},
        env=NOON)
    client = oai(sluice)
    for _ in range(2):
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=40,
                                             extra_headers={"x-fake-usage": "empty"})
    await client.close()
    events = await completed_events(sluice, 2)
    assert [e["usage"] for e in events] == ["reserved", "reserved"]
    assert all(e["output_tokens"] == 40 and e["input_tokens"] > 0 for e in events)
    assert await sluice.metric("sluice_usage_missing_total", route="openai") == 2


async def test_usage_above_the_reservation_is_charged_and_said(upstream, start_sluice):
    """An upstream that reports more than the call's worst case (past its max_tokens here;
    an input the estimate undercounts does the same) is charged what it reports, the count
    being the bill, and a budget can then pass its limit by the difference: that was said
    nowhere (a hostile trial). The completed event says by how much, and it is counted."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, "openai", budget={"tokens": "100000/day", "per": "tenant"})]},
        env=NOON)
    client = oai(sluice)
    await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=100)
    await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=10,
                                         extra_headers={"x-fake-tokens": "500"})
    await client.close()
    within, over = await completed_events(sluice, 2)
    assert "over_reservation_tokens" not in within
    assert over["usage"] == "reported" and over["output_tokens"] == 500
    reserved = over["output_tokens"] + over["input_tokens"] - over["over_reservation_tokens"]
    assert 10 < reserved < 500  # the input estimate plus the cap of 10
    assert await sluice.metric("sluice_usage_over_reservation_total", route="openai") == 1


async def test_a_tenant_named_star_does_not_take_the_route_budgets_gauges(upstream,
                                                                          start_sluice):
    """``*`` labels the per-route budget's gauges: a caller sending ``X-Tenant-ID: *`` had
    its own budget written over them (955 shown for a route with 99,955 left; a hostile
    trial). Such a tenant's series go under ``other``."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, "openai", budget=[{"tokens": "100000/day", "per": "route"},
                                                   {"tokens": "1000/day", "per": "tenant"}])]},
        env=NOON)
    client = oai(sluice, tenant="*")
    await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=20)
    await client.close()
    [event] = await completed_events(sluice, 1)
    spent = event["input_tokens"] + event["output_tokens"]
    assert await sluice.metric("sluice_budget_remaining", route="openai", tenant="*",
                               unit="tokens") == 100000 - spent
