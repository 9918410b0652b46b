"""Runs as the unit of work: run trees, fan-out limits, run budgets and cancellation.

A run is named by ``identity.run_header`` (``X-Run-ID``) *within its caller's tenant*: a run
is the pair (tenant, run id), so two tenants naming ``run-1`` have two runs, with their own
counts, links, fan-out and cancellation (as their token and USD budgets are their own,
``policies/budget.py``). ``identity.parent_run_header`` (``X-Parent-Run-ID``) links it to the
run that delegated it, looked up in the same tenant. The links make a tree, and the tree is
what Sluice reasons about:

* **Depth** is derived from the links (a root is depth 0, its child 1, ...), never read from
  a header, so an agent cannot claim to be shallower than it is. A run keeps the parent it was
  first seen with; a later, different parent (or one that would close a cycle) is ignored.
  One exception: a run first seen as a root whose calls have counted nothing yet (none live,
  no ``max_requests`` count) is linked by the first call that names a parent, and its
  descendants' depths follow.
* **Inheritance**: a call that names no priority takes its run's, else the nearest
  ancestor's; a call with no deadline of its own takes the earliest remaining deadline of
  its run's ancestors (a sub-agent cannot outlive the caller waiting for it; the run's own
  last deadline bounded the call that gave it).
* **Depth cap**: a call of a run more than :data:`MAX_DEPTH` levels below its root is refused
  (``fanout_limited``) whatever ``fanout.depth`` says, so every lineage reaches its root.
* **Run budgets** (``run: {max_duration, max_requests, warn_at}``) and token/USD budgets
  ``per: run`` count a run's calls *and its descendants'*: each call is counted on its run and
  on every ancestor (see ``policies/budget.py``), so a parent's limit bounds its whole subtree.
* **Fan-out** (``fanout: {width, depth}``): per run at most ``width`` calls in flight (more
  wait up to ``max_wait`` in the run's own queue) and at most ``depth`` levels of delegation.
* **Cancellation** (``POST /admin/runs/{run}/cancel``, in every tenant that has the run, or
  in one) marks the run and its descendants cancelled for ``run.cancel_ttl``, refuses their
  queued calls at once and closes their calls in flight (their tasks are cancelled, which
  closes the upstream connection; streamed usage is still charged by the accounting
  holding). A run created later under a cancelled ancestor is refused too.

A ``run`` or ``fanout`` block on a route limits the run's calls on that route; the same blocks
at the top level of the config limit them across all routes together. Both apply.

State lives behind :class:`RunRegistry` (one per server): this replica's runs, their live
calls and statistics. With the Redis backend it also asks the shared run state
(:mod:`policies.state.runs`) for what every replica must agree on: each call reads its run's
lineage, first-call times and cancellation from Redis and counts it for ``max_requests``
there (one round trip), and a cancel made on any replica is recorded there and reaches every
replica's queued and in-flight calls through pub/sub. Fan-out width is shared through the
limiters the server gives :class:`FanoutWidth` (leases in Redis, two round trips a call).
Inherited priorities and deadlines, and the statistics ``sluice runs`` shows stay per
replica. While Redis does not answer, ``state.on_unavailable`` applies: ``local`` decides
from this replica's own view (a ``1/state.replicas`` share of ``max_requests`` and of
``width``), ``reject`` refuses 503 ``state_unavailable``. A count Redis may have taken
though its answer was lost (sent to a frozen Redis, which runs it when it thaws), and a
give-back Redis did not answer, are given back once it answers again, each once
(:class:`GiveBacks`): calls that never reached the upstream spend nothing of the run. A
``max_requests`` count taken on the local share is added to the shared counts once Redis
answers again, once (:class:`OutageCount`), and given back as any other if its call never
reached the upstream: after an outage a run's shared count holds every call it made. A run
placed under its parent only here while Redis did not answer is linked there once it
answers (:class:`OutageLink`), so a cancel of an ancestor reaches its descendants on every
replica.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from policies.concurrency import ConcurrencyLimiter, queued_hook, report_expiry
from policies.config import FanoutConfig, RunConfig
from policies.logs import PER_CALL
from policies.pipeline import Call, Holding, Outcome, survive_leaving
from policies.rate import Background, unavailable
from policies.reasons import Reason, Rejected
from policies.redelivery import Redeliveries
from policies.state import Fallback, StateUnavailable
from policies.state.runs import NO_TAKE, Count, CountedOn, Lineage, RedisRuns, new_take_id
from policies.wording import counted

log = logging.getLogger("sluice")

T = TypeVar("T")

#: Response header on admitted calls once a run limit is ``warn_at`` used:
#: ``"max_requests";used=0.800`` (the fuller of the two limits).
RUN_WARNING_HEADER = "X-Sluice-Run-Warning"
#: A run with no call for this long is forgotten (its counts and first-call time with it).
RUN_IDLE_TTL_S = 86400.0
#: Runs remembered at most (about 1.5 KiB each with 100-character ids). Past it, the least
#: recently seen runs that hold nothing a limit needs are forgotten first: see
#: :meth:`RunRegistry.resolve`.
MAX_RUNS = 10_000
#: Runs remembered at most even when they hold ``max_requests`` counts (~150 MiB): past it, runs
#: that hold only counts (no call live, no cancellation in force, no child remembered) are
#: forgotten as the eviction's scan finds them, with their own counts (ancestors keep theirs).
MAX_COUNTED_RUNS = 100_000
#: Runs without a child looked at per eviction, so that one new run costs a bounded time even
#: when the least recently seen ones must all be kept (runs found to have gained a child since
#: they were listed are dropped from the list as they are met, each paid for by its listing).
EVICT_SCAN = 8
#: How often forgotten runs are swept, seconds.
SWEEP_INTERVAL_S = 60.0
#: Longest lineage (a run and its ancestors) Sluice follows: runs more than
#: :data:`MAX_DEPTH` levels below their root are refused, so every count, budget charge,
#: cancellation check and cycle check reaches the root.
MAX_LINEAGE = 64
#: Deepest a run may be below its root (a root is 0); a call of a deeper run is refused
#: ``fanout_limited`` whatever ``fanout.depth`` says, with the Redis backend too
#: (``policies.state.runs.MAX_LINEAGE`` is the same cap).
MAX_DEPTH = MAX_LINEAGE - 1
#: Queue of one run's width limiter (the route's own queue bounds the rest).
WIDTH_QUEUE = 1024
#: Suggested wait when a run's ``max_requests`` is held by calls not yet sent upstream,
#: seconds: they either reach it or give their count back within a queue wait or two.
PENDING_WAIT_S = 1.0
#: Give-backs and outage counts kept while the shared state does not answer (see
#: :class:`GiveBacks`), as ``policies.budget.MAX_PENDING`` keeps budget spend to reconcile.
MAX_GIVE_BACKS = 100_000


def too_deep(run: str, depth: int, verb: str) -> Rejected:
    """``fanout_limited`` (429, final) for a call of ``run``, which ``verb`` (``"is"``,
    ``"would be"``) ``depth`` levels below its root, past :data:`MAX_DEPTH`."""
    return Rejected(Reason.FANOUT_LIMITED, None,
                    f"depth: run {run} {verb} {counted(depth, 'level')} below its root; Sluice "
                    f"follows {MAX_DEPTH} at most", retry=False)


class RunInfo:
    """What Sluice knows of one run on this replica.

    Attributes:
        id, tenant: the run id and its tenant (every call of the run is the tenant's).
        key: ``(tenant, id)``, its key in :attr:`RunRegistry.runs`.
        parent: the parent run, or ``None`` for a root.
        depth: delegation levels below its root.
        started, started_wall: its first call (monotonic, Unix seconds).
        priority, deadline: the last explicitly given priority and deadline (monotonic) of
            its calls, inherited by descendants; ``None`` when none was given.
        counts: calls admitted per limit scope, its descendants' included.
        timed: a ``max_duration`` limit has measured its age (its ``started`` is then kept
            as its counts are: forgetting it would start the run's time over).
        calls, attempts, tokens, usd: its own calls finished, upstream attempts, tokens and
            USD charged (for ``sluice runs show`` and amplification).
        unpriced: its own calls that used tokens of a model ``pricing`` does not name: their
            cost is unknown, not 0 (``usd`` leaves them out).
        cancelled_until: monotonic seconds until which its calls are refused (0: never).
        live: its calls now being admitted, queued or forwarded.
        holders: per limit scope, the calls live here that hold a ``max_requests`` count of
            it (its descendants' included); ``None`` until the first.
    """

    __slots__ = ("attempts", "calls", "cancelled_until", "children", "counts", "deadline",
                 "depth", "holders", "id", "key", "last_seen", "live", "parent", "priority",
                 "started", "started_wall", "tenant", "timed", "tokens", "unpriced", "usd")

    def __init__(self, run: str, tenant: str, parent: RunInfo | None, now: float) -> None:
        self.id = run
        self.tenant = tenant
        self.key = (tenant, run)
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.started = now
        self.started_wall = time.time()
        self.last_seen = now
        self.priority: int | None = None
        self.deadline: float | None = None
        self.counts: dict[str, int] = {}
        #: A ``max_duration`` limit measured its age: its first-call time is held as counts are.
        self.timed = False
        self.calls = 0
        self.attempts = 0
        self.tokens = 0
        self.usd = 0.0
        self.unpriced = 0
        self.cancelled_until = 0.0
        #: Its child runs' ids (all of its tenant).
        self.children: set[str] = set()
        self.live: set[LiveCall] = set()
        self.holders: dict[str, set[Call]] | None = None

    def lineage(self) -> Iterator[RunInfo]:
        """This run, then its parent, up to the root: at most :data:`MAX_LINEAGE` runs,
        which reach the root of every run whose calls are admitted (:data:`MAX_DEPTH`)."""
        info: RunInfo | None = self
        for _ in range(MAX_LINEAGE):
            if info is None:
                return
            yield info
            info = info.parent


class LiveCall:
    """One call of a run, from admission to its end: what a cancel reaches."""

    __slots__ = ("call", "task")

    def __init__(self, call: Call, task: asyncio.Task[Any] | None) -> None:
        self.call = call
        self.task = task

    def cancel(self, why: str) -> None:
        """End the call now: its handler task is cancelled wherever it waits (a queue, the
        upstream's answer), and the request path answers ``run_cancelled`` (or cuts a
        stream already started); a call finishing after its caller left
        (:attr:`Call.background`) has that task cancelled instead, unless the call says how
        it stops (:attr:`Call.stop`: its MCP server is asked to cancel, and its answer
        awaited)."""
        if self.call.cancelled is None:
            self.call.cancelled = why
            if self.call.stop is not None:
                self.call.stop()
                return
            task = self.running
            if task is not None and not task.done():
                task.cancel()

    @property
    def running(self) -> asyncio.Task[Any] | None:
        """The task whose end is the call's: its handler's, or the one finishing its upstream
        exchange after its caller left (:attr:`Call.background`)."""
        return self.call.background or self.task


class RunRegistry:
    """Run trees and their counters, in this process's memory, with the shared run state
    beside them when there is one.

    Every operation on memory completes without suspending, so each is atomic on the event
    loop; the shared ones are each one script in Redis. Runs are keyed ``(tenant, run id)``.

    Args:
        clock: monotonic seconds.
        shared: the runs state every replica shares (Redis backend), or ``None``.
        fallback: what to do while ``shared`` does not answer (``state.on_unavailable``).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 shared: RedisRuns | None = None, fallback: Fallback | None = None) -> None:
        self.clock = clock
        self.runs: dict[tuple[str, str], RunInfo] = {}
        #: Runs that had no child when listed, least recently seen first: what eviction looks
        #: at (a run with a child is kept, and chains left their tips out of reach of a scan
        #: of all runs, oldest first). Entries that gained a child are dropped when met.
        self._leaves: OrderedDict[tuple[str, str], RunInfo] = OrderedDict()
        self._next_sweep = 0.0
        self.shared = shared
        self.fallback = fallback if fallback is not None else Fallback("local", 1)
        #: Give-backs of shared counts, which a holding's release cannot await.
        self.background = Background()
        #: What the run tracker's round trip counted, per call, until the call ends.
        self.counted: dict[Call, SharedCount] = {}
        #: Give-backs the shared state did not answer, until it does.
        self.give_backs = GiveBacks(shared, self.background)
        if shared is not None:
            self.give_backs.resend_when_up(shared.state.health)

    # -- the tree -----------------------------------------------------------------------------

    def resolve(self, run: str, parent: str | None, tenant: str) -> RunInfo:
        """The run ``run`` of ``tenant`` (created on first sight, linked under the tenant's
        run ``parent`` if given).

        Memory stays bounded whatever run ids callers send: past :data:`MAX_RUNS` runs, the
        least recently seen ones are forgotten if they hold nothing a limit needs (no call
        live, no ``max_requests`` count, no first-call time a ``max_duration`` measured, no
        cancellation in force, no child run remembered).
        A run kept only because it has a child counts as seen when its newest descendant was:
        once a chain's tip is among the least recently seen and holds nothing, it is
        forgotten, and each ancestor left childless and holding nothing with it, up the tree.
        A forgotten run loses only its statistics (``sluice runs show``) and the priority and
        deadline its descendants would inherit; if it calls again it starts as a new run.
        Runs that do hold something are kept until :data:`RUN_IDLE_TTL_S` after their last
        call, so that no spend of a run budget is lost; but past :data:`MAX_COUNTED_RUNS` runs
        (a caller sending a new run id per call), those holding only ``max_requests`` counts
        are forgotten too, with a warning.

        Raises:
            Rejected: ``fanout_limited`` (429, final) when the run, a root, would be linked
                under a ``parent`` whose chain is longer than :data:`MAX_LINEAGE` (it stays
                a root; with shared state it stays one unrefused here, and the shared tree
                decides). A new run is linked however deep: :class:`RunTracker` refuses its
                calls past :data:`MAX_DEPTH`.
        """
        now = self.clock()
        if now >= self._next_sweep:
            self._sweep(now)
        runs = self.runs
        key = (tenant, run)
        info = runs.pop(key, None)
        if info is None:
            up = None
            if parent is not None and parent != run:
                up = runs.get((tenant, parent)) or self.resolve(parent, None, tenant)
            # Linked however deep (its calls are refused past MAX_DEPTH, see RunTracker): a
            # run not remembered made its children roots, out of their ancestors' reach.
            info = RunInfo(run, tenant, up, now)
            runs[key] = info
            self._unlinked(info)
            if up is not None:
                up.children.add(run)
            if len(runs) > MAX_RUNS:
                self._evict(now, info)
        else:
            runs[key] = info  # last in the dict: the most recently seen
            if not info.children:
                self._unlinked(info)
            if info.parent is None and parent is not None and parent != run \
                    and not info.live and not info.counts:
                # Named as a root first only by a call that counted nothing: link it now,
                # unless the link would make a cycle. The check walks the parent's chain to
                # its root; one longer than MAX_LINEAGE would put the run past MAX_DEPTH:
                # the call is refused rather than the walk made longer (the shared script's).
                up = runs.get((tenant, parent)) or self.resolve(parent, None, tenant)
                if runs.get(key) is not info:
                    # Creating the parent made room by forgetting this run itself (childless,
                    # nothing live yet): remembered again, or its call would be linked on an
                    # object no cancel reaches (a review).
                    runs[key] = info
                    self._unlinked(info)
                above = self._above(info, up)
                if above is None and self.shared is None:
                    raise too_deep(run, MAX_LINEAGE, "would be at least")
                if above is False:  # with shared state, the shared tree decides (a review)
                    info.parent = up
                    up.children.add(run)
                    self._set_depths(info)
        info.last_seen = now
        return info

    @staticmethod
    def _above(info: RunInfo, node: RunInfo) -> bool | None:
        """Whether ``info`` is ``node`` or one of its ancestors, from a walk of ``node``'s
        chain up to its root; ``None`` when that chain is longer than :data:`MAX_LINEAGE`
        (not walked further: a run linked below it would be past :data:`MAX_DEPTH`). The
        check a 64-step walk made missed a root re-linked under the tip of a longer chain
        below it, closing a cycle (a hostile trial)."""
        walk: RunInfo | None = node
        for _ in range(MAX_LINEAGE):
            if walk is None:
                return False
            if walk is info:
                return True
            walk = walk.parent
        return False if walk is None else None

    def _unlinked(self, info: RunInfo) -> None:
        """``info`` has no child now (or was just seen without one): listed last among the
        runs eviction may forget (:meth:`_evict`)."""
        leaves = self._leaves
        leaves.pop(info.key, None)
        leaves[info.key] = info

    def get(self, run: str, tenant: str) -> RunInfo | None:
        """The run ``run`` of ``tenant``, if known here."""
        return self.runs.get((tenant, run))

    def tenants_of(self, run: str) -> list[str]:
        """The tenants that have a run named ``run`` here, sorted (a scan of every run known:
        for the admin API, never the request path)."""
        return sorted(tenant for tenant, name in self.runs if name == run)

    def adopt(self, info: RunInfo, lineage: Lineage) -> None:
        """Make this replica's tree agree with the shared one along ``info``'s lineage (its
        links, depths and first-call times), so that its limits, its cancels and the views
        see the tree every replica sees. Ancestors unknown here are created."""
        now = self.clock()
        wall = time.time()
        tenant = info.tenant
        up: RunInfo | None = None
        for index in range(len(lineage.ids) - 1, -1, -1):
            name = lineage.ids[index]
            node = info if index == 0 else self.runs.get((tenant, name))
            if node is None:
                node = self.runs[(tenant, name)] = RunInfo(name, tenant, up, now)
                self._unlinked(node)
                if up is not None:  # before the eviction: a parent with a child is kept
                    up.children.add(name)
                if len(self.runs) > MAX_RUNS:
                    self._evict(now, node)
            if node.parent is not up:
                # The shared links are acyclic and set here from the root down, so this
                # cannot make a cycle: ``up``'s own lineage is the rest of ``lineage``.
                old = node.parent
                if old is not None:
                    old.children.discard(name)
                    if not old.children:
                        self._unlinked(old)
                node.parent = up
            if up is not None:
                up.children.add(name)
            if node.depth != (0 if up is None else up.depth + 1):
                self._set_depths(node)
            age = lineage.ages[index]
            node.started = now - age
            node.started_wall = wall - age
            up = node

    def _set_depths(self, info: RunInfo) -> None:
        """Derive the depth of ``info`` and of every descendant known here from their links
        again, after ``info``'s own link was made or moved: a child's depth was set from its
        parent's when it was first seen, and a root linked later under a chain left its
        children a level too shallow for ``fanout.depth`` (a new user's trial)."""
        for node in self.subtree(info):  # parents before children
            node.depth = 0 if node.parent is None else node.parent.depth + 1

    def subtree(self, info: RunInfo) -> list[RunInfo]:
        """``info`` and every descendant known here, parents before children (each once,
        even were the links to make a cycle: a cycle looped here for ever, a hostile trial)."""
        out, todo = [], [info]
        seen = {info.key}
        tenant = info.tenant
        while todo:
            node = todo.pop()
            out.append(node)
            for name in node.children:
                child = self.runs.get((tenant, name))
                if child is not None and child.key not in seen:
                    seen.add(child.key)
                    todo.append(child)
        return out

    # -- counters (run budgets) ---------------------------------------------------------------

    def take_request(self, scope: str, lineage: list[RunInfo], limit: int) -> RunInfo | None:
        """Count one call on every run of ``lineage`` for ``scope``, or none of them: returns
        the first run already at ``limit``, else ``None`` (counted)."""
        for info in lineage:
            if info.counts.get(scope, 0) >= limit:
                return info
        for info in lineage:
            info.counts[scope] = info.counts.get(scope, 0) + 1
        return None

    def give_back_request(self, scope: str, lineage: list[RunInfo]) -> None:
        """Undo :meth:`take_request` for a call that never reached the upstream."""
        for info in lineage:
            info.counts[scope] = max(0, info.counts.get(scope, 0) - 1)

    def count_outage(self, scope: str, lineage: list[RunInfo]) -> OutageCount:
        """Keep a count :meth:`take_request` took on the local share while the shared state
        did not answer, to add to the shared counts of ``lineage`` once it answers
        (:class:`GiveBacks`): else a run got its whole ``max_requests`` again after an outage
        (a hostile trial: 40 calls served on a limit of 20 by 2 replicas)."""
        outage = OutageCount(scope, (lineage[0].tenant, tuple(node.id for node in lineage)))
        self.give_backs.keep(outage)
        return outage

    def give_back_outage(self, outage: OutageCount) -> None:
        """The call of ``outage`` never reached the upstream: undo its add to the shared
        counts (once added; a give-back that arrives first keeps it from being added)."""
        self.give_back(outage.take, (outage.scope,),
                       outage.counted_on if outage.added else None)

    def settle_count(self, call: Call) -> None:
        """The call ended: give back the shared counts it took at admission that no run
        limit claimed (it was refused, replayed or cancelled before that step)."""
        part = self.counted.pop(call, None)
        if part is None or not part.lineage.counted or self.shared is None:
            return
        unclaimed = [count.scope for count in part.counts if count.scope not in part.claimed]
        if unclaimed:
            self.give_back(part.take, unclaimed, (part.lineage.tenant, part.lineage.ids))

    def give_back(self, take: str, scopes: Sequence[str],
                  counted_on: CountedOn | None = None) -> None:
        """Give back the shared count ``take`` took in ``scopes`` (its call never reached
        the upstream); ``counted_on`` when the shared state answered that it counted (see
        :meth:`RedisRuns.give_back_request`). Never awaits: it runs as a task, and one the
        shared state does not answer is sent again once it answers (:class:`GiveBacks`). No
        scope: nothing was counted (a run with no ``max_requests``), nothing is sent."""
        if scopes:
            self.background.start(self.give_backs.give_back(take, tuple(scopes), counted_on),
                                  "run request give-back")

    async def counting(self, step: Awaitable[T], take: str, scopes: Sequence[str]) -> T:
        """Await ``step``, a shared count taken under ``take`` in ``scopes``: if the shared
        state does not answer it but it was sent, a frozen or slow Redis may still count
        the call, which will never reach the upstream (it is refused, or decided on this
        replica's own view): given back (:meth:`give_back`), once Redis answers if not now.
        Whether the caller waits for the answer or has left (:func:`survive_leaving`).

        Raises:
            StateUnavailable: as ``step`` does.
        """
        try:
            result = await step
        except StateUnavailable as exc:
            if exc.maybe_applied:
                self.give_back(take, scopes)
            raise
        self.give_backs.kick()  # Redis answers: give-backs it did not answer can go in now
        return result

    # -- cancellation -------------------------------------------------------------------------

    def cancel(self, run: str, ttl_s: float, tenant: str) -> tuple[list[RunInfo],
                                                                   list[LiveCall]]:
        """Cancel ``tenant``'s run ``run`` and its descendants on this replica for ``ttl_s``
        seconds (what a cancel made here, or heard from another replica, does here); the
        run is created if unknown, so that its first calls are refused too. Other tenants'
        runs of that name are not touched.

        The descendants are the runs below ``run`` in this replica's tree, and the tenant's
        runs of live calls whose lineage, as the shared state gave it, includes ``run``.

        Returns:
            ``(runs, calls)``: the runs now cancelled, and their calls that were live (each
            already told to end: see :meth:`LiveCall.cancel`).
        """
        return self.cancel_in(run, ttl_s, (tenant,))

    def cancel_in(self, run: str, ttl_s: float, tenants: Iterable[str]
                  ) -> tuple[list[RunInfo], list[LiveCall]]:
        """:meth:`cancel` in each of ``tenants`` at once: one look at the runs known here for
        all of them (once per tenant, a cancel of an id many tenants have cost tenants x
        runs on the event loop: 1.7 s at 9,000 tenants, a review)."""
        until = self.clock() + ttl_s
        wanted = dict.fromkeys(tenants)  # in the order given: the answer lists them so
        runs: list[RunInfo] = []
        seen: set[tuple[str, str]] = set()
        for tenant in wanted:
            for node in self.subtree(self.resolve(run, None, tenant)):
                if node.key not in seen:
                    runs.append(node)
                    seen.add(node.key)
        for node in self.runs.values():
            if node.live and node.tenant in wanted and node.key not in seen and any(
                    run in live.call.lineage for live in node.live):
                runs.append(node)
                seen.add(node.key)
        calls: list[LiveCall] = []
        for node in runs:
            node.cancelled_until = max(node.cancelled_until, until)
            calls.extend(node.live)
        for live in calls:
            live.cancel(f"run {run} was cancelled")
        return runs, calls

    def cancelled_by(self, info: RunInfo) -> RunInfo | None:
        """The run of ``info``'s lineage whose cancellation refuses its calls now, if any."""
        now = self.clock()
        for node in info.lineage():
            if node.cancelled_until > now:
                return node
        return None

    # -- housekeeping -------------------------------------------------------------------------

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + SWEEP_INTERVAL_S

        def idle(info: RunInfo) -> bool:
            return (not info.live and not info.children and info.cancelled_until <= now
                    and now - info.last_seen > RUN_IDLE_TTL_S)

        # A run with a child remembered is kept (as eviction keeps it): the child links to
        # this object, so forgetting it would leave the child under a run that no cancel,
        # count or view of that name reaches. An idle child goes first, then its parent if
        # that leaves it idle and childless, up the tree.
        for key in [key for key, info in self.runs.items() if idle(info)]:
            info = self.runs.get(key)
            while info is not None and idle(info) and self.runs.get(info.key) is info:
                del self.runs[info.key]
                self._leaves.pop(info.key, None)
                parent = info.parent
                if parent is not None:
                    parent.children.discard(info.id)
                    if not parent.children:
                        self._unlinked(parent)
                info = parent

    def _evict(self, now: float, new: RunInfo) -> None:
        """Forget least recently seen runs that hold nothing (see :meth:`resolve`) until at
        most :data:`MAX_RUNS` remain, looking at :data:`EVICT_SCAN` runs without a child at
        most (never at ``new``, the run being created). Each one forgotten takes with it
        its ancestors that are left childless, hold nothing and were seen no later than it
        (as :meth:`_sweep` does): a forgotten run never leaves a child remembered."""
        runs, leaves = self.runs, self._leaves
        looked = 0
        while len(runs) > MAX_RUNS and looked < EVICT_SCAN and leaves:
            key = next(iter(leaves))
            info = leaves.pop(key)
            if runs.get(key) is not info or info.children:
                continue  # forgotten by the sweep, or a parent now: listed again when not
            looked += 1
            if info is new or not self._forgettable(info, now):
                leaves[key] = info  # kept: to the end, so the next scan looks further
                continue
            seen = info.last_seen
            while True:
                del runs[info.key]
                parent = info.parent
                if parent is None:
                    break
                parent.children.discard(info.id)
                if parent.children:
                    break
                if len(runs) > MAX_RUNS and parent is not new and parent.last_seen <= seen \
                        and self._forgettable(parent, now):
                    leaves.pop(parent.key, None)
                    info = parent  # seen no later than the least recently seen: next
                    continue
                self._unlinked(parent)
                if parent.last_seen <= seen:  # older than every run listed: first in line
                    leaves.move_to_end(parent.key, last=False)
                break

    def _forgettable(self, info: RunInfo, now: float) -> bool:
        """``info``, a run without a child, holds nothing a limit needs (see :meth:`resolve`):
        no call live, no cancellation in force on it or an ancestor, and no ``max_requests``
        count or measured ``max_duration``, unless :data:`MAX_COUNTED_RUNS` runs are
        remembered (then those go too, with a warning)."""
        if info.live or any(node.cancelled_until > now for node in info.lineage()):
            # A run under a cancelled ancestor holds that link: forgotten, its child's next
            # call named it anew as a root and was served (a review).
            return False
        if info.timed or any(info.counts.values()):
            if len(self.runs) < MAX_COUNTED_RUNS:
                return False
            # One text whatever the run, so that the log's repeat filter folds a flood.
            log.warning("more than %d runs remembered: runs holding only max_requests "
                        "counts are forgotten, their counts with them", MAX_COUNTED_RUNS,
                        extra=PER_CALL)
        return True

    def view(self, info: RunInfo, *, detail: bool = False) -> dict[str, Any]:
        """One run as the admin API shows it (JSON-ready), descendants' totals included."""
        now = self.clock()
        tree = self.subtree(info)
        calls = sum(node.calls for node in tree)
        attempts = sum(node.attempts for node in tree)
        out: dict[str, Any] = {
            "run": info.id,
            "tenant": info.tenant,
            "parent": info.parent.id if info.parent else None,
            "depth": info.depth,
            "started": round(info.started_wall, 3),
            "age_s": round(now - info.started, 3),
            "inflight": sum(1 for n in tree for c in n.live
                            if c.call.phase in ("forwarding", "answering")),
            "queued": sum(1 for n in tree for c in n.live if c.call.phase == "queued"),
            "calls": calls,
            "attempts": attempts,
            "amplification": round(attempts / calls, 3) if calls else None,
            "tokens": sum(node.tokens for node in tree),
            "usd": round(sum(node.usd for node in tree), 9),
            "unpriced_calls": sum(node.unpriced for node in tree),
            "cancelled": self.cancelled_by(info) is not None,
            "descendants": len(tree) - 1,
        }
        if detail:
            out["children"] = sorted(info.children)
            out["own"] = {"calls": info.calls, "attempts": info.attempts,
                          "tokens": info.tokens, "usd": round(info.usd, 9),
                          "unpriced_calls": info.unpriced}
            out["live_calls"] = [
                {"request_id": c.call.request_id, "run": node.id, "route": c.call.route,
                 "phase": c.call.phase, "age_s": round(now - c.call.received_at, 3)}
                for node in tree for c in node.live
            ]
        return out


#: A kept give-back: the take's id, its scopes, and the runs it was heard to count on.
_GiveBack = tuple[str, tuple[str, ...], CountedOn | None]


class OutageCount:
    """A ``max_requests`` count this replica took on its local share while the shared
    state did not answer (``state.on_unavailable: local``), to add to the shared counts once
    it answers (:class:`GiveBacks`), on the lineage the shared count would have been taken
    on, uncapped: the call was admitted already.

    Attributes:
        take: the id it is added under (:meth:`RedisRuns.take_request`): added once however
            often it is sent, and not at all if given back first.
        scope: the limit scope counted.
        counted_on: ``(tenant, run ids)``, the run first.
        added: the shared state answered that it added it.
    """

    __slots__ = ("added", "counted_on", "scope", "take")

    def __init__(self, scope: str, counted_on: CountedOn) -> None:
        self.take = new_take_id()
        self.scope = scope
        self.counted_on = counted_on
        self.added = False

    def __repr__(self) -> str:
        return f"OutageCount({self.take!r}, {self.scope!r}, {self.counted_on!r})"


class OutageLink:
    """A run this replica linked under its parent in its own tree while the shared state
    did not answer the run's admission (``state.on_unavailable: local``), to link there too
    once it answers (:meth:`RedisRuns.link`, through :class:`GiveBacks`). Without it the
    shared tree could hold the run as a root for good (a descendant's admission on another
    replica makes its hash, and a run that counted is never linked later), and a cancel of
    an ancestor did not reach the run's descendants on replicas that ask Redis.

    Attributes:
        tenant, run, parent: the run, and the parent this replica placed it under.
    """

    __slots__ = ("parent", "run", "tenant")

    def __init__(self, tenant: str, run: str, parent: str) -> None:
        self.tenant = tenant
        self.run = run
        self.parent = parent

    def __repr__(self) -> str:
        return f"OutageLink({self.tenant!r}, {self.run!r}, {self.parent!r})"


class GiveBacks(Redeliveries["_GiveBack | OutageCount | OutageLink"]):
    """Give-backs of shared ``max_requests`` counts the shared state did not answer, and
    counts taken on the local share while it did not answer (:class:`OutageCount`), sent
    once it answers (:class:`policies.redelivery.Redeliveries`, as budget spend is), in the
    order they were kept.

    Each names the id its count was taken under (:meth:`RedisRuns.give_back_request`), so it
    applies once however often it is sent: one Redis ran though its answer was lost (a
    frozen Redis runs what was sent to it when it thaws) finds nothing the second time, and
    one sent before the count it gives back has run keeps that count from being taken (an
    outage count's too). They are sent again when the health sees Redis up again and
    whenever a run call is answered (:meth:`kick`). Kept up to :data:`MAX_GIVE_BACKS`.

    Args:
        shared: the shared run state (``None``: memory only, nothing to give back there).
        background: where the round runs (shutdown waits for it).
    """

    __slots__ = ("_links", "_shared")

    def __init__(self, shared: RedisRuns | None, background: Background) -> None:
        super().__init__(background, MAX_GIVE_BACKS)
        self._shared = shared
        #: ``(tenant, run)`` of each :class:`OutageLink` kept: one per run, not per call.
        self._links: set[tuple[str, str]] = set()

    def keep_link(self, tenant: str, run: str, parent: str) -> None:
        """Keep the link of ``tenant``'s ``run`` under ``parent`` (:class:`OutageLink`) for
        when the shared state answers, unless one of that run is kept already."""
        if (tenant, run) not in self._links:
            self._links.add((tenant, run))
            self.keep(OutageLink(tenant, run, parent))

    async def give_back(self, take: str, scopes: tuple[str, ...],
                        counted_on: CountedOn | None = None) -> None:
        """Give back the count ``take`` took in ``scopes`` now
        (:meth:`RedisRuns.give_back_request`); if the shared state does not answer, keep it
        for when it does.

        Raises:
            StateUnavailable: not answered now (kept).
        """
        await self.send((take, scopes, counted_on))

    async def _send(self, entry: _GiveBack | OutageCount | OutageLink) -> None:
        shared = self._shared
        assert shared is not None
        if isinstance(entry, OutageLink):
            await shared.link(entry.tenant, entry.run, entry.parent)
            self._links.discard((entry.tenant, entry.run))
        elif isinstance(entry, OutageCount):
            tenant, ids = entry.counted_on
            await shared.take_request(entry.scope, tenant, ids, None, entry.take)
            entry.added = True
        else:
            await shared.give_back_request(*entry)

    def _round_name(self) -> str:
        return "run request give-backs"

    def _dropped(self, entry: _GiveBack | OutageCount | OutageLink) -> None:
        if isinstance(entry, OutageLink):
            self._links.discard((entry.tenant, entry.run))
            log.warning("run link made during an outage dropped (over %d kept while the "
                        "state backend does not answer): run %s under %s", MAX_GIVE_BACKS,
                        entry.run, entry.parent, extra=PER_CALL)
            return
        if isinstance(entry, OutageCount):
            log.warning("run request count made during an outage dropped (over %d kept while "
                        "the state backend does not answer): %s of run %s", MAX_GIVE_BACKS,
                        entry.scope, entry.counted_on[1][0], extra=PER_CALL)
            return
        take, scopes, _ = entry
        log.warning("run request give-back dropped (over %d kept while the state backend "
                    "does not answer): take %s of %s", MAX_GIVE_BACKS, take,
                    ", ".join(scopes), extra=PER_CALL)

    def _sent(self, count: int) -> None:
        log.warning("run links, request counts and give-backs of %s reconciled into the "
                    "shared run state", counted(count, "call"))

    def _refused(self, entry: _GiveBack | OutageCount | OutageLink,
                 exc: StateUnavailable) -> None:
        if isinstance(entry, OutageLink):
            self._links.discard((entry.tenant, entry.run))
        super()._refused(entry, exc)


# --- the policies ----------------------------------------------------------------------------


class SharedCount:
    """The ``max_requests`` counts the run tracker's round trip took for one call (all its
    scopes at once), until each scope's :class:`RunLimits` claims its part; parts never
    claimed are given back when the call ends (:meth:`RunRegistry.settle_count`)."""

    __slots__ = ("claimed", "counts", "lineage", "take")

    def __init__(self, counts: list[Count], lineage: Lineage, take: str) -> None:
        self.counts = counts
        self.lineage = lineage
        #: The id the counts were taken under (:meth:`RedisRuns.give_back_request`).
        self.take = take
        self.claimed: set[str] = set()

    def index(self, scope: str) -> int | None:
        return next((i for i, count in enumerate(self.counts) if count.scope == scope), None)


class RunTracker:
    """First step of every call that names a run: place it in its tree, inherit priority and
    deadline, refuse it if its run (or an ancestor) is cancelled, and keep it reachable by a
    cancel until it ends (the holding).

    With shared run state the same round trip also counts the call for the ``max_requests``
    of ``limits`` (the run limits of the call's route and of the top level), so a call of a
    run costs one round trip; each :class:`RunLimits` then only claims its count.
    """

    def __init__(self, registry: RunRegistry, limits: Sequence[RunLimits] = ()) -> None:
        self.registry = registry
        self.limits = limits

    async def admit(self, call: Call) -> _Tracked | None:
        """With shared run state, one round trip reads the run's lineage and cancellation
        from Redis (see :meth:`RunRegistry.adopt`) and counts the call (see
        :class:`SharedCount`).

        Raises:
            Rejected: ``run_cancelled`` (409); ``fanout_limited`` (429, final) when the run is
                (or, linked under the parent it names, would be) more than
                :data:`MAX_DEPTH` levels below its root; ``deadline_unreachable`` when the
                call has no deadline of its own and an ancestor run's has passed;
                ``state_unavailable`` (503) when the shared state does not answer and
                ``state.on_unavailable`` is ``reject``.
        """
        if call.run is None:
            return None
        registry = self.registry
        info = registry.resolve(call.run, call.parent_run, call.tenant)
        call.lineage = tuple(node.id for node in itertools.islice(info.lineage(), 1, None))
        self._refuse_if_cancelled(info)
        # Reachable by a cancel from here on, the shared round trip included: a cancel heard
        # meanwhile ends this call at its await (or is caught by the check after it).
        live = LiveCall(call, asyncio.current_task())
        info.live.add(live)
        try:
            if registry.shared is not None:
                await self._share(registry.shared, info, call)
            # Checked on the tree the shared state gave (adopted), else on this replica's:
            # checked before asking it, a link only this replica had made refused calls
            # another replica served (a review).
            if info.depth > MAX_DEPTH:  # also pushed down by a root linked later above it
                raise too_deep(info.id, info.depth, "is")
            self._inherit(info, call)
        except BaseException:
            info.live.discard(live)
            registry.settle_count(call)
            raise
        return _Tracked(registry, info, live)

    def _refuse_if_cancelled(self, info: RunInfo) -> None:
        registry = self.registry
        stopped = registry.cancelled_by(info)
        if stopped is not None:
            left = stopped.cancelled_until - registry.clock()
            raise Rejected(Reason.RUN_CANCELLED, None,
                           f"run {stopped.id} was cancelled; its calls are refused for "
                           f"{left:.0f}s more", retry=False)

    async def _share(self, shared: RedisRuns, info: RunInfo, call: Call) -> None:
        """Place the call's run in the shared tree and refuse it if the shared state says
        its run or an ancestor is cancelled."""
        registry = self.registry
        counts = [count for limits in self.limits if (count := limits.shared_count())]
        take = new_take_id() if counts else NO_TAKE  # nothing counted, nothing to give back
        step = shared.admit(info.tenant, info.id, call.parent_run, counts, take)
        try:
            lineage = await survive_leaving(
                registry.counting(step, take, [count.scope for count in counts]),
                lambda late: self._give_back(call, counts, late, take),
                registry.background.spawn)
        except StateUnavailable as exc:
            # A count sent is given back by ``counting``: the call is refused, or counted
            # on this replica's own view.
            if registry.fallback.mode == "reject":
                raise unavailable(exc) from None
            # This replica's own tree decides (state.on_unavailable: local); the link it
            # holds goes to the shared tree once Redis answers, should the admission never
            # have run there.
            if info.parent is not None:
                registry.give_backs.keep_link(info.tenant, info.id, info.parent.id)
            return
        if counts:
            registry.counted[call] = SharedCount(counts, lineage, take)
        if lineage.deep:  # the shared tree is deeper than this replica's (nothing counted)
            raise too_deep(info.id, MAX_DEPTH + 1, "would be at least")
        registry.adopt(info, lineage)
        call.lineage = lineage.ids[1:]
        if lineage.cancelled is not None:
            stopped = registry.get(lineage.cancelled, info.tenant)
            if stopped is not None:  # remembered here too, should Redis stop answering
                stopped.cancelled_until = max(stopped.cancelled_until,
                                              registry.clock() + lineage.cancelled_left)
            raise Rejected(Reason.RUN_CANCELLED, None,
                           f"run {lineage.cancelled} was cancelled; its calls are refused for "
                           f"{lineage.cancelled_left:.0f}s more", retry=False)
        self._refuse_if_cancelled(info)

    def _give_back(self, call: Call, counts: list[Count], lineage: Lineage,
                   take: str) -> None:
        """Give back what the round trip of a call whose caller left during it counted."""
        if counts:
            self.registry.counted[call] = SharedCount(counts, lineage, take)
            self.registry.settle_count(call)

    def _inherit(self, info: RunInfo, call: Call) -> None:
        """Priority and deadline from the run's lineage (this replica's view of it): the
        priority the run last gave, else its nearest ancestor's; the earliest of its
        ancestors' deadlines (a sub-agent cannot outlive a caller waiting for it). The
        run's own deadline bounded the call that gave it, not the run's later calls."""
        lineage = list(info.lineage())
        now = self.registry.clock()
        if call.priority_given:
            info.priority = call.priority
        else:
            inherited = next((n.priority for n in lineage if n.priority is not None), None)
            if inherited is not None:
                call.priority = inherited
        if call.timeout is not None:
            # A read timeout (the SDKs' x-stainless-timeout) bounds this call's wait for its
            # first byte, not the run: the openai SDK sends 600 on every call, so taking it
            # for a deadline refused every call of a sub-agent once its parent's last call
            # was ten minutes old.
            if not call.timeout_reads:
                info.deadline = call.received_at + call.timeout
        else:
            # Not the run's own: a review found an agent's per-call X-Request-Timeout
            # refusing its next tool call for good, and a sub-agent that once sent 60 s
            # outliving its parent's 1 s (the nearest deadline was its own).
            owner = min((n for n in lineage[1:] if n.deadline is not None),
                        key=_deadline_of, default=None)
            if owner is not None and owner.deadline is not None:
                deadline = owner.deadline
                if deadline <= now:
                    raise Rejected(Reason.DEADLINE_UNREACHABLE, None,
                                   f"run {owner.id}'s deadline has passed", retry=False)
                call.timeout = deadline - call.received_at
                call.timeout_reads = False  # a deadline for the whole call


def _deadline_of(info: RunInfo) -> float:
    return info.deadline if info.deadline is not None else math.inf


class _Tracked:
    __slots__ = ("info", "live", "registry")

    def __init__(self, registry: RunRegistry, info: RunInfo, live: LiveCall) -> None:
        self.registry = registry
        self.info = info
        self.live = live

    def release(self, outcome: Outcome) -> None:
        info = self.info
        info.live.discard(self.live)
        call = self.live.call
        self.registry.settle_count(call)
        info.attempts += call.attempts
        if outcome.label not in ("rejected", "replayed"):
            info.calls += 1
        charged = call.charged
        if charged:
            used = int(charged.get("input_tokens") or 0) + int(charged.get("output_tokens") or 0)
            info.tokens += used
            cost = charged.get("cost_usd")
            if cost is None:
                info.unpriced += used > 0
            else:
                info.usd += float(cost)


class RunLimits:
    """``run`` limits and ``fanout.depth`` of one scope (a route, or ``*`` for all routes).

    Holds one count of ``max_requests`` on the run and each ancestor, given back if the call
    never reached the upstream. With shared run state the count is taken in Redis, by the run
    tracker's round trip (claimed here) or else by one of its own, so every replica's calls
    spend one ``max_requests``; the depth and the run's age are the shared tree's (see
    :meth:`RunRegistry.adopt`).
    """

    def __init__(self, registry: RunRegistry, scope: str, run: RunConfig | None,
                 fanout: FanoutConfig | None) -> None:
        self.registry = registry
        self.scope = scope
        self.run = run
        self.depth = fanout.depth if fanout is not None else None

    def shared_count(self) -> Count | None:
        """What the run tracker counts for this scope in its round trip, if anything."""
        run = self.run
        if run is None or run.max_requests is None:
            return None
        return Count(self.scope, run.max_requests, self.depth, run.max_duration)

    async def admit(self, call: Call) -> _Counted | None:
        """Raises:
            Rejected: ``fanout_limited`` (429, naming ``depth``); ``run_budget_exhausted``
                (429, ``x-should-retry: false``) naming the limit and the run that spent it;
                ``state_unavailable`` (503) when the shared state does not answer and
                ``state.on_unavailable`` is ``reject``.
        """
        if call.run is None:
            return None
        registry = self.registry
        info = registry.get(call.run, call.tenant)
        if info is None:  # admitted by no tracker (a direct test of the policy)
            info = registry.resolve(call.run, call.parent_run, call.tenant)
        if self.depth is not None and info.depth > self.depth:
            raise Rejected(Reason.FANOUT_LIMITED, None,
                           f"depth: run {info.id} is {counted(info.depth, 'level')} below its "
                           f"root; fanout.depth is {self.depth}", retry=False)
        config = self.run
        if config is None:
            return None
        lineage = list(info.lineage())
        used = 0.0
        warn = ""
        if config.max_duration is not None:
            now = registry.clock()
            for node in lineage:
                age = now - node.started
                if age >= config.max_duration:
                    raise Rejected(
                        Reason.RUN_BUDGET_EXHAUSTED, None,
                        f"max_duration: run {node.id} started {age:.1f}s ago; the limit is "
                        f"{config.max_duration:g}s", retry=False)
                if age / config.max_duration > used:
                    used, warn = age / config.max_duration, "max_duration"
            for node in lineage:  # their first calls' times now limit them: keep them
                node.timed = True
        take: str | OutageCount | None = None
        if config.max_requests is not None:
            claimed = self._claim(call, config.max_requests)
            take, full, share = (claimed if claimed is not None else
                                 await self._take(lineage, config.max_requests))
            if full is not None:
                raise self._spent(full, call, config.max_requests)
            if share >= used:
                used, warn = share, "max_requests"
        if used >= config.warn_at:
            headers = call.response_headers
            if headers is None:
                headers = call.response_headers = {}
            said = headers.get(RUN_WARNING_HEADER)
            # The top-level run block and the route's both warn: the fuller one is said (the
            # route's, second, told a caller at its top-level limit used=0.500).
            if said is None or float(said.rpartition("=")[2]) < min(used, 1.0):
                headers[RUN_WARNING_HEADER] = f'"{warn}";used={min(used, 1.0):.3f}'
        if config.max_requests is None:
            return None
        return _Counted(registry, self.scope, lineage, take, call)

    def _spent(self, full: str, call: Call, limit: int) -> Rejected:
        """``run_budget_exhausted`` for run ``full`` at ``limit`` calls: final, unless calls
        live here still hold counts of it that they give back if they never reach the
        upstream (queued, waiting for an idempotent twin, or being admitted): then retryable
        in :data:`PENDING_WAIT_S`, as a budget is while only reservations in flight deny it.
        Costs one look at each holder, and at each call counted by the shared state here.
        Calls on other replicas are not known here: a refusal they would have made retryable
        is final."""
        registry = self.registry
        node = registry.get(full, call.tenant)
        holders = node.holders.get(self.scope, ()) if node is not None and node.holders else ()
        pending = sum(1 for held in holders if held is not call and not held.reached)
        # With shared run state a call holds its count from the run tracker's round trip on,
        # before it claims it here: one waiting for its idempotent twin's answer (which it
        # will be replayed, giving the count back) made an unrelated call's refusal final.
        pending += sum(1 for other, part in registry.counted.items()
                       if other is not call and not other.reached and other not in holders
                       and part.lineage.counted and part.index(self.scope) is not None
                       and part.lineage.tenant == call.tenant and full in part.lineage.ids)
        if pending:
            return Rejected(
                Reason.RUN_BUDGET_EXHAUSTED, PENDING_WAIT_S,
                f"max_requests: run {full} and its descendants have "
                f"{counted(limit, 'call')} counted, {pending} not yet sent upstream (given "
                "back if never sent)")
        return Rejected(Reason.RUN_BUDGET_EXHAUSTED, None,
                        f"max_requests: run {full} and its descendants made "
                        f"{counted(limit, 'call')}",
                        retry=False)

    def _claim(self, call: Call, limit: int) -> tuple[str | None, str | None,
                                                      float] | None:
        """What the run tracker's round trip decided for this scope (as :meth:`_take`
        returns it), or ``None`` when it did not count the call here (no shared state, Redis
        not answering then, or a limit of another scope refusing it): count it now."""
        registry = self.registry
        part = registry.counted.get(call)
        index = part.index(self.scope) if part is not None else None
        if part is None or index is None:
            return None
        lineage = part.lineage
        if lineage.full and lineage.full[index] is not None:
            return None, lineage.full[index], 1.0
        if not lineage.counted:
            return None
        part.claimed.add(self.scope)
        return part.take, None, lineage.highs[index] / limit

    async def _take(self, lineage: list[RunInfo], limit: int
                    ) -> tuple[str | OutageCount | None, str | None, float]:
        """Count the call on ``lineage`` in the shared state, else in this replica's.

        A count sent to a Redis that did not answer is given back once it answers
        (:meth:`RunRegistry.counting`): the call is refused, or counted here instead, and
        then added to the shared counts once Redis answers (:meth:`RunRegistry.count_outage`).

        Returns:
            ``(take, full, share)``: the id the shared state counted it under (an
            :class:`OutageCount`: counted here while it did not answer; ``None``: counted
            here, with no shared state), the run already at the limit (nothing counted), and
            the fullest run's share of the limit after counting.
        """
        registry = self.registry
        shared = registry.shared
        if shared is not None:
            ids = tuple(node.id for node in lineage)
            take = new_take_id()
            step = shared.take_request(self.scope, lineage[0].tenant, ids, limit, take)
            try:
                full, high = await survive_leaving(
                    registry.counting(step, take, (self.scope,)),
                    lambda late: self._give_back(take, late[0], (lineage[0].tenant, ids)),
                    registry.background.spawn)
            except StateUnavailable as exc:
                if registry.fallback.mode == "reject":
                    raise unavailable(exc) from None
                limit = registry.fallback.whole_share(limit)
            else:
                return take, full, high / limit
        node = registry.take_request(self.scope, lineage, limit)
        if node is not None:
            return None, node.id, 1.0
        outage = registry.count_outage(self.scope, lineage) if shared is not None else None
        return outage, None, max(n.counts[self.scope] for n in lineage) / limit

    def _give_back(self, take: str, full: str | None, counted_on: CountedOn) -> None:
        """Give back the count a call whose caller left during :meth:`_take` made."""
        if full is None:  # counted
            self.registry.give_back(take, (self.scope,), counted_on)


class _Counted:
    """A call's ``max_requests`` count on each run of its lineage (a holding): listed in each
    run's ``holders`` until the call ends, given back then if it never reached the upstream
    (in the shared state by ``take``, the id it was counted under there; ``None``: counted
    in this replica's memory; an :class:`OutageCount`: in this replica's memory and, once
    Redis answers, in the shared state too)."""

    __slots__ = ("call", "lineage", "registry", "scope", "take")

    def __init__(self, registry: RunRegistry, scope: str, lineage: list[RunInfo],
                 take: str | OutageCount | None, call: Call) -> None:
        self.registry = registry
        self.scope = scope
        self.lineage = lineage
        self.take = take
        self.call = call
        for node in lineage:
            holders = node.holders
            if holders is None:
                holders = node.holders = {}
            held = holders.get(scope)
            if held is None:
                held = holders[scope] = set()
            held.add(call)

    def release(self, outcome: Outcome) -> None:
        scope = self.scope
        for node in self.lineage:
            held = node.holders[scope]  # type: ignore[index]
            held.discard(self.call)
            if not held:
                del node.holders[scope]  # type: ignore[union-attr]
        if outcome.reached:
            return
        if self.take is None or isinstance(self.take, OutageCount):
            self.registry.give_back_request(self.scope, self.lineage)
            if self.take is not None:
                self.registry.give_back_outage(self.take)
        else:
            lineage = self.lineage
            self.registry.give_back(self.take, (self.scope,),
                                    (lineage[0].tenant, tuple(node.id for node in lineage)))


#: Builds the limiter of one live run for a :class:`FanoutWidth`: ``(tenant, run, width,
#: max_wait)`` -> a limiter of ``width`` slots whose queue (:data:`WIDTH_QUEUE` places) waits
#: up to ``max_wait`` seconds. The memory one is :func:`local_width`; with the Redis backend
#: the server passes one whose slots are leases every replica shares.
WidthLimiters = Callable[[str, str, int, float], ConcurrencyLimiter]


def local_width(tenant: str, run: str, width: int, max_wait: float) -> ConcurrencyLimiter:
    """The limiter of one run's width in this process's memory."""
    return ConcurrencyLimiter(width, WIDTH_QUEUE, max_wait, None)


class FanoutWidth:
    """``fanout.width``: per run (a tenant's run id), at most ``width`` calls in flight in
    this scope; more wait in the run's own queue (a limiter of ``policies/concurrency.py``,
    one per live run).

    Args:
        width, max_wait: the block's ``width`` and ``max_wait`` (seconds).
        limiters: builds a run's limiter when a call of it arrives and none is live
            (:data:`WidthLimiters`); the limiter is forgotten once the run has no call
            admitted, queued or being admitted here, so memory does not grow with the number
            of runs seen.
    """

    def __init__(self, width: int, max_wait: float,
                 limiters: WidthLimiters = local_width) -> None:
        self.width = width
        self.max_wait = max_wait
        self.limiters = limiters
        self.runs: dict[tuple[str, str], _RunWidth] = {}
        #: A reload removed the block (:meth:`retire`): every run's limiter admits at once.
        self.retired = False

    def reconfigure(self, config: FanoutConfig) -> None:
        """Adopt a new block in place (hot reload), keeping every run's held and queued calls;
        after :meth:`retire`, the block added back, counting the calls still in flight."""
        self.retired = False
        self.width = config.width or self.width
        self.max_wait = config.max_wait
        for entry in self.runs.values():
            entry.limiter.reconfigure(self.width, WIDTH_QUEUE, self.max_wait, None)

    def retire(self) -> None:
        """A reload removed the block: every run's queued calls are admitted at once, and so
        is any call that reaches this object later; calls in flight release as before
        (:meth:`policies.concurrency.ConcurrencyLimiter.retire`)."""
        self.retired = True
        for entry in self.runs.values():
            entry.limiter.retire()

    @property
    def busy(self) -> bool:
        """Some run has a call admitted, queued or being admitted here."""
        return bool(self.runs)

    async def admit(self, call: Call) -> _WidthSlot | None:
        """Raises:
            Rejected: ``fanout_limited`` (429, naming ``width``) when no slot of the run
                freed within ``max_wait``; ``deadline_unreachable`` as the route's queue;
                ``state_unavailable`` (503) when the run's slots are shared, Redis does not
                answer and ``state.on_unavailable`` is ``reject``.
        """
        run = call.run
        if run is None:
            return None
        key = (call.tenant, run)
        entry = self.runs.get(key)
        if entry is None:
            entry = self.runs[key] = _RunWidth(
                self.limiters(call.tenant, run, self.width, self.max_wait))
            if self.retired:
                entry.limiter.retire()
        # Counted from here, not from the limiter's own counts: a shared limiter counts a
        # call only once Redis has answered, and the run's limiter must not be forgotten
        # (and a second one made) while a call of it waits for that answer.
        entry.users += 1
        try:
            # Queued like any other wait: ``enqueued`` and the queue wait see it.
            slot = await entry.limiter.take(run, call.priority, call.wait_left(),
                                            queued_hook(call), reads=call.timeout_reads)
        except Rejected as rejected:
            self._leave(key, entry)
            report_expiry(call, rejected)  # its wait, seen as the route's queues' are
            if rejected.reason in (Reason.QUEUE_TIMEOUT, Reason.QUEUE_FULL):
                raise Rejected(Reason.FANOUT_LIMITED, rejected.retry_after,
                               f"width: run {run} has {counted(self.width, 'call')} in "
                               f"flight (fanout.width) and none ended within "
                               f"{self.max_wait:g}s"
                               ) from None
            raise
        except BaseException:
            self._leave(key, entry)
            raise
        return _WidthSlot(self, key, entry, slot)

    def _leave(self, key: tuple[str, str], entry: _RunWidth) -> None:
        entry.users -= 1
        if not entry.users and self.runs.get(key) is entry:
            del self.runs[key]

    def state(self) -> dict[str, object]:
        return {"width": self.width, "runs": len(self.runs)}


class _RunWidth:
    """One live run's limiter, and its calls being admitted, queued or in flight."""

    __slots__ = ("limiter", "users")

    def __init__(self, limiter: ConcurrencyLimiter) -> None:
        self.limiter = limiter
        self.users = 0


class _WidthSlot:
    __slots__ = ("entry", "key", "owner", "slot")

    def __init__(self, owner: FanoutWidth, key: tuple[str, str], entry: _RunWidth,
                 slot: Holding) -> None:
        self.owner = owner
        self.key = key
        self.entry = entry
        self.slot = slot

    def release(self, outcome: Outcome) -> None:
        self.slot.release(outcome)
        self.owner._leave(self.key, self.entry)
