"""Token accounting of one request on an ``openai`` or ``anthropic`` route, end to end.

It is one step of the admission pipeline (:mod:`policies.pipeline`):

1. :meth:`Accounting.admit` reads the call's body once (model, output cap, stream) if it is a
   metered call (:func:`policies.usage.endpoint_for`), maybe rewrites it (default cap, usage
   option), then, in one atomic call to the route's state (one Redis round trip,
   :mod:`policies.state.admission`), takes the request units of ``rate.requests`` and
   ``rate.per_tenant`` and its worst case from the token rate (``rate.tokens``), and
   reserves that worst case on the budgets (``budget``); or raises
   :class:`~policies.reasons.Rejected`, naming the limit with the longest wait. It leaves the
   :class:`Charge` held, its meter on ``call.meter``.
2. While forwarding, the meter reads the answer's usage as it passes.
3. When the call ends, whatever ended it, :meth:`Charge.release` is told the outcome. A call
   that never reached the upstream (refused by a later step, caller gone, no connection) gets
   everything back: its tokens and its reservation (on Redis, in one round trip). Otherwise
   the reservation is replaced by what was used, and ``call.charged`` gets the ``completed``
   event's fields (tokens, cost, how usage was known), which the request path also counts in
   its metrics. Never awaits.

What is charged (``usage`` in the event):

* ``reported``: the upstream's own count, whenever the answer carried one.
* ``none`` (0): the request never reached the upstream (refused, or no connection), or the
  upstream answered an error status in full: providers bill neither.
* ``estimated``: a stream cut before its usage arrived (caller gone, upstream cut or stalled):
  the input (the upstream's count if it came, else the estimate) and the output streamed so
  far, at least 1 token and at most the cap; never 0.
* ``reserved``: anything else without a count (a complete answer without usage, a timeout
  before the answer, a proxy error): the whole reservation, since the upstream may have
  billed it all.

The last two are counted in ``sluice_usage_missing_total`` by the request path: missing usage
is never counted as zero.
"""

from __future__ import annotations

import asyncio
import math

from policies.budget import Budgets, Reservation, price_usd
from policies.config import DEFAULT_OPERATION, ModelPrice, RouteConfig
from policies.pipeline import Call, Outcome
from policies.rate import RateLimiter, Units, fallback_for
from policies.reasons import Reason, Rejected
from policies.state import LedgerFull, StateBackends, StateUnavailable
from policies.state.admission import AdmissionResult
from policies.state.rate import Take
from policies.usage import Meter, RequestCost, Usage, endpoint_for, read_request

#: Tenants whose remaining budget the admin API lists (the first seen).
MAX_TENANTS_SHOWN = 100


class Accounting:
    """The token accounting of one route.

    Args:
        config: the route's config (protocol, ``usage``).
        pricing: the top-level ``pricing`` table.
        rate: the route's rate limits, if any; with ``rate.tokens`` set, this step takes a
            metered call's request units and tokens together (:meth:`RateLimiter.take`).
        budgets: the route's budgets, if any.
        run_header: the header naming a run, for the message when it is missing.
        token_models: models whose own ``rate.tokens`` (:mod:`policies.operations`) weighs
            their calls, so those must name an output cap too; ``default`` in it stands for
            every model.
    """

    def __init__(self, config: RouteConfig, pricing: dict[str, ModelPrice],
                 rate: RateLimiter | None, budgets: Budgets | None,
                 run_header: str, token_models: frozenset[str] = frozenset()) -> None:
        self.protocol = config.protocol
        self.anthropic = config.protocol == "anthropic"
        usage = config.usage
        self.default_cap = usage.default_max_tokens
        self.write_cap = usage.write_max_tokens
        self.stream_usage = usage.stream_usage
        self.pricing = pricing
        self.budgets = budgets
        self.rate: RateLimiter | None = None
        self.use_rate(rate)
        self.run_header = run_header
        self.token_models = token_models
        #: Tenants seen on this route (the first ``MAX_TENANTS_SHOWN``), for the admin API.
        self.tenants: dict[str, None] = {}
        self.tenant_units: list[str] = []
        if budgets is not None:
            self.tenant_units = list(dict.fromkeys(
                limit.unit for limit in budgets.limits if limit.per == "tenant"))

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
                     for unit in self.tenant_units}
            for tenant in sorted(self.tenants)
        }
        return {"budget_remaining": {"route": per_route or None, "tenants": per_tenant}}

    async def admit(self, call: Call) -> Charge | None:
        """The pipeline step (:class:`policies.pipeline.Policy`): read and reserve a metered
        call (see the module docstring); ``None`` for a call that is not metered.

        Raises:
            Rejected: from :meth:`open` or :meth:`reserve`; nothing is held.
        """
        charge = self.open(call.method, call.path, call.body, call.tenant, call.run)
        if charge is None:
            return None
        charge.ancestors = call.lineage
        await self.reserve(charge)
        call.cost = float(charge.cost.input_tokens + (charge.cost.output_cap or 0))
        call.body = charge.body
        call.meter = charge.meter
        charge.call = call
        return charge

    def use_rate(self, rate: RateLimiter | None) -> None:
        """Account with ``rate`` (the route's, kept across a reload). On a route that limits
        tokens, this step takes a metered call's request units too, with its tokens and
        budget holds in one round trip, so ``rate``'s own step leaves metered calls alone."""
        self.rate = rate
        if rate is not None:
            rate.metered_elsewhere = self.enforcing

    @property
    def enforcing(self) -> bool:
        """The route limits tokens (a token rate or a budget), so every metered call must be
        readable and name an output cap."""
        return (self.rate is not None and self.rate.tokens is not None) or (
            self.budgets is not None)

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
        models = self.token_models
        if self.enforcing or (models and (cost.model in models or DEFAULT_OPERATION in models)):
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
        """Take the request's units and worst-case tokens from the rates, and hold its worst
        case on the budgets, all or nothing in one call to the route's state
        (:meth:`policies.state.admission.Admissions.admit`, one Redis round trip). The rules
        stay in their modules: :class:`~policies.rate.RateLimiter` names the buckets and its
        refusal, :class:`~policies.budget.Budgets` the claims and its own.

        A refusal names the limit with the longest wait (a rate's, or a budget's: one that
        never frees is the longest), so a retry after it fits every limit.

        Raises:
            Rejected: ``exceeds_limit``, ``unpriced_model``, ``rate_limited``,
                ``token_rate_limited``, ``budget_exhausted``, ``state_unavailable``; nothing
                is left held.
        """
        if not self.enforcing:
            return  # the rate step took the call's request units, if any
        cost = charge.cost
        cap = cost.output_cap or 0
        rate, budgets = self.rate, self.budgets
        takes: list[Take] = []
        if rate is not None:
            takes = rate.request_takes(charge.tenant)
            if rate.tokens is not None:
                takes.append(rate.token_take(cost.input_tokens + cap))
        reservation = None
        if budgets is not None:
            reservation = budgets.prepare(charge.tenant, charge.run, cost.model,
                                          cost.input_tokens, cap, charge.ancestors)
        owner = budgets if budgets is not None else rate
        if owner is None or (not takes and reservation is None):
            return
        backends = owner.backends
        source = backends
        rid, claims, now = "", [], 0.0
        if reservation is not None:
            rid, claims, now = reservation.rid, reservation.claims, reservation.now
        hold_s = budgets.hold_s if budgets is not None else 0.0
        try:
            result = await backends.admissions.admit(owner.group, takes, rid, claims, now,
                                                     hold_s)
        except StateUnavailable as exc:
            if budgets is not None and reservation is not None:
                budgets.unanswered(reservation, exc)
            source = fallback_for(backends, exc)
            if rate is not None:
                takes = rate.local_takes(takes)
            if budgets is not None and reservation is not None:
                budgets.localize(reservation, source)
                claims = reservation.claims
            try:  # the local fallback is a memory ledger, with its own cap
                result = await source.admissions.admit(owner.group, takes, rid, claims, now,
                                                       hold_s)
            except LedgerFull as full:
                raise Budgets.full(full) from None
        except asyncio.CancelledError:
            # Rate units taken by a script that ran drain within a period (a refusal, never
            # excess); a reservation it held is released by id.
            if budgets is not None and reservation is not None:
                budgets.abandon(reservation)
            raise
        except LedgerFull as exc:  # raised before anything was taken
            raise Budgets.full(exc) from None
        if rate is not None:
            rate.note(source, takes, result.rates)
        if budgets is not None and reservation is not None:
            budgets.answered(reservation)
        if not result.admitted:
            raise self._refusal(takes, reservation, result, source)
        if rate is not None and takes:
            charge.units = Units(rate, source, takes)
        if budgets is None or reservation is None:
            return
        charge.reservation = reservation
        try:
            charge.meter.headers = budgets.headers(reservation)
        except BaseException:
            charge.release(None)
            raise
        if (self.tenant_units and charge.tenant not in self.tenants
                and len(self.tenants) < MAX_TENANTS_SHOWN):
            self.tenants[charge.tenant] = None

    def _refusal(self, takes: list[Take], reservation: Reservation | None,
                 result: AdmissionResult, source: StateBackends) -> Rejected:
        """The refusal of the limit with the longest wait among those that denied."""
        refusals = []
        if result.rates.denied is not None and self.rate is not None:
            refusals.append(self.rate.refusal(takes, result.rates, source))
        if result.denied and self.budgets is not None and reservation is not None:
            refusals.append(self.budgets.refusal(reservation, result.denied))
        return max(refusals, key=lambda r: math.inf if r.retry_after is None
                   else r.retry_after)


class Charge:
    """One metered request, from reading to settling (see the module docstring).

    Attributes:
        cost: what was read from the request.
        meter: reads the answer; handed to :func:`proxy.forward.forward`.
        reservation: held on the budgets, if any.
        units: taken from the rates (request units and tokens), if any.
    """

    __slots__ = ("_acct", "_open", "ancestors", "call", "cost", "meter", "reservation", "run",
                 "tenant", "units")

    def __init__(self, acct: Accounting, cost: RequestCost, tenant: str, run: str | None):
        self._acct = acct
        self._open = True
        self.cost = cost
        self.tenant = tenant
        self.run = run
        #: The run's ancestors, charged on ``per: run`` budgets too.
        self.ancestors: tuple[str, ...] = ()
        self.meter = Meter(cost.endpoint, acct.anthropic, cost.strip_usage)
        self.reservation: Reservation | None = None
        self.units: Units | None = None
        self.call: Call | None = None

    @property
    def body(self) -> bytes:
        """The body to forward."""
        return self.cost.body

    def release(self, outcome: Outcome | None) -> None:
        """End the charge, once (a :class:`policies.pipeline.Holding`). Never awaits.

        ``outcome`` ``None`` or not ``reached``: the upstream never saw the request, so its
        tokens and its reservation are given back in full. Otherwise the reservation settles
        to what was used (see the module docstring), and the ``completed`` event's fields go
        to ``call.charged``.
        """
        if not self._open:
            return
        self._open = False
        acct = self._acct
        units, reservation, budgets = self.units, self.reservation, acct.budgets
        if outcome is None or not outcome.reached:
            usage, source = Usage(), "none"
            if (units is not None and reservation is not None and budgets is not None
                    and units.source is reservation.source
                    and reservation.source.redis is not None):
                # Taken in one round trip, given back in one.
                units.handed_over()
                budgets.give_back(reservation, units.takes)
                reservation = None
        else:
            usage, source = self._used(outcome.label)
        if units is not None:
            units.release(outcome)
        if reservation is not None and budgets is not None:
            budgets.settle(reservation, usage)
        if self.call is None or outcome is None or outcome.label == "rejected":
            return
        model = self.cost.model
        price = acct.pricing.get(model) if model is not None else None
        usd = price_usd(price, usage) if price is not None else None
        self.call.charged = {
            "model": model,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cost_usd": None if usd is None else round(usd, 9),
            "usage": source,
        }

    def _used(self, outcome: str) -> tuple[Usage, str]:
        meter = self.meter
        cost = self.cost
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
