"""Request rate limits per route and per tenant (config key ``rate``).

A rate ``N/period`` is an aiolimiter leaky bucket of size ``N`` draining at ``N/period`` per
second: a burst of up to ``N`` passes, then requests pass at the steady rate. A request that
finds no capacity is answered 429 ``rate_limited`` at once; it never waits in the bucket, so a
caller is never left hanging by a rate limit.

``Retry-After`` is the time until the bucket has drained enough for one more request:
``(level + 1 - N) / (N / period)`` seconds (the RFC 6585 meaning of 429's Retry-After).
aiolimiter exposes no public reading of its level, so this reads ``_level`` right after the
public ``has_capacity()`` has brought it up to date; the version is pinned for that reason.

On a config reload (:meth:`RateLimiter.reconfigure`) a bucket whose rate is unchanged is kept as
it is; one whose rate changed is replaced by a bucket of the new size that starts at the old
one's level, so a reload neither forgets recent traffic nor grants a fresh burst.

``tokens: N/period`` is the same bucket counting tokens: each request takes its *reserved*
worst case (estimated input + output cap) at admission, as OpenAI counts ``max_tokens`` against
its own tokens-per-minute limit when a request arrives, so Sluice refuses what the upstream
would. Nothing is given back after the answer (aiolimiter has no refund, and the upstream does
not refund either); only a request refused later in admission, which never reached the
upstream, gets its tokens back. A request reserving more than ``N`` could never pass (and
``acquire(n > N)`` raises in aiolimiter): it is refused at once with 400 ``exceeds_limit``.
"""

from __future__ import annotations

from collections import OrderedDict

from aiolimiter import AsyncLimiter

from policies.config import Rate, RateConfig
from policies.pipeline import Call, Outcome
from policies.reasons import Reason, Rejected

#: Tenants whose buckets are kept; beyond it the least recently seen *idle* ones are dropped.
MAX_TENANT_BUCKETS = 10_000


class Bucket:
    """One ``N/period`` limit. ``take()`` admits one request or raises ``Rejected``."""

    __slots__ = ("_limiter", "policy", "rate")
    #: Why a request this bucket cannot hold is refused.
    reason = Reason.RATE_LIMITED

    def __init__(self, rate: Rate, policy_name: str) -> None:
        self.rate = rate
        self._limiter = AsyncLimiter(rate.count, rate.period_s)
        self.policy = (policy_name, rate.count, rate.period_s)

    def successor(self, rate: Rate | None) -> Bucket | None:
        """The bucket to use after a reload sets this limit to ``rate`` (``None``: no limit).

        Same rate: this very bucket. Another rate: a new bucket carrying this one's level (what
        it counts as recent), which then drains at the new rate.
        """
        if rate is None or rate == self.rate:
            return None if rate is None else self
        new = type(self)(rate, self.policy[0])
        old = self._limiter
        old.has_capacity()  # brings _level and _last_check up to now
        new._limiter._level = old._level
        new._limiter._last_check = old._last_check
        return new

    def take(self, amount: int = 1) -> None:
        """Consume ``amount`` (requests, or tokens for ``rate.tokens``); never suspends.

        Raises:
            Rejected: ``self.reason`` with the seconds until ``amount`` fits.
        """
        limiter = self._limiter
        if limiter.has_capacity(amount):
            limiter._level += amount  # what acquire(amount) does when it does not wait
            return
        deficit = limiter._level + amount - limiter.max_rate
        raise Rejected(
            self.reason,
            deficit * limiter.time_period / limiter.max_rate,
            self._detail(amount),
            self.policy,
        )

    def _detail(self, amount: int) -> str:
        return f"limit {self.rate}"

    def refund(self, amount: int = 1) -> None:
        """Give back what a request took when another limit then refused it, or it never
        reached the upstream."""
        limiter = self._limiter
        limiter.has_capacity(0)  # drains the bucket up to now
        limiter._level = max(limiter._level - amount, 0.0)

    def state(self) -> dict[str, object]:
        """The rate as written and the requests it can admit right now."""
        limiter = self._limiter
        limiter.has_capacity()  # brings _level up to now
        available = int(max(0.0, limiter.max_rate - limiter._level))
        return {"rate": str(self.rate), "available": available}

    @property
    def idle(self) -> bool:
        """True when the bucket has drained empty, so dropping it forgets nothing."""
        return self._limiter.has_capacity(self.rate.count)


class TokenBucket(Bucket):
    """``rate.tokens``: ``take(n)`` admits a request reserving ``n`` tokens or raises."""

    __slots__ = ()
    reason = Reason.TOKEN_RATE_LIMITED

    def __init__(self, rate: Rate, policy_name: str = "tokens") -> None:
        super().__init__(rate, policy_name)

    def take(self, amount: int = 1) -> None:
        """Consume ``amount`` tokens; never suspends.

        Raises:
            Rejected: ``exceeds_limit`` if ``amount`` exceeds the whole bucket (it could never
                pass, and aiolimiter's ``acquire`` would raise); ``token_rate_limited`` with
                the seconds until it fits.
        """
        if amount > self._limiter.max_rate:
            raise Rejected(
                Reason.EXCEEDS_LIMIT, None,
                f"this request reserves {amount} tokens, more than the whole token rate "
                f"limit of {self.rate}; lower max_tokens", retry=False,
            )
        super().take(amount)

    def _detail(self, amount: int) -> str:
        return f"limit {self.rate} tokens; this request reserves {amount}"


class Units:
    """The request units one call took (a :class:`policies.pipeline.Holding`): kept when the
    request reached the upstream (it was served), given back when it never did (refused by a
    later step, or its caller left first), so refused calls do not burn a tenant's quota."""

    __slots__ = ("route", "tenant")

    def __init__(self, tenant: Bucket | None, route: Bucket | None) -> None:
        self.tenant = tenant
        self.route = route

    def release(self, outcome: Outcome) -> None:
        if outcome.reached:
            return
        if self.tenant is not None:
            self.tenant.refund()
        if self.route is not None:
            self.route.refund()


class RateLimiter:
    """The ``rate`` block of one route: a route-wide bucket and one bucket per tenant, and the
    route's token bucket (used by :mod:`policies.accounting`)."""

    def __init__(self, config: RateConfig) -> None:
        self.tokens = TokenBucket(config.tokens) if config.tokens else None
        self.route_bucket = Bucket(config.requests, "requests") if config.requests else None
        per_tenant = config.per_tenant
        self.tenant_rate = per_tenant.requests if per_tenant else None
        self._tenants: OrderedDict[str, Bucket] = OrderedDict()

    def reconfigure(self, config: RateConfig) -> None:
        """Adopt a changed ``rate`` block in place, keeping each request bucket's level (hot
        reload), the token bucket's too."""
        if self.tokens is not None:
            self.tokens = self.tokens.successor(config.tokens)
        elif config.tokens is not None:
            self.tokens = TokenBucket(config.tokens)
        if self.route_bucket is not None:
            self.route_bucket = self.route_bucket.successor(config.requests)
        elif config.requests is not None:
            self.route_bucket = Bucket(config.requests, "requests")
        per_tenant = config.per_tenant
        self.tenant_rate = per_tenant.requests if per_tenant else None
        if self.tenant_rate is None:
            self._tenants.clear()
        else:
            for name, bucket in self._tenants.items():
                self._tenants[name] = bucket.successor(self.tenant_rate)

    def state(self) -> dict[str, object]:
        """Limits and fill levels for the admin API (JSON-ready)."""
        return {
            "requests": None if self.route_bucket is None else self.route_bucket.state(),
            "tokens": None if self.tokens is None else str(self.tokens.rate),
            "per_tenant": None if self.tenant_rate is None else str(self.tenant_rate),
            "tenants_tracked": len(self._tenants),
        }

    async def admit(self, call: Call) -> Units | None:
        """The pipeline step (:class:`policies.pipeline.Policy`): one request unit from the
        tenant's bucket, then the route's, held as :class:`Units`. Never suspends.

        The tenant is checked first so one tenant's burst is refused before it drains the
        route-wide bucket that every tenant shares; a request the route then refuses gets the
        tenant's unit back, since it was never served.

        Raises:
            Rejected: ``rate_limited`` from whichever bucket is empty; nothing is held.
        """
        route_bucket = self.route_bucket
        if self.tenant_rate is None:
            if route_bucket is None:
                return None
            route_bucket.take()
            return Units(None, route_bucket)
        bucket = self._tenant_bucket(call.tenant)
        bucket.take()
        if route_bucket is not None:
            try:
                route_bucket.take()
            except Rejected:
                bucket.refund()
                raise
        return Units(bucket, route_bucket)

    def _tenant_bucket(self, tenant: str) -> Bucket:
        bucket = self._tenants.get(tenant)
        if bucket is None:
            if len(self._tenants) >= MAX_TENANT_BUCKETS:
                self._evict_idle()
            bucket = self._tenants[tenant] = Bucket(self.tenant_rate, "requests-per-tenant")
        else:
            self._tenants.move_to_end(tenant)
        return bucket

    def _evict_idle(self) -> None:
        for name in [name for name, bucket in self._tenants.items() if bucket.idle]:
            del self._tenants[name]
        while len(self._tenants) >= MAX_TENANT_BUCKETS:
            self._tenants.popitem(last=False)
