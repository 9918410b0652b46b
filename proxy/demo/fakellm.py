"""A fake OpenAI-style LLM provider that degrades on a schedule (``sluice demo``, storms).

Run as ``python -m proxy.demo.fakellm --provider JSON [--seed SEED]``, ``JSON`` being
:meth:`Provider.to_json`'s output (the provider and its schedule of phases), ``SEED`` that of
its work times' spread (or in-process with :class:`FakeLLM`); it binds 127.0.0.1 on a free
port and prints ``port N`` on its first line.

The model, scaled down in time from a real provider's incident:

* **Service.** A chat completion needs ``work_s`` seconds at full speed (varied by up to
  ±``WORK_SPREAD``, as answers differ in length). Up to ``slots`` completions run at full
  speed at once; with ``n > slots`` in service every one advances at ``slots / n`` of full
  speed (processor sharing, as continuous batching spreads a GPU over a growing batch), so
  throughput stays at ``slots / work_s`` and latency grows with the load.
* **Overload.** Beyond ``max_inflight`` completions in service, a request is refused at once
  with 503 (the provider's "overloaded" answer), at no cost.
* **Outage** (a phase with ``slots: 0``). Every request is answered 503 after
  ``OUTAGE_DELAY_S``; completions in service when an outage starts are cut with 503.
* **Completion.** A finished completion is billed (``tokens_per_call`` tokens) and its side
  effect applied, counted per ``Idempotency-Key``, whether or not the caller is still
  waiting: a non-streamed completion is generated whole, and the provider does not notice
  that the caller gave up. A key executed twice is a duplicate side effect; tokens billed for
  answers nobody used are wasted.

Control endpoints: ``POST /_fake/reset`` restarts the schedule's clock and clears the
counters; ``GET /_fake/stats`` returns them (:meth:`FakeLLM.stats`).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from aiohttp import web

#: How long an outage's 503 takes (the provider's edge answering for a dead backend), seconds.
OUTAGE_DELAY_S = 0.02
#: Work varies uniformly within ±this fraction of ``work_s``.
WORK_SPREAD = 0.2
#: The processor-sharing clock's step, seconds: a completion ends at most this late.
TICK_S = 0.005
#: Width of the timeline's bins, seconds.
BIN_S = 0.5


@dataclass(frozen=True)
class Phase:
    """One stretch of the schedule: ``[start_s, end_s)`` seconds after a reset."""

    name: str
    start_s: float
    end_s: float
    slots: int  # completions served at full speed at once; 0 = outage


@dataclass(frozen=True)
class Provider:
    """What the provider is like when healthy, and its schedule."""

    phases: tuple[Phase, ...]
    work_s: float = 0.3
    max_inflight: int = 64
    tokens_per_call: int = 1500  # prompt + completion tokens billed per completion

    def phase_at(self, t: float) -> Phase:
        """The phase in force ``t`` seconds after a reset (the last one after the end)."""
        for phase in self.phases:
            if phase.start_s <= t < phase.end_s:
                return phase
        return self.phases[-1]

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "phases": [asdict(p) for p in self.phases]})

    @classmethod
    def from_json(cls, text: str) -> Provider:
        data = json.loads(text)
        phases = tuple(Phase(**p) for p in data.pop("phases"))
        return cls(phases=phases, **data)


def completion(tokens: int) -> bytes:
    """A chat-completion answer billing ``tokens`` tokens (4/5 prompt, 1/5 completion)."""
    completion_tokens = tokens // 5
    return json.dumps({
        "id": "chatcmpl-fake", "object": "chat.completion", "created": 1760000000,
        "model": "fake-llm", "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": "Step done."}}],
        "usage": {"prompt_tokens": tokens - completion_tokens,
                  "completion_tokens": completion_tokens, "total_tokens": tokens},
    }).encode()


def _error(message: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error", "code": None}}
    return web.json_response(body, status=503)


class FakeLLM:
    """The provider as an aiohttp app; ``start()`` binds 127.0.0.1 on a free port."""

    def __init__(self, provider: Provider, seed: int = 1) -> None:
        self.provider = provider
        self.port = 0
        self._answer = completion(provider.tokens_per_call)
        self._random = random.Random(seed)
        self._runner: web.AppRunner | None = None
        self._ticker: asyncio.Task[None] | None = None
        # Processor sharing on a virtual clock: it advances at min(1, slots / n) per second,
        # and a completion is done when it reaches the value it was given on arrival.
        self._virtual = 0.0
        self._heap: list[tuple[float, int, asyncio.Future[bool]]] = []
        self._order = itertools.count()
        self._clear()

    def _clear(self) -> None:
        self.t0 = time.monotonic()
        self.attempts = 0
        self.outcomes: Counter[str] = Counter()
        self.executions: Counter[str] = Counter()
        self.key_attempts: Counter[str] = Counter()
        self.tokens = 0
        self.peak_inflight = 0
        self._bins: dict[int, Counter[str]] = {}

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> FakeLLM:
        app = web.Application()
        app.router.add_post("/_fake/reset", self._reset)
        app.router.add_get("/_fake/stats", self._stats)
        app.router.add_post("/{tail:.*}", self._chat)
        # A caller that leaves cancels its handler; a completion in service is shielded from
        # that (see the module docstring), so only the answer is lost.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._ticker = asyncio.create_task(self._tick_forever())
        return self

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- counters -----------------------------------------------------------------------------

    def stats(self, per_key: bool = False) -> dict[str, object]:
        """Counters since the last reset (JSON-ready).

        ``attempts``: requests received; ``outcomes``: ``ok``, ``overloaded``, ``outage``,
        ``cut``; ``executions``: completions finished (billed, side effect applied);
        ``duplicates``: executions beyond the first of each ``Idempotency-Key``; ``tokens``:
        tokens billed; ``timeline``: per ``BIN_S`` bin, ``{"t", "attempts", "ok",
        "refused", "inflight"}``; with ``per_key``, ``per_key``: ``{key: [attempts,
        executions]}``.
        """
        timeline = [{"t": b * BIN_S, "attempts": c["attempts"], "ok": c["ok"],
                     "refused": c["refused"], "inflight": c["inflight"]}
                    for b, c in sorted(self._bins.items())]
        out: dict[str, object] = {
            "elapsed_s": time.monotonic() - self.t0,
            "phase": self.provider.phase_at(time.monotonic() - self.t0).name,
            "attempts": self.attempts,
            "outcomes": dict(self.outcomes),
            "executions": sum(self.executions.values()),
            "duplicates": sum(n - 1 for n in self.executions.values() if n > 1),
            "tokens": self.tokens,
            "inflight": len(self._heap),
            "peak_inflight": self.peak_inflight,
            "timeline": timeline,
        }
        if per_key:
            out["per_key"] = {key: [n, self.executions[key]]
                              for key, n in self.key_attempts.items()}
        return out

    def _bin(self) -> Counter[str]:
        index = int((time.monotonic() - self.t0) / BIN_S)
        found = self._bins.get(index)
        if found is None:
            found = self._bins[index] = Counter()
        return found

    # -- handlers -----------------------------------------------------------------------------

    async def _reset(self, request: web.Request) -> web.Response:
        for _, _, future in self._heap:
            if not future.done():
                future.set_result(False)
        self._heap.clear()
        self._clear()
        return web.json_response({"ok": True})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats(per_key=bool(request.query.get("keys"))))

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.attempts += 1
        self.key_attempts[request.headers.get("Idempotency-Key", "")] += 1
        current = self._bin()
        current["attempts"] += 1
        phase = self.provider.phase_at(time.monotonic() - self.t0)
        if phase.slots == 0:
            await asyncio.sleep(OUTAGE_DELAY_S)
            return self._refused("outage", "the service is unavailable")
        if len(self._heap) >= self.provider.max_inflight:
            return self._refused("overloaded", "the engine is currently overloaded")
        work = self.provider.work_s * (1 + WORK_SPREAD * (2 * self._random.random() - 1))
        done = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (self._virtual + work, next(self._order), done))
        self.peak_inflight = max(self.peak_inflight, len(self._heap))
        # The caller leaving does not stop a completion in service: shield it.
        key = request.headers.get("Idempotency-Key", "")
        finished = await asyncio.shield(self._finish(done, key))
        if not finished:
            return self._refused("cut", "the service is unavailable")
        return web.Response(body=self._answer, content_type="application/json")

    async def _finish(self, done: asyncio.Future[bool], key: str) -> bool:
        """Wait for a completion; when it finishes, bill it and apply its side effect."""
        finished = await done
        if finished:
            self.outcomes["ok"] += 1
            self._bin()["ok"] += 1
            self.executions[key] += 1
            self.tokens += self.provider.tokens_per_call
        return finished

    def _refused(self, outcome: str, message: str) -> web.Response:
        self.outcomes[outcome] += 1
        self._bin()["refused"] += 1
        return _error(message)

    # -- the processor-sharing clock ----------------------------------------------------------

    async def _tick_forever(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self._advance(now - last, self.provider.phase_at(now - self.t0))
            last = now

    def _advance(self, elapsed: float, phase: Phase) -> None:
        heap = self._heap
        if phase.slots == 0:  # an outage cuts every completion in service
            for _, _, future in heap:
                future.set_result(False)
            heap.clear()
            return
        if not heap:
            return
        current = self._bin()
        current["inflight"] = max(current["inflight"], len(heap))
        self._virtual += elapsed * min(1.0, phase.slots / len(heap))
        while heap and heap[0][0] <= self._virtual:
            _, _, future = heapq.heappop(heap)
            future.set_result(True)


async def _serve(provider: Provider, seed: int) -> None:
    fake = await FakeLLM(provider, seed).start()
    print(f"port {fake.port}", flush=True)
    try:
        await asyncio.Event().wait()  # until the parent terminates the process
    finally:
        await fake.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", required=True, help="Provider.to_json() output")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    provider = Provider.from_json(args.provider)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(provider, args.seed))
    else:
        uvloop.run(_serve(provider, args.seed))


if __name__ == "__main__":
    sys.exit(main())
