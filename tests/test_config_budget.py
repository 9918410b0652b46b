"""Config keys of token accounting: ``budget``, ``rate.tokens``, ``usage``, ``pricing``.

A budget that could not bind must be an error at load, never a silent no-op."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxy.config import ConfigError, parse_config
from tests.conftest import REPO

GOOD = """\
pricing:
  gpt-4o-mini: {input: 0.15, output: 0.60, cache_read: 0.075}
routes:
  - name: openai
    path_prefix: /openai/
    upstream: https://api.openai.com
    protocol: openai
    usage: {default_max_tokens: 4096}
    rate: {tokens: 200000/min}
    budget:
      - {tokens: 5000000/day, usd: 100/day, per: tenant, warn_at: 0.8}
      - {output_tokens: 200000/total, per: run, ttl: 2h}
  - name: anthropic
    path_prefix: /anthropic/
    upstream: https://api.anthropic.com
    protocol: anthropic
    budget: {input_tokens: 1000000/h, per: route}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(text, "f.yaml")
    return err.value.problems


def test_a_full_accounting_config_loads():
    config = parse_config(GOOD, "f.yaml")
    openai_route, anthropic_route = config.routes
    assert [(b.per, [(u, a.text) for u, a in b.limits()]) for b in openai_route.budget] == [
        ("tenant", [("tokens", "5000000/day"), ("usd", "100/day")]),
        ("run", [("output_tokens", "200000/total")]),
    ]
    assert anthropic_route.budget[0].limits()[0][1].period_s == 3600
    assert config.pricing["gpt-4o-mini"].cache_read == 0.075


def test_budgets_that_could_not_bind_are_errors():
    text = """\
routes:
  - name: tools
    path_prefix: /tools/
    upstream: http://127.0.0.1:1
    protocol: http
    rate: {tokens: 1000/min}
    budget: {tokens: 1000/day}
  - name: llm
    path_prefix: /llm/
    upstream: http://127.0.0.1:1
    protocol: openai
    usage: {default_max_tokens: 5000}
    budget: {usd: 5/total, output_tokens: 10/fortnight, per: tenant}
  - name: llm2
    path_prefix: /llm2/
    upstream: http://127.0.0.1:1
    protocol: openai
    budget: {per: run}
"""
    assert problems(text) == [
        "f.yaml:13: routes[1].budget.output_tokens: '10/fortnight' is not a budget: write "
        "N/min, N/h, N/day or N/total, e.g. 5000000/day",
        "f.yaml:18: routes[2].budget: set at least one of tokens, input_tokens, "
        "output_tokens, usd",
    ]
    text = text.replace("10/fortnight", "10/day").replace("{per: run}", "{tokens: 1/h}")
    assert problems(text) == [
        "f.yaml:6: routes[0].rate.tokens: token limits need protocol openai or anthropic "
        "(Sluice reads usage from those only), not http",
        "f.yaml:7: routes[0].budget: budgets need protocol openai or anthropic (Sluice reads "
        "usage from those only), or a usd limit and operations with cost_per_call or "
        "cost_per_second, not http",
        "f.yaml:12: routes[1].usage.default_max_tokens: 5000 exceeds the output_tokens "
        "budget 10/day: every request without max_tokens would be refused",
        "f.yaml:13: routes[1].budget.usd: 5/total needs per: run (a tenant's or route's "
        "all-time spend is not kept across restarts; use a window such as N/day)",
        "f.yaml:13: routes[1].budget.usd: a usd budget needs the top-level pricing table",
    ]


def test_the_same_limit_twice_is_an_error():
    text = GOOD.replace("{output_tokens: 200000/total, per: run, ttl: 2h}",
                        "{tokens: 9000/day, per: tenant}")
    assert problems(text) == [
        "f.yaml:12: routes[0].budget[1].tokens: budget[0] already limits tokens per tenant "
        "over the same window; keep the smaller one",
    ]


def test_check_config_reports_file_lines(tmp_path):
    path = tmp_path / "sluice.yaml"
    path.write_text(GOOD.replace("input: 0.15", "input: cheap"))
    result = subprocess.run([sys.executable, "-m", "proxy", "check-config", str(path)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"{path}:2: pricing.gpt-4o-mini.input: 'cheap' should be a number")
