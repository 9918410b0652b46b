"""Hostile review, round 35, of the LLM paths through the official SDKs: each test failed on
the code it was written against."""

from __future__ import annotations

import time

import openai
import pytest

from tests.conftest import route

#: Budgets' clock: today 12:00 UTC, so no daily window rolls over mid-test.
NOON = {"SLUICE_TEST_NOW": str(int(time.time()) // 86400 * 86400 + 43200)}


def oai(sluice, tenant: str = "acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sluice.url + "/openai/v1", api_key="sk-test",
                              max_retries=0, default_headers={"X-Tenant-ID": tenant})


# -- 1. legacy Completions: each prompt of a list, and best_of, is billed its own output --

@pytest.mark.parametrize("shape", [
    {"prompt": [f"say {i}" for i in range(10)]},  # ten prompts, each up to max_tokens
    {"prompt": [[1, 2, 3]] * 10},  # ten prompts given as token ids
    {"prompt": "say it", "best_of": 10},  # ten completions generated, one returned
    {"prompt": ["a", "b"], "n": 5},  # two prompts, five choices each
], ids=["prompt-list", "token-prompt-list", "best_of", "prompts-times-n"])
async def test_completions_reserve_every_prompt_and_best_of_not_one_answer(
        upstream, start_sluice, shape) -> None:
    """OpenAI's ``/v1/completions`` takes a list of prompts and answers each with ``n``
    choices of up to ``max_tokens``; ``best_of`` generates that many server-side (billed) and
    returns ``n``. Sluice multiplied the cap by ``n`` only, so one call reserving 100 output
    tokens could bill 1,000: a 500-token budget let it through (then ran 500 over)."""
    sluice = await start_sluice({"routes": [route(
        "openai", upstream.url, budget={"output_tokens": "500/day", "per": "tenant"})]},
        env=NOON)
    client = oai(sluice)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model="gpt-3.5-turbo-instruct", max_tokens=100,
                                        **shape)
    assert caught.value.code == "exceeds_limit"
    assert upstream.requests == []
    # One prompt of the same cap fits, as before.
    await client.completions.create(model="gpt-3.5-turbo-instruct", prompt="say it",
                                    max_tokens=100)
    assert len(upstream.requests) == 1
    await client.close()
