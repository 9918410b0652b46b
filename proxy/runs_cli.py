"""``sluice runs list|show RUN|cancel RUN [--tenant NAME]``: the runs a replica knows,
through its admin port.

A run is a tenant's run id: ``show`` and ``cancel`` act on the run id in every tenant that has
it, or with ``--tenant`` in that one (``list --tenant`` lists only its runs).

The address is the config's ``server.admin_listen`` (a wildcard host is reached on loopback:
``0.0.0.0`` on 127.0.0.1, ``[::]`` on ::1), or ``--admin URL`` (then no config is read unless
``--config`` is given).
``cancel`` sends the admin token: ``admin.token_file``, else the ``SLUICE_ADMIN_TOKEN``
environment variable.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import IO, Any

from policies.config import Config
from policies.state.connection import redact_url
from proxy.config import env_token, load_token
from proxy.timeline import cost_text

#: Seconds a CLI request to the admin port may take, in all.
TIMEOUT_S = 10.0
EXIT_FAILED = 1


def admin_url(config: Config) -> str:
    """The admin port's base URL (``http://HOST:PORT``) from ``server.admin_listen``, a
    wildcard host replaced by the loopback address of its family."""
    host, _, port = config.server.admin_listen.rpartition(":")
    host = host.strip("[]")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        # asyncio binds ``::`` IPv6-only, so 127.0.0.1 found nothing there (a hostile trial).
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class AdminCallError(Exception):
    """The admin port could not be asked, or its answer was not one Sluice serves; the
    message is the CLI's whole complaint, quoting no token and no URL password."""


def token(config: Config | None) -> str | None:
    """The admin bearer token, as the server reads it (``None``: no config, the environment's
    alone).

    Raises:
        AdminCallError: the token file cannot be read, or the token holds whitespace or a
            control character inside (never quoted).
    """
    path = config.admin.token_path if config is not None else None
    if path is not None:
        try:
            return load_token(Path(path))
        except ValueError as exc:
            raise AdminCallError(f"admin.token_file: {exc}") from None
    try:
        return env_token()
    except ValueError as exc:
        raise AdminCallError(str(exc)) from None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuses every redirect: following one sent ``Authorization: Bearer TOKEN`` to
    whatever host the ``Location`` named (a hostile trial)."""

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int,
                         msg: str, headers: Any, newurl: str) -> None:
        raise AdminCallError(f"the admin port answered {code} (a redirect): sluice does not "
                             "follow one, which would send the admin token where it points")


def _check_url(base: str) -> None:
    """Refuses a URL urllib would fail on, in words of ours: its own errors were printed as
    they were, and one (http.client's refused header) quoted the admin token."""
    try:
        parts = urllib.parse.urlsplit(base)
        parts.port  # noqa: B018  (raises ValueError on a port that is no number)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise AdminCallError(f"{redact_url(base)} is no admin port's URL (http://HOST:PORT)")


def _call(method: str, url: str, bearer: str | None = None) -> tuple[int, Any]:
    """The admin port's status and JSON answer to ``method url``, within ``TIMEOUT_S`` in
    all (urllib's timeout is per socket read: a port trickling a byte a read never ended).

    Raises:
        AdminCallError: it could not be reached, redirected, or took longer than that.
    """
    result: list[tuple[int, Any]] = []
    failure: list[BaseException] = []

    def ask() -> None:
        try:
            result.append(_ask(method, url, bearer))
        except BaseException as exc:  # handed to the waiting thread
            failure.append(exc)

    # A daemon thread: one still blocked on a trickling socket does not keep the CLI alive.
    worker = threading.Thread(target=ask, name="sluice-runs-call", daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    shown = redact_url(url.split("/admin/", 1)[0])
    if worker.is_alive():
        raise AdminCallError(f"the admin port at {shown} did not answer within "
                             f"{TIMEOUT_S:g}s")
    if failure:
        error = failure[0]
        if isinstance(error, AdminCallError):
            raise error
        if isinstance(error, OSError):
            raise AdminCallError(f"cannot reach the admin port at {shown}: {error}")
        # Never its text: http.client's refusal of a header quotes the header's value.
        raise AdminCallError(f"the request to the admin port at {shown} could not be made "
                             f"({type(error).__name__})")
    return result[0]


def _ask(method: str, url: str, bearer: str | None) -> tuple[int, Any]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if bearer:
        request.add_header("Authorization", f"Bearer {bearer}")
    # No redirect and no proxy from the environment: the bearer token goes to the admin
    # port named, nowhere else.
    opener = urllib.request.build_opener(_NoRedirect, urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=TIMEOUT_S) as response:
            try:
                return response.status, json.load(response)
            except ValueError:  # JSONDecodeError, UnicodeDecodeError: HTML, say
                raise AdminCallError(
                    f"the admin port's answer at {redact_url(url.split('/admin/', 1)[0])} is "
                    "not what Sluice serves (not JSON): is --admin (or server.admin_listen) a "
                    "Sluice admin port?") from None
    except urllib.error.HTTPError as error:
        try:
            return error.code, json.load(error)
        except ValueError:
            return error.code, {"error": error.reason}


def run(config: Config | None, args: argparse.Namespace, out: IO[str] | None = None) -> int:
    """Carry out ``sluice runs ...``, writing to ``out`` (``sys.stdout`` as it is when
    called); returns the exit status. ``config`` is ``None`` when ``--admin`` names the
    address and no ``--config`` was given."""
    if out is None:
        out = sys.stdout
    base = args.admin or admin_url(config)  # type: ignore[arg-type]  (None only with --admin)
    if "://" not in base:  # --admin 127.0.0.1:9901, as server.admin_listen writes it
        base = "http://" + base
    # Given, even empty: the admin port refuses an empty tenant rather than reading it as
    # "every tenant", which is what no --tenant means.
    query = (f"?{urllib.parse.urlencode({'tenant': args.tenant})}"
             if args.tenant is not None else "")
    try:
        bearer = token(config) if args.runs_command == "cancel" else None
        _check_url(base)
        if args.runs_command == "list":
            status, body = _call("GET", f"{base}/admin/runs{query}")
        elif args.runs_command == "show":
            status, body = _call(
                "GET", f"{base}/admin/runs/{urllib.parse.quote(args.run, '')}{query}")
        else:
            status, body = _call(
                "POST", f"{base}/admin/runs/{urllib.parse.quote(args.run, '')}/cancel{query}",
                bearer)
    except AdminCallError as error:
        print(f"sluice: {error}", file=sys.stderr)
        return EXIT_FAILED
    if not isinstance(body, dict):
        body = {"error": body}
    if status != 200:
        print(f"sluice: {status}: {body.get('error', body)}", file=sys.stderr)
        if status in (401, 403) and args.runs_command == "cancel":
            if "no admin token is configured" in str(body.get("error", "")):
                # The server's side: a new user's trial read the client's hint below and
                # looked for the fault in the command.
                print("sluice: the server was started with no admin token: restart `sluice "
                      "serve` with SLUICE_ADMIN_TOKEN set in its environment, or with "
                      "admin.token_file in its config", file=sys.stderr)
            elif bearer is None and config is not None:
                # Given a config that names no token file (a new user, round 35, was told to
                # pass the --config it had passed).
                print(f"sluice: no admin token was found to send: {args.config} sets no "
                      "admin.token_file, and SLUICE_ADMIN_TOKEN is not set", file=sys.stderr)
            elif bearer is None:  # a new user's trial read "the token sent" where none was
                print("sluice: no admin token was found to send: pass --config with the "
                      "server's config (its admin.token_file), or set SLUICE_ADMIN_TOKEN",
                      file=sys.stderr)
            else:
                print("sluice: the token sent is admin.token_file's (from --config), else the "
                      "SLUICE_ADMIN_TOKEN environment variable's", file=sys.stderr)
        return EXIT_FAILED
    try:
        return _render(args, body, out)
    except (KeyError, TypeError, AttributeError, ValueError):
        # A 200 of another shape ({} from some other service): a KeyError traceback was all
        # the CLI said (a hostile trial).
        print(f"sluice: the admin port's answer at {redact_url(base)} is not what Sluice "
              "serves: is --admin (or server.admin_listen) a Sluice admin port?",
              file=sys.stderr)
        return EXIT_FAILED


def _render(args: argparse.Namespace, body: dict[str, Any], out: IO[str]) -> int:
    """Write the admin port's 200 answer ``body`` as ``sluice runs`` says it.

    Raises:
        KeyError, TypeError, AttributeError, ValueError: ``body`` is not of the shape the
            admin port serves.
    """
    if args.runs_command == "list":
        out.write(_list(body["runs"]))
        known = body.get("known", 0)
        if known > len(body["runs"]):  # the admin API lists the most recently active
            out.write(f"({len(body['runs'])} most recently active of {known} runs known here; "
                      "--tenant NAME lists one tenant's)\n")
    elif args.runs_command == "show":
        out.write("\n".join(_show(run) for run in body["runs"]))
    elif not body["tenants"]:
        if body.get("shared") is False:
            # Nothing known here, and the other replicas were not asked: saying "nothing
            # cancelled" would tell the operator the run is not running (a review).
            print(f"sluice: the shared run state did not answer, and this replica knows no "
                  f"run {body['run']}: other replicas were not asked, nothing was cancelled; "
                  f"try again once Redis answers (or with --tenant NAME)", file=sys.stderr)
            return EXIT_FAILED
        out.write(f"no tenant has a run {body['run']}: nothing cancelled (--tenant NAME "
                  "refuses its calls before they start)\n")
    else:
        # With shared state the runs and calls are this replica's; the others end theirs on
        # hearing the cancel. A trial read "0 call(s) ended" from a replica carrying none of
        # the run's calls as a cancel that did nothing.
        here = " here" if body.get("shared") else ""
        out.write(
            f"cancelled {_cancelled(body['cancelled_runs'])}{here}: {body['calls_ended']} "
            f"call(s) ended{here} in {body['quiet_ms']:.1f} ms"
            + (f", {body['calls_still_running']} still running" if body["calls_still_running"]
               else "")
            + f"; new calls refused for {body['refused_for_s']:g}s"
            + ("; every replica ends the run's calls and its descendants' as it hears the "
               "cancel\n" if body.get("shared") else "\n"))
    return 0


def _cancelled(runs: list[dict[str, str]]) -> str:
    """``run-7, run-7-kid of team-a; run-7 of team-b``: the runs a cancel hit, per tenant."""
    by_tenant: dict[str, list[str]] = {}
    for run in runs:
        by_tenant.setdefault(run["tenant"], []).append(run["run"])
    return "; ".join(f"{', '.join(names)} of {tenant}" for tenant, names in by_tenant.items())


_COLUMNS = ("run", "tenant", "depth", "calls", "inflight", "queued", "amplification", "tokens",
            "usd", "cancelled")


def _list(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return "no runs known\n"
    rows = [tuple(_usd(r) if c == "usd" else _cell(r.get(c)) for c in _COLUMNS) for r in runs]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines) + "\n"


def _show(run: dict[str, Any]) -> str:
    keys = ("run", "tenant", "parent", "depth", "age_s", "calls", "attempts", "amplification",
            "tokens", "usd", "inflight", "queued", "descendants", "cancelled")
    lines = [f"{k:>13}: {_usd(run) if k == 'usd' else _cell(run.get(k))}" for k in keys]
    own = run.get("own")
    if isinstance(own, dict) and "usd" in own:
        own = {**own, "usd": _usd(own)}
        own.pop("unpriced_calls", None)
    lines.append(f"{'own':>13}: {_cell(own)}")
    lines.append(f"{'children':>13}: {', '.join(run.get('children') or []) or '-'}")
    for call in run.get("live_calls") or []:
        lines.append(f"{'live':>13}: {call['request_id']} run={call['run']} "
                     f"route={call['route']} {call['phase']} {call['age_s']}s")
    return "\n".join(lines) + "\n"


def _usd(run: dict[str, Any]) -> str:
    """A run's spend as ``sluice timeline`` says it: calls of models without pricing make it
    unknown, not $0; ``-`` until one of its calls has finished (the admin API's ``usd`` is
    then 0.0, a spend not known yet, not one of nothing)."""
    usd = run.get("usd")
    if not isinstance(usd, int | float):
        return _cell(usd)
    unpriced = int(run.get("unpriced_calls") or 0)
    if not run.get("calls") and not usd and not unpriced:
        return "-"
    return cost_text(usd, unpriced)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):  # "cancelled False" read as Python, not as a table
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    return str(value)
