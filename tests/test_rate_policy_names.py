"""Each limit's refusal names its own policy in RateLimit-Policy (a hostile trial's F5: a
model's rate and its route's were both ``"requests"``, with different ``q`` and ``w``)."""

from __future__ import annotations

import aiohttp
import pytest

from policies.config import RateConfig
from policies.rate import RateLimiter
from policies.reasons import Rejected
from policies.state import memory_backends
from proxy.rejections import rejection_headers


async def test_a_models_rate_and_its_routes_rate_have_distinct_policy_names(
        upstream, start_sluice):
    sluice = await start_sluice({"routes": [{
        "name": "llm", "path_prefix": "/llm/", "upstream": upstream.url, "protocol": "openai",
        "rate": {"requests": "5/min"},
        "models": {"gpt-4o": {"rate": {"requests": "1/min"}}}}]})
    seen: dict[str, tuple[str, str]] = {}
    async with aiohttp.ClientSession() as http:
        for model in ["gpt-4o"] * 2 + ["gpt-4o-mini"] * 5:
            body = {"model": model, "max_tokens": 5, "messages": []}
            async with http.post(sluice.url + "/llm/v1/chat/completions", json=body) as answer:
                await answer.read()
                if answer.status == 429:
                    seen[model] = (answer.headers["RateLimit-Policy"],
                                   answer.headers["RateLimit"].split(";")[0])
    assert seen == {"gpt-4o": ('"gpt-4o:requests";q=1;w=60', '"gpt-4o:requests"'),
                    "gpt-4o-mini": ('"requests";q=5;w=60', '"requests"')}


async def test_an_operations_name_is_quoted_as_a_structured_field_string():
    from proxy.rejections import sf_string

    limiter = RateLimiter(RateConfig.model_validate({"per_tenant": {"requests": "1/min"}}),
                          memory_backends(), 'r/say "hi"\\', operation='say "hi"\\')
    units = limiter.request_units("t")
    assert units is not None
    await limiter.take(units.takes)
    with pytest.raises(Rejected) as refused:
        await limiter.take(units.takes)
    headers = rejection_headers(refused.value)
    assert headers["RateLimit-Policy"] == r'"say \"hi\"\\:requests-per-tenant";q=1;w=60'
    assert sf_string("naïve") == '"na?ve"'
