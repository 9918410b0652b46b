"""The admin API on ``server.admin_listen``, beside ``/metrics``, ``/healthz`` and ``/readyz``.

* ``GET /admin/config``: the config now serving, as JSON, with secrets redacted
  (:func:`proxy.redact.redact`); durations are in seconds, rates as written (``600/min``).
  Also the file's path, when it was loaded and how the last reload attempt went.
* ``GET /admin/routes``: each route's live state: in flight (including requests admitted before
  a reload), and each policy's ``state()`` (limits, queued, bucket levels, per-tenant holders...);
  ``"removed": true`` on a route a reload removed while it still had calls (in flight or
  queued), listed after the routes in force until they end (a route added back under the same
  name is listed apart from it).
A run is a tenant's run id (``policies/runs.py``): two tenants naming ``run-7`` have two runs.
The run endpoints take ``?tenant=NAME`` (validated as ``X-Tenant-ID`` is: visible ASCII, at
most 128 characters, sent once; else 400) to act on one tenant's run; without it they act on
the run id in every tenant.

* ``GET /admin/runs``: the runs this replica knows, each with its ``tenant``, most recently
  active first (calls, spend, depth, amplification, in flight and queued; descendants' totals
  included), at most ``RUNS_SHOWN`` (only the tenant's with ``?tenant=``):
  ``{"runs": [...], "known": N}``.
* ``GET /admin/runs/{run}``: ``{"run": RUN, "runs": [...]}``, one entry per tenant that has a
  run of that id here (sorted by tenant), each with its ``tenant``, children and live calls;
  404 if none.
* ``POST /admin/runs/{run}/cancel``: cancel the run and its descendants (``policies/runs.py``)
  in ``?tenant=``, else in every tenant that has a run of that id (known here, or with the Redis
  backend known to Redis): their queued calls are refused ``run_cancelled`` at once, their
  calls in flight closed (a keyed 2025-era MCP call is answered ``run_cancelled`` too, and
  its server sent the call's ``notifications/cancelled``; the call holds its key until the
  server answers, docs/mcp.md), their new calls refused for ``run.cancel_ttl``. A cancel naming a
  tenant whose run is not known yet refuses its first calls too; one naming none, for an id no
  tenant has, cancels nothing (``"tenants": []``). Answers once the cancelled calls have all
  ended (at most ``CANCEL_WAIT_S``)::

      {"run": "run-7", "tenant": null, "tenants": ["team-a", "team-b"],
       "cancelled_runs": [{"tenant": "team-a", "run": "run-7"}, ...],
       "calls_ended": 3, "calls_still_running": 0, "quiet_ms": 4.1,
       "refused_for_s": 600.0, "shared": true}

  ``tenant`` is the one asked for (``null``: every tenant), ``tenants`` the tenants the cancel
  hit, ``quiet_ms`` the time from the cancel to the last cancelled call ending here. With the
  Redis backend the cancel is also recorded in Redis and published, so every replica ends the
  runs' calls and refuses their new ones (``"shared": true``); while Redis does not answer it
  is sure to apply to this replica only, and to the tenants known here (``"shared": false``,
  logged; a Redis that was only slow may still run it and tell the others). With the memory
  backend, ``"shared": null``.
  Needs ``Authorization: Bearer TOKEN`` (``admin.token_file``'s as the config in force read
  it, see :func:`admin_token`; else the ``SLUICE_ADMIN_TOKEN`` environment variable; with
  neither, 403): read-only endpoints stay open, one that stops work does not.
* ``GET /admin/``: a status page for a person showing the same at a glance; plain HTML with no
  external assets, refreshing itself every ``PAGE_REFRESH_S`` seconds.

The admin port carries no agent traffic; in a pod it listens on ``0.0.0.0`` so the kubelet's
probes and Prometheus reach it, so nothing it serves may carry a secret.
"""

from __future__ import annotations

import asyncio
import hmac
import html
import logging
import time
from typing import Any

from aiohttp import web

from policies.config import IDENTITY_VALUE, MAX_IDENTITY_LENGTH
from policies.state import StateUnavailable
from proxy.config import TOKEN_ENV, env_token
from proxy.redact import redact
from proxy.reload import RELOADER
from proxy.runtime import RUNTIME, Runtime

log = logging.getLogger("sluice")

#: Seconds between refreshes of the status page.
PAGE_REFRESH_S = 2
#: Longest a cancel waits for the cancelled calls to end before it answers, seconds.
CANCEL_WAIT_S = 2.0
#: Runs listed by ``GET /admin/runs``, the most recently active first.
RUNS_SHOWN = 200


def admin_token(runtime: Runtime) -> str | None:
    """The bearer token mutating endpoints require; ``None`` when none is configured.

    ``admin.token_file``'s is the one the config in force read when it was loaded (at start,
    or by the last reload that applied), as Envoy and HAProxy keep what was last accepted:
    a rotated file applies through the reload its change triggers, and a reload refusing
    the file (gone, empty) leaves the token in force with the rest of the running config.
    It was read at each request instead, so a reload logged as refused, "the running config
    stays in force", still took the token away and cancels got 403 (a hostile trial)."""
    admin = runtime.config.admin
    if admin.token_file is not None:
        return admin.token
    return _env_token()[0]


def _env_token() -> tuple[str | None, str | None]:
    """``SLUICE_ADMIN_TOKEN``'s token (``None`` if unset or blank), and why it is refused if
    it is (:func:`proxy.config.env_token`'s error: no client could send it); never quoting
    it."""
    try:
        return env_token(), None
    except ValueError as exc:
        return None, str(exc)


def _authorized(request: web.Request) -> web.Response | None:
    """``None`` when the request carries the admin token, else the answer refusing it."""
    runtime = request.app[RUNTIME]
    token = admin_token(runtime)
    if token is None and runtime.config.admin.token_file is None and (
            refused := _env_token()[1]):
        return web.json_response(
            {"error": f"{refused}: mutating admin endpoints are disabled"}, status=403)
    if token is None:
        return web.json_response(
            {"error": f"no admin token is configured (admin.token_file or {TOKEN_ENV}): "
                      "mutating admin endpoints are disabled"}, status=403)
    sent = request.headers.get("Authorization", "")
    scheme, _, value = sent.partition(" ")
    # surrogateescape: a value that is not UTF-8 (aiohttp keeps its bytes as escapes) is
    # compared as the bytes sent, and refused, rather than failing the encode with a 500.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
            value.strip().encode("utf-8", "surrogateescape"), token.encode()):
        return web.json_response({"error": "a valid 'Authorization: Bearer TOKEN' is required"},
                                 status=401, headers={"WWW-Authenticate": "Bearer"})
    return None


def _tenant(request: web.Request) -> tuple[str | None, web.Response | None]:
    """The ``?tenant=`` of a run endpoint (``None``: every tenant), or the 400 refusing it."""
    values = request.query.getall("tenant", [])
    if not values:
        return None, None
    tenant = values[0]
    if len(values) > 1 or len(tenant) > MAX_IDENTITY_LENGTH or not IDENTITY_VALUE.fullmatch(
            tenant):
        # No caller could be of that tenant: X-Tenant-ID and the tenants table take no other.
        return None, web.json_response(
            {"error": f"not a tenant: visible ASCII (no spaces or control characters), at most "
                      f"{MAX_IDENTITY_LENGTH} characters, given once, as X-Tenant-ID takes"},
            status=400)
    return tenant, None


async def admin_runs(request: web.Request) -> web.Response:
    tenant, refused = _tenant(request)
    if refused is not None:
        return refused
    registry = request.app[RUNTIME].runs
    known = [info for info in registry.runs.values() if tenant is None or info.tenant == tenant]
    runs = sorted(known, key=lambda info: -info.last_seen)[:RUNS_SHOWN]
    return web.json_response({"runs": [registry.view(info) for info in runs],
                              "known": len(known)})


async def admin_run(request: web.Request) -> web.Response:
    tenant, refused = _tenant(request)
    if refused is not None:
        return refused
    registry = request.app[RUNTIME].runs
    run = request.match_info["run"]
    tenants = [tenant] if tenant is not None else registry.tenants_of(run)
    runs = [info for name in tenants if (info := registry.get(run, name)) is not None]
    if not runs:
        where = "in that tenant " if tenant is not None else ""
        return web.json_response({"error": f"no such run {where}on this replica"}, status=404)
    return web.json_response({"run": run,
                              "runs": [registry.view(info, detail=True) for info in runs]})


async def admin_cancel_run(request: web.Request) -> web.Response:
    refused = _authorized(request)
    if refused is not None:
        return refused
    tenant, refused = _tenant(request)
    if refused is not None:
        return refused
    runtime = request.app[RUNTIME]
    registry = runtime.runs
    run = request.match_info["run"]
    if len(run) > MAX_IDENTITY_LENGTH or not IDENTITY_VALUE.fullmatch(run):
        # No caller could send it as X-Run-ID: cancelling it would only leave a phantom run.
        return web.json_response(
            {"error": f"not a run id: visible ASCII (no spaces or control characters), at most "
                      f"{MAX_IDENTITY_LENGTH} characters, as X-Run-ID takes"}, status=400)
    started = time.monotonic()
    tenants = [tenant] if tenant is not None else registry.tenants_of(run)
    # Here first, so this replica's calls end without waiting for Redis.
    runs, calls = registry.cancel_in(run, runtime.cancel_ttl, tenants)
    shared: bool | None = None  # no shared state: this replica is all there is
    if registry.shared is not None:
        shared = False
        try:
            hit = await registry.shared.cancel(run, runtime.cancel_ttl, tenants,
                                               every=tenant is None)
            shared = True
        except StateUnavailable as exc:
            log.warning("cancel of run %s is not confirmed beyond this replica (Redis may still "
                        "apply it when it answers): %s", run, exc.cause)
        else:
            more = [name for name in hit if name not in tenants]
            if more:  # known to Redis only: refused here too from now
                tenants += more
                cancelled, ended = registry.cancel_in(run, runtime.cancel_ttl, more)
                runs += cancelled
                calls += ended
    tasks = {task for task in (live.running for live in calls) if task is not None}
    pending: set[asyncio.Task[Any]] = set()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
    quiet_ms = (time.monotonic() - started) * 1000
    return web.json_response({
        "run": run,
        "tenant": tenant,
        "tenants": sorted(tenants),
        "cancelled_runs": [{"tenant": info.tenant, "run": info.id} for info in runs],
        "calls_ended": len(tasks) - len(pending),
        "calls_still_running": len(pending),
        "quiet_ms": round(quiet_ms, 3),
        "refused_for_s": runtime.cancel_ttl,
        "shared": shared,
    })
def config_view(request: web.Request) -> dict[str, Any]:
    """What ``/admin/config`` serves (see the module docstring)."""
    runtime = request.app[RUNTIME]
    reloader = request.app.get(RELOADER)
    return {
        "path": str(reloader.path) if reloader else None,
        "loaded_at": reloader.loaded_at if reloader else None,
        "last_reload": reloader.last_attempt if reloader else None,
        "config": redact(runtime.config.model_dump(mode="json")),
    }


def routes_view(runtime: Runtime) -> dict[str, Any]:
    """What ``/admin/routes`` serves (see the module docstring)."""
    return {
        "draining": runtime.draining,
        "inflight": runtime.inflight,
        "routes": [redact({**route.state(), "removed": removed})
                   for routes, removed in ((runtime.routes, False),
                                           (runtime.draining_routes, True))
                   for route in routes],
    }


async def admin_config(request: web.Request) -> web.Response:
    return web.json_response(config_view(request))


async def admin_routes(request: web.Request) -> web.Response:
    return web.json_response(routes_view(request.app[RUNTIME]))


async def status_page(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    return web.Response(
        text=render_page(routes_view(runtime), config_view(request)),
        content_type="text/html",
        headers={"Cache-Control": "no-store"},
    )


def add_admin_routes(app: web.Application) -> None:
    """Register the admin endpoints (see the module docstring) on the admin app."""
    app.router.add_get("/admin/", status_page)
    app.router.add_get("/admin", status_page)
    app.router.add_get("/admin/config", admin_config)
    app.router.add_get("/admin/routes", admin_routes)
    app.router.add_get("/admin/runs", admin_runs)
    app.router.add_get("/admin/runs/{run}", admin_run)
    app.router.add_post("/admin/runs/{run}/cancel", admin_cancel_run)


# --- the status page -------------------------------------------------------------------------

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d2330;background:#fafbfc}
h1{font-size:20px;margin:0 0 .2em}h1 small{font-weight:normal;color:#667}
table{border-collapse:collapse;width:100%;background:#fff;margin:1em 0}
th,td{border:1px solid #dde;padding:.4em .6em;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#17692d}.bad{color:#b3261e;font-weight:600}.muted{color:#778}
.bar{width:9em;height:.7em;background:#e6e9ef;border-radius:3px;overflow:hidden;margin-top:.2em}
.bar span{display:block;height:100%;background:#3b7dd8}.bar span.hot{background:#d9822b}
dl{margin:0;display:grid;grid-template-columns:auto auto;gap:0 .8em}dt{color:#667}dd{margin:0}
pre{background:#fff;border:1px solid #dde;padding:.6em;white-space:pre-wrap}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _bar(used: float, limit: float) -> str:
    share = min(1.0, used / limit) if limit else 0.0
    hot = " class=hot" if share >= 0.8 else ""
    return f'<div class=bar><span{hot} style="width:{share * 100:.0f}%"></span></div>'


def _policy_cell(state: Any) -> str:
    if state is None:
        return '<span class=muted>off</span>'
    if not isinstance(state, dict) or not state:
        return '<span class=muted>on</span>'
    # Any policy reporting a count against a limit gets a bar (concurrency does, others may).
    bars = ""
    for used, limit, label in (("inflight", "limit", "in flight"), ("queued", "queue", "queued")):
        if isinstance(state.get(used), int) and isinstance(state.get(limit), int):
            bars += f"{state[used]} / {state[limit]} {label}{_bar(state[used], state[limit])}"
    items = "".join(
        f"<dt>{_e(k)}</dt><dd>{_e(_compact(v))}</dd>" for k, v in state.items()
        if k not in {"limit", "inflight", "queue", "queued"} or not bars
    )
    return f"{bars}<dl>{items}</dl>"


def _compact(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_compact(v)}" for k, v in value.items()) or "-"
    if value is None:
        return "-"
    return str(value)


def render_page(routes: dict[str, Any], config: dict[str, Any]) -> str:
    """The status page as one HTML document (no scripts, styles inline, no external assets)."""
    policies = sorted({k for r in routes["routes"] for k in r} - {
        "name", "path_prefix", "upstream", "protocol", "inflight", "removed"})
    if routes["draining"]:
        status = '<span class=bad>draining</span>'
    else:
        status = '<span class=ok>serving</span>'
    last = config.get("last_reload")
    if last is None:
        reload_line = "no reload since start"
    elif last["ok"]:
        held = f" (kept until restart: {', '.join(last['held'])})" if last.get("held") else ""
        reload_line = f'<span class=ok>last reload applied</span> {_ago(last["at"])}{_e(held)}'
    else:
        problems = _e("\n".join(last["problems"]))
        reload_line = (f'<span class=bad>last reload refused</span> {_ago(last["at"])}; '
                       f"the previous config still serves:<pre>{problems}</pre>")
    head = "".join(f"<th>{_e(p)}</th>" for p in policies)
    rows = []
    for route in routes["routes"]:
        cells = "".join(f"<td>{_policy_cell(route.get(p))}</td>" for p in policies)
        removed = " <span class=bad>removed, draining</span>" if route.get("removed") else ""
        rows.append(
            f"<tr><td><b>{_e(route['name'])}</b>{removed}<br>"
            f"<span class=muted>{_e(route['path_prefix'])}"
            f" &rarr; {_e(route['upstream'])}</span><br>{_e(route['protocol'])}</td>"
            f"<td class=num>{_e(route['inflight'])}</td>{cells}</tr>"
        )
    loaded = _ago(config["loaded_at"]) if config.get("loaded_at") else ""
    path = _e(config.get("path") or "-")
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8>
<meta http-equiv=refresh content="{PAGE_REFRESH_S}">
<meta name=viewport content="width=device-width,initial-scale=1">
<title>Sluice status</title><style>{_STYLE}</style></head><body>
<h1>Sluice <small>{status} &middot; {_e(routes['inflight'])} in flight</small></h1>
<div>config <code>{path}</code> loaded {loaded} &middot; {reload_line}</div>
<table><thead><tr><th>route</th><th>in flight</th>{head}</tr></thead>
<tbody>{''.join(rows)}</tbody></table>
<div class=muted>JSON: <a href="/admin/routes">/admin/routes</a> &middot;
<a href="/admin/config">/admin/config</a> &middot; <a href="/metrics">/metrics</a>
&middot; refreshes every {PAGE_REFRESH_S}s</div>
</body></html>
"""


def _ago(at: float) -> str:
    seconds = max(0, int(time.time() - at))
    text = f"{seconds}s" if seconds < 120 else f"{seconds // 60}m" if seconds < 7200 else (
        f"{seconds // 3600}h")
    stamp = _e(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at)))
    return f'<span title="{stamp}">{text} ago</span>'
