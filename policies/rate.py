"""Request and token rate limits per route and per tenant (config key ``rate``).

A rate ``N/period`` is a bucket of ``N`` units draining at ``N/period`` per second (GCRA in its
continuous-state leaky bucket form, :mod:`policies.state.rate`): a burst of up to ``N`` passes,
then requests pass at the steady rate. A request that finds no capacity is answered 429
``rate_limited`` at once; it never waits in the bucket, so a caller is never left hanging by a
rate limit.

The buckets live in the route's state backend (``route.backends.rates``): this process's memory,
or Redis shared by every replica, so a tenant's ``10/min`` is 10 per minute across all of them.
Every bucket that applies to a call (the route's, the tenant's, and the route's token bucket for
a metered call) is taken in **one** atomic call, all or none: one Redis round trip per
admission. ``Retry-After`` is the time until every bucket would fit the call,
``(level + amount - N) / (N / period)`` seconds for the slowest (the RFC 6585 meaning of 429's
Retry-After), *or later when other refused callers were already told that time*
(:class:`Promises`): under steady over-demand every refused caller of a bucket was told the
same instant (12 clients on ``2/s`` all told the same 10 ms slot, ~11 refusals per success;
a hostile trial), so each refusal is given its own slot, one emission interval after the
last one promised, as GCRA's virtual scheduling spaces conforming cells. A lone caller's
wait stays exact: a caller that waits exactly ``retry-after-ms`` is admitted.

``tokens: N/period`` counts tokens: a metered call takes its *reserved* worst case (estimated
input + output cap) at admission, as OpenAI counts ``max_tokens`` against its own
tokens-per-minute limit when a request arrives, so Sluice refuses what the upstream would.
Since only :mod:`policies.accounting` reads the body, on a route that limits tokens (a token
rate or a budget) it takes the metered call's request units, its tokens and its budget holds
together (:attr:`RateLimiter.metered_elsewhere`; one round trip,
:mod:`policies.state.admission`); this step then holds nothing for that call. Nothing is given
back after the answer (the upstream does not refund either); only a call that never reached
the upstream gets its units back. A request reserving more than ``N`` tokens could never pass:
400 ``exceeds_limit`` at once (before any state is asked).

When the shared state does not answer (:class:`~policies.state.StateUnavailable`),
``state.on_unavailable`` decides: ``local`` takes from this replica's own memory buckets with
``state.replicas``' share of each limit (and keeps counting there across outages); ``reject``
refuses 503 ``state_unavailable``.

A reload keeps every level: buckets are named by route and role (``requests``,
``tenant:<name>``, ``tokens``), not by rate. What a bucket held at the reload drains at the old
rate until the bucket's next take, and at the new rate from there
(:meth:`RateLimiter.reconfigure`, :mod:`policies.state.rate`).

Replicas whose rates differ (a reload reaches them one at a time) share the lowest in Redis:
each admission names the limiter's :attr:`~RateLimiter.holder` and records its rate per bucket
for ``state.lease``, and each bucket is checked and drained by the smallest limit and the
slowest steady rate among the live records (the rule and why: :mod:`policies.state.rate`).
A refusal's ``Retry-After``, ``RateLimit-Policy`` (``q``, ``w``) and message follow the
rate that refused it: the script answers with the limit and interval it checked the refusing
bucket by (in the same reply), and the message names this replica's own beside it. A limit
and an interval from two replicas read as ``q`` = the limit, ``w`` = the limit times the
interval rounded to whole seconds (``10/min`` and ``5/s``: ``q=5;w=30``, said ``5 per 30s``),
the rate the bucket enforces. A reservation within this replica's ``N`` tokens
but over another live replica's lower token limit is not a 400: it fits once that record
lapses (or that replica reloads), so it is 429 ``token_rate_limited`` with the wait the
script measures: until the last lower record lapses (its holder's ``state.lease`` after its
last take, if it takes no more), or until the level has drained to the limit left then, if
later. Only this replica's own limit makes a request that can never pass; one over only its
local share while the shared state is unavailable is 503 ``state_unavailable`` with the probe
interval as its wait (it fits once that answers).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, TypeVar

from policies.config import Rate, RateConfig
from policies.logs import PER_CALL
from policies.pipeline import Call, Outcome, survive_leaving
from policies.reasons import Reason, Rejected
from policies.state import StateBackends, StateUnavailable
from policies.state.errors import outage_hint
from policies.state.leases import new_lease_id
from policies.state.rate import (
    Holder,
    MemoryRateBuckets,
    Plan,
    RateBucketsFull,
    RateResult,
    Take,
    memory_plan,
)
from policies.usage import endpoint_for
from policies.wording import counted

log = logging.getLogger("sluice")

T = TypeVar("T")

#: Bucket names within a route's group.
REQUESTS = "requests"
TOKENS = "tokens"
TENANT_PREFIX = "tenant:"
#: Tenants whose request units a limiter keeps built (``request_units``).
TAKES_KEPT = 1024
#: Buckets whose promised slots a limiter keeps (:class:`Promises`); lapsed ones are
#: dropped first when it is reached, and the oldest bucket's if none has.
PROMISES_KEPT = 4096


def unavailable(exc: StateUnavailable) -> Rejected:
    """The 503 ``state_unavailable`` of ``state.on_unavailable: reject``, with
    :attr:`StateUnavailable.hint` as ``Retry-After``: the time the backend has been down so
    far, at least until its next probe and at most 10 s.

    The caller is told no more than the reason: ``exc.cause`` names Redis's address and the
    error, which are the operator's (the log, ``/readyz`` on the admin port), not a caller's.
    """
    hint = exc.hint
    wait = hint if hint is not None else 1.0
    return Rejected(Reason.STATE_UNAVAILABLE, wait)


def buckets_full(exc: RateBucketsFull) -> Rejected:
    """``rate_buckets_full`` (503, never retried as sent) for a call whose new tenant would
    need a rate bucket beyond the memory state's cap (``state.max_rate_buckets``)."""
    return Rejected(
        Reason.RATE_BUCKETS_FULL, None,
        f"Sluice keeps at most {exc.cap} rate buckets (state.max_rate_buckets), each until "
        "it drains, and this call's tenant would need a new one; tenants already counted "
        "are served", retry=False)


def fallback_for(backends: StateBackends, exc: StateUnavailable) -> StateBackends:
    """Where to decide while ``backends`` is unavailable (``state.on_unavailable``): the
    local memory state of ``local`` mode, whose limits are this replica's share.

    Raises:
        Rejected: ``state_unavailable`` (``reject`` mode).
    """
    fallback = backends.fallback
    if fallback.mode == "reject":
        raise unavailable(exc) from None
    return fallback.memory()


def finish_now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a memory state call to its end right here and return its result.

    A holding's ``release`` may not await (pipeline contract), and the memory implementations
    never suspend, so their coroutine completes on its first step; giving it to the loop as a
    task instead would let the next admission run before the refund lands.

    Raises:
        RuntimeError: the coroutine suspended (it was not a memory implementation's).
    """
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a memory state call suspended")


class Background:
    """State calls a ``release`` starts and cannot await (refunds, settles on Redis): each
    runs as a task kept referenced here until it ends, so none is garbage-collected midway,
    and its failure is logged rather than lost."""

    __slots__ = ("_backends", "_tasks")

    def __init__(self, backends: StateBackends | None = None) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._backends = backends

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a task; an exception it ends with is logged with ``what``."""
        task = asyncio.get_running_loop().create_task(coro, name=f"sluice-{what}")
        self._tasks.add(task)
        if self._backends is not None:
            self._backends.keep(task)  # shutdown waits for it (StateBackends.close)
        task.add_done_callback(lambda t: self._done(t, what))
        return task

    def spawn(self, step: Awaitable[T]) -> asyncio.Future[T]:
        """Run ``step`` as a task its caller awaits (see
        :func:`policies.pipeline.survive_leaving`): kept here, so that shutdown waits for it
        once the caller left, but its failure is the caller's to handle, not logged."""
        task = asyncio.ensure_future(step)
        self._tasks.add(task)  # type: ignore[arg-type]
        if self._backends is not None:
            self._backends.keep(task)
        task.add_done_callback(self._tasks.discard)  # type: ignore[arg-type]
        return task

    def _done(self, task: asyncio.Task[Any], what: str) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, StateUnavailable):
            log.warning("%s not applied: %s", what, exc.cause, extra=PER_CALL)
        elif exc is not None:
            log.error("%s failed", what, exc_info=exc)

    async def wait(self) -> None:
        """Until every task started so far has ended (for shutdown and tests)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class Units:
    """What one call took from the rate buckets (a :class:`policies.pipeline.Holding`): kept
    when the request reached the upstream (it was served), given back when it never did
    (refused by a later step, or its caller left first), so refused calls do not burn a
    tenant's quota.

    Attributes:
        source: the state the units were taken from (the shared one, or the local fallback's).
        takes: the buckets and amounts taken (limits as enforced there).
    """

    __slots__ = ("_limiter", "_open", "source", "takes")

    def __init__(self, limiter: RateLimiter, source: StateBackends, takes: Sequence[Take]
                 ) -> None:
        self._limiter = limiter
        self._open = True
        self.source = source
        self.takes = takes

    def handed_over(self) -> None:
        """Another holding gives the units back with its own release, in the same round
        trip (:meth:`policies.budget.Budgets.give_back`): this one does nothing more."""
        self._open = False

    def release(self, outcome: Outcome | None) -> None:
        """Give the units back unless the call reached the upstream (``outcome`` ``None``:
        it never did). Once; never awaits (a Redis refund runs as a task)."""
        if not self._open:
            return
        self._open = False
        if outcome is not None and outcome.reached:
            return
        limiter = self._limiter
        refund = self.source.rates.refund(limiter.group, self.takes)
        if self.source.redis is None:
            finish_now(refund)
        else:
            limiter.background.start(refund, f"rate refund on {limiter.group}")


class RequestUnits:
    """A tenant's request units on a route: the buckets one of its requests takes (its own,
    the route's: those configured) as :class:`~policies.state.rate.Take` values and as their
    memory :data:`~policies.state.rate.Plan`, built once per tenant (a call names the same
    buckets each time).

    On a route whose state is memory it is also the :class:`policies.pipeline.Holding` of
    every call that took them, the same object each time: it keeps nothing per call, so none
    is built per request, and the pipeline releases each admission's holding once.

    Attributes:
        takes: the buckets, the tenant's first.
        plan: the same for the memory buckets.
    """

    __slots__ = ("_memory", "plan", "takes")

    def __init__(self, takes: tuple[Take, ...], plan: Plan,
                 memory: MemoryRateBuckets | None) -> None:
        self.takes = takes
        self.plan = plan
        self._memory = memory

    def release(self, outcome: Outcome | None) -> None:
        """Give the units back unless the call reached the upstream (``outcome`` ``None``:
        it never did). Never awaits."""
        if outcome is not None and outcome.reached:
            return
        assert self._memory is not None  # a holding only on a memory route
        self._memory.give_back(self.plan)


class Promises:
    """The waits a limiter has told refused callers, per bucket, so that callers refused
    together are told successive slots instead of one instant.

    Each bucket keeps ``tat``, GCRA's theoretical arrival time (ITU-T I.371's virtual
    scheduling form) of the units promised so far: the time the bucket would be back at
    its present level had every caller told a wait taken its amount then. A refusal of
    ``amount`` units whose own wait is ``wait`` (the bucket's level alone) is told when it
    would conform once those promises are kept:
    ``max(own slot, tat - (limit - amount) x interval)``, and ``tat`` advances by its
    ``amount x interval`` (``interval`` = ``period / limit`` seconds per unit, the time one
    unit takes to drain). The promises lapse by themselves: once the bucket's own level
    is past them (time passed, or admitted calls took the units), each refusal's own wait
    is what it is told, so a lone caller's wait stays exact. A caller that never comes
    back costs its slot once (a later caller is told one interval more than it needed). No
    caller is told more than one period past its own wait.

    The promises are this process's (:class:`RateLimiter` keeps them), also when the
    buckets are in Redis: each replica spaces its own callers; replicas that refuse the
    same bucket at once can still tell two callers one slot, as before, but no longer
    their every caller. Kept in memory only, they cost no round trip.
    """

    __slots__ = ("_tat",)

    def __init__(self) -> None:
        self._tat: dict[str, float] = {}

    def told(self, bucket: str, wait: float, amount: float, limit: float, period_s: float,
             now: float) -> float:
        """The wait to tell a refusal of ``amount`` units from ``bucket`` (``limit`` per
        ``period_s`` seconds) whose own wait is ``wait`` seconds at ``now`` (monotonic
        seconds), recording it as promised. Never less than ``wait``."""
        interval = period_s / limit
        # The TAT at which this caller conforms by the bucket's level alone.
        own = now + wait + (limit - amount) * interval
        # Promises run at most one period past it: callers that ignore their waits take
        # units as they free, and their refusals would push everyone else's further without
        # end (a review: 409 s told on 2/s, x-should-retry false, after two minutes).
        tat = min(max(self._tat.get(bucket, -math.inf), own), own + period_s)
        tats = self._tat
        if bucket not in tats and len(tats) >= PROMISES_KEPT:
            for name in [name for name, at in tats.items() if at <= now]:
                del tats[name]
            if len(tats) >= PROMISES_KEPT:  # the oldest promised first, not every bucket's
                del tats[next(iter(tats))]
        tats[bucket] = tat + amount * interval
        return max(wait, tat - (limit - amount) * interval - now)


def fits_whole(amount: int, tokens: Rate) -> None:
    """Refuse a call reserving ``amount`` tokens from a token rate ``tokens`` whose whole
    bucket is smaller: it could never pass, so no wait is given.

    Raises:
        Rejected: ``exceeds_limit`` (400).
    """
    if amount > tokens.count:
        raise Rejected(
            Reason.EXCEEDS_LIMIT, None,
            f"this request reserves {counted(amount, 'token')}, more than the whole "
            f"token rate limit of {tokens}; lower max_tokens",
        )


class RateLimiter:
    """The ``rate`` block of one route: a route-wide bucket, one bucket per tenant and the
    route's token bucket, kept in ``backends.rates`` under the route's name.

    Args:
        config: the route's ``rate`` block.
        backends: where the buckets live (memory or Redis) and what to do when it is down.
        group: the route's name; every bucket of the route is in this group (one Redis slot).
        protocol: the route's protocol; on ``openai``/``anthropic`` routes with a token rate,
            metered calls leave their request units to :mod:`policies.accounting`, which
            takes them with the tokens in one call.
        operation: the operation block's name (a model, a tool, an endpoint) for an
            operation's ``rate``, ``None`` for the route's: it prefixes the policy names its
            refusals give (:func:`name_of`).
    """

    def __init__(self, config: RateConfig, backends: StateBackends, group: str,
                 protocol: str | None = None, operation: str | None = None) -> None:
        self.backends = backends
        self.group = group
        self.protocol = protocol
        self.operation = operation
        self.background = Background(backends)
        #: The route's buckets when its state is this process's memory: the request path
        #: takes from them directly (:meth:`MemoryRateBuckets.take`, nothing to await).
        self.memory = backends.rates if isinstance(backends.rates, MemoryRateBuckets) else None
        #: Metered calls' request units are taken by the accounting step, with their tokens
        #: and budget holds in the same round trip (:mod:`policies.accounting` sets it).
        self.metered_elsewhere = False
        #: The route bucket's whole units left as the shared state last answered (Redis),
        #: for the admin API; ``None`` before any answer.
        self.available: int | None = None
        #: This limiter's name among the replicas' in Redis: each shared bucket is checked
        #: and drained by the lowest rate that live holders took from it with (a reload
        #: reaches replicas one at a time). The same across a reload, so the new rate
        #: replaces this replica's old one at its next admission.
        self.holder = Holder(new_lease_id(), backends.lease_s)
        #: The waits told to refused callers, per bucket (kept across a reload).
        self.promises = Promises()
        self.reconfigure(config)

    def reconfigure(self, config: RateConfig) -> None:
        """Adopt a changed ``rate`` block in place (hot reload). Levels are kept: they live in
        the state backend under names a rate change does not touch, and drain at the new rate
        from where they stood. With Redis, the new rates are recorded (under the same
        :attr:`holder`) at the next admission; until every replica has reloaded, the lowest
        of theirs applies."""
        self.requests: Rate | None = config.requests
        self.tokens: Rate | None = config.tokens
        per_tenant = config.per_tenant
        self.tenant_rate: Rate | None = per_tenant.requests if per_tenant else None
        #: Each tenant's request units, built once (:meth:`request_units`); a reload
        #: rebuilds them from the new rates.
        self._tenants: dict[str, RequestUnits] = {}

    def state(self) -> dict[str, object]:
        """Limits for the admin API (JSON-ready), with the requests the route bucket can
        admit now (as of the last answer, for a Redis bucket: reading it would be a round
        trip)."""
        requests = None
        if self.requests is not None:
            rate = self.requests
            take = Take(REQUESTS, rate.count, float(rate.period_s))
            if self.backends.redis is None:
                available = finish_now(self.backends.rates.available(self.group, [take]))[0]
            else:
                available = rate.count if self.available is None else self.available
            requests = {"rate": str(rate), "available": available}
        return {
            "requests": requests,
            "tokens": None if self.tokens is None else str(self.tokens),
            "per_tenant": None if self.tenant_rate is None else str(self.tenant_rate),
            "backend": self.backends.kind,
        }

    async def admit(self, call: Call) -> RequestUnits | Units | None:
        """The pipeline step (:class:`policies.pipeline.Policy`): one request unit from the
        tenant's bucket and the route's, in one atomic call. Held as the tenant's
        :class:`RequestUnits` on a memory route, else as :class:`Units`.

        Raises:
            Rejected: ``rate_limited`` from the bucket with the longest wait (nothing is held),
                ``rate_buckets_full`` (:func:`buckets_full`), or ``state_unavailable``
                (``on_unavailable: reject``).
        """
        if self.metered_elsewhere and self.protocol is not None and endpoint_for(
                self.protocol, call.method, call.path) is not None:
            # The accounting step takes the units with the tokens and budget: told per call,
            # as a reload may change the flag before that step runs (Call.units_deferred).
            call.units_deferred = True
            return None
        units = self._tenants.get(call.tenant)
        if units is None:
            units = self.request_units(call.tenant)
            if units is None:
                return None
        memory = self.memory
        if memory is None:
            return await self.take(units.takes)
        try:
            refused = memory.take(units.plan)
        except RateBucketsFull as exc:
            raise buckets_full(exc) from None
        if refused is not None:
            raise self._refusal(units.takes, refused, False)
        return units

    def request_units(self, tenant: str) -> RequestUnits | None:
        """The tenant's :class:`RequestUnits`, built and kept (``None``: no request rate)."""
        units = self._tenants.get(tenant)
        if units is not None:
            return units
        takes: list[Take] = []
        if self.tenant_rate is not None:
            takes.append(Take(TENANT_PREFIX + tenant, self.tenant_rate.count,
                              float(self.tenant_rate.period_s)))
        if self.requests is not None:
            takes.append(Take(REQUESTS, self.requests.count, float(self.requests.period_s)))
        if not takes:
            return None
        if len(self._tenants) >= TAKES_KEPT:  # many tenants: start over
            self._tenants.clear()
        units = self._tenants[tenant] = RequestUnits(
            tuple(takes), memory_plan(self.group, takes), self.memory)
        return units

    def request_takes(self, tenant: str) -> list[Take]:
        """One request unit from the tenant's bucket and the route's (those configured)."""
        units = self.request_units(tenant)
        return [] if units is None else list(units.takes)

    def token_take(self, amount: int) -> Take:
        """``amount`` tokens from the route's token bucket (``rate.tokens`` must be set).

        Raises:
            Rejected: ``exceeds_limit`` (400) when ``amount`` exceeds the whole bucket: it
                could never pass.
        """
        rate = self.tokens
        assert rate is not None
        fits_whole(amount, rate)
        return Take(TOKENS, rate.count, float(rate.period_s), amount)

    async def take(self, takes: Sequence[Take]) -> Units:
        """Take every bucket's amount in one call, all or none.

        With the shared state unavailable, ``on_unavailable: local`` takes from this
        replica's memory with each limit's share (``state.replicas``); ``reject`` refuses.

        Raises:
            Rejected: ``rate_limited`` / ``token_rate_limited`` with the wait of the slowest
                bucket; ``rate_buckets_full``; ``state_unavailable``. Nothing is held.
            asyncio.CancelledError: the caller left; units a Redis take took are refunded
                once its reply arrives.
        """
        backends = self.backends
        try:
            if backends.redis is None:  # memory: nothing suspends, so no caller leaves midway
                result = await backends.rates.admit(self.group, takes, self.holder)
            else:
                # A caller leaving while Redis runs the script does not cut it: it ends in the
                # background and what it took is given back once its reply says so
                # (:meth:`_left`). A take whose reply never comes (StateUnavailable) may
                # still have taken units there: they drain within one period, so the error
                # is a refusal, never excess.
                result = await survive_leaving(
                    backends.rates.admit(self.group, takes, self.holder),
                    lambda late: self._left(late, takes), self.background.spawn)
            source = backends
        except StateUnavailable as exc:
            source = fallback_for(backends, exc)
            takes = self.local_takes(takes)
            try:  # the local fallback is memory buckets, with their own cap
                result = await source.rates.admit(self.group, takes)
            except RateBucketsFull as full:
                raise buckets_full(full) from None
        except RateBucketsFull as exc:  # memory: raised before anything was taken
            raise buckets_full(exc) from None
        self.note(source, takes, result)
        if not result.admitted:
            raise self.refusal(takes, result, source)
        return Units(self, source, takes)

    def _left(self, result: RateResult, takes: Sequence[Take]) -> None:
        """Refund the units a take whose caller left before its reply took (``result``, the
        late reply). Only a reply saying they were taken is acted on: a refund is not
        idempotent, so one for a take that took nothing would free units others hold."""
        if result.admitted:
            Units(self, self.backends, takes).release(None)

    def local_takes(self, takes: Sequence[Take]) -> list[Take]:
        """``takes`` with this replica's share of each limit (``state.replicas``), for the
        local fallback."""
        fallback = self.backends.fallback
        return [take._replace(limit=fallback.whole_share(take.limit)) for take in takes]

    def note(self, source: StateBackends, takes: Sequence[Take], result: RateResult) -> None:
        """Keep what the shared buckets answered about the route bucket (admin API; memory
        buckets are read there instead)."""
        if (source is self.backends and self.requests is not None
                and source.redis is not None):
            for take, left in zip(takes, result.remaining, strict=True):
                if take.name == REQUESTS:
                    self.available = left

    def refusal(self, takes: Sequence[Take], result: RateResult, source: StateBackends
                ) -> Rejected:
        """The refusal for the bucket ``result`` names (``result.denied`` is set)."""
        return self._refusal(takes, result, source is not self.backends)

    def _refusal(self, takes: Sequence[Take], result: RateResult, local: bool) -> Rejected:
        assert result.denied is not None
        take = takes[result.denied]
        rate = self.tokens if take.name == TOKENS else (
            self.requests if take.name == REQUESTS else self.tenant_rate)
        share = (f" (this replica's share, {take.limit}, while the shared state is "
                 "unavailable)" if local else "")
        left = result.remaining[result.denied]  # RateLimit's r: under this request's need
        # The rate that refused: this replica's, or the lowest another live replica holds.
        quota, window, limit, why = take.limit, int(take.period_s), str(rate), share
        lower = result.applied
        if lower is not None and _differs(lower, take):
            quota, window = max(1, round(lower[0])), max(1, round(lower[1]))
            limit = rate_text(quota, window)
            why = f" (the lowest rate a live replica holds; this replica's is {rate})"
        policy = (name_of(take.name, self.operation), quota, window, left)
        wait = result.retry_after_s
        if not math.isinf(wait) and take.amount <= quota:
            checked = (take.limit, take.period_s) if lower is None else lower
            wait = self.promises.told(take.name, wait, take.amount, checked[0], checked[1],
                                      time.monotonic())
        if take.name != TOKENS:
            return Rejected(Reason.RATE_LIMITED, wait, f"limit {limit}{why}", policy)
        reserves = int(take.amount)
        if math.isinf(result.retry_after_s):
            # Only a local share is this small: a whole limit was checked by token_take,
            # and one over another replica's lower rate only waits for its record to lapse.
            # It fits once the shared state answers: not a 400, which says never to retry.
            redis = self.backends.redis
            return Rejected(Reason.STATE_UNAVAILABLE,
                            1.0 if redis is None
                            else outage_hint(redis.probe_interval_s, redis.health.down_for()),
                            f"this request reserves {counted(reserves, 'token')}, more than "
                            f"this replica's share ({take.limit:g}) of the token rate limit of "
                            f"{rate} while the shared state does not answer; it fits once "
                            "that answers")
        if take.amount > quota:  # fits this replica's rate once the lower one lapses
            return Rejected(Reason.TOKEN_RATE_LIMITED, result.retry_after_s,
                            f"this request reserves {counted(reserves, 'token')}, more than "
                            f"{limit}{why}: it fits once that replica reloads or its rate lapses",
                            policy)
        return Rejected(Reason.TOKEN_RATE_LIMITED, wait,
                        f"limit {limit} tokens{why}; this request reserves {reserves}", policy)


def name_of(bucket: str, operation: str | None = None) -> str:
    """A bucket's name in ``RateLimit-Policy``: ``requests``, ``requests-per-tenant``,
    ``tokens``; an operation's (``operation``: its block's name) prefixed by it and a colon,
    ``gpt-4o:requests``. The draft (draft-ietf-httpapi-ratelimit-headers, "RateLimit-Policy")
    asks each policy's name to identify it: an operation's rate beside its route's, both
    named ``requests``, could not be told apart (a hostile trial)."""
    name = bucket if bucket in (REQUESTS, TOKENS) else "requests-per-tenant"
    return name if operation is None else f"{operation}:{name}"


#: Config's rate units by their period (``N/min``), to name a rate the replicas applied.
_UNITS = {1: "s", 60: "min", 3600: "h", 86400: "day"}


def rate_text(count: int, period_s: int) -> str:
    """``count`` per ``period_s`` as the config writes it (``120/min``), else ``5 per 30s``
    (a limit and an interval from two replicas' rates)."""
    unit = _UNITS.get(period_s)
    return f"{count}/{unit}" if unit is not None else f"{count} per {period_s}s"


def _differs(applied: tuple[float, float], take: Take) -> bool:
    """Whether the rate a bucket applied is not ``take``'s own (float rounding aside)."""
    limit, period_s = applied
    return (abs(limit - take.limit) > 1e-9 * take.limit
            or abs(period_s - take.period_s) > 1e-9 * take.period_s)
