"""``sluice timeline RUN_ID [--tenant NAME]``: one agent run's admission story, rebuilt from
the event log. A run is a tenant's run id: without ``--tenant`` the events of every tenant's run
of that id are read together (each event names its ``tenant``).

Reads the JSON-lines event log (SPEC, "Events") that the config's ``events.path`` names, or the
files given with ``--events`` (``-`` for standard input, e.g. ``kubectl logs POD -c sluice |
sluice timeline RUN --events -`` when events go to stdout; more than one for a log rotated
away, in any order, gzipped ones read as such when their name ends in ``.gz``). Lines that
are not JSON events, such as log lines interleaved with them, are skipped, as are objects
without an ``event`` name and a ``ts`` (Unix seconds, 1970 to 9999) or with a ``request_id``
that is not a string; counts and durations that are not numbers count as none. A line that
begins a JSON object and is cut or damaged (a write a full disk cut short) is skipped too,
but said: stderr names how many such lines each file has and the first few line numbers,
since one may be an event of the run (the exit status stays 0). NUL bytes before a line
(what a ``copytruncate`` leaves when the writer does not append) are passed over. Control
characters in the events' text (which callers choose: models, tenants, paths) are printed as
escapes, ``\x1b``.

It prints two tables:

* every event of the run in order, with its time since the run's first event and what it says
  (queue depth, wait, status, reason, Retry-After, attempt...);
* one row per request: when it arrived, how long it queued, how long the upstream took, how many
  times it was retried, and how it ended (status, rejection reason, replay, dead letter).

Events this module does not know by name are shown with all their own fields, so events added
later appear without a change here.
"""

from __future__ import annotations

import gzip
import math
import sys
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import IO, Any

import orjson

from policies.wording import counted
from proxy.terminal import printable

#: Fields every request event has; the rest are the event's own.
COMMON_FIELDS = ("ts", "event", "request_id", "route", "tenant", "run", "idempotency_key")
#: The last second of year 9999, the latest ``ts`` a timeline can print.
LAST_TS = 253_402_300_799


#: How many line numbers of a file's unreadable lines ``sluice timeline`` names.
SHOWN_UNREADABLE = 5


#: Lines ``read_run`` passes over together when none names the run and each is whole.
_BLOCK = 256


def read_run(lines: Iterable[bytes | str], run_id: str, tenant: str | None = None,
             unreadable: list[int] | None = None) -> list[dict[str, Any]]:
    """The events of run ``run_id`` (of ``tenant``, else of every tenant) among ``lines``
    (JSON lines, one a line, as a file's iteration gives them), ordered by ``ts``.
    ``unreadable``, if given, gets the 1-based numbers of the lines that begin a JSON object
    and are cut or damaged (of this run or, as far as a cut line can tell, another); lines
    that begin otherwise are other programs' output."""
    # The log is written by orjson, so the run id appears in a line exactly as orjson
    # encodes it: a substring test skips the other runs' lines without parsing them. Most
    # lines are other runs' and whole (they end with "}\n", the one "\n" of a line), so a
    # block of them is passed over by one substring test and one count, in C: testing each
    # line for a cut made sluice timeline 1.4-1.75x slower on them (a review).
    needle = orjson.dumps(run_id)[1:-1]
    events = []
    lines = iter(lines)
    first = 1
    while block := list(islice(lines, _BLOCK)):
        try:
            joined = b"".join(block)  # type: ignore[arg-type]
        except TypeError:  # str lines, a caller's: taken one by one
            joined = needle
        if needle in joined or joined.count(b"}\n") != len(block):
            _read_block(block, first, needle, run_id, tenant, unreadable, events)
        first += len(block)
    events.sort(key=lambda e: e["ts"])
    return events


def _read_block(block: list[bytes | str], first: int, needle: bytes, run_id: str,
                tenant: str | None, unreadable: list[int] | None,
                events: list[dict[str, Any]]) -> None:
    """``read_run``'s look at each line of ``block``, whose first line is number ``first``."""
    for number, line in enumerate(block, start=first):
        raw = line.encode() if isinstance(line, str) else line
        if needle not in raw:
            # A line cut before it named the run (a full disk) may still be one of its
            # events: an object begun and not ended is counted, without parsing it.
            if (unreadable is not None and not raw.endswith(b"}\n")
                    and not raw.rstrip().endswith(b"}") and raw.lstrip(b"\0")[:1] == b"{"):
                unreadable.append(number)
            continue
        if raw[:1] == b"\0":  # a copytruncate's hole before the next line written
            raw = raw.lstrip(b"\0")
        try:
            event = orjson.loads(raw)
        except orjson.JSONDecodeError:
            if unreadable is not None and raw[:1] == b"{":
                unreadable.append(number)
            continue
        if isinstance(event, dict) and event.get("run") == run_id and _is_event(event) and (
                tenant is None or event.get("tenant") == tenant):
            events.append(printable(event))


def _is_event(event: dict[str, Any]) -> bool:
    """``event`` has what the tables rely on (lines of other programs may be JSON too)."""
    ts = event.get("ts")
    return (isinstance(event.get("event"), str) and _number(ts) is not None
            and 0 <= ts <= LAST_TS and isinstance(event.get("request_id"), str | None))


def _number(value: Any) -> float | None:
    """``value`` if it is a finite number (not a bool), else ``None``."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


@dataclass
class RequestStory:
    """What happened to one request of the run, summed up from its events (seconds)."""

    request_id: str
    route: str
    tenant: str
    arrived: float
    queued_s: float | None = None
    upstream_s: float | None = None
    retries: int = 0
    result: str = "in flight"
    events: list[str] = field(default_factory=list)


def stories(events: list[dict[str, Any]]) -> list[RequestStory]:
    """One :class:`RequestStory` per request, in order of arrival. A request is its id and
    its tenant: a caller names its own ids (``X-Request-ID``), so two tenants' requests of
    one id are two (merged, one tenant's id could distort another's run report)."""
    out: dict[tuple[str, str], RequestStory] = {}
    enqueued: dict[tuple[str, str], float] = {}
    for ev in events:
        request_id = ev.get("request_id")
        if request_id is None:
            continue
        # "-" for a field an event lacks, as in the table of events (not "None").
        tenant = str(ev.get("tenant") or "-")
        rid = (tenant, request_id)
        story = out.get(rid)
        if story is None:
            story = out[rid] = RequestStory(request_id, str(ev.get("route") or "-"), tenant,
                                            ev["ts"])
        kind = ev["event"]
        story.events.append(kind)
        if kind == "enqueued":  # the first of its queues (run width, operation, route)
            enqueued.setdefault(rid, ev["ts"])
        elif kind == "admitted" and rid in enqueued:
            story.queued_s = ev["ts"] - enqueued[rid]
        elif kind == "expired":
            waited = _number(ev.get("waited_s"))
            story.queued_s = waited if waited is not None else ev["ts"] - enqueued.get(
                rid, ev["ts"])
        elif kind == "retried":
            story.retries += 1
        elif kind == "completed":
            story.upstream_s = _number(ev.get("duration_s"))
            waited = _number(ev.get("waited_s"))  # ended in the queue: left, or cut
            if waited is not None:
                story.queued_s = waited
            status = ev.get("status")
            story.result = f"{status} {ev.get('outcome', '')}".strip() if status else str(
                ev.get("outcome", "completed"))
        elif kind == "rejected":
            story.result = f"rejected {ev.get('reason', '')}".strip()
            if rid in enqueued and story.queued_s is None:  # refused from a queue
                story.queued_s = ev["ts"] - enqueued[rid]
        elif kind == "replayed":
            story.result = "replayed"
        elif kind == "cancel_held":
            story.result = f"{ev.get('status', 202)} cancel held"
        elif kind == "cancel_applied":
            story.result = f"{ev.get('status', 202)} cancel applied"
        elif kind == "dead_lettered":
            story.result = "dead-lettered"
    return list(out.values())


def describe(event: dict[str, Any]) -> str:
    """What one event says, in words, from its own fields."""
    own = {k: v for k, v in event.items() if k not in COMMON_FIELDS}
    kind = event["event"]
    words: list[str] = []
    if kind == "enqueued" and "queue_depth" in own:
        words.append(f"queue depth {own.pop('queue_depth')}")
    elif kind == "expired" and "waited_s" in own:
        words.append(f"gave up after {_s(own.pop('waited_s'))} in the queue")
    elif kind == "completed":
        if "status" in own:
            words.append(f"status {own.pop('status')}")
        if "outcome" in own:
            words.append(str(own.pop("outcome")))
        if "duration_s" in own:
            words.append(f"upstream {_s(own.pop('duration_s'))}")
        if "waited_s" in own:
            words.append(f"after {_s(own.pop('waited_s'))} in the queue")
    elif kind == "rejected":
        if "reason" in own:
            words.append(str(own.pop("reason")))
        if own.get("retry_after_s") is not None:
            words.append(f"Retry-After {_s(own.pop('retry_after_s'))}")
        own.pop("retry_after_s", None)
    if event.get("idempotency_key"):
        own["key"] = event["idempotency_key"]
    words.extend(f"{k}={_value(v)}" for k, v in own.items())
    return ", ".join(words)


def summary(events: list[dict[str, Any]], requests: list[RequestStory]) -> str:
    """Amplification and spend: upstream attempts per request (the first attempt of each
    admitted request plus every retry) and the tokens and USD charged (tools' costs
    included)."""
    admitted = sum(1 for ev in events if ev["event"] == "admitted")
    attempts = admitted + sum(story.retries for story in requests)
    tokens = usd = 0.0
    unpriced = 0  # calls that used tokens of a model `pricing` does not name: cost unknown
    for ev in events:
        if ev["event"] == "completed":
            used = (_number(ev.get("input_tokens")) or 0) + (
                _number(ev.get("output_tokens")) or 0)
            tokens += used
            usd += (_number(ev.get("cost_usd")) or 0.0) + (
                _number(ev.get("operation_cost_usd")) or 0.0)
            unpriced += used > 0 and _number(ev.get("cost_usd")) is None
    ratio = f"{attempts / len(requests):.2f}" if requests else "-"
    # Lines claiming more than a float holds (1e308 twice, a hostile trial) sum to inf.
    spent = (counted(int(tokens), "token") if math.isfinite(tokens) else
             "more tokens than can be counted (the events' counts overflow)")
    return (f"amplification {ratio} ({attempts} upstream attempt(s) for {len(requests)} "
            f"request(s)); spend {spent}, {cost_text(usd, unpriced)}")


def cost_text(usd: float, unpriced: int) -> str:
    """A spend of ``usd`` dollars plus ``unpriced`` calls whose models have no price (their
    cost unknown, not 0): ``$0.000008``, ``cost unknown (1 call of a model without
    pricing)`` or ``$0.000008 + unknown (2 calls of models without pricing)``. Also
    ``sluice runs``' form."""
    cost = f"${usd:.6f}"
    if unpriced:
        which = (f"{counted(unpriced, 'call')} of "
                 f"{'a model' if unpriced == 1 else 'models'} without pricing")
        cost = f"{cost} + unknown ({which})" if usd else f"cost unknown ({which})"
    return cost


def render(run_id: str, events: list[dict[str, Any]]) -> str:
    """The two tables described in the module docstring, as text."""
    start = events[0]["ts"]
    span = events[-1]["ts"] - start
    requests = stories(events)
    lines = [
        f"run {run_id}: {len(requests)} request(s), {len(events)} event(s) over {_s(span)}, "
        f"from {_utc(start)}",
        summary(events, requests),
        "",
    ]
    lines += _table(
        ("+time", "request", "route", "tenant", "event", "detail"),
        [(f"+{ev['ts'] - start:.3f}s", str(ev.get("request_id") or "-"),
          str(ev.get("route") or "-"), str(ev.get("tenant") or "-"), ev["event"], describe(ev))
         for ev in events],
        right=(0,),
    )
    lines.append("")
    lines += _table(
        ("request", "route", "tenant", "arrived", "queued", "upstream", "retries", "result"),
        [(s.request_id, s.route, s.tenant, f"+{s.arrived - start:.3f}s",
          _s(s.queued_s) if s.queued_s is not None else "-",
          _s(s.upstream_s) if s.upstream_s is not None else "-",
          str(s.retries), s.result) for s in requests],
        right=(3, 4, 5, 6),
    )
    return "\n".join(lines) + "\n"


def open_events(paths: Sequence[str]) -> Iterator[bytes]:
    """Lines of the event logs at ``paths``, one file after another: ``-`` reads standard
    input, a name ending in ``.gz`` is read through gzip (logrotate's ``compress``).

    Raises:
        OSError: a file cannot be read or is not valid gzip; its message names the file.
    """
    for path in paths:
        if path == "-":
            yield from sys.stdin.buffer
            continue
        try:
            with (gzip.open if path.endswith(".gz") else open)(path, "rb") as stream:
                yield from stream
        except (OSError, EOFError, zlib.error) as exc:  # gzip's name no file; a file cut
            # short (logrotate still compressing it) raises EOFError, a corrupt one zlib.error
            raise OSError(f"{path}: {getattr(exc, 'strerror', None) or exc or 'cut short'}"
                          ) from exc


def print_timeline(run_id: str, paths: Sequence[str], out: IO[str],
                   tenant: str | None = None) -> int:
    """Print run ``run_id``'s timeline (of ``tenant``'s run only, if given) from the logs at
    ``paths`` (events ordered by ``ts`` whatever the files' order); the exit status.

    Raises:
        OSError: a log cannot be read.
    """
    events = []
    for path in paths:
        unreadable: list[int] = []
        events += read_run(open_events([path]), run_id, tenant, unreadable)
        if unreadable:
            shown = ", ".join(map(str, unreadable[:SHOWN_UNREADABLE]))
            more = ", ..." if len(unreadable) > SHOWN_UNREADABLE else ""
            print(f"{'standard input' if path == '-' else path}: skipped "
                  f"{counted(len(unreadable), 'unreadable line')} (JSON cut short or damaged; "
                  f"an event of this run may be among them): line(s) {shown}{more}",
                  file=sys.stderr)
    events.sort(key=lambda e: e["ts"])
    if not events:
        of = f" of tenant {tenant!r}" if tenant is not None else ""
        print(f"no events for run {run_id!r}{of} in {', '.join(paths)}", file=sys.stderr)
        return 1
    tenants = sorted({str(ev.get("tenant") or "-") for ev in events})
    if tenant is None and len(tenants) > 1:  # runs are per tenant: say whose are merged
        print(f"note: {len(tenants)} tenants have a run {run_id!r} ({', '.join(tenants)}): "
              "their events are shown together; --tenant NAME shows one", file=sys.stderr)
    out.write(render(run_id, events))
    return 0


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]],
           right: tuple[int, ...] = ()) -> list[str]:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i])
              for i in range(len(header))]
    last = len(header) - 1

    def line(cells: tuple[str, ...]) -> str:
        parts = []
        for i, cell in enumerate(cells):
            if i == last:
                parts.append(cell)
            elif i in right:
                parts.append(cell.rjust(widths[i]))
            else:
                parts.append(cell.ljust(widths[i]))
        return "  ".join(parts).rstrip()

    return [line(header), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)]


def _s(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return str(seconds)
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.3f}s"


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
