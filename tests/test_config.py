"""``sluice check-config``: every bad file gets the exact ``FILE:LINE: KEY: PROBLEM`` lines.

The table runs the CLI's own ``main()`` in-process (the console script calls nothing else), so
it stays fast; the last tests run the installed ``sluice`` script and ``python -m proxy`` as a
user would.
"""

from __future__ import annotations

import os
import re
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from policies.config import _Section
from proxy.cli import main
from proxy.config import ConfigError, parse_config
from tests.conftest import REPO, free_port

README = (REPO / "README.md").read_text()

ROUTE = ("routes:\n"
         "  - name: openai\n"
         "    path_prefix: /openai/\n"
         "    upstream: https://api.openai.com\n")
TYPO = "(a typo here would otherwise be silently ignored)"
NOT_A_DURATION = "is not a duration: write a number and a unit, e.g. 250ms, 5s, 10m, 24h"
NOT_A_RATE = "is not a rate: write N/s, N/min, N/h or N/day, e.g. 600/min"
NOT_A_URL = "must be an http:// or https:// base URL with no query or fragment"
NOT_A_HOST = ("is not a host to listen on: write an IPv4 address, an IPv6 one in brackets or "
              "a host name, then :PORT (no scheme, no spaces), e.g. 127.0.0.1:8080 or [::1]:8080")
MERGE_KEY = ("merge keys (<<) are not supported: write the keys out in this block, or make "
             "the whole block an alias (*name) of one written once")
INFINITE = ("must be a finite number; this one is beyond a float's range (about 1.8e308), "
            "which YAML reads as infinity")
EMPTY = ("is empty (null), which would silently disable a limit: give it a value, or leave "
         "the key out")
EMPTY_VALUED = "is empty (null): give it a value, or leave the key out for its default"
YAML11_BOOL = ("is a boolean to YAML 1.1 readers and a string to YAML 1.2: "
               "write true or false, or quote the string")

# (case id, file text, expected stderr lines with {f} for the file's path)
BAD_FILES = [
    ("unknown top-level key", "servr:\n  listen: 127.0.0.1:8080\n" + ROUTE,
     [f"{{f}}:1: servr: unknown key {TYPO}; did you mean server?"]),
    # Said of any key: server.listen is no limit (it said "would silently disable a limit").
    ("unknown server key", "server:\n  lisen: 127.0.0.1:8080\n" + ROUTE,
     [f"{{f}}:2: server.lisen: unknown key {TYPO}; did you mean listen?"]),
    ("unknown route key", ROUTE + "    concurency: {limit: 2}\n",
     [f"{{f}}:5: routes[0].concurency: unknown key {TYPO}; did you mean concurrency?"]),
    ("unknown nested key", ROUTE + "    concurrency:\n      limit: 2\n      max_wiat: 5s\n",
     [f"{{f}}:7: routes[0].concurrency.max_wiat: unknown key {TYPO}; did you mean "
      "max_wait?"]),
    ("known key in the wrong section", ROUTE + "    limit: 2\n",
     [f"{{f}}:5: routes[0].limit: unknown key {TYPO}; did you mean concurrency.limit?"]),
    ("one port for both listeners",
     "server:\n  listen: 127.0.0.1:8080\n  admin_listen: 0.0.0.0:8080\n" + ROUTE,
     ["{f}:3: server.admin_listen: 0.0.0.0:8080 uses the same port as listen (127.0.0.1:8080)"]),
    ("duplicate key", ROUTE + "    protocol: openai\n    protocol: http\n",
     ["{f}:6: routes[0].protocol: duplicate key"]),
    ("duplicate section", "server:\n  drain_timeout: 5s\nserver:\n  drain_timeout: 6s\n" + ROUTE,
     ["{f}:3: server: duplicate key"]),
    ("duration with a spaced unit", "server:\n  drain_timeout: 5 sec\n" + ROUTE,
     [f"{{f}}:2: server.drain_timeout: '5 sec' {NOT_A_DURATION}"]),
    ("sexagesimal duration", "server:\n  drain_timeout: 1:30\n" + ROUTE,
     ["{f}:2: server.drain_timeout: '1:30' is 90 (base 60) to YAML 1.1 readers and a string "
      "to YAML 1.2: write the number, a duration with a unit (90s), or quote the string"]),
    # A new user's 99999999999999999999h became a 24-digit Retry-After; 400 digits, infinity.
    ("duration beyond a year",
     ROUTE + "    circuit_breaker: {reset_timeout: 99999999999999999999h}\n",
     ["{f}:5: routes[0].circuit_breaker.reset_timeout: '99999999999999999999h' is longer "
      "than 365d, the longest duration Sluice takes"]),
    ("duration without a unit", ROUTE + "    concurrency: {limit: 2, max_wait: 30}\n",
     [f"{{f}}:5: routes[0].concurrency.max_wait: 30 {NOT_A_DURATION}"]),
    # Seen (new-user trial): Python's forms, "True is not a duration".
    ("boolean where a duration belongs", ROUTE + "    concurrency: {limit: 2, max_wait: true}\n",
     [f"{{f}}:5: routes[0].concurrency.max_wait: true {NOT_A_DURATION}"]),
    ("boolean where a rate belongs", ROUTE + "    rate: {requests: false}\n",
     [f"{{f}}:5: routes[0].rate.requests: false {NOT_A_RATE}"]),
    ("mapping where a budget belongs", ROUTE + "    budget: {usd: {per: day}}\n",
     ["{f}:5: routes[0].budget.usd: {{\"per\":\"day\"}} is not a budget: write N/min, N/h, "
      "N/day or N/total, e.g. 5000000/day"]),
    ("a queue nobody may wait in", ROUTE + "    concurrency: {limit: 2, queue: 4, max_wait: 0s}\n",
     ["{f}:5: routes[0].concurrency: max_wait: 0s leaves the queue of 4 unused: set max_wait "
      "above 0, or queue: 0 to refuse at once"]),
    ("rate with a long unit", ROUTE + "    rate: {requests: 600/minute}\n",
     [f"{{f}}:5: routes[0].rate.requests: '600/minute' {NOT_A_RATE}"]),
    ("rate without a period", ROUTE + "    rate: {per_tenant: {requests: 600}}\n",
     [f"{{f}}:5: routes[0].rate.per_tenant.requests: 600 {NOT_A_RATE}"]),
    ("zero rate", ROUTE + "    rate: {requests: 0/min}\n",
     ["{f}:5: routes[0].rate.requests: '0/min': a rate must allow at least 1 per period"]),
    ("'on' where a string belongs", "identity:\n  default_tenant: on\n" + ROUTE,
     [f"{{f}}:2: identity.default_tenant: 'on' {YAML11_BOOL}"]),
    ("'no' where a string belongs", "identity:\n  tenant_header: no\n" + ROUTE,
     [f"{{f}}:2: identity.tenant_header: 'no' {YAML11_BOOL}"]),
    ("leading-zero number", ROUTE + "    concurrency: {limit: 0755}\n",
     ["{f}:5: routes[0].concurrency.limit: '0755' is octal to YAML 1.1 readers (493) and "
      "decimal to YAML 1.2: drop the leading zero, or quote the string"]),
    # Reported on the next run only, as "not a duration" or "a valid integer", which said
    # nothing of the 90 a YAML 1.1 reader takes (a new user's trial, round 36).
    ("base-60 number", ROUTE + "    timeouts: {total: 1:30}\n    concurrency: {limit: 1:30}\n"
     "    concurrency: {limit: 2}\n",
     ["{f}:5: routes[0].timeouts.total: '1:30' is 90 (base 60) to YAML 1.1 readers and a "
      "string to YAML 1.2: write the number, a duration with a unit (90s), or quote the "
      "string",
      "{f}:6: routes[0].concurrency.limit: '1:30' is 90 (base 60) to YAML 1.1 readers and a "
      "string to YAML 1.2: write the number, a duration with a unit (90s), or quote the "
      "string",
      "{f}:7: routes[0].concurrency: duplicate key"]),
    # YAML 1.1's base-60 integers start with 1-9: 0:30 is a string to every reader.
    ("0:30 is no base-60 number", "server:\n  drain_timeout: 0:30\n" + ROUTE,
     [f"{{f}}:2: server.drain_timeout: '0:30' {NOT_A_DURATION}"]),
    # A tool's name is no key of its block: a tool named retry got retry's keys suggested.
    ("a tool named like a block", ROUTE + "    protocol: mcp\n    tools:\n"
     "      retry: {deadlline: 1s}\n",
     [f"{{f}}:7: routes[0].tools.retry.deadlline: unknown key {TYPO}"]),
    ("number where a string belongs", "identity:\n  default_tenant: 3.10\n" + ROUTE,
     ["{f}:2: identity.default_tenant: 3.1 should be a string (quote it)"]),
    ("string where a number belongs", ROUTE + "    concurrency: {limit: '8'}\n",
     ["{f}:5: routes[0].concurrency.limit: '8' should be a whole number"]),
    # A tenant's share of the dead letters cannot be more than the store.
    ("dead-letter share above the store",
     "dead_letter:\n  max_records: 8\n  max_records_per_tenant: 9\n" + ROUTE,
     ["{f}:3: dead_letter.max_records_per_tenant: 9 exceeds max_records (8): no tenant can "
      "keep more letters than the store"]),
    ("empty dead-letter share", "dead_letter:\n  max_records_per_tenant:\n" + ROUTE,
     [f"{{f}}:2: dead_letter.max_records_per_tenant: {EMPTY}"]),
    ("zero limit", ROUTE + "    concurrency: {limit: 0}\n",
     ["{f}:5: routes[0].concurrency.limit: 0 should be more than 0"]),
    ("missing upstream", "routes:\n  - name: openai\n    path_prefix: /openai/\n",
     ["{f}:2: routes[0].upstream: required key is missing"]),
    ("upstream without a scheme",
     "routes:\n  - name: openai\n    path_prefix: /openai/\n    upstream: api.openai.com\n",
     [f"{{f}}:4: routes[0].upstream: 'api.openai.com' {NOT_A_URL}"]),
    ("upstream with a query", "routes:\n  - name: openai\n    path_prefix: /openai/\n"
     "    upstream: https://api.openai.com/v1?x=1\n",
     [f"{{f}}:4: routes[0].upstream: 'https://api.openai.com/v1?x=1' {NOT_A_URL}"]),
    # Told only the rule, a new user looked for a query or fragment (a new user's trial).
    ("upstream with a space in its host", ROUTE.replace("api.openai", "api.open ai"),
     ["{f}:4: routes[0].upstream: 'https://api.open ai.com' has a space in its host or port, "
      "which neither can hold"]),
    ("upstream with a space in its path", ROUTE.replace(".com", ".com/v1/my app"),
     ["{f}:4: routes[0].upstream: 'https://api.openai.com/v1/my app' has a space after its "
      "host, which a URL cannot hold: write it %20"]),
    ("upstream with a space in its user info",
     ROUTE.replace("https://", "https://u:my pass@"),
     ["{f}:4: routes[0].upstream: 'https://<redacted>@api.openai.com' has a space in its user "
      "info, which a URL cannot hold: write it %20"]),
    ("upstream with a trailing tab", ROUTE.replace(".com", '.com\t"').replace("https", '"https'),
     ["{f}:4: routes[0].upstream: 'https://api.openai.com\\t' starts or ends with a tab: "
      "leave it out"]),
    ("duplicate route name",
     ROUTE + "  - name: openai\n    path_prefix: /other/\n    upstream: https://x.example\n",
     ["{f}:5: routes[1].name: 'openai' is already used by routes[0]"]),
    ("duplicate route prefix",
     ROUTE + "  - name: other\n    path_prefix: /openai/\n    upstream: https://x.example\n",
     ["{f}:6: routes[1].path_prefix: '/openai/' is already used by routes[0]"]),
    ("prefix without slashes",
     "routes:\n  - name: openai\n    path_prefix: openai\n    upstream: https://x.example\n",
     ["{f}:3: routes[0].path_prefix: 'openai' must start and end with '/', e.g. /openai/"]),
    ("unknown protocol", ROUTE + "    protocol: grpc\n",
     ["{f}:5: routes[0].protocol: 'grpc' should be 'openai', 'anthropic', 'mcp' or 'http'"]),
    ("bad listen address", "server:\n  listen: nowhere\n" + ROUTE,
     ["{f}:2: server.listen: 'nowhere' is not HOST:PORT, e.g. 127.0.0.1:8080"]),
    # Split at the last ':' and only the port checked, these passed check-config and serve
    # could not start ("Name or service not known"; a hostile trial).
    ("a listen address with a scheme", "server:\n  listen: 'http://127.0.0.1:8080'\n" + ROUTE,
     [f"{{f}}:2: server.listen: 'http://127.0.0.1' {NOT_A_HOST}"]),
    ("a listen address with a space", "server:\n  listen: ' 127.0.0.1:8080'\n"
     "  admin_listen: '127.0.0.1 :9901'\n" + ROUTE,
     [f"{{f}}:2: server.listen: ' 127.0.0.1' {NOT_A_HOST}",
      f"{{f}}:3: server.admin_listen: '127.0.0.1 ' {NOT_A_HOST}"]),
    ("an IPv6 address without brackets", "server:\n  listen: '::1:8080'\n" + ROUTE,
     [f"{{f}}:2: server.listen: '::1' {NOT_A_HOST}"]),
    ("a dotted number that is no IPv4 address", "server:\n  listen: '256.0.0.1:8080'\n" + ROUTE,
     [f"{{f}}:2: server.listen: '256.0.0.1' {NOT_A_HOST}"]),
    ("no routes", "server:\n  drain_timeout: 5s\n",
     ["{f}:1: routes: required key is missing"]),
    ("routes as a mapping", "routes:\n  openai: {path_prefix: /openai/}\n",
     ["{f}:1: routes: Input should be a valid list"]),
    # Said as pydantic says it, "List should have at least 1 item after validation, not 0",
    # it read unlike every other line (a new user's trial, round 35).
    ("empty routes", "routes: []\n", ["{f}:1: routes: needs at least 1 item, has none"]),
    ("empty retry.on", ROUTE + "    retry: {on: []}\n",
     ["{f}:5: routes[0].retry.on: needs at least 1 item, has none"]),
    ("empty file", "", ["{f}:1: (top): the file is empty"]),
    ("comments only", "# nothing here\n", ["{f}:1: (top): the file is empty"]),
    ("not a mapping", "- a\n- b\n", ["{f}:1: (top): the file must be a mapping of sections"]),
    ("YAML syntax error", "server:\n  listen: [127.0.0.1\n" + ROUTE,
     ["{f}:3: (yaml): expected ',' or ']', but got ':' (while parsing a flow sequence that "
      "starts on line 2)"]),
    # Was said at the file's last line, where PyYAML noticed the quote never closed.
    ("unclosed quote", "server:\n  listen: '127.0.0.1:8080\n" + ROUTE,
     ["{f}:2: (yaml): while scanning a quoted scalar: found unexpected end of stream "
      "(line 7)"]),
    ("misindented line", ROUTE + "   protocol: openai\n",
     ["{f}:5: (yaml): expected <block end>, but found '<block mapping start>' (while parsing "
      "a block collection that starts on line 2); check this line's indentation against "
      "the lines around it, and for a quote left open above it (closed by one further "
      "down)"]),
    ("over-indented line", "server:\n  listen: 127.0.0.1:8080\n    drain_timeout: 5s\n" + ROUTE,
     ["{f}:3: (yaml): mapping values are not allowed here; quote a value that holds ': ', or "
      "indent this line no deeper than its key"]),
    ("unquoted IPv6 address", "server:\n  listen: [::1]:8080\n" + ROUTE,
     ["{f}:2: (yaml): expected the node content, but found ':'; quote a value that starts "
      "with [ or {{ and is no list or mapping (e.g. '[::1]:8080')"]),
    ("tab indentation", "server:\n\tlisten: 127.0.0.1:8080\n" + ROUTE,
     ["{f}:2: (yaml): found character '\\t' that cannot start any token; indent with "
      "spaces, not tabs"]),
    # Each member of retry.on's union said its own line in pydantic's words (a new user's
    # trial, stop 38): one line, what the value could be, and a near miss named.
    ("a retry.on item neither a status nor a condition",
     ROUTE + "    retry: {on: [502, 'on', connect_eror]}\n",
     ["{f}:5: routes[0].retry.on[1]: 'on' should be a whole number or 'connect_error' or "
      "'timeout'",
      "{f}:5: routes[0].retry.on[2]: 'connect_eror' should be a whole number or "
      "'connect_error' or 'timeout'; did you mean 'connect_error'?"]),
    # Grouped by path alone, with the number keys dropped from it, these two said one line,
    # "pricing.input: 'abc' should be a number or 0 or more" (a review).
    ("two bad prices under model names YAML reads as numbers",
     "pricing:\n  1: {input: 'abc', output: 1}\n  2: {input: -5, output: 1}\n" + ROUTE,
     ["{f}:2: pricing.1: 1 should be a string (quote it)",
      "{f}:2: pricing.1.input: 'abc' should be a number",
      "{f}:3: pricing.2: 2 should be a string (quote it)",
      "{f}:3: pricing.2.input: -5 should be 0 or more"]),
    ("a word where a count belongs", ROUTE + "    circuit_breaker: {fail_max: five}\n",
     ["{f}:5: routes[0].circuit_breaker.fail_max: 'five' should be a whole number"]),
    # PyYAML reports where such a character is as an offset only: it was said at line 1, on
    # two lines (a hostile trial, stop 38).
    ("NUL in a comment", ROUTE + "    protocol: openai  # x\x00\n",
     ["{f}:5: (yaml): unacceptable character #x0000 at column 26: special characters are "
      "not allowed (YAML allows only printable characters, tab and line breaks)"]),
    ("U+FFFE in a value", "server:\n  listen: 127.0.0.1:8080\ufffe\n" + ROUTE,
     ["{f}:2: (yaml): unacceptable character #xfffe at column 25: special characters are "
      "not allowed (YAML allows only printable characters, tab and line breaks)"]),
    # In the file's order (pydantic's own is its fields', which said line 3 before line 2).
    ("several problems at once",
     "server:\n  drain_timeout: 5 sec\n  listen: nowhere\n" + ROUTE + "    concurency: 1\n",
     [f"{{f}}:2: server.drain_timeout: '5 sec' {NOT_A_DURATION}",
      "{f}:3: server.listen: 'nowhere' is not HOST:PORT, e.g. 127.0.0.1:8080",
      f"{{f}}:8: routes[0].concurency: unknown key {TYPO}; did you mean concurrency?"]),
    # YAML reads 1e309 as infinity: a usd budget then never refused (every cost NaN), and
    # /admin/config showed a bare Infinity, which is no JSON (a hostile trial).
    ("a price beyond a float's range",
     "pricing:\n  gpt-4o-mini: {input: 1e309, output: 0.6}\n" + ROUTE,
     [f"{{f}}:2: pricing.gpt-4o-mini.input: {INFINITE}"]),
    ("a cost beyond a float's range",
     ROUTE + "    protocol: http\n    endpoints: {'* /**': {cost_per_second: 1e309}}\n",
     [f"{{f}}:6: routes[0].endpoints.\"* /**\".cost_per_second: {INFINITE}"]),
    ("a tenant weight beyond a float's range",
     ROUTE + "    concurrency: {limit: 2, tenant_weights: {a: 1e309}}\n",
     [f"{{f}}:5: routes[0].concurrency.tenant_weights.a: {INFINITE}"]),
    ("a warn_at beyond a float's range", "run: {max_requests: 5, warn_at: -1e309}\n" + ROUTE,
     [f"{{f}}:1: run.warn_at: {INFINITE}"]),
    ("a tagged NaN", "run: {max_requests: 5, warn_at: !!float .nan}\n" + ROUTE,
     ["{f}:1: run.warn_at: must be a finite number, not NaN"]),
    # 1/weight was infinite for a subnormal weight, and the fair queue's order erratic.
    ("a subnormal tenant weight", ROUTE + "    concurrency: {limit: 2, tenant_weights: "
     "{a: 1e-320, b: 2e6}}\n",
     ["{f}:5: routes[0].concurrency.tenant_weights.a: 1e-320 should be 1e-06 or more",
      "{f}:5: routes[0].concurrency.tenant_weights.b: 2000000.0 should be 1e+06 or less"]),
    ("a price past any real one", "pricing:\n  m: {input: 1, output: 2e6}\n" + ROUTE,
     ["{f}:2: pricing.m.output: 2000000.0 should be 1e+06 or less"]),
    # Each passed check-config, then `sluice serve` died of an OverflowError: the listen
    # backlog is a C int, and a budget or rate past a float's range is infinity (a hostile
    # trial); an integer past Python's 4300 digits was a traceback.
    ("max_connections beyond the listen backlog", "server:\n  max_connections: 2147483648\n"
     + ROUTE, ["{f}:2: server.max_connections: 2147483648 should be 1000000 or less"]),
    ("a budget beyond a float's range",
     ROUTE + "    protocol: openai\n    budget: {tokens: 1" + "0" * 400 + "/day}\n",
     ["{f}:6: routes[0].budget.tokens: '" + "1" + "0" * 35 + "...: a budget may "
      "allow at most 1e15 a window"]),
    ("a rate beyond a float's range",
     ROUTE + "    rate: {requests: 1" + "0" * 400 + "/s}\n",
     ["{f}:5: routes[0].rate.requests: '" + "1" + "0" * 35 + "...: a rate may allow "
      "at most 1e15 a period"]),
    # Written into each request without one: orjson refuses an integer past 64 bits (502).
    ("a default cap past 64 bits", ROUTE + "    protocol: openai\n    usage: "
     "{default_max_tokens: 1" + "0" * 30 + "}\n",
     ["{f}:6: routes[0].usage.default_max_tokens: 1" + "0" * 30 + " should be "
      "1000000000000000 or less"]),
    ("a number of 5000 digits", ROUTE + "    concurrency: {limit: 1" + "0" * 5000 + "}\n",
     ["{f}:5: (yaml): a number of 5001 digits (at most 4300 are read)"]),
    # `<<: *defaults` was refused as an unknown key, `!!merge <<: *defaults` merged: one
    # file, two readings (a hostile trial). Both are refused, saying what to write instead.
    ("a merge key", ROUTE + "    concurrency: &d {limit: 4, queue: 8}\n"
     "  - name: b\n    path_prefix: /b/\n    upstream: https://x.example\n"
     "    concurrency:\n      <<: *d\n      limit: 2\n",
     [f"{{f}}:10: routes[1].concurrency.<<: {MERGE_KEY}"]),
    ("a tagged merge key", ROUTE + "    concurrency: &d {limit: 4, queue: 8}\n"
     "    rate: {!!merge <<: *d}\n",
     [f"{{f}}:6: routes[0].rate.<<: {MERGE_KEY}"]),
    # An empty block (its keys commented out, or a file cut there mid-write when a reload read
    # it) was taken as no block: no limit, and check-config said ok (a hostile trial).
    ("an empty concurrency block", ROUTE + "    concurrency:\n      # limit: 2\n",
     [f"{{f}}:5: routes[0].concurrency: {EMPTY}"]),
    ("an empty rate block", ROUTE + "    rate:\n    protocol: openai\n",
     [f"{{f}}:5: routes[0].rate: {EMPTY}"]),
    ("an empty budget block", ROUTE + "    protocol: openai\n    budget:\n",
     [f"{{f}}:6: routes[0].budget: {EMPTY}"]),
    ("an empty limit in a block", ROUTE + "    concurrency: {limit: 4, per_tenant: }\n"
     "    rate:\n      per_tenant:\n",
     [f"{{f}}:5: routes[0].concurrency.per_tenant: {EMPTY}",
      f"{{f}}:7: routes[0].rate.per_tenant: {EMPTY}"]),
    ("an empty model block's limit", ROUTE + "    protocol: openai\n    models:\n"
     "      gpt-4o:\n        concurrency:\n",
     [f"{{f}}:8: routes[0].models.gpt-4o.concurrency: {EMPTY}"]),
    ("an empty top-level fanout", "fanout:\n" + ROUTE, [f"{{f}}:1: fanout: {EMPTY}"]),
    # A key with a value by default (a block, a duration) took pydantic's wording ("Input
    # should be a valid dictionary"), and one that took null as "off" took it unseen (a review).
    ("an empty timeouts block", ROUTE + "    timeouts:\n      # total: 30s\n",
     [f"{{f}}:5: routes[0].timeouts: {EMPTY_VALUED}"]),
    ("an empty usage block", ROUTE + "    protocol: openai\n    usage:\n",
     [f"{{f}}:6: routes[0].usage: {EMPTY_VALUED}"]),
    ("an empty key with a value by default", "server:\n  drain_timeout:\n" + ROUTE,
     [f"{{f}}:2: server.drain_timeout: {EMPTY_VALUED}"]),
    # Written as {} (or []), these loaded as blocks that limit or configure nothing, while
    # concurrency: {}, fanout: {} and budget: {} were refused (a review).
    ("a rate block with no limit", ROUTE + "    rate: {}\n",
     ["{f}:5: routes[0].rate: set at least one of requests, tokens, per_tenant"]),
    ("a run block with no limit", ROUTE + "    run: {warn_at: 0.5}\n",
     ["{f}:5: routes[0].run: set max_duration, max_requests or both (or, at the top level, "
      "cancel_ttl)"]),
    ("an empty top-level run block", "run: {}\n" + ROUTE,
     ["{f}:1: run: set max_duration, max_requests or both (or, at the top level, cancel_ttl)"]),
    ("a route's cancel_ttl, never read", ROUTE + "    run: {max_requests: 5, cancel_ttl: 5m}\n",
     ["{f}:5: routes[0].run: cancel_ttl is read from the top-level run block only: set it "
      "there"]),
    ("an empty list of budgets", ROUTE + "    budget: []\n",
     ["{f}:5: routes[0].budget: is an empty list: give at least one budget block, or leave "
      "the key out"]),
    *[(f"an empty {key} map", ROUTE + f"    protocol: {protocol}\n    {key}: {{}}\n",
       [f"{{f}}:6: routes[0].{key}: names no operation: give at least one (or default), or "
        "leave the key out"])
      for key, protocol in (("tools", "mcp"), ("endpoints", "http"), ("models", "openai"))],
    ("an unknown key before a bad value",
     ROUTE + "state:\n  backend: redis\n  on_unavailible: local\n  timeout: 50\n",
     [f"{{f}}:7: state.on_unavailible: unknown key {TYPO}; did you mean on_unavailable?",
      "{f}:8: state.timeout: 50 is not a duration: write a number and a unit, e.g. 250ms, "
      "5s, 10m, 24h"]),
]


@pytest.mark.parametrize("text,expected", [case[1:] for case in BAD_FILES],
                         ids=[case[0] for case in BAD_FILES])
def test_bad_file_names_file_line_and_key(tmp_path: Path, capsys, text: str,
                                          expected: list[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line.format(f=path) for line in expected]
    assert captured.out == ""


def test_a_tenants_table_with_an_unclosed_quote_is_refused_on_the_quote_s_line(
        tmp_path: Path, capsys) -> None:
    (tmp_path / "tenants.yaml").write_text(f"{'a' * 64}: team-a\n'{'b' * 64}: team-b\n"
                                           f"{'c' * 64}: team-c\n")
    path = tmp_path / "sluice.yaml"
    path.write_text("identity: {tenants: tenants.yaml}\n" + ROUTE)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"{tmp_path / 'tenants.yaml'}:2: identity.tenants: not valid YAML (while "
                   "scanning a quoted scalar: found unexpected end of stream (line 4))\n")


def test_a_tenants_table_with_a_control_character_names_its_line(tmp_path: Path,
                                                                  capsys) -> None:
    (tmp_path / "tenants.yaml").write_text(f"{'a' * 64}: team-a\n{'b' * 64}: team\x07b\n")
    path = tmp_path / "sluice.yaml"
    path.write_text("identity: {tenants: tenants.yaml}\n" + ROUTE)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"{tmp_path / 'tenants.yaml'}:2: identity.tenants: not valid YAML (unacceptable "
                   "character #x0007 at column 71: special characters are not allowed (YAML "
                   "allows only printable characters, tab and line breaks))\n")


def test_quoted_yaml11_words_and_every_key_are_accepted(tmp_path: Path, capsys) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(
        "server: {listen: '127.0.0.1:8080', admin_listen: '127.0.0.1:9901',"
        " drain_timeout: 250ms, max_request_bytes: 1048576}\n"
        "state: {backend: memory}\n"
        "identity: {tenant_header: 'no', run_header: X-Run, priority_header: X-Prio,"
        " default_tenant: \"on\"}\n"
        "events: {path: null}\n"
        "routes:\n"
        "  - name: api.v2_x-1\n"
        "    path_prefix: /a/b/\n"
        "    upstream: http://127.0.0.1:9/base/\n"
        "    protocol: mcp\n"
        "    timeouts: {connect: 1.5s, total: 10m}\n"
        "    concurrency: {limit: 1, queue: 0, max_wait: 0s, per_tenant: 1}\n"
        "    rate: {requests: 1/day, per_tenant: {requests: 10/h}}\n"
    )
    assert main(["check-config", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: ok (1 route(s))\n"


def test_the_keys_documented_as_nullable_take_null(tmp_path: Path, capsys) -> None:
    """Where null means something written down (stdout, no table, no token file, every name
    of the listen address, no default cap, the input price, no aging, no deadline header),
    it stays accepted; only limits and policy blocks refuse it."""
    path = tmp_path / "nulls.yaml"
    path.write_text(
        "server: {allowed_hosts: null}\n"
        "state: {redis_url: null}\n"
        "identity: {tenants: null, unknown_key_tenant: null}\n"
        "admin: {token_file: null}\n"
        "events: {path: null}\n"
        "pricing: {gpt-4o: {input: 1, output: 2, cache_read: null, cache_write: null}}\n"
        + ROUTE +
        "    protocol: openai\n"
        "    timeouts: {deadline_header: null}\n"
        "    usage: {default_max_tokens: null}\n"
        "    concurrency: {limit: 2, aging: null}\n"
        "    circuit_breaker: {tool_errors: null}\n"
        "    budget: {tokens: 1000/day, warn_at: null}\n"
    )
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == f"{path}: ok (1 route(s))\n"
    # Those and no others are what the README lists as taking null.
    said = README.split("Null stays\nvalid where it is documented:", 1)[1].split(". ", 1)[0]
    listed = {name.rpartition(".")[2] for name in re.findall(r"`([\w.]+)`", said)}
    assert listed == set().union(*(model.NULLABLE for model in _sections(_Section)))


def _sections(model: type[_Section]) -> Iterator[type[_Section]]:
    for sub in model.__subclasses__():
        if sub.__module__.startswith(("policies.", "proxy.")):  # not a test's own
            yield sub
        yield from _sections(sub)


def test_a_key_added_later_refuses_null_whatever_its_default() -> None:
    """A review: the rule was keyed on a null default, so a later key defaulting to a value
    whose null means "off" (as ``aging`` does, listed in NULLABLE) took a written null
    unseen. Only NULLABLE decides now."""
    class Future(_Section):
        NULLABLE = frozenset({"documented"})
        burst_cap: int | None = 10
        documented: int | None = 10

    with pytest.raises(ValidationError, match="is empty \\(null\\)"):
        Future.model_validate({"burst_cap": None})
    assert Future.model_validate({"documented": None}).documented is None


def test_a_top_level_run_block_may_set_cancel_ttl_alone(tmp_path: Path, capsys) -> None:
    """It sets how long a cancelled run is refused, which needs no run limit."""
    path = tmp_path / "cancel.yaml"
    path.write_text("run: {cancel_ttl: 5m}\n" + ROUTE)
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    assert parse_config(path.read_text(), str(path)).run.cancel_ttl == 300


def test_missing_file_is_an_error(tmp_path: Path, capsys) -> None:
    path = tmp_path / "absent.yaml"
    assert main(["check-config", str(path)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{path}:1: (file): cannot read: ")


def test_the_default_config_missing_says_to_pass_one(tmp_path: Path, monkeypatch, capsys
                                                      ) -> None:
    """Outside the clone (a new user's trial) "config/sluice.yaml:1: (file): cannot read: No
    such file or directory" was all ``serve`` and ``check-config`` said."""
    hint = (f"sluice: no config/sluice.yaml (the default config) in this directory, {tmp_path}: "
            "it ships in Sluice's repository, not in the installed package; run from the clone "
            "or pass --config PATH")
    monkeypatch.chdir(tmp_path)
    assert main(["check-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "config/sluice.yaml:1: (file): cannot read: No such file or directory", hint]
    served = subprocess.run([sys.executable, "-m", "proxy", "serve"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=60)
    assert (served.returncode, served.stderr.splitlines()[-1]) == (2, hint)


def test_console_script_exit_codes_and_default_config(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "sluice"
    sluice = [str(script)] if script.exists() else [sys.executable, "-m", "proxy"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(ROUTE + "    concurency: {limit: 2}\n")
    expected = f"{bad}:5: routes[0].concurency: unknown key {TYPO}; did you mean concurrency?\n"

    def run(*command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)

    ok = run(*sluice, "check-config", "config/sluice.yaml")
    assert (ok.returncode, ok.stdout, ok.stderr) == (
        0, "config/sluice.yaml: ok (2 route(s))\n", "")
    failed = run(*sluice, "check-config", str(bad))
    assert (failed.returncode, failed.stderr) == (2, expected)
    module = run(sys.executable, "-m", "proxy", "serve", "--config", str(bad))
    assert (module.returncode, module.stderr) == (2, expected)  # serve refuses it the same way


def test_a_port_already_taken_is_one_clear_line_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "sluice.yaml"
        config.write_text(f"server: {{listen: '127.0.0.1:{port}', admin_listen: '127.0.0.1:0'}}\n"
                          + ROUTE)
        done = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(config)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    # Naming the key to change (a new user's trial: it named only the address).
    assert (f"sluice: cannot start: [Errno 98] server.listen 127.0.0.1:{port}: error while "
            f"attempting to bind on address ('127.0.0.1', {port}): address already in use "
            "(set server.listen to a free address in a copy of the config)") in done.stderr
    assert "Traceback" not in done.stderr


def _serve_with_a_port_taken(tmp_path: Path, taken: str, more: str
                             ) -> tuple[int, subprocess.CompletedProcess]:
    """``sluice serve`` run in ``tmp_path`` on a config whose ``taken`` listener
    (``server.listen`` or ``server.admin_listen``) is on a port another socket holds, with a
    route that retries and the top-level blocks ``more`` (YAML): that port and the run."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        listen = {"server.listen": "127.0.0.1:0", "server.admin_listen": "127.0.0.1:0",
                  taken: f"127.0.0.1:{port}"}
        config = tmp_path / "sluice.yaml"
        config.write_text(
            f"server: {{listen: '{listen['server.listen']}', "
            f"admin_listen: '{listen['server.admin_listen']}'}}\n{more}"
            "routes:\n  - {name: r, path_prefix: /r/, upstream: 'http://127.0.0.1:9', "
            "retry: {attempts: 2}}\n")
        return port, subprocess.run(
            [sys.executable, "-m", "proxy", "serve", "--config", str(config)], cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
            timeout=60)


@pytest.mark.parametrize("taken", ["server.listen", "server.admin_listen"])
def test_a_start_that_fails_leaves_no_dead_letter_file_behind(tmp_path: Path,
                                                              taken: str) -> None:
    """A ``serve`` that could not bind its port created ``./sluice-dlq.sqlite`` (the default
    ``dead_letter.path``, in the user's working directory) on its way out: an empty file,
    and for a user of ``state.backend: redis`` one that ``sluice dlq`` then pointed at. The
    files a failed start created, holding nothing, are removed (the event log's too)."""
    port, done = _serve_with_a_port_taken(tmp_path, taken, "events: {path: events.jsonl}\n")
    assert done.returncode == 1 and f"{taken} 127.0.0.1:{port}" in done.stderr, done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["sluice.yaml"]


def test_a_failed_start_keeps_the_users_symlinks(tmp_path: Path) -> None:
    """``events.path`` and ``dead_letter.path`` as symlinks to files not made yet: a start
    that failed removed the links themselves, taking them for files it had created (a
    hostile review). They are the user's: kept."""
    (tmp_path / "events.jsonl").symlink_to(tmp_path / "target-events.jsonl")
    (tmp_path / "dlq.sqlite").symlink_to(tmp_path / "target-dlq.sqlite")
    _, done = _serve_with_a_port_taken(tmp_path, "server.listen",
                                       "events: {path: events.jsonl}\n"
                                       "dead_letter: {path: dlq.sqlite}\n")
    assert done.returncode == 1, done.stderr
    assert (tmp_path / "events.jsonl").is_symlink() and (tmp_path / "dlq.sqlite").is_symlink()


def test_a_dead_letter_file_that_cannot_be_opened_stops_the_start_before_it_listens(
        tmp_path: Path) -> None:
    """Opened once the listeners were bound, a dead-letter file another process kept locked
    let a start serve calls for SQLite's busy timeout (5 s), then cut them and exit 1, their
    letters lost (a hostile review). It is opened before: the proxy port is never bound."""
    letters = tmp_path / "dlq.sqlite"
    locker = sqlite3.connect(letters, isolation_level=None)
    locker.execute("CREATE TABLE t (x)")
    locker.execute("BEGIN EXCLUSIVE")  # as an open sqlite3 shell's transaction would
    locker.execute("INSERT INTO t VALUES (1)")
    port = free_port()
    config = tmp_path / "sluice.yaml"
    config.write_text(
        f"server: {{listen: '127.0.0.1:{port}', admin_listen: '127.0.0.1:0'}}\n"
        f"dead_letter: {{path: '{letters}'}}\n"
        "routes:\n  - {name: r, path_prefix: /r/, upstream: 'http://127.0.0.1:9', "
        "retry: {attempts: 2}}\n")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--config",
                                 str(config)], cwd=REPO, stderr=subprocess.PIPE, text=True)
        answered = 0
        while proc.poll() is None:
            with socket.socket() as probe:
                answered += probe.connect_ex(("127.0.0.1", port)) == 0
            time.sleep(0.05)
        stderr = proc.stderr.read()
        proc.stderr.close()
    finally:
        locker.close()
    assert proc.returncode == 1 and "dead_letter.path" in stderr, stderr
    assert answered == 0  # never listening, so no call was taken and then cut


@pytest.mark.parametrize("section", ["events", "dead_letter"])
def test_a_file_in_a_missing_directory_is_refused_by_serve_and_a_warning_of_check_config(
        tmp_path: Path, capsys, section: str) -> None:
    """A hostile trial: check-config said "ok" of an ``events.path`` (or, a route
    retrying, a ``dead_letter.path``) in a missing directory, which serve then could not
    open (exit 1; a crash loop for a reload that had held it "until a restart"). serve
    refuses it as a config error, on its line, with no traceback (a new user had seen a
    sqlite3 one, and an "Unclosed client session"); check-config, often run on another
    machine (CI), where the directory need not exist, warns of it and passes (a review)."""
    config = tmp_path / "sluice.yaml"
    config.write_text(
        "server: {listen: '127.0.0.1:0', admin_listen: '127.0.0.1:0'}\n"
        f"{section}: {{path: {tmp_path / 'missing' / 'file'}}}\n"
        "routes:\n  - {name: r, path_prefix: /r/, upstream: 'http://127.0.0.1:9', "
        "retry: {attempts: 2}}\n")
    expected = (f"{config}:2: {section}.path: the directory {str(tmp_path / 'missing')!r} "
                "does not exist: Sluice creates the file, not its directory\n")
    assert main(["check-config", str(config)]) == 0
    assert capsys.readouterr().err == (f"warning: {expected[:-1]} (where Sluice runs, it must "
                                       "be able to)\n")
    done = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, expected)


@pytest.mark.parametrize(("more", "route_retry"), [
    ("", ""),  # no route retries: no letter is ever written
    ("state: {backend: redis, redis_url: 'redis://127.0.0.1:9'}\n", ", retry: {attempts: 2}"),
], ids=["no retry", "letters in redis"])
def test_a_dead_letter_path_nothing_opens_may_be_anywhere(tmp_path: Path, capsys, more: str,
                                                          route_retry: str) -> None:
    config = tmp_path / "sluice.yaml"
    config.write_text(f"dead_letter: {{path: {tmp_path / 'missing' / 'dlq.sqlite'}}}\n{more}"
                      "routes:\n  - {name: r, path_prefix: /r/, upstream: 'http://127.0.0.1:9'"
                      f"{route_retry}}}\n")
    assert main(["check-config", str(config)]) == 0, capsys.readouterr().err


def test_a_relative_event_log_path_is_checked_from_the_working_directory(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "sluice.yaml"
    config.write_text("events: {path: logs/events.jsonl}\n" + ROUTE)
    (tmp_path / "logs").mkdir()  # beside the config, but not where serve would look
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["check-config", str(config)]) == 0
    assert capsys.readouterr().err == (
        f"warning: {config}:1: events.path: the directory 'logs' does not exist (relative to "
        f"the working directory, {elsewhere}): Sluice creates the file, not its directory "
        "(where Sluice runs, it must be able to)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["check-config", str(config)]) == 0
    assert capsys.readouterr().err == ""


def test_the_read_only_commands_do_not_look_at_the_files_a_server_writes(
        tmp_path: Path, capsys) -> None:
    # A review: `sluice runs list` and `timeline` on an operator's machine, where the event
    # log's directory does not exist (or is not writable), were refused by the check meant
    # for serve.
    config = tmp_path / "sluice.yaml"
    config.write_text("server: {listen: '127.0.0.1:0', admin_listen: '127.0.0.1:1'}\n"
                      f"events: {{path: {tmp_path / 'missing' / 'events.jsonl'}}}\n" + ROUTE)
    assert main(["runs", "list", "--config", str(config)]) == 1  # nothing listens on port 1
    err = capsys.readouterr().err
    assert "cannot reach the admin port" in err and "events.path" not in err


def test_a_rejected_upstream_url_is_shown_without_its_credentials(tmp_path: Path, capsys) -> None:
    # check-config quoted the URL it refused whole, user info and ?api_key= included (a new
    # user's trial); its output lands in CI logs. The server's reload log redacted them.
    path = tmp_path / "bad.yaml"
    path.write_text("routes:\n  - name: r\n    path_prefix: /r/\n"
                    "    upstream: 'http://alice:s3cretpw@127.0.0.1:9/base?api_key=SECRETQ'\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4: routes[0].upstream: " in err
    assert "s3cretpw" not in err and "SECRETQ" not in err


def test_an_api_key_where_a_duration_belongs_is_not_echoed(tmp_path: Path, capsys) -> None:
    # A hostile trial: `'sk-...' is not a duration` printed the key whole (only a message
    # starting with one was redacted).
    path = tmp_path / "bad.yaml"
    path.write_text("server:\n  drain_timeout: sk-proj-K3yS3cr3tValue\n"
                    "  stall_after: 'Bearer T0kenS3cr3tValue'\n"
                    "  idle_timeout: 'Basic dXNlcjpwYXNz'\n"  # short, no digit (a review)
                    "  body_timeout: 3f9a1c0b7d2e4f6a8b9c0d1e2f3a4b5c\n")  # no known prefix
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: server.drain_timeout: '<redacted>' is not a duration" in err
    assert f"{path}:3: server.stall_after: 'Bearer <redacted>' is not a duration" in err
    assert f"{path}:4: server.idle_timeout: 'Basic <redacted>' is not a duration" in err
    assert f"{path}:5: server.body_timeout: '<redacted>' is not a duration" in err
    assert "S3cr3t" not in err and "dXNlcjpwYXNz" not in err and "3f9a1c0b" not in err


@pytest.mark.parametrize("upstream", [
    "http://bob:PW S13@127.0.0.1:9",  # a space: no URL parser reads it
    "http:/bob:PW-S13@127.0.0.1:9",  # one slash: no authority at all
    "http://bob:PW@S13@127.0.0.1:9/a b",
])
def test_a_malformed_upstream_url_is_shown_without_its_password(
        tmp_path: Path, capsys, upstream: str) -> None:
    # A new user's trial: a URL too malformed to parse was quoted whole, password and all,
    # by check-config, at startup and in the reload log (the redaction reads URLs it parses).
    path = tmp_path / "bad.yaml"
    path.write_text(f"routes:\n  - {{name: r, path_prefix: /r/, upstream: '{upstream}'}}\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: routes[0].upstream: " in err
    assert "S13" not in err and "<redacted>@127.0.0.1:9" in err


def test_max_buffered_bytes_must_hold_the_largest_body(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("server: {max_request_bytes: 2000, max_buffered_bytes: 1000}\n"
                    "routes:\n  - {name: r, path_prefix: /r/, upstream: 'http://127.0.0.1:9'}\n")
    assert main(["check-config", str(path)]) == 2
    assert "max_buffered_bytes (1000) is less than max_request_bytes (2000)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("line_break", ["\r", "\x85", "\u2028"], ids=["CR", "NEL", "LS"])
def test_a_refused_character_is_named_on_its_line_whatever_breaks_the_lines(line_break):
    """YAML counts CR, NEL and U+2028 as line breaks too: a review saw line 1 said for a
    character on line 3 of a file broken by those alone."""
    text = ROUTE.replace("\n", line_break).replace("    path_prefix", "  \x07 path_prefix", 1)
    with pytest.raises(ConfigError) as refused:
        parse_config(text, "c.yaml")
    assert refused.value.problems[0].startswith(
        "c.yaml:3: (yaml): unacceptable character #x0007 at column 3: ")


def test_a_tenants_table_in_an_environment_variable_that_is_not_utf8_is_refused(
        tmp_path: Path, capsys, monkeypatch) -> None:
    """A byte that is not UTF-8 reaches Python as a lone surrogate (PEP 383): libyaml's
    encoding of it crashed check-config with a traceback (a review)."""
    monkeypatch.setenv("TENANTS", f"{'a' * 64}: team-a\n{'b' * 64}: team\udcffb\n")
    path = tmp_path / "sluice.yaml"
    path.write_text("identity: {tenants: 'env:TENANTS'}\n" + ROUTE)
    assert main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err.startswith(
        "env:TENANTS:2: identity.tenants: not valid YAML (unacceptable character #xdcff at "
        "column 71: ")


def test_a_key_pasted_where_a_word_belongs_is_not_quoted_back():
    """The refusal quotes short values back ('redsi' should be 'memory' or 'redis'), but
    not one shaped like an API key (a review)."""
    key = "sk-" + "a1" * 15
    with pytest.raises(ConfigError) as refused:
        parse_config(f"state: {{backend: {key}}}\n" + ROUTE, "c.yaml")
    assert refused.value.problems == [
        "c.yaml:1: state.backend: '<redacted>' should be 'memory' or 'redis'"]


@pytest.mark.parametrize("field", ["tenant_header", "run_header", "priority_header"])
@pytest.mark.parametrize("name", ["x-api-key", "Authorization", "Cookie", "X-Auth-Token",
                                  "Proxy-Authorization", "X-Session-Token", "X-Vault-Token",
                                  "X-Api-Secret", "X-Amz-Security-Token", "Private-Token",
                                  "X-Authorization", "Authentication", "X-Api-Auth"])
def test_a_header_that_carries_a_credential_cannot_name_a_tenant_or_a_run(field, name):
    """A hostile trial: ``tenant_header: x-api-key`` (a "quota per key" shortcut) passed
    check-config, and every caller's key then showed as a tenant label in /metrics, in the
    admin API and in the event log. The headers callers' credentials travel in are refused
    here, as is any name holding a token's, key's, secret's or password's word."""
    with pytest.raises(ConfigError) as refused:
        parse_config(f"identity: {{{field}: {name}}}\n" + ROUTE, "c.yaml")
    assert refused.value.problems == [
        f"c.yaml:1: identity.{field}: {name!r} carries a credential, so it cannot name a "
        "tenant, run, priority or deadline: its values would be shown in /metrics, the admin "
        "API and the event log; map keys to tenants with identity.tenants instead"]


@pytest.mark.parametrize("name", ["X-Team", "Cf-Access-Authenticated-User-Email",
                                  "X-Goog-Authenticated-User-Email", "X-Authenticated-Userid",
                                  "X-Auth-Request-User", "X-Session-ID"])
def test_an_authenticating_gateways_checked_user_can_name_the_tenant(name):
    """What an authenticating gateway sets after its check (a user's name or email) is the
    natural tenant behind it: "auth" or "session" in a name alone refuses nothing (a review)."""
    parse_config(f"identity: {{tenant_header: {name}}}\n" + ROUTE, "c.yaml")  # no ConfigError


def test_a_tenant_weight_is_keyed_by_a_tenant_name_a_caller_can_have():
    """A hostile trial: ``tenant_weights`` took keys no caller can have (``"team a"``,
    ``""``, ``"team-a "``), so a typo left the tenant it meant at weight 1 unseen."""
    text = ROUTE + "    concurrency: {limit: 4, tenant_weights: {'team-a ': 3}}\n"
    with pytest.raises(ConfigError) as refused:
        parse_config(text, "c.yaml")
    assert refused.value.problems == [
        "c.yaml:5: routes[0].concurrency.tenant_weights.\"team-a \": 'team-a ' is not an "
        "identity value: visible ASCII (letters, digits, punctuation), no spaces, at most "
        "128 characters"]


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "0.0.0.0:8080", "[::1]:8080", "[::]:8080",
                                    "localhost:8080", "sluice-0.sluice.svc.cluster.local.:80",
                                    "[fe80::1%eth0]:8080"])
def test_a_listen_address_serve_can_bind_is_accepted(listen: str) -> None:
    parse_config(f"server: {{listen: '{listen}', admin_listen: '127.0.0.1:1'}}\n" + ROUTE,
                 "c.yaml")  # no ConfigError


def test_a_byte_that_is_not_utf8_is_named_on_its_line_and_column(tmp_path: Path, capsys) -> None:
    """A hostile trial: one Latin-1 byte in a comment on line 9 was said at line 1, with
    nothing naming where it was. The tenants table names its own line too."""
    path = tmp_path / "bad.yaml"
    path.write_bytes(ROUTE.encode() + b"    protocol: openai\n    # caf\xe9 limits\n")
    assert main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err == (f"{path}:6: (file): cannot read: not UTF-8 (byte 0xe9 "
                                       "at line 6, column 10)\n")
    (tmp_path / "tenants.yaml").write_bytes(b"# t\xc3\xa9am\n" + b"a" * 64 + b": t\xff\n")
    path.write_text("identity: {tenants: tenants.yaml}\n" + ROUTE)
    assert main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"{path}:1: identity.tenants: cannot read the file it names: not UTF-8 (byte 0xff at "
        f"line 2, column 68) (a path relative to the config file's directory, {tmp_path}, "
        "with no directory part: if the value is the secret itself, write it to a file and "
        "name that file)\n")


UNEXPANDED = ("is a variable, and Sluice expands none in its config (only the keys documented "
              "to take env:NAME, such as state.redis_url and identity.tenants, read the "
              "environment): write the value itself, or render the file before Sluice reads "
              "it (e.g. envsubst); a password holding ${ writes its $ as %24")


@pytest.mark.parametrize(("upstream", "problem"), [
    ("http://a..b:80", "the host is not a name DNS can look up (its IDNA encoding fails: a "
     "label, the text between dots, is empty or longer than 63 characters, or holds a "
     "character IDNA forbids)"),
    (f"http://{'a' * 64}.example", "the host is not a name DNS can look up (its IDNA encoding "
     "fails: a label, the text between dots, is empty or longer than 63 characters, or holds "
     "a character IDNA forbids)"),
    ("http://[::1]x:80", "the host cannot be read as a URL's host (an IPv6 address goes in "
     "brackets with nothing but :PORT after them, e.g. http://[::1]:8080)"),
    ("http://u:pässwörd中@127.0.0.1:80", "the user name or password in the URL has a "
     "character outside Latin-1, which aiohttp cannot send as HTTP Basic credentials "
     "(percent-encoding does not help: it is decoded first); send the credential in a header "
     "the caller sets instead"),
    ("http://u%3Ax:pw@127.0.0.1:80", "the user name in the URL holds ':' (encoded as %3A), "
     "which HTTP Basic credentials cannot carry"),
    ("http://127.1:80", "the host is not an IPv4 address aiohttp connects to: write it as four "
     "decimal numbers from 0 to 255 with no leading zeros, e.g. 127.0.0.1"),
    ("http://${UPSTREAM_HOST}:80", f"${{UPSTREAM_HOST}} {UNEXPANDED}"),
    ("http://$UPSTREAM_HOST:80", f"$UPSTREAM_HOST {UNEXPANDED}"),
    ("http://u:${PW:-pässwörd}@h:80", f"${{PW}} {UNEXPANDED}"),
    # A review: a variable in the port was read as a port that is no number, and a zone
    # written %25 passed the check and failed every call.
    ("http://${HOST:-ollama}:11434", f"${{HOST}} {UNEXPANDED}"),
    ("http://ollama:${PORT}", f"${{PORT}} {UNEXPANDED}"),
    ("http://[fe80::1%25eth0]:80", "an IPv6 zone written %25NAME is looked up as part of a "
     "name and never found: write it unencoded, e.g. http://[fe80::1%eth0]:8080"),
])
def test_an_upstream_aiohttp_refuses_at_every_call_is_refused_at_load(
        tmp_path: Path, capsys, upstream: str, problem: str) -> None:
    """A hostile trial: each of these passed check-config, serve and reload, then failed
    every call with a 502 "proxy error" and a traceback (IDNA, yarl and aiohttp's Basic
    credentials refusing them at the first request), or could never resolve (a variable
    nothing expands). Refused on their line, never quoting the password."""
    path = tmp_path / "bad.yaml"
    path.write_text(f"routes:\n  - {{name: r, path_prefix: /r/, upstream: '{upstream}'}}\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"{path}:2: routes[0].upstream: {problem}"]
    assert "pässwörd" not in err and "pw@" not in err


@pytest.mark.parametrize("upstream", [
    "http://upstream_svc:8080",  # an underscore: compose service names have them
    "https://exämple.example/v1",  # IDNA encodes it as getaddrinfo does
    "http://[::1]:9/base",
    "http://u:pé@127.0.0.1:9",  # Latin-1
    "http://127.0.0.1:9/v1/$batch",  # a dollar in a path is a path
    "http://u:pa$word@127.0.0.1:9",
])
def test_an_upstream_aiohttp_can_call_is_accepted(tmp_path: Path, capsys, upstream: str) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(f"routes:\n  - {{name: r, path_prefix: /r/, upstream: '{upstream}'}}\n")
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(("block", "key", "secret"), [
    ("admin: {token_file: s3cr3t-admin-token-Zq9}", "admin.token_file", "s3cr3t-admin-token-Zq9"),
    ("admin: {token_file: /run/t0k/en+Zq9/xyz}", "admin.token_file", "t0k/en+Zq9"),
    ("identity: {tenants: sk-proj-Zq9abcdefabcdef}", "identity.tenants", "Zq9abcdef"),
])
def test_a_secret_pasted_in_place_of_a_path_is_not_echoed(tmp_path: Path, capsys, block: str,
                                                          key: str, secret: str) -> None:
    """A hostile trial: a token pasted into ``admin.token_file`` (an API key into
    ``identity.tenants``) in place of a path was quoted whole by check-config, serve's
    refusal and the reload log (``cannot read '/dir/s3cr3t-token'``). The key and its line
    are named, and whether the value has a directory part; none of the value is shown."""
    path = tmp_path / "sluice.yaml"
    path.write_text(f"{block}\n" + ROUTE)
    where = ("an absolute path" if "/run/" in block else
             f"a path relative to the config file's directory, {tmp_path}, with no directory "
             "part: if the value is the secret itself, write it to a file and name that file")
    expected = (f"{path}:1: {key}: cannot read the file it names: No such file or directory "
                f"({where})\n")
    assert main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err == expected
    done = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(path)],
                          env={**os.environ, "SLUICE_ADMIN_TOKEN": ""}, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, expected)
    assert secret not in done.stderr


def test_check_config_warns_of_an_openai_token_limit_with_no_default_output_cap(
        tmp_path: Path, capsys) -> None:
    # A new user's trial: a budget added to the openai route passed check-config, then every
    # call without max_tokens (most SDK calls) was refused 400 bad_request.
    path = tmp_path / "sluice.yaml"
    path.write_text("routes:\n  - name: llm\n    path_prefix: /llm/\n"
                    "    upstream: 'http://127.0.0.1:9'\n    protocol: openai\n"
                    "    budget: {tokens: 100000/day, per: tenant}\n")
    assert main(["check-config", str(path)]) == 0
    assert capsys.readouterr().err == (
        f"warning: {path}:6: routes[0].budget: this route limits tokens or spend and sets no "
        "usage.default_max_tokens: a call that names no max_tokens (most SDK calls) is refused "
        "400 bad_request; set one, e.g. usage: {default_max_tokens: 4096}\n")
    path.write_text(path.read_text() + "    usage: {default_max_tokens: 4096}\n")
    assert main(["check-config", str(path)]) == 0
    assert capsys.readouterr().err == ""
    # A model's own token rate refuses such calls too (a review).
    path.write_text("routes:\n  - name: llm\n    path_prefix: /llm/\n"
                    "    upstream: 'http://127.0.0.1:9'\n    protocol: openai\n"
                    "    models:\n      gpt-test: {rate: {tokens: 100000/min}}\n")
    assert main(["check-config", str(path)]) == 0
    assert "routes[0].models.gpt-test.rate.tokens: this route limits tokens" in \
        capsys.readouterr().err
