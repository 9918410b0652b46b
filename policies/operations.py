"""Per-operation policies: a route's ``tools:``, ``endpoints:`` or ``models:`` blocks.

An *operation* is what a call asks the upstream to do, as far as a limit cares: on ``mcp``
routes the tool of a ``tools/call`` (the handler reads it from the body, and checks the
``Mcp-Name`` header of newer protocol versions against it); on ``http`` routes the first
``"METHOD /path"`` pattern of ``endpoints:`` that matches (file order); on ``openai`` and
``anthropic`` routes the request's ``model``, to mirror providers' per-model limits. A block
named ``default`` applies to the operations no other key names.

:meth:`Operations.resolve` finds a call's operation once, at the start of its admission, and
the route then admits it with that operation's :class:`Plan`: the route's steps with the
operation's own in between (``proxy/routes.py``). The operation's ``concurrency``, ``rate``
and ``circuit_breaker`` apply *in addition to* the route's (both must admit); its
``idempotency``, ``retry`` and ``timeouts`` replace the route's for its calls. Its slot is
taken before the route's, so a call waiting for a busy tool holds none of the route's slots
and the route's other tools go on being served. On ``mcp`` routes an operation's breaker also
counts tool failures (an ``isError`` result, or a JSON-RPC error other than invalid params:
:attr:`policies.mcp.Outcome.tool_failure`), so one failing tool opens its own breaker only.

Every object keeps its state in the route's state backends (memory, or Redis shared by
replicas) under the group ``ROUTE/OPERATION``, so two operations never share a counter, and a
reload keeps an operation's objects as the route keeps its own (:meth:`Operations.take_over`).

Costs (``cost_per_call``, ``cost_per_second``, USD): :class:`Costs` charges them to the
route's ``usd`` budgets, the ones tokens are charged to: ``cost_per_call`` per upstream
attempt, ``cost_per_second`` per second of upstream time (each attempt from its sending to
the end of its answer). ``cost_per_call`` is reserved before the call is forwarded, so an
exhausted budget refuses the call (429 ``budget_exhausted``); the rest (retries, upstream
time) settles at the end, and may pass the budget: it is reported as
:attr:`policies.pipeline.Call.operation_overrun`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

from policies.bodies import FormReader, form_field, is_form
from policies.breaker import Breaker
from policies.budget import Budgets, Reservation
from policies.concurrency import ConcurrencyLimiter
from policies.config import (
    DEFAULT_OPERATION,
    ConcurrencyConfig,
    IdempotencyConfig,
    OperationConfig,
    PathGlob,
    RouteConfig,
    TimeoutsConfig,
    endpoint_pattern,
)
from policies.idempotency import Idempotency
from policies.paths import deployment_named, readings
from policies.pipeline import Call, Outcome, Policy
from policies.rate import RateLimiter, Units
from policies.reasons import Reason, Rejected
from policies.retry import RetryPolicy
from policies.runs import WIDTH_QUEUE, WidthLimiters, local_width
from policies.shared_concurrency import OutageNotice, SharedConcurrencyLimiter
from policies.state import StateBackends
from policies.usage import model_named

P = TypeVar("P")
C = TypeVar("C")

#: The least USD held for a call of an operation with a cost: an operation priced by time
#: only (``cost_per_second``) still holds this much, so a spent budget refuses it.
MIN_HOLD_USD = 1e-6


def carry_over(old: P | None, new: P | None, old_config: C | None, new_config: C | None,
               reconfigure: Callable[[P, C], None] | None = None) -> P | None:
    """The policy object a reloaded route or operation keeps: ``old`` where it can, else
    ``new``.

    ``old`` is kept as it is when its config block is unchanged, and reconfigured in place with
    ``reconfigure(old, new_config)`` when the block changed; without a ``reconfigure`` a changed
    block gets the ``new`` object (fresh state). A block added or removed gives ``new``.
    """
    if old is None or new is None:
        return new
    if old_config != new_config:
        if reconfigure is None:
            return new
        reconfigure(old, new_config)  # type: ignore[arg-type]
    return old


class TakeOver:
    """One reload's carrying over of one route's policy objects (:func:`carry_over`, block by
    block), and of the objects of the blocks it removes that still hold calls.

    A removed block is a limit raised without bound: its object is told so (its
    ``retire()``: a limiter's queued calls are admitted at once, its calls in flight release
    into it as before) and kept in :attr:`draining` under the block's key while it is
    ``busy`` (holds calls). The block added back under that key gets that object again,
    reconfigured, so the calls still in flight under it count toward the new limit: a fresh
    object would start empty beside them. Objects with no ``retire`` (rates, breakers, ...)
    are only carried over. A route keeps :attr:`draining` until its next reload, which drops
    the objects no longer busy.

    Args:
        draining: the route's ``draining`` from its previous reload, by block key.
    """

    __slots__ = ("draining",)

    def __init__(self, draining: Mapping[str, Any]) -> None:
        self.draining: dict[str, Any] = {key: kept for key, kept in draining.items()
                                         if kept.busy}

    def __call__(self, key: str, old: P | None, new: P | None, old_config: C | None,
                 new_config: C | None,
                 reconfigure: Callable[[P, C], None] | None = None) -> P | None:
        """:func:`carry_over` of the block ``key`` (unique within the route: ``concurrency``,
        ``operations['GET /slow'].concurrency``), and what the class docstring says of a
        block removed or added back."""
        if old is None and new is not None and reconfigure is not None:
            kept = self.draining.pop(key, None)
            if kept is not None:
                reconfigure(kept, new_config)  # type: ignore[arg-type]
                return kept  # type: ignore[no-any-return]
        carried = carry_over(old, new, old_config, new_config, reconfigure)
        if old is not None and carried is None:
            self.retire(key, old)
        return carried

    def retire(self, key: str, old: object | None) -> None:
        """The block ``key`` is gone: ``old``, its object, retires, and is kept while busy."""
        retire = getattr(old, "retire", None)
        if retire is not None:
            retire()
            if old.busy:  # type: ignore[union-attr]
                self.draining[key] = old


def reconfigure_limiter(limiter: ConcurrencyLimiter, c: ConcurrencyConfig) -> None:
    """Adopt a changed ``concurrency`` block in place (slots held and waiters kept)."""
    limiter.reconfigure(c.limit, c.queue, c.max_wait, c.per_tenant,
                        tenant_weights=c.tenant_weights, aging=c.aging)


def new_limiter(c: ConcurrencyConfig | None, backends: StateBackends,
                group: str) -> ConcurrencyLimiter | None:
    """The limiter of a ``concurrency`` block, or ``None`` without one: this process's, or
    with the Redis backend one whose limits hold across replicas (leases in ``group``; the
    queue stays local, :mod:`policies.shared_concurrency`)."""
    if c is None:
        return None
    if backends.redis is not None:
        return SharedConcurrencyLimiter(c.limit, c.queue, c.max_wait, c.per_tenant,
                                        backends=backends, group=group,
                                        tenant_weights=c.tenant_weights, aging=c.aging)
    return ConcurrencyLimiter(c.limit, c.queue, c.max_wait, c.per_tenant,
                              tenant_weights=c.tenant_weights, aging=c.aging)


def width_limiters(backends: StateBackends, scope: str) -> WidthLimiters:
    """How a ``fanout.width`` of ``scope`` (a route's name, or ``*`` for the top-level block)
    builds each live run's limiter: in this process's memory, or with the Redis backend one
    whose ``width`` holds across replicas (leases in the group
    ``<scope>/run:<len(tenant)>:<tenant>:<run>``, one hash slot per tenant's run, the length
    keeping any tenant and run pair from reading as another; the run's queue stays local,
    :mod:`policies.shared_concurrency`). ``*`` is no route name, so the top level's leases
    never mix with a route's."""
    if backends.redis is None:
        return local_width
    # One outage line for all of the scope's runs (each run's limiter is made anew once its
    # calls have all ended, so a limiter's own "once" would be once per call).
    notice = OutageNotice("fanout.width (top level)" if scope == "*"
                          else f"fanout.width of route {scope}")

    def shared(tenant: str, run: str, width: int, max_wait: float) -> ConcurrencyLimiter:
        return SharedConcurrencyLimiter(width, WIDTH_QUEUE, max_wait, None, backends=backends,
                                        group=f"{scope}/run:{len(tenant)}:{tenant}:{run}",
                                        notice=notice)
    return shared


class Plan:
    """How one call is admitted and forwarded: its route's steps and its operation's.

    Attributes:
        operation: the operation's object, ``None`` for a call no block applies to.
        policies: the admission steps, in order (:class:`policies.pipeline.Policy`).
        runless: ``policies`` less ``run_steps``, the steps that act only on a call of a run
            (run tree, run limits, fan-out): the steps of a call that names no run.
        breakers: admit and hear every upstream attempt (the route's, then the operation's).
        tool_breaker: the one of ``breakers`` that also counts MCP tool failures, or ``None``.
        retry: the retry policy, or ``None`` (the operation's replaces the route's).
        timeouts: the upstream timeouts (the operation's replace the route's).
        idempotent: retries may repeat the call whatever its method (``idempotent`` of the
            route or of the operation).
        reads_request: a step reads an MCP call's parsed request (an ``mcp`` route's
            idempotency keys it): the request path hands it over (``Call.parsed``) rather
            than the step parsing the body again.
    """

    __slots__ = ("breakers", "idempotent", "operation", "policies", "reads_request", "retry",
                 "runless", "timeouts", "tool_breaker")

    def __init__(self, operation: Operation | None, policies: Iterable[Policy | None],
                 breakers: Iterable[Breaker | None], tool_breaker: Breaker | None,
                 retry: RetryPolicy | None, timeouts: TimeoutsConfig, idempotent: bool,
                 run_steps: Iterable[Policy | None] = ()) -> None:
        self.operation = operation
        self.policies: tuple[Policy, ...] = tuple(p for p in policies if p is not None)
        self.reads_request = any(isinstance(p, Idempotency) and p.mcp for p in self.policies)
        by_run = {id(p) for p in run_steps if p is not None}
        self.runless: tuple[Policy, ...] = tuple(p for p in self.policies
                                                 if id(p) not in by_run)
        self.breakers: tuple[Breaker, ...] = tuple(b for b in breakers if b is not None)
        self.tool_breaker = tool_breaker
        self.retry = retry
        self.timeouts = timeouts
        self.idempotent = idempotent


class Operation:
    """One operation block's live policy objects.

    Args:
        name: the block's key (a tool, an endpoint pattern, a model, or ``default``).
        config: the block.
        route: the route's config (name, protocol, ``idempotent``).
        backends: the route's state backends.
        on_event: the breaker's transition events (``on_event(event, **fields)``); they carry
            the route and the operation.
        budgets: the route's budgets, charged with the operation's costs.
        run_header: the header naming a run, for the message when a per-run budget needs it.
    """

    #: Attributes holding policy objects (shown by the admin API under their name).
    POLICIES = ("idempotency", "breaker", "rate", "costs", "concurrency", "retry")

    __slots__ = ("breaker", "concurrency", "config", "costs", "group", "idempotency", "name",
                 "rate", "retry")

    def __init__(self, name: str, config: OperationConfig, route: RouteConfig,
                 backends: StateBackends, on_event: Callable[..., None],
                 budgets: Budgets | None, run_header: str) -> None:
        self.name = name
        self.config = config
        #: The operation's counters in the state backends: distinct from the route's and
        #: from every other operation's.
        self.group = operation_group(route.name, name)
        self.concurrency = new_limiter(config.concurrency, backends, self.group)
        self.rate = (OperationRate(RateLimiter(config.rate, backends, self.group,
                                                operation=name))
                     if config.rate else None)
        i = config.idempotency
        self.idempotency = (Idempotency(i, self.group, backends=backends,
                                        mcp_calls=route.protocol == "mcp")
                            if i and i.mode != "off" else None)
        cb = config.circuit_breaker

        def emit(event: str, **fields: Any) -> None:
            on_event(event, **{**fields, "route": route.name, "operation": name})

        self.breaker = Breaker(cb, self.group, emit, backends) if cb else None
        self.retry = RetryPolicy(config.retry) if config.retry else None
        self.costs = (Costs(config.cost_per_call or 0.0, config.cost_per_second or 0.0,
                            budgets, run_header)
                      if config.cost_per_call or config.cost_per_second else None)

    def take_over(self, old: Operation | None, carry: TakeOver) -> None:
        """Carry the live state of ``old``, the operation of the same name this one replaces
        on a reload (as :meth:`proxy.routes.Route.take_over` does for the route's); ``None``
        for a block the running config lacks (it may have had it before: ``carry``)."""
        new, prev = self.config, old and old.config
        self.concurrency = carry(self._key("concurrency"), old and old.concurrency,
                                 self.concurrency, prev and prev.concurrency, new.concurrency,
                                 reconfigure_limiter)
        self.rate = carry(self._key("rate"), old and old.rate, self.rate, prev and prev.rate,
                          new.rate, lambda rate, c: rate.limiter.reconfigure(c))
        self.idempotency = carry(self._key("idempotency"), old and old.idempotency,
                                 self.idempotency, prev and prev.idempotency, new.idempotency,
                                 lambda keys, c: keys.reconfigure(c))
        self.breaker = carry(self._key("breaker"), old and old.breaker, self.breaker,
                             prev and prev.circuit_breaker, new.circuit_breaker)
        self.retry = carry(self._key("retry"), old and old.retry, self.retry,
                           prev and prev.retry, new.retry)

    def retire(self, carry: TakeOver) -> None:
        """A reload removed this whole block: each of its objects as a removed block's
        (:class:`TakeOver`)."""
        for name in self.POLICIES:
            carry.retire(self._key(name), getattr(self, name))

    def _key(self, policy: str) -> str:
        """The key of this operation's ``policy`` among its route's blocks (:class:`TakeOver`)."""
        return f"operations[{self.name!r}].{policy}"

    def state(self) -> dict[str, Any]:
        """The operation's live state for the admin API (JSON-ready)."""
        out: dict[str, Any] = {}
        for name in self.POLICIES:
            policy = getattr(self, name)
            state = getattr(policy, "state", None)
            out[name] = None if policy is None else (state() if state else {})
        return out


class OperationIndex:
    """Which of a route's operation blocks a call is under, found from what it asks (the
    rule of :meth:`Operations.resolve`), by the blocks' names alone: ``sluice dlq replay``
    finds a dead letter's block from the config with it.

    Args:
        key: the key naming the route's operations (``tools``, ``endpoints`` or ``models``).
        names: the names of its blocks, in file order (``endpoints:`` match in that order).

    Raises:
        ValueError: an ``endpoints:`` name is no ``"METHOD /path"`` (config validation
            refuses those first).
    """

    __slots__ = ("default", "deployments", "endpoints", "key", "names")

    def __init__(self, key: str, names: Iterable[str], protocol: str = "",
                 upstream: str = "") -> None:
        self.key = key
        self.names = frozenset(names)
        #: On ``openai`` routes, the upstream URL's own path (``upstream``: the route's), which
        #: the call's path follows: Azure OpenAI names the model in the path the upstream sees
        #: (:func:`policies.paths.deployment_named`); ``None`` elsewhere.
        self.deployments = (urlsplit(upstream).path if key == "models" and protocol == "openai"
                            else None)
        self.default = DEFAULT_OPERATION if DEFAULT_OPERATION in self.names else None
        #: ``endpoints:`` as ``(method, path pattern folded to lower case, block name)``, in
        #: file order: upstreams that route case-insensitively (Express, ASP.NET Core) would
        #: serve ``/V1/JOBS/3`` as ``/v1/jobs/3`` (:mod:`policies.paths`).
        self.endpoints: list[tuple[str, PathGlob, str]] = []
        if key == "endpoints":
            for name in names:
                if name != DEFAULT_OPERATION:
                    method, pattern = endpoint_pattern(name)
                    self.endpoints.append((method, PathGlob(pattern.pattern.lower()), name))

    def find(self, method: str, path: str, body: bytes, tool: str | None,
             headers: Mapping[str, str] | None = None,
             model: str | None = None) -> tuple[str | None, str | None]:
        """``(name, block)`` of a call: its name for metrics and events (the tool, the
        matching endpoint pattern or ``default``, the model; ``None`` when it has none), and
        the name of the block that applies (``None`` for none).

        ``path``: the upstream's path (after the route's prefix, query included or not);
        ``tool``: the tool of an MCP ``tools/call`` (:attr:`policies.mcp.McpPost.tool`),
        ``None`` for other calls, which have no operation; ``headers``: the request's, for
        the ``Content-Type`` of a form naming its model.

        The model (``model``: as :meth:`read_model` read it, else read here with
        :meth:`model`) is the Azure deployment the path names, on ``openai`` routes; else
        the body's ``model`` (a JSON member, or a form's field: :func:`model_of`). Only a
        POST takes a model block: a POST naming none that Sluice can read is ``default``'s,
        as the upstream serves it some model; other methods (``GET /v1/models``, a file's
        download) none.
        """
        if self.key == "endpoints":
            # Every reading of the path (policies.paths), folded to lower case as the patterns
            # are: the first pattern one matches applies.
            found = readings(path)
            for allowed, pattern, name in self.endpoints:
                if (allowed == "*" or allowed == method) and any(
                        pattern.fullmatch(reading) for reading in found):
                    return name, name
            default = self.default
            return (DEFAULT_OPERATION, default) if default is not None else (None, None)
        if self.key == "tools":
            if tool is None:
                return None, None
            name = tool
        elif method != "POST":
            # Only a POST asks a model for an answer: GET /v1/models, a file's download and
            # the like take the route's policies alone, never default's block.
            return None, None
        else:
            name = model if model is not None else self.model(path, body, headers)
        if not name:  # a request naming no model is the upstream's default model's
            default = self.default
            return (DEFAULT_OPERATION, default) if default is not None else (None, None)
        if name not in self.names or name == DEFAULT_OPERATION:
            return name, self.default
        return name, name

    def deployment(self, path: str) -> str | None:
        """The Azure deployment ``path`` (after the route's prefix) names on an ``openai``
        route (:func:`policies.paths.deployment_named`), else ``None``."""
        base = self.deployments
        return deployment_named(base + path) if base is not None else None

    def model(self, path: str, body: bytes, headers: Mapping[str, str] | None) -> str:
        """The model a POST of ``models:`` names: the Azure deployment of its ``path``, else
        its body's (:func:`model_of`, a form parsed in this thread)."""
        deployment = self.deployment(path)
        return deployment if deployment is not None else model_of(body, headers)

    async def read_model(self, path: str, body: bytes, headers: Mapping[str, str] | None,
                         forms: FormReader) -> str:
        """:meth:`model` from the event loop: a large form parsed in ``forms``' worker
        thread (:func:`read_model_of`)."""
        deployment = self.deployment(path)
        return (deployment if deployment is not None
                else await read_model_of(body, headers, forms))


def model_of(body: bytes, headers: Mapping[str, str] | None) -> str:
    """The model an LLM request's body names: its JSON ``model``
    (:func:`policies.usage.model_named`), else a form's ``model`` field (OpenAI's
    transcriptions and image edits send ``multipart/form-data``:
    :func:`policies.bodies.form_field`); ``""`` for none, or a body neither reads."""
    model = model_named(body)
    if model is None and (content_type := _form_type(body, headers)) is not None:
        model = form_field(body, content_type, "model")
    return model or ""


async def read_model_of(body: bytes, headers: Mapping[str, str] | None,
                        forms: FormReader) -> str:
    """:func:`model_of` from the event loop: a multipart form over
    :data:`policies.bodies.FORM_OFF_LOOP_BYTES` is parsed in ``forms``' worker thread
    (:meth:`policies.bodies.FormReader.field`; a 32 MiB urlencoded body of ``%41`` parsed on
    the loop froze every call for 9 s, a hostile trial), an urlencoded one that large not
    at all."""
    model = model_named(body)
    if model is None and (content_type := _form_type(body, headers)) is not None:
        model = await forms.field(body, content_type, "model")
    return model or ""


def _form_type(body: bytes, headers: Mapping[str, str] | None) -> str | None:
    """The ``Content-Type`` of a request whose non-empty ``body`` is a form
    (:func:`policies.bodies.is_form`), else ``None``."""
    if not body or headers is None:
        return None
    content_type = headers.get("Content-Type", "")
    return content_type if is_form(content_type) else None


def operation_group(route: str, name: str) -> str:
    """The group an operation block's state is kept under, ``ROUTE/NAME``: its counters,
    breaker and idempotency records, apart from the route's and every other block's."""
    return f"{route}/{name}"


def replaces_idempotency(block: OperationConfig) -> bool:
    """Whether an operation block's ``idempotency`` replaces its route's for its calls: as
    soon as it has one, ``mode: off`` included (its calls are then keyed by nothing)."""
    return block.idempotency is not None


def idempotency_of(route: RouteConfig, block: str | None) -> tuple[str, IdempotencyConfig | None]:
    """``(group, idempotency)`` of a call under operation block ``block`` (a name
    :meth:`OperationIndex.find` gave; ``None`` for none): the ``idempotency`` block its key
    is handled by (``None`` for none or ``mode: off``) and the group its shared records are
    named by (:func:`policies.idempotency.shared_record_key`): the operation's, when its
    block replaces the route's (:func:`replaces_idempotency`), else the route's."""
    group, keys = route.name, route.idempotency
    if block is not None:
        own = route.operations()[1].get(block)
        if own is not None and replaces_idempotency(own):
            group, keys = operation_group(route.name, block), own.idempotency
    return group, keys if keys is not None and keys.mode != "off" else None


class Operations:
    """A route's operation blocks and how a call finds its own.

    Args:
        route: the route's config; its blocks are those under
            :meth:`~policies.config.RouteConfig.operations`.
        backends, on_event, budgets, run_header: as :class:`Operation` takes them.
        forms: reads a form's model (the runtime's, shared by its routes).
    """

    __slots__ = ("by_name", "forms", "index", "key", "prefix_len", "protocol")

    def __init__(self, route: RouteConfig, backends: StateBackends,
                 on_event: Callable[..., None], budgets: Budgets | None,
                 run_header: str, forms: FormReader) -> None:
        self.key, blocks = route.operations()
        self.forms = forms
        self.protocol = route.protocol
        self.prefix_len = len(route.path_prefix) - 1
        self.by_name = {name: Operation(name, block, route, backends, on_event, budgets,
                                        run_header)
                        for name, block in blocks.items()}
        self.index = OperationIndex(self.key, self.by_name, route.protocol, route.upstream)

    def __iter__(self) -> Iterator[Operation]:
        """The operation blocks, in file order."""
        return iter(self.by_name.values())

    async def resolve(self, call: Call) -> tuple[str | None, Operation | None]:
        """``(name, operation)`` of ``call`` (:meth:`OperationIndex.find`): its name for
        metrics and events, and the block that applies (``None`` for none). On ``models:``
        a POST's model is read once, here (:meth:`OperationIndex.read_model`), and kept as
        ``call.model`` for the accounting, which would otherwise read the body again.

        On ``mcp`` routes the name is ``call.operation`` as the handler set it (the tool of a
        ``tools/call``); other MCP calls (``resources/read``, ...) have no operation.
        """
        path = call.path[self.prefix_len:]
        index = self.index
        model = None
        if index.key == "models" and call.method == "POST":
            model = call.model = await index.read_model(path, call.body, call.headers,
                                                        self.forms)
        name, block = index.find(call.method, path, call.body, call.operation, call.headers,
                                 model)
        return name, self.by_name[block] if block is not None else None

    def take_over(self, old: Operations | None, carry: TakeOver) -> None:
        """Keep the live state of the operations ``old`` had under the same names (``old``:
        the running route's, ``None`` if it has none); retire those it had and these lack."""
        before = old.by_name if old is not None else {}
        for name, previous in before.items():
            if name not in self.by_name:
                previous.retire(carry)
        for name, op in self.by_name.items():
            op.take_over(before.get(name), carry)

    def retire(self, carry: TakeOver) -> None:
        """A reload removed every operation block (:meth:`Operation.retire`)."""
        for op in self.by_name.values():
            op.retire(carry)

    def state(self) -> dict[str, Any]:
        """Every operation block's live state, by name (JSON-ready)."""
        return {name: op.state() for name, op in self.by_name.items()}




class OperationRate:
    """An operation's ``rate``: one request unit from its buckets and, on a model with
    ``rate.tokens``, the call's reserved tokens (``call.cost``, set by the route's token
    accounting: estimated input + output cap), all in one atomic take."""

    __slots__ = ("limiter",)

    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter

    def state(self) -> dict[str, object]:
        return self.limiter.state()

    async def admit(self, call: Call) -> Units | None:
        """The pipeline step; see the class docstring.

        Raises:
            Rejected: ``rate_limited`` or ``token_rate_limited`` (429), ``exceeds_limit``
                (400, more tokens than the whole bucket), ``state_unavailable`` (503).
        """
        limiter = self.limiter
        takes = limiter.request_takes(call.tenant)
        if limiter.tokens is not None and call.cost is not None:
            takes.append(limiter.token_take(int(call.cost)))
        if not takes:
            return None
        return await limiter.take(takes)


class Costs:
    """An operation's costs charged to the route's ``usd`` budgets (the module docstring).

    Args:
        per_call: USD per upstream attempt.
        per_second: USD per second of upstream time.
        budgets: the route's budgets; without ``usd`` limits the cost is only reported.
        run_header: the header naming a run, for the message when a per-run budget needs it.
    """

    __slots__ = ("budgets", "per_call", "per_second", "run_header")

    def __init__(self, per_call: float, per_second: float, budgets: Budgets | None,
                 run_header: str) -> None:
        self.per_call = per_call
        self.per_second = per_second
        self.budgets = (budgets if budgets is not None
                        and any(limit.unit == "usd" for limit in budgets.limits) else None)
        self.run_header = run_header

    def state(self) -> dict[str, object]:
        return {"cost_per_call": self.per_call, "cost_per_second": self.per_second}

    async def admit(self, call: Call) -> CostCharge:
        """The pipeline step: hold ``cost_per_call`` (at least :data:`MIN_HOLD_USD`) on the
        ``usd`` budgets, if any.

        Raises:
            Rejected: ``bad_request`` (400) when a per-run budget applies and the call names
                no run; ``budget_exhausted`` (429), ``exceeds_limit`` (400) or
                ``state_unavailable`` (503) from :meth:`Budgets.reserve_usd`.
        """
        budgets = self.budgets
        reservation = None
        if budgets is not None:
            usd_per_run = any(limit.unit == "usd" and limit.per == "run"
                              for limit in budgets.limits)
            if call.run is None and usd_per_run:
                raise Rejected(Reason.BAD_REQUEST, None,
                               f"send the {self.run_header} header: this route budgets per run")
            reservation = await budgets.reserve_usd(call.tenant, call.run, self.held_usd,
                                                    call.lineage)
        return CostCharge(self, call, reservation)

    @property
    def held_usd(self) -> float:
        """USD held on the budgets for a call before it is forwarded: one ``cost_per_call``,
        at least :data:`MIN_HOLD_USD`."""
        return max(self.per_call, MIN_HOLD_USD)


class CostCharge:
    """A call's cost, held until it ends: settled to ``attempts x cost_per_call + upstream
    seconds x cost_per_second``, counting only attempts that may have reached the upstream
    (one refused a connection costs nothing; nothing at all when none may have)."""

    __slots__ = ("call", "costs", "reservation")

    def __init__(self, costs: Costs, call: Call, reservation: Reservation | None) -> None:
        self.costs = costs
        self.call = call
        self.reservation = reservation

    def release(self, outcome: Outcome) -> None:
        costs, call = self.costs, self.call
        usd = 0.0
        if outcome.reached:
            usd = ((call.attempts - call.unsent) * costs.per_call
                   + call.upstream_seconds(time.monotonic()) * costs.per_second)
            call.operation_cost = round(usd, 9)
            if self.reservation is not None:
                # Charged as spent, past the hold by retries and upstream time: a budget can
                # be passed by this much (concurrent calls each by their own), so it is said.
                call.operation_overrun = max(round(usd - costs.held_usd, 9), 0.0)
        if self.reservation is not None and costs.budgets is not None:
            costs.budgets.settle_usd(self.reservation, usd)
            self.reservation = None
