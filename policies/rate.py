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

from policies.reasons import Reason, Rejected
from proxy.config import Rate, RateConfig

#: Tenants whose buckets are kept; beyond it the least recently seen *idle* ones are dropped.
MAX_TENANT_BUCKETS = 10_000


class Bucket:
    """One ``N/period`` limit. ``take()`` admits one request or raises ``Rejected``."""

    __slots__ = ("_limiter", "policy", "rate")

    def __init__(self, rate: Rate, policy_name: str) -> None:
        self.rate = rate
        self._limiter = AsyncLimiter(rate.count, rate.period_s)
        self.policy = (policy_name, rate.count, rate.period_s)

    def successor(self, rate: Rate | None) -> Bucket | None:
        """The bucket to use after a reload sets this limit to ``rate`` (``None``: no limit).

        Same rate: this very bucket. Another rate: a new bucket carrying this one's level (the
        requests it counts as recent), which then drains at the new rate.
        """
        if rate is None or rate == self.rate:
            return None if rate is None else self
        new = Bucket(rate, self.policy[0])
        old = self._limiter
        old.has_capacity()  # brings _level and _last_check up to now
        new._limiter._level = old._level
        new._limiter._last_check = old._last_check
        return new

    def take(self) -> None:
        """Consume one request's capacity; never suspends.

        Raises:
            Rejected: ``rate_limited`` with the seconds until capacity returns.
        """
        limiter = self._limiter
        if limiter.has_capacity(1):
            limiter._level += 1  # what acquire(1) does when it does not wait
            return
        deficit = limiter._level + 1 - limiter.max_rate
        raise Rejected(
            Reason.RATE_LIMITED,
            deficit * limiter.time_period / limiter.max_rate,
            f"limit {self.rate}",
            self.policy,
        )

    def state(self) -> dict[str, object]:
        """The rate as written and the requests it can admit right now."""
        limiter = self._limiter
        limiter.has_capacity()  # brings _level up to now
        available = int(max(0.0, limiter.max_rate - limiter._level))
        return {"rate": str(self.rate), "available": available}

    def give_back(self) -> None:
        """Undo the ``take()`` just made, for a request another limit then refused."""
        self._limiter._level -= 1

    @property
    def idle(self) -> bool:
        """True when the bucket has drained empty, so dropping it forgets nothing."""
        return self._limiter.has_capacity(self.rate.count)


class TokenBucket:
    """``rate.tokens``: ``take(n)`` admits a request reserving ``n`` tokens or raises."""

    __slots__ = ("_limiter", "policy", "rate")

    def __init__(self, rate: Rate) -> None:
        self.rate = rate
        self._limiter = AsyncLimiter(rate.count, rate.period_s)
        self.policy = ("tokens", rate.count, rate.period_s)

    def take(self, tokens: int) -> None:
        """Consume ``tokens``; never suspends.

        Raises:
            Rejected: ``exceeds_limit`` if ``tokens`` exceeds the whole bucket;
                ``token_rate_limited`` with the seconds until it fits.
        """
        limiter = self._limiter
        if tokens > limiter.max_rate:
            raise Rejected(
                Reason.EXCEEDS_LIMIT, None,
                f"this request reserves {tokens} tokens, more than the whole token rate "
                f"limit of {self.rate}; lower max_tokens", retry=False,
            )
        if limiter.has_capacity(tokens):
            limiter._level += tokens  # what acquire(tokens) does when it does not wait
            return
        deficit = limiter._level + tokens - limiter.max_rate
        raise Rejected(
            Reason.TOKEN_RATE_LIMITED,
            deficit * limiter.time_period / limiter.max_rate,
            f"limit {self.rate} tokens; this request reserves {tokens}",
            self.policy,
        )

    def refund(self, tokens: int) -> None:
        """Give back what a request took when it never reached the upstream."""
        limiter = self._limiter
        limiter.has_capacity(0)  # drains the bucket up to now
        limiter._level = max(limiter._level - tokens, 0.0)


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
        reload); a changed ``tokens`` rate starts a fresh token bucket."""
        if config.tokens != (self.tokens.rate if self.tokens else None):
            self.tokens = TokenBucket(config.tokens) if config.tokens else None
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

    def admit(self, tenant: str) -> None:
        """Charge one request to the tenant's bucket, then the route's.

        The tenant is checked first so one tenant's burst is refused before it drains the
        route-wide bucket that every tenant shares; a request the route then refuses gets the
        tenant's unit back, since it was never served.

        Raises:
            Rejected: ``rate_limited`` from whichever bucket is empty.
        """
        if self.tenant_rate is None:
            if self.route_bucket is not None:
                self.route_bucket.take()
            return
        bucket = self._tenant_bucket(tenant)
        bucket.take()
        if self.route_bucket is not None:
            try:
                self.route_bucket.take()
            except Rejected:
                bucket.give_back()
                raise

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
