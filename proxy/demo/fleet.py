"""A simulated agent fleet: open-loop units of work, each one LLM call retried in two layers.

**Units of work.** The fleet starts ``rate`` units per second for ``arrivals_s`` seconds, on
a fixed schedule whatever became of earlier ones (open loop: every run is offered the same
work). A unit is one agent step: a chat completion carrying the step's own
``Idempotency-Key`` (the same on every try, as an agent passes one with ``extra_headers``). It
counts as completed if it succeeds within ``deadline_s`` of its start; at that point it is
abandoned (its request in flight is cancelled, as an agent run that gave up on a step, and
that request's answer is counted as :data:`ABANDONED`).

**Inner layer: the openai SDK's retry rules** (``openai/_base_client.py``, 3.x; see
``shared/notes/infra-semantics.md`` §5), re-implemented on aiohttp so that the demo needs
nothing beyond Sluice's own dependencies:

* ``max_retries`` 2 (3 attempts); each attempt bounded by the client's ``timeout``
  (``timeout_s``), sent as ``x-stainless-read-timeout``; ``x-stainless-retry-count`` is 0,
  1, 2 on the attempts;
* retried: timeouts, connection errors, and answers for which ``x-should-retry: true``, or,
  without that header, status 408, 409, 429 or >= 500; ``x-should-retry: false`` forbids it;
* the wait: ``retry-after-ms``, else ``Retry-After`` (seconds or an HTTP-date), when
  ``0 < wait <= 120 s``; a longer one means no retry at all; otherwise
  ``min(0.5 * 2^k, 8) * (1 - 0.25 U)`` for retry ``k`` (0-based).

**Outer layer: the agent framework's step retry**, modelled on LangGraph's default
``RetryPolicy`` (3 attempts, 0.5 s initial interval, factor 2, jitter): a step whose call
failed after the SDK's retries is run again after ``0.5 * 2^k`` seconds plus up to 1 s of
random jitter, up to 3 tries, on any API error. Two layers of 3 attempts each make up to 9
requests per unit: the retry amplification Sluice exists to contain.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.utils import mktime_tz, parsedate_tz

import aiohttp

# The openai SDK's constants (openai/_constants.py, 3.x).
SDK_INITIAL_DELAY_S = 0.5
SDK_MAX_DELAY_S = 8.0
SDK_MAX_RETRY_AFTER_S = 120.0
# The agent framework's step retry (LangGraph's RetryPolicy defaults).
AGENT_INITIAL_INTERVAL_S = 0.5
AGENT_BACKOFF_FACTOR = 2.0
AGENT_JITTER_S = 1.0

#: The answer counted for a request still awaiting its answer when its step's deadline came.
ABANDONED = "abandoned"

REQUEST_BODY = (
    b'{"model":"fake-llm","messages":[{"role":"user","content":"Plan the next step."}],'
    b'"max_tokens":300}'
)


@dataclass(frozen=True)
class Fleet:
    """How the agents behave (all durations in seconds)."""

    rate: float = 40.0  # units started per second, by the whole fleet
    arrivals_s: float = 16.0  # units start during [0, arrivals_s)
    deadline_s: float = 6.0  # a unit completes only if it succeeds this soon after its start
    timeout_s: float = 2.0  # the SDK client's timeout, per attempt
    sdk_retries: int = 2  # the SDK's max_retries
    agent_tries: int = 3  # the framework's attempts per step
    agents: int = 20  # X-Run-ID values the units are spread over

    @property
    def units(self) -> int:
        return math.ceil(self.arrivals_s * self.rate)


@dataclass
class Unit:
    """One step of work and what became of it (times in seconds after the run's start)."""

    index: int
    start: float
    key: str
    done: float | None = None  # when it succeeded, if it did within the deadline
    requests: int = 0  # HTTP requests the agent sent for it, every layer counted

    @property
    def latency(self) -> float | None:
        return None if self.done is None else self.done - self.start


@dataclass
class FleetRun:
    """One run of the fleet against one URL; live counters for progress reports."""

    fleet: Fleet
    url: str
    seed: int = 1
    units: list[Unit] = field(default_factory=list)
    # Per request sent, exactly once: its status, Sluice's reason, "timeout" (the client's),
    # "connect_error", or ABANDONED.
    answers: Counter[str] = field(default_factory=Counter)
    t0: float = 0.0
    in_flight: int = 0  # HTTP requests awaiting an answer now

    @property
    def completed(self) -> int:
        return sum(1 for u in self.units if u.done is not None)

    async def run(self) -> list[Unit]:
        """Start every unit on schedule and wait until each has completed or been abandoned."""
        rng = random.Random(self.seed)
        prefix = f"{self.seed:x}-{time.time_ns():x}"
        self.units = [Unit(i, i / self.fleet.rate, f"step-{prefix}-{i}")
                      for i in range(self.fleet.units)]
        # The openai SDK's pool allows 1000 connections; keep-alive as it does.
        connector = aiohttp.TCPConnector(limit=1000)
        async with aiohttp.ClientSession(connector=connector) as session:
            self.t0 = time.monotonic()
            tasks = []
            for unit in self.units:
                delay = self.t0 + unit.start - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(
                    self._unit(session, unit, random.Random(rng.random()))))
            await asyncio.gather(*tasks)
        return self.units

    async def _unit(self, session: aiohttp.ClientSession, unit: Unit,
                    rng: random.Random) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.fleet.deadline_s):
                for attempt in range(self.fleet.agent_tries):
                    if await self._sdk_call(session, unit, rng):
                        unit.done = time.monotonic() - self.t0
                        break
                    if attempt + 1 < self.fleet.agent_tries:
                        interval = AGENT_INITIAL_INTERVAL_S * AGENT_BACKOFF_FACTOR ** attempt
                        await asyncio.sleep(interval + rng.uniform(0, AGENT_JITTER_S))

    async def _sdk_call(self, session: aiohttp.ClientSession, unit: Unit,
                        rng: random.Random) -> bool:
        """One SDK call (up to ``sdk_retries + 1`` attempts); True on success."""
        timeout = aiohttp.ClientTimeout(total=self.fleet.timeout_s)
        agent = unit.index % self.fleet.agents
        for retry in range(self.fleet.sdk_retries + 1):
            headers = {
                "Content-Type": "application/json",
                "Authorization": "Bearer sk-demo-not-a-real-key",
                "Idempotency-Key": unit.key,
                "X-Run-ID": f"agent-{agent}",
                "x-stainless-retry-count": str(retry),
                "x-stainless-read-timeout": f"{self.fleet.timeout_s:g}",
            }
            unit.requests += 1
            self.in_flight += 1
            status: int | None = None
            answer: Mapping[str, str] = {}
            # Stays so if the step's deadline cancels this request before it is answered.
            label = ABANDONED
            try:
                async with session.post(self.url, data=REQUEST_BODY, headers=headers,
                                        timeout=timeout) as response:
                    await response.read()
                    status, answer = response.status, response.headers
                    label = answer.get("X-Sluice-Reason") or str(status)
            except TimeoutError:
                label = "timeout"
            except aiohttp.ClientError:
                label = "connect_error"
            finally:
                self.in_flight -= 1
                self.answers[label] += 1
            if status is not None and status < 400:
                return True
            if retry == self.fleet.sdk_retries:
                return False
            wait = _sdk_wait(status, answer, retry, rng)
            if wait is None:
                return False
            await asyncio.sleep(wait)
        return False


def _sdk_wait(status: int | None, headers: Mapping[str, str], retry: int,
              rng: random.Random) -> float | None:
    """Seconds the openai SDK waits before its next attempt, or ``None`` for no retry."""
    hint = retry_after(headers) if status is not None else None
    if status is not None:
        if hint is not None and hint > SDK_MAX_RETRY_AFTER_S:
            return None
        verdict = headers.get("x-should-retry")
        if verdict == "false":
            return None
        if verdict != "true" and not (status in (408, 409, 429) or status >= 500):
            return None
    if hint is not None and 0 < hint <= SDK_MAX_RETRY_AFTER_S:
        return hint
    return min(SDK_INITIAL_DELAY_S * 2.0 ** retry, SDK_MAX_DELAY_S) * (1 - 0.25 * rng.random())


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The wait an answer asks for, seconds, as the SDKs read it (``retry-after-ms`` first)."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            with contextlib.suppress(ValueError):
                return float(value) / scale
    date = parsedate_tz(headers.get("retry-after") or "")
    return None if date is None else mktime_tz(date) - time.time()
