"""Token accounting of one request on an ``openai`` or ``anthropic`` route, end to end.

It is one step of the admission pipeline (:mod:`policies.pipeline`):

1. :meth:`Accounting.admit` reads the call's body once (model, output cap, stream) if it is a
   metered call (:func:`policies.usage.endpoint_for`), maybe rewrites it (default cap, usage
   option), then, on a route that limits tokens (a token rate or a budget), in one atomic
   call to the route's state (one Redis round trip, :mod:`policies.state.admission`), takes
   the request units of ``rate.requests`` and ``rate.per_tenant`` and its worst case from
   the token rate (``rate.tokens``), and reserves that worst case on the budgets
   (``budget``); or raises :class:`~policies.reasons.Rejected`, naming the limit with the
   longest wait. On a route without token limits nothing is taken here (the rate step took
   the request units). It leaves the :class:`Charge` held, and on ``call.meter``: the
   charge is also the meter of the answer.
2. While forwarding, the meter reads the answer's usage as it passes.
3. When the call ends, whatever ended it, :meth:`Charge.release` is told the outcome. A call
   that never reached the upstream (refused by a later step, caller gone, no connection) gets
   everything back: its tokens and its reservation (on Redis, in one round trip). Otherwise
   the reservation is replaced by what was used, and ``call.charged`` gets the ``completed``
   event's fields (tokens, cost, how usage was known), which the request path also counts in
   its metrics. Never awaits.

What is charged (``usage`` in the event):

* ``reported``: the upstream's own count, whenever the answer carried one (a stream's: one
  no content followed, :attr:`policies.usage.Meter.final`; of a stream ended from this side
  before any content, only one its answer ended with).
* ``none`` (0): the request never reached the upstream (refused, or no connection), or the
  upstream answered an error status, whether or not its body came whole (a status is sent
  before any of it: the provider failed the request, and bills none).
* ``estimated``: a stream cut before its usage arrived (caller gone, upstream cut or timed
  out, or an error event from the upstream in place of the rest of the answer):
  the input (the upstream's count if it came, else the estimate) and the output streamed so
  far, at least 1 token and at most the cap; never 0.
* ``reserved``: anything else without a count (a complete answer without usage, a timeout
  before the answer, a proxy error, a Responses stream with ``"background": true``, which
  its upstream runs to the end whoever leaves, a stream its caller left, its run's cancel,
  the drain or ``timeouts.total`` cut before any content came, as a call not streamed):
  the whole reservation, since the upstream may have billed it all.

With retries, each attempt is a request the upstream may bill, so a call is charged for all
of them (:meth:`Charge._used`): the answer relayed as above; when none was relayed, the
latest attempt as above if it may have been billed (no answer, or one below 400 its caller
left before), and nothing for an error answer let go in a retry's wait or an attempt refused
a connection; plus the whole reservation for each earlier attempt that may have reached the
upstream and got no answer (a timeout, a connection lost after sending), counted in the
``completed`` event's ``unanswered_attempts`` and labelled ``reserved`` if nothing else was
charged. Before, only the last answer counted: a caller that left in the back-off after a
503 was charged its whole reservation, and a timed-out attempt followed by a relayed 503 was
charged nothing (a hostile trial). So that these charges cannot pass a budget, the retry
after such an attempt first holds another worst case (:meth:`Charge.hold_retry`); if it
does not fit, retrying ends there.

The last two are counted in ``sluice_usage_missing_total`` by the request path: missing usage
is never counted as zero.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Mapping
from urllib.parse import urlsplit

from policies.budget import Budgets, Reservation, price_usd
from policies.config import DEFAULT_OPERATION, ModelPrice, Rate, RouteConfig
from policies.paths import deployment_named
from policies.pipeline import SENT_UNANSWERED, Call, Outcome, survive_leaving
from policies.rate import RateLimiter, Units, buckets_full, fallback_for, fits_whole
from policies.reasons import Reason, Rejected
from policies.state import LedgerFull, RateBucketsFull, StateBackends, StateUnavailable
from policies.state.admission import AdmissionResult
from policies.state.rate import Take
from policies.usage import (
    MESSAGES,
    Endpoint,
    Meter,
    RequestCost,
    Usage,
    content_coding,
    endpoint_for,
    model_named,
    read_request,
)

#: Tenants whose remaining budget the admin API lists (the first seen).
MAX_TENANTS_SHOWN = 100
#: Raw paths whose endpoint an :class:`Accounting` keeps (a route sees a handful).
ENDPOINTS_KEPT = 256
#: Outcomes of a call ended from Sluice's side while its upstream was still at work: its
#: caller left (``client_disconnected``), its run was cancelled, the drain cut it, or its
#: ``timeouts.total`` ran out (``upstream_timeout``: a metered call has no other timer, so
#: its upstream was still sending or thinking). Not a cut its upstream made (a reset, an
#: error event: ``upstream_error``).
_ENDED_HERE = frozenset({"client_disconnected", "run_cancelled", "drain_cut",
                         "upstream_timeout"})


def _limits_tokens(rate: RateLimiter | None, budgets: Budgets | None) -> bool:
    """Whether a route with this rate limiter and these budgets limits tokens (a token rate
    or a budget): its metered calls are then reserved and settled by this step."""
    return budgets is not None or (rate is not None and rate.tokens is not None)


class Accounting:
    """The token accounting of one route.

    Args:
        config: the route's config (protocol, ``usage``).
        pricing: the top-level ``pricing`` table.
        rate: the route's rate limits, if any; with ``rate.tokens`` set, this step takes a
            metered call's request units and tokens together (:meth:`RateLimiter.take`).
        budgets: the route's budgets, if any.
        run_header: the header naming a run, for the message when it is missing.
        token_models: each ``models:`` block (:mod:`policies.operations`) by name, and its
            ``rate.tokens`` (``None``: none), which weighs its calls: they must then name an
            output cap too; ``default``'s stands for every model no other block names.
    """

    def __init__(self, config: RouteConfig, pricing: dict[str, ModelPrice],
                 rate: RateLimiter | None, budgets: Budgets | None,
                 run_header: str, token_models: Mapping[str, Rate | None] | None = None
                 ) -> None:
        self.protocol = config.protocol
        usage = config.usage
        self.default_cap = usage.default_max_tokens
        self.write_cap = usage.write_max_tokens
        self.stream_usage = usage.stream_usage
        self.pricing = pricing
        self.budgets = budgets
        self.rate: RateLimiter | None = None
        self.use_rate(rate)
        #: Each raw path's metered endpoint (``None``: not metered) and Azure deployment
        #: (``None``: none), as :meth:`_endpoint` found them.
        self._endpoints: dict[str, tuple[Endpoint | None, str | None]] = {}
        #: On ``openai`` routes, how a raw path becomes the path the upstream sees (its URL's
        #: own path, then the path after the route's prefix), for Azure's deployments.
        self._deployments = ((urlsplit(config.upstream).path, len(config.path_prefix) - 1)
                             if config.protocol == "openai" else None)
        self.run_header = run_header
        self.token_models = token_models or {}
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
        call (see the module docstring); ``None`` for a call that is not metered (it then
        passes unmetered).

        Raises:
            Rejected: ``bad_request`` on a route with token limits (or to a model with a
                token rate of its own), when the body is compressed (``Content-Encoding``
                other than ``identity``) or not JSON, names no output cap (and no default
                is configured) or one that is not a non-negative integer, or a per-run
                budget applies and no run id was sent; ``exceeds_limit`` when its worst case
                passes its model's whole token rate (``models:``), which no wait could make
                fit; or from :meth:`reserve`. Nothing is held.
        """
        if call.method != "POST":
            return None  # only POSTs are metered
        try:
            endpoint, deployment = self._endpoints[call.path]
        except KeyError:
            endpoint, deployment = self._endpoint(call.path)
        if endpoint is None:
            return None
        # Every metered call on a route that limits tokens must be readable and name an
        # output cap. Read per call, not kept: a reload reconfigures the route's rate in place.
        rate = self.rate
        enforcing = _limits_tokens(rate, self.budgets)
        try:
            encoding = content_coding(call.headers)
            if encoding:
                # Its bytes are not the JSON they encode (nor may Sluice rewrite them).
                raise ValueError(f"the body is compressed (Content-Encoding: {encoding:.40}); "
                                 f"send it uncompressed")
            cost = read_request(endpoint, call.body, self.default_cap, self.write_cap,
                                self.stream_usage)
        except ValueError as exc:
            # A model's own token rate needs the cap as the route's does: passed unmetered,
            # a cap sent as "900" or 900.0 (which lax upstreams read as 900) took no tokens
            # from it (a hostile trial).
            if not enforcing and self._model_limits_tokens(call, deployment):
                raise Rejected(Reason.BAD_REQUEST, None,
                               f"{exc}; this model's tokens are limited, so Sluice must "
                               f"read it") from None
            if not enforcing:
                # Unmetered; its request units are this step's if the rate step left them
                # (a reload changed the route's blocks between the two steps).
                return (await rate.take(rate.request_takes(call.tenant))
                        if call.units_deferred and rate is not None else None)
            raise Rejected(Reason.BAD_REQUEST, None,
                           f"{exc}; this route limits tokens, so Sluice must read it") from None
        if deployment is not None:
            cost.model = deployment  # Azure serves its deployment's model, whatever the body says
        model_rate = self._token_rate(cost.model or "") if self.token_models else None
        if enforcing or model_rate is not None:
            self._check(cost, call.run)
            if model_rate is not None:
                # Before the route's buckets: a call its model's rate could never take was
                # told to retry (429) when the route's token bucket was short (a hostile
                # trial), and its retry met this 400.
                fits_whole(cost.input_tokens + (cost.output_cap or 0), model_rate)
        charge = Charge(self, cost, call)
        if enforcing or call.units_deferred:
            await self.reserve(charge)
        call.cost = float(cost.input_tokens + (cost.output_cap or 0))
        call.body = cost.body
        call.meter = charge
        return charge

    def _model_limits_tokens(self, call: Call, deployment: str | None) -> bool:
        """Whether the model ``call`` names has a token rate of its own (``models:``): asked
        only for a body the accounting could not take. The model is ``call.model``, as the
        route's ``models:`` read it (its form parsed once, off the loop when large); else
        ``deployment`` (the Azure deployment its path names) or its JSON ``model``."""
        if not self.token_models:
            return False
        model = call.model
        if model is None:  # token_models come from models:, whose read sets it: a fallback
            model = deployment or model_named(call.body) or ""
        return self._token_rate(model) is not None

    def _token_rate(self, model: str) -> Rate | None:
        """The token rate of the ``models:`` block that applies to ``model`` (its own, else
        ``default``'s, as :meth:`policies.operations.OperationIndex.find` picks it; ``""``
        for none named), ``None`` if it has none: a model's own block without one is not
        weighed though ``default``'s is (a review)."""
        blocks = self.token_models
        if model and model != DEFAULT_OPERATION and model in blocks:
            return blocks[model]
        return blocks.get(DEFAULT_OPERATION)

    def _endpoint(self, raw_path: str) -> tuple[Endpoint | None, str | None]:
        """The metered endpoint a POST to ``raw_path`` calls (:func:`endpoint_for`) and the
        Azure deployment it names (:func:`deployment_named`: it names the model), kept for
        the next call to the same path (a route sees a handful; at most
        :data:`ENDPOINTS_KEPT`, then it starts over)."""
        endpoint = endpoint_for(self.protocol, "POST", raw_path)
        deployment = None
        if self._deployments is not None:
            base, cut = self._deployments
            deployment = deployment_named(base + raw_path[cut:])
        if len(self._endpoints) >= ENDPOINTS_KEPT:
            self._endpoints.clear()
        self._endpoints[raw_path] = endpoint, deployment
        return endpoint, deployment

    def _check(self, cost: RequestCost, run: str | None) -> None:
        """Refuse a call that token limits apply to if it names no output cap, or if a
        per-run budget applies and it names no run.

        Raises:
            Rejected: ``bad_request``.
        """
        if cost.output_cap is None:
            raise Rejected(
                Reason.BAD_REQUEST, None,
                # Every field the endpoint reads: max_completion_tokens alone sent a user of
                # max_tokens, which the README and the SDKs still speak of, looking for it.
                f"set {' or '.join(cost.endpoint.cap_fields)}: this route limits tokens and "
                f"configures no usage.default_max_tokens",
            )
        if run is None and self.budgets is not None and self.budgets.needs_run:
            raise Rejected(Reason.BAD_REQUEST, None,
                           f"send the {self.run_header} header: this route budgets per run")

    def use_rate(self, rate: RateLimiter | None) -> None:
        """Account with ``rate`` (the route's, kept across a reload). On a route that limits
        tokens, this step takes a metered call's request units too, with its tokens and
        budget holds in one round trip, so ``rate``'s own step leaves metered calls alone."""
        self.rate = rate
        if rate is not None:
            rate.metered_elsewhere = _limits_tokens(rate, self.budgets)
            # Which calls it leaves to this step is read by this step's protocol: a rate kept
            # by a reload that changed the route's protocol had the old one, and the calls
            # only that one meters took no request unit at all (a review).
            rate.protocol = self.protocol

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
                ``token_rate_limited``, ``budget_exhausted``, ``budget_counters_full``,
                ``rate_buckets_full``, ``state_unavailable``; nothing is left held.
            asyncio.CancelledError: the caller left; what a Redis admission took is given
                back once its reply arrives.
        """
        cost, call = charge.cost, charge.call
        cap = cost.output_cap or 0
        rate, budgets = self.rate, self.budgets
        takes: list[Take] = []
        if rate is not None:
            # The request units only if the rate step left them to this step (the flag it
            # read then, not the one a reload may have set since).
            if call.units_deferred:
                takes = rate.request_takes(call.tenant)
            if rate.tokens is not None:
                takes.append(rate.token_take(cost.input_tokens + cap))
        reservation = None
        if budgets is not None:
            reservation = budgets.prepare(call.tenant, call.run, cost.model,
                                          cost.input_tokens, cap, call.lineage)
        owner = budgets if budgets is not None else rate
        if owner is None or (not takes and reservation is None):
            return
        backends = owner.backends
        source = backends
        rid, claims, now = "", [], 0.0
        if reservation is not None:
            rid, claims, now = reservation.rid, reservation.claims, reservation.now
        hold_s = budgets.hold_s if budgets is not None else 0.0
        step = backends.admissions.admit(owner.group, takes, rid, claims, now, hold_s,
                                         rate.holder if rate is not None and takes else None)
        try:
            if backends.redis is None:  # memory: nothing suspends, so no caller leaves midway
                result = await step
            else:
                # A caller leaving while Redis runs the script does not cut it: it ends in the
                # background and what it took is given back once its reply says so
                # (:meth:`_left`); a reservation it may hold without a reply is released by
                # id (:func:`_shared`).
                result = await survive_leaving(
                    _shared(step, budgets, reservation),
                    lambda late: self._left(late, rate, budgets, takes, reservation),
                    owner.background.spawn)
        except StateUnavailable as exc:
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
            except RateBucketsFull as full:  # and memory buckets, with theirs
                raise buckets_full(full) from None
        except LedgerFull as exc:  # raised before anything was taken
            raise Budgets.full(exc) from None
        except RateBucketsFull as exc:  # the same
            raise buckets_full(exc) from None
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
        budgets.holds.held(reservation)
        try:
            charge.headers = budgets.headers(reservation)
        except BaseException:
            charge.release(None)
            raise
        if (self.tenant_units and call.tenant not in self.tenants
                and len(self.tenants) < MAX_TENANTS_SHOWN):
            self.tenants[call.tenant] = None

    @staticmethod
    def _left(result: AdmissionResult, rate: RateLimiter | None, budgets: Budgets | None,
              takes: list[Take], reservation: Reservation | None) -> None:
        """Give back what the shared admission of a call whose caller left before its reply
        took (``result``, the late reply), as for a call that never reached the upstream:
        the units and the reservation in one round trip (:meth:`Budgets.give_back`), or the
        units alone. Only a reply saying admitted is acted on: nothing was taken otherwise,
        and a refund is not idempotent, so one would free units others hold."""
        if not result.admitted:
            return
        if budgets is not None and reservation is not None:
            budgets.give_back(reservation, takes)
        elif rate is not None and takes:
            Units(rate, rate.backends, takes).release(None)

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


async def _shared(step: Awaitable[AdmissionResult], budgets: Budgets | None,
                  reservation: Reservation | None) -> AdmissionResult:
    """Await ``step``, an admission sent to the shared state; when it ends without a reply
    (:class:`~policies.state.StateUnavailable`), a reservation it may have held there is
    released by id (:meth:`Budgets.unanswered`), whether the caller waits or has left.

    Raises:
        StateUnavailable: from ``step``.
    """
    try:
        return await step
    except StateUnavailable as exc:
        if budgets is not None and reservation is not None:
            budgets.unanswered(reservation, exc)
        raise


class Charge(Meter):
    """One metered request, from reading to settling (see the module docstring). It is also
    the meter that reads its answer (:class:`policies.usage.Meter`, handed to
    :func:`proxy.forward.forward` as ``call.meter``): one object per metered call.

    Attributes:
        cost: what was read from the request.
        call: the call it charges; ``call.charged`` gets the ``completed`` event's fields.
        reservation: held on the budgets, if any.
        units: taken from the rates (request units and tokens), if any.
    """

    def __init__(self, acct: Accounting, cost: RequestCost, call: Call) -> None:
        # Read in Anthropic's shape only at /messages: an anthropic route's /chat/completions
        # answers in OpenAI's.
        super().__init__(cost.endpoint, cost.endpoint is MESSAGES, cost.strip_usage)
        if cost.recoded:
            self.recoded = True
        self._acct = acct
        self.cost = cost
        self.call: Call | None = call
        self.reservation: Reservation | None = None
        self.units: Units | None = None
        self._released = False

    #: Reservations :meth:`hold_retry` took for retries, settled to nothing when the charge
    #: ends (the call's whole spend settles on ``reservation``). A class-level default: most
    #: calls are never retried.
    _retry_holds: list[tuple[Budgets, Reservation]] | None = None

    async def hold_retry(self) -> None:
        """Hold one more worst case on the budgets before a retry that follows an attempt
        which may have been billed in full (sent, and no answer: a timeout, a connection
        lost): that attempt is charged its whole reservation (:meth:`_used`), so without
        this, retries could pass a budget by ``retry.attempts - 1`` reservations. Nothing on
        a call without a budget reservation. Taken as the call's first (:meth:`Budgets.reserve
        <policies.budget.Budgets.reserve>`: one ledger call, the local fallback while the
        shared ledger is unavailable), and kept on the charge with no ``await`` between.

        Raises:
            Rejected: ``budget_exhausted`` when another attempt does not fit now;
                ``state_unavailable`` (``on_unavailable: reject``) or
                ``budget_counters_full``; nothing more is held then.
        """
        call = self.call
        if self.reservation is None or call is None:
            return
        cost = self.cost
        # On the budgets in force now: a reload since the call's admission may have lowered
        # them, and this hold is a new admission (held on the old limit, a retry passed the
        # reloaded budget). In the call's windows, though, where its every attempt is charged
        # (:meth:`_used`): held in the window the retry came in, a per-minute budget's
        # previous minute was passed by what the hold was for (a review).
        budgets = self._acct.budgets.current()
        held = await budgets.reserve(call.tenant, call.run, cost.model, cost.input_tokens,
                                     cost.output_cap or 0, call.lineage,
                                     self.reservation.now)
        if self._retry_holds is None:
            self._retry_holds = []
        self._retry_holds.append((budgets, held))

    def release(self, outcome: Outcome | None) -> None:
        """End the charge, once (a :class:`policies.pipeline.Holding`). Never awaits.

        ``outcome`` ``None`` or not ``reached``: the upstream never saw the request, so its
        tokens and its reservation are given back in full. Otherwise the reservation settles
        to what was used (see the module docstring), and the ``completed`` event's fields go
        to ``call.charged``.
        """
        if self._released:
            return
        self._released = True
        # The call holds this charge as its meter: letting go of the call here breaks that
        # cycle, so both are freed when the request ends (by reference counting, not by the
        # cyclic collector's next pass).
        call, self.call = self.call, None
        units, reservation = self.units, self.reservation
        if outcome is None or not outcome.reached:
            usage, source = Usage(), "none"
            if (units is not None and reservation is not None
                    and units.source is reservation.source
                    and reservation.source.redis is not None):
                # Taken in one round trip, given back in one.
                units.handed_over()
                self._acct.budgets.give_back(reservation, units.takes)
                reservation = None
        elif (self.final and self.status and not call.unanswered  # most calls: one answer
              and (self.complete or self._count_stands(outcome.label))):
            usage, source = self.usage, "reported"
        else:
            usage, source = self._used(outcome.label, call)
        if units is not None:
            units.release(outcome)
        if reservation is not None:
            self._acct.budgets.settle(reservation, usage)
        retry_holds = self._retry_holds
        if retry_holds is not None:
            for budgets, held in retry_holds:
                budgets.settle(held, None)
        if outcome is None or outcome.label == "rejected":
            return
        model = self.cost.model
        price = self._acct.pricing.get(model)  # None for no model too
        call.charged = {
            "model": model,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cost_usd": None if price is None else round(price_usd(price, usage), 9),
            "usage": source,
        }
        if call.unanswered:
            call.charged["unanswered_attempts"] = call.unanswered
        cap = self.cost.output_cap
        if cap is not None and (source == "reported" or call.unanswered):
            # Charged as reported, the upstream's count being the bill, or for retried
            # attempts each at the reservation: more than the reservations held (an input
            # the estimate undercounted, an upstream past max_tokens, attempts that timed
            # out on a route without a budget to hold their retries on) can pass a budget
            # by the difference, so it is said.
            worst = self.cost.input_tokens + cap
            over = (usage.input_tokens + usage.output_tokens) - worst
            if retry_holds is not None:
                over -= len(retry_holds) * worst
            if over > 0:
                call.charged["over_reservation_tokens"] = over

    def _used(self, outcome: str, call: Call) -> tuple[Usage, str]:
        """What a call that reached the upstream used, over all its attempts (module
        docstring): the relayed answer's usage, or, when none was relayed, the latest
        attempt's worst case if it may have been billed; plus the whole reservation for each
        earlier attempt that may have reached the upstream and got no answer."""
        if self.status:  # an answer was relayed, and read as it passed
            if self.final and (self.complete or self._count_stands(outcome)):
                usage, source = self.usage, "reported"
            else:
                usage, source = self._unreported(outcome)
        elif call.answer_status == SENT_UNANSWERED and call.sent_at is None:
            # It ended unanswered (a timeout, a connection lost), not cut by its caller
            # leaving: the upstream may have run it to the end, streamed or not.
            usage, source = self._worst(), "reserved"
        elif call.answer_status == SENT_UNANSWERED or 0 < call.answer_status < 400:
            usage, source = self._unreported(outcome)  # its caller left while it was open
        else:  # an error answer (providers bill none) let go in a retry's wait, or unsent
            usage, source = Usage(), "none"
        if call.unanswered:
            worst = self._worst()
            usage = Usage(usage.input_tokens + call.unanswered * worst.input_tokens,
                          usage.output_tokens + call.unanswered * worst.output_tokens,
                          usage.cache_read_tokens, usage.cache_write_tokens)
            if source == "none":
                source = "reserved"
        return usage, source

    def _count_stands(self, outcome: str) -> bool:
        """Whether the final count of an answer that did not complete is its bill. Not for
        a stream ended from this side (:data:`_ENDED_HERE`) before any content came and
        before its answer ended: a count in its first chunk (``{prompt 11, completion 0}``,
        as vLLM's ``continuous_usage_stats`` sends) is no count of the work the upstream
        does on unseen, and a caller that left then was charged 0 output tokens (a review);
        it is charged as a stream without usage (:meth:`_unreported`)."""
        return bool(self.streamed_tokens) or not self.cut_short or outcome not in _ENDED_HERE

    def _worst(self) -> Usage:
        """The most one attempt can use: the reservation (input estimate, output cap)."""
        return Usage(self.cost.input_tokens, self.cost.output_cap or 0)

    def _unreported(self, outcome: str) -> tuple[Usage, str]:
        """What a call that reached the upstream used when its answer gave no final count."""
        cost = self.cost
        status = self.status
        if status >= 400:  # cut or whole: an error from its first byte (an ops trial saw a
            return Usage(), "none"  # torn 500 charged its whole reservation)
        cap = cost.output_cap
        # A stream whose upstream said in an error event that it gave up is charged as a cut
        # one: what it reported and streamed. Its whole reservation (max_tokens) made an
        # overloaded_error after a few tokens cost far more than a dropped connection. Not a
        # background one: its upstream runs on to the end and bills it all (a hostile trial
        # left three after their first event, charged 117 tokens for 12,033 billed). Nor one
        # ended from this side (its caller gone, its run cancelled, the drain's cut, its
        # timeouts.total) before any content came: the upstream was working unseen until
        # then (a reasoning model thinks silently), as for a call not streamed, so it is
        # charged as one (a hostile trial's read timeout left five such streams, charged 1
        # output token each).
        if (cost.stream and status and (not self.complete or self.failed)
                and not cost.background
                and (self.streamed_tokens or self.failed or outcome not in _ENDED_HERE)):
            seen = self.usage
            output = max(seen.output_tokens, self.streamed_tokens, 1)
            if cap is not None:
                output = min(output, cap)
            return Usage(seen.input_tokens or cost.input_tokens, output,
                         seen.cache_read_tokens, seen.cache_write_tokens), "estimated"
        return self._worst(), "reserved"
