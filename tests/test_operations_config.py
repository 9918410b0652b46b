"""Per-operation blocks in the config (``tools:``, ``endpoints:``, ``models:``; issue 11):
what loads, and the ``FILE:LINE: KEY: PROBLEM`` line each mistake gets."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.config import ConfigError, endpoint_pattern
from proxy.config import load_config

MCP = """\
routes:
  - name: tools
    path_prefix: /tools/
    upstream: http://127.0.0.1:9000
    protocol: mcp
"""


def load(tmp_path: Path, text: str):
    path = tmp_path / "sluice.yaml"
    path.write_text(textwrap.dedent(text))
    return load_config(path)


def problems(tmp_path: Path, text: str) -> list[str]:
    """The problems found, each from the file's name on (``sluice.yaml:LINE: ...``)."""
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    return [line[len(str(tmp_path)) + 1:] for line in err.value.problems]


def test_operation_blocks_load(tmp_path: Path) -> None:
    config = load(tmp_path, MCP + """\
    budget: {usd: 10/day, per: tenant}
    tools:
      search: {concurrency: {limit: 4, queue: 16, max_wait: 2s}, rate: {requests: 60/min}}
      send_email: {idempotency: {mode: dedup}, cost_per_call: 0.01, retry: {attempts: 2}}
      slow: {timeouts: {total: 30s}, cost_per_second: 0.002, idempotent: true}
      default: {circuit_breaker: {fail_max: 3}}
""")
    tools = config.routes[0].tools
    assert tools is not None and set(tools) == {"search", "send_email", "slow", "default"}
    assert tools["search"].concurrency.limit == 4
    assert tools["search"].rate.requests.count == 60
    assert tools["send_email"].cost_per_call == 0.01
    assert tools["slow"].timeouts.total == 30.0 and tools["slow"].idempotent is True
    assert config.routes[0].costs_usd()


@pytest.mark.parametrize(("key", "matches", "misses"), [
    ("POST /v1/jobs/*", ["/v1/jobs/1", "/v1/jobs/"], ["/v1/jobs/1/cancel", "/v1/jobs"]),
    ("* /v1/**", ["/v1/a/b/c"], ["/v2/a"]),
    ("GET /v1/a.b", ["/v1/a.b"], ["/v1/aXb"]),  # a dot is a dot, not a regex wildcard
    ("GET /**/a*b/**", ["/x/ab/", "/a/azb/y", "//ab/"], ["/ab/", "/x/a/b/"]),
    ("GET /v1/*/*-*", ["/v1/m/a-b", "/v1//-"], ["/v1/m/ab", "/v1/m/n/a-b"]),
])
def test_endpoint_patterns(key: str, matches: list[str], misses: list[str]) -> None:
    _, pattern = endpoint_pattern(key)
    assert all(pattern.fullmatch(p) for p in matches)
    assert not any(pattern.fullmatch(p) for p in misses)


# No per-example deadline, as in the suite's other property tests: Hypothesis's default
# 200 ms fails a run whose worker a busy machine paused mid-example (speed is
# test_operations_hostile's to check, on long paths).
@settings(deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "/", "*", "**"]), max_size=7),
       st.text(alphabet="ab/", max_size=10))
def test_endpoint_pattern_means_what_its_regex_means(items: list[str], tail: str) -> None:
    """Patterns of several wildcards run as an NFA (linear time); they must agree with the
    plain regex reading (``*``: ``[^/]*``, ``**``: ``.*``) on every path."""
    key = "/" + "".join(items)
    regex = re.compile("".join(".*" if p == "**" else "[^/]*" if p == "*" else re.escape(p)
                               for p in re.split(r"(\*\*|\*)", key)))
    _, pattern = endpoint_pattern("GET " + key)
    path = "/" + tail
    assert pattern.fullmatch(path) == (regex.fullmatch(path) is not None)


@pytest.mark.parametrize(("tail", "expected"), [
    # A typo inside a tool's block must not silently disable its limit.
    ("""\
    tools:
      search: {concurency: {limit: 1}}
""", "sluice.yaml:7: routes[0].tools.search.concurency: unknown key"),
    ("""\
    tools:
      search:
        concurrency: {limit: 0}
""", "sluice.yaml:8: routes[0].tools.search.concurrency.limit: 0 should be more than 0"),
    ("""\
    tools:
      send: {cost_per_call: -1}
""", "sluice.yaml:7: routes[0].tools.send.cost_per_call: -1 should be 0 or more"),
    ("""\
    endpoints:
      "POST /x": {rate: {requests: 1/s}}
""", "sluice.yaml:6: routes[0].endpoints: mcp routes name their operations under tools, "
     "not endpoints"),
    ("""\
    tools:
      search: {rate: {tokens: 100/min}}
""", "sluice.yaml:7: routes[0].tools.search.rate.tokens: token rates apply to models"),
    ("""\
    budget: {usd: 1/day}
""", "sluice.yaml:6: routes[0].budget: budgets need protocol openai or anthropic"),
    ("""\
    budget: {usd: 1/day, tokens: 100/day}
    tools:
      send: {cost_per_call: 0.01}
""", "sluice.yaml:6: routes[0].budget: only usd can be budgeted on a mcp route"),
    ("""\
    tools:
      send:
        retry: {backoff: {base: 2s, max: 1s}}
""", "sluice.yaml:8: routes[0].tools.send.retry.backoff.base: must not exceed backoff.max"),
    # Taken and ignored before (idle bounds a GET stream; the header is the route's).
    ("""\
    tools:
      search:
        timeouts: {total: 10s, idle: 30s, deadline_header: X-Left}
""", "sluice.yaml:8: routes[0].tools.search.timeouts: an operation's timeouts take connect "
     "and total only; set deadline_header and idle in the route's timeouts"),
])
def test_bad_operation_blocks(tmp_path: Path, tail: str, expected: str) -> None:
    found = problems(tmp_path, MCP + tail)
    assert any(line.startswith(expected) for line in found), found


def test_bad_endpoint_key_names_its_line(tmp_path: Path) -> None:
    found = problems(tmp_path, """\
routes:
  - name: api
    path_prefix: /api/
    upstream: http://127.0.0.1:9000
    endpoints:
      "POST /v1/jobs/*": {concurrency: {limit: 1}}
      "post v1/jobs": {concurrency: {limit: 1}}
""")
    assert len(found) == 1, found
    assert found[0].startswith("sluice.yaml:5: routes[0].endpoints: 'post v1/jobs' is not an "
                               "endpoint: write METHOD /path"), found


def test_endpoint_patterns_equal_but_for_case_are_refused(tmp_path: Path) -> None:
    # A review: patterns match case-insensitively, so of two differing only in case the
    # later one never matched a call, silently.
    found = problems(tmp_path, """\
routes:
  - name: api
    path_prefix: /api/
    upstream: http://127.0.0.1:9000
    endpoints:
      "POST /v1/Uploads/*": {concurrency: {limit: 1}}
      "GET /v1/uploads/*": {concurrency: {limit: 1}}
      "POST /v1/uploads/*": {rate: {requests: 10/min}}
""")
    assert found == ["sluice.yaml:5: routes[0].endpoints: 'POST /v1/uploads/*' is "
                     "'POST /v1/Uploads/*' but for case: patterns match paths "
                     "case-insensitively, so it would never match a call; keep one"], found


def test_models_on_llm_routes_only(tmp_path: Path) -> None:
    found = problems(tmp_path, """\
routes:
  - name: api
    path_prefix: /api/
    upstream: http://127.0.0.1:9000
    models: {gpt-4o: {rate: {tokens: 1000/min}}}
""")
    assert found == ["sluice.yaml:5: routes[0].models: http routes name their operations under "
                     "endpoints, not models (tools: mcp; endpoints: http; models: openai, "
                     "anthropic)"]
    config = load(tmp_path, """\
routes:
  - name: llm
    path_prefix: /llm/
    upstream: http://127.0.0.1:9000
    protocol: openai
    models: {gpt-4o: {rate: {tokens: 1000/min}}, default: {concurrency: {limit: 2}}}
""")
    assert config.routes[0].models["gpt-4o"].rate.tokens.count == 1000
