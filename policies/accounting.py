"""Token accounting of one request on an ``openai`` or ``anthropic`` route, end to end.

The request path (:mod:`proxy.handler`) calls, in order:

1. :meth:`Accounting.open`: is this a metered call (:func:`policies.usage.endpoint_for`)? Read
   its body once (model, output cap, stream), maybe rewrite it (default cap, usage option).
2. :meth:`Accounting.reserve`: take its worst case from the token rate (``rate.tokens``) and
   reserve it on the budgets (``budget``), or raise :class:`~policies.reasons.Rejected`.
3. If admission fails later (queue full, caller gone): :meth:`Charge.release` gives it all back.
4. While forwarding, :attr:`Charge.meter` reads the answer's usage as it passes.
5. In the handler's ``finally``, whatever happened: :meth:`Charge.settle` replaces the
   reservation by what was used, counts tokens and cost, and returns the ``completed``
   event's fields. It never awaits.

What is charged (``usage`` in the event):

* ``reported``: the upstream's own count, whenever the answer carried one.
* ``none`` (0): the request never reached the upstream (connection refused), or the upstream
  answered an error status in full: providers bill neither.
* ``estimated``: a stream cut before its usage arrived (caller gone, upstream cut or stalled):
  the input (the upstream's count if it came, else the estimate) and the output streamed so
  far, at least 1 token and at most the cap; never 0.
* ``reserved``: anything else without a count (a complete answer without usage, a timeout
  before the answer, a proxy error): the whole reservation, since the upstream may have
  billed it all.

The last two count in ``sluice_usage_missing_total``: missing usage is never counted as zero.
"""

from __future__ import annotations

from collections.abc import Callable

from policies.budget import Budgets, Reservation, price_usd
from policies.config import ModelPrice, RouteConfig
from policies.rate import TokenBucket
from policies.reasons import Reason, Rejected
from policies.usage import Meter, RequestCost, Usage, endpoint_for, read_request
from proxy.metrics import OTHER_TENANT, Metrics, RouteMetrics

#: Label of the per-route budget's gauges, which belong to no tenant.
ROUTE_SCOPE_LABEL = "*"


class Accounting:
    """The token accounting of one route.

    Args:
        config: the route's config (protocol, ``usage``).
        pricing: the top-level ``pricing`` table.
        token_bucket: the route's ``rate.tokens`` bucket, if any.
        budgets: the route's budgets, if any.
        metrics: the server's series; ``route_metrics`` the route's bound ones.
        run_header: the header naming a run, for the message when it is missing.
    """

    def __init__(self, config: RouteConfig, pricing: dict[str, ModelPrice],
                 token_bucket: TokenBucket | None, budgets: Budgets | None, metrics: Metrics,
                 route_metrics: RouteMetrics, run_header: str) -> None:
        self.protocol = config.protocol
        self.anthropic = config.protocol == "anthropic"
        usage = config.usage
        self.default_cap = usage.default_max_tokens
        self.write_cap = usage.write_max_tokens
        self.stream_usage = usage.stream_usage
        self.pricing = pricing
        self.token_bucket = token_bucket
        self.budgets = budgets
        self.enforcing = token_bucket is not None or budgets is not None
        self.metrics = metrics
        self.route_metrics = route_metrics
        self.run_header = run_header
        self._gauged: set[str] = set()
        self._tenant_units: list[str] = []
        if budgets is not None:
            units: dict[tuple[str, str], None] = {}
            for limit in budgets.limits:
                if limit.per in ("tenant", "route"):
                    units[limit.per, limit.unit] = None
            self._tenant_units = [unit for per, unit in units if per == "tenant"]
            for per, unit in units:
                if per == "route":
                    self._gauge(ROUTE_SCOPE_LABEL, "route", "", unit)

    def state(self) -> dict[str, object]:
        """Budget left now, per tenant seen (within the label cap) and per route, for the
        admin API (JSON-ready; tokens or USD by unit)."""
        budgets = self.budgets
        if budgets is None:
            return {"budget_remaining": None}
        per_route = {unit: round(budgets.remaining(unit, "route", ""), 6)
                     for limit in budgets.limits if limit.per == "route"
                     for unit in (limit.unit,)}
        per_tenant = {
            tenant: {unit: round(budgets.remaining(unit, "tenant", tenant), 6)
                     for unit in self._tenant_units}
            for tenant in sorted(self._gauged)
        }
        return {"budget_remaining": {"route": per_route or None, "tenants": per_tenant}}

    def open(self, method: str, raw_path: str, body: bytes, tenant: str,
             run: str | None) -> Charge | None:
        """Read a request; ``None`` if it is not a metered call (it then passes unmetered).

        Raises:
            Rejected: ``bad_request`` on a route with token limits, when the body is not JSON,
                names no output cap (and no default is configured), or a per-run budget
                applies and no run id was sent.
        """
        endpoint = endpoint_for(self.protocol, method, raw_path)
        if endpoint is None:
            return None
        try:
            cost = read_request(endpoint, body, self.default_cap, self.write_cap,
                                self.stream_usage)
        except ValueError as exc:
            if not self.enforcing:
                return None
            raise Rejected(Reason.BAD_REQUEST, None,
                           f"{exc}; this route limits tokens, so Sluice must read it") from None
        if self.enforcing:
            if cost.output_cap is None:
                raise Rejected(
                    Reason.BAD_REQUEST, None,
                    f"set {endpoint.cap_fields[0]}: this route limits tokens and configures "
                    f"no usage.default_max_tokens",
                )
            if run is None and self.budgets is not None and self.budgets.needs_run:
                raise Rejected(Reason.BAD_REQUEST, None,
                               f"send the {self.run_header} header: this route budgets per run")
        return Charge(self, cost, tenant, run)

    async def reserve(self, charge: Charge) -> None:
        """Take the request's worst case from the token rate and the budgets.

        Raises:
            Rejected: from :meth:`TokenBucket.take` or :meth:`Budgets.reserve`; nothing is
                left held.
        """
        cost = charge.cost
        cap = cost.output_cap or 0
        bucket = self.token_bucket
        if bucket is not None:
            worst = cost.input_tokens + cap
            bucket.take(worst)
            charge.rate_tokens = worst
        budgets = self.budgets
        if budgets is None:
            return
        try:
            charge.reservation = await budgets.reserve(
                charge.tenant, charge.run, cost.model, cost.input_tokens, cap)
        except BaseException:
            charge.release()
            raise
        charge.meter.headers = budgets.headers(charge.reservation)
        if self._tenant_units and charge.tenant not in self._gauged:
            self._watch(charge.tenant)

    def _watch(self, tenant: str) -> None:
        """Export a tenant's remaining budget, unless it is beyond the label cap (then it has
        no gauges: one ``other`` series could not say whose budget it is)."""
        if self.route_metrics.tenant(tenant).label == OTHER_TENANT:
            return
        self._gauged.add(tenant)
        for unit in self._tenant_units:
            self._gauge(tenant, "tenant", tenant, unit)

    def _gauge(self, label: str, per: str, tenant: str, unit: str) -> None:
        budgets = self.budgets
        assert budgets is not None
        route = self.route_metrics.name
        self.metrics.budget_remaining.labels(route, label, unit).set_function(
            _reader(budgets.remaining, unit, per, tenant))
        self.metrics.budget_reserved.labels(route, label, unit).set_function(
            _reader(budgets.reserved, unit, per, tenant))


def _reader(read: Callable[[str, str, str], float], unit: str, per: str,
            tenant: str) -> Callable[[], float]:
    return lambda: read(unit, per, tenant)


class Charge:
    """One metered request, from reading to settling (see the module docstring).

    Attributes:
        cost: what was read from the request.
        meter: reads the answer; handed to :func:`proxy.forward.forward`.
        reservation: held on the budgets, if any.
        rate_tokens: taken from the token rate, if any.
    """

    __slots__ = ("_acct", "_open", "cost", "meter", "rate_tokens", "reservation", "run",
                 "tenant")

    def __init__(self, acct: Accounting, cost: RequestCost, tenant: str, run: str | None):
        self._acct = acct
        self._open = True
        self.cost = cost
        self.tenant = tenant
        self.run = run
        self.meter = Meter(cost.endpoint, acct.anthropic, cost.strip_usage)
        self.reservation: Reservation | None = None
        self.rate_tokens = 0

    @property
    def body(self) -> bytes:
        """The body to forward."""
        return self.cost.body

    def release(self) -> None:
        """The request will not be forwarded: give back its tokens and its reservation."""
        if not self._open:
            return
        self._open = False
        acct = self._acct
        if self.rate_tokens and acct.token_bucket is not None:
            acct.token_bucket.refund(self.rate_tokens)
        if self.reservation is not None and acct.budgets is not None:
            acct.budgets.settle(self.reservation, None)

    def settle(self, outcome: str) -> dict[str, object]:
        """Charge what was used (see the module docstring); returns event fields. Never awaits.

        Args:
            outcome: the ``sluice_requests_total`` outcome of the request.
        """
        if not self._open:
            return {}
        self._open = False
        acct = self._acct
        usage, source = self._used(outcome)
        if source in ("estimated", "reserved"):
            acct.route_metrics.usage_missing.inc()
        if self.reservation is not None and acct.budgets is not None:
            acct.budgets.settle(self.reservation, usage)
        model = self.cost.model
        price = acct.pricing.get(model) if model is not None else None
        usd = price_usd(price, usage) if price is not None else None
        series = acct.route_metrics.tenant(self.tenant)
        if usage.input_tokens:
            series.input_tokens.inc(usage.input_tokens)
        if usage.output_tokens:
            series.output_tokens.inc(usage.output_tokens)
        if usd:
            series.cost.inc(usd)
        return {
            "model": model,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cost_usd": None if usd is None else round(usd, 9),
            "usage": source,
        }

    def _used(self, outcome: str) -> tuple[Usage, str]:
        meter = self.meter
        cost = self.cost
        if not meter.sent:
            return Usage(), "none"
        if meter.final:
            return meter.usage, "reported"
        status = meter.status
        if status >= 400 and meter.complete:
            return Usage(), "none"
        cap = cost.output_cap
        if (cost.stream and not meter.complete and status < 400
                and (status or outcome == "client_disconnected")):
            seen = meter.usage
            output = max(seen.output_tokens, meter.streamed_tokens, 1)
            if cap is not None:
                output = min(output, cap)
            return Usage(seen.input_tokens or cost.input_tokens, output,
                         seen.cache_read_tokens, seen.cache_write_tokens), "estimated"
        return Usage(cost.input_tokens, cap or 0), "reserved"
