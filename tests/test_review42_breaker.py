"""A review of the shared breaker's ordered failure run (a success resets only the failures
recorded before it) and of the reload of files changed while Sluice started."""

from __future__ import annotations

import os
import time

import yaml

from policies.state import redis_backends
from policies.state.breaker import FAILURE, OPENED, BreakerParams
from tests.conftest import route
from tests.test_reload import until

DIGEST_A = "a" * 64
DIGEST_B = "b" * 64


# -- B: reload at startup ----------------------------------------------------------------------


async def test_a_tenants_file_changed_while_the_config_was_read_is_applied(upstream, tmp_path):
    """As for the config file, for the files it names: identity.tenants (and
    admin.token_file) are read by load_config, before the Reloader is made; a tenants table
    replaced while a slow config loads is applied at the first poll (a review: it was
    never applied, its fingerprint taken after the read)."""
    from proxy.config import load_config
    from proxy.reload import Reloader, fingerprint
    from proxy.runtime import Runtime

    path = tmp_path / "sluice.yaml"
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"{DIGEST_A}: team-a\n")
    path.write_text(yaml.safe_dump({
        "identity": {"tenants": "tenants.yaml"},
        "routes": [route("llm", upstream.url, concurrency={"limit": 2, "queue": 0})]},
        sort_keys=False))
    read, read_since_ns = fingerprint(path), time.time_ns()  # as cli._serve does
    config = load_config(path)
    assert config.identity.keys == {DIGEST_A: "team-a"}
    # Replaced (editor-style rename) after the read, before the watch starts.
    tmp = tenants.with_name("tenants.yaml.tmp")
    tmp.write_text(f"{DIGEST_B}: team-b\n")
    os.replace(tmp, tenants)
    runtime = Runtime(config)
    await runtime.open()
    reloader = Reloader(runtime, path, poll_interval_s=0.05, read=read,
                        read_since_ns=read_since_ns)
    reloader.start()
    try:
        await until(lambda: runtime.config.identity.keys == {DIGEST_B: "team-b"}, timeout=3,
                    what="the newer tenants table applied")
    finally:
        await reloader.stop()
        await runtime.close()


# -- A: the breaker's failure run ('run' field) --------------------------------------------------


BIG = BreakerParams(fail_max=10**6, reset_s=30, success_threshold=1, probe_s=5)


async def _seeded(url: str, n: int):
    """A breaker whose current run holds n consecutive failures, as n failure scripts under
    fail_max 10**6 (rate-only users set a huge fail_max) leave it: 'failures' n, 'run' n
    server times (seeded directly: the scripts would take minutes)."""
    from tests.redis_servers import new_prefix
    b = await redis_backends(url, new_prefix(), 60.0)
    admission = await b.breakers.admit("r", BIG)
    key = b.redis.key("r", "breaker")
    base = time.time_ns() // 1000 - 10_000_000
    run = " ".join(str(base + i) for i in range(n))
    await b.redis.run(lambda c: c.hset(key, mapping={"failures": n, "run": run}))
    return b, admission.ticket


async def test_a_long_failure_run_keeps_a_short_list_and_lowering_fail_max_opens(
        redis_server):
    """A rate-only breaker (fail_max 10**6) in a long outage: each failure's script read and
    rewrote every failure time of the run (20,000 failures: a 340 KB field, ~26 ms of Redis
    a script, and lowering fail_max by reload trimmed it one entry at a time, 1.8 s with
    every replica waiting: a review). The run keeps its latest 32 times whatever fail_max,
    and a reload to fail_max 3 opens at the next failure."""
    b, ticket = await _seeded(redis_server.url, 20_000)
    key = b.redis.key("r", "breaker")
    try:
        await b.breakers.record("r", ticket, FAILURE, BIG)
        run = (await b.redis.run(lambda c: c.hget(key, "run"))).split()
        assert len(run) == 32 and int(await b.redis.run(lambda c: c.hget(key, "failures"))
                                      ) == 20_001
        verdict = await b.breakers.record("r", ticket, FAILURE, BIG._replace(fail_max=3))
        assert verdict.transition == OPENED
    finally:
        await b.close()
