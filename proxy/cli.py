"""The ``sluice`` command line (SPEC, "Command line").

``sluice serve [--config PATH]`` runs the proxy; ``sluice check-config PATH`` validates a file
and exits 0, or 2 after printing one ``FILE:LINE: KEY: PROBLEM`` line per problem;
``sluice timeline RUN_ID [--config PATH] [--events FILE ...]`` prints a run's admission timeline
(exit 1 when the log has no event of that run).
``sluice dlq list|show ID|replay ID|delete ID|purge [--config PATH] [--file PATH]`` inspects,
replays and deletes dead-lettered work (see ``proxy/dlq.py``).
``sluice runs list|show RUN|cancel RUN [--config PATH] [--admin URL]`` lists, shows and
cancels runs through the admin port (see ``proxy/runs_cli.py``).
``sluice demo [--quick]`` runs a retry storm on a local fake provider, direct and through
Sluice, and compares them (see ``proxy/demo/cli.py``).
``sluice --version`` prints the installed distribution's version.
"""

from __future__ import annotations

# Only what ``main`` needs before ``serve`` holds its signals (asyncio, logging and
# importlib.metadata took ~60 ms of the ~0.1 s in which a SIGHUP ended the process): the rest
# is imported where it is used.
import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config's modules take ~0.4 s to import: each command imports its own
    from policies.config import Config

DEFAULT_CONFIG = "config/sluice.yaml"
#: The distribution ``sluice --version`` names the version of (``pyproject.toml``'s name).
DISTRIBUTION = "sluice"
EXIT_CONFIG_ERROR = 2
#: ``serve`` could not start: a listener could not bind, or a file could not be opened.
EXIT_START_FAILED = 1
#: The reader of standard output went away (128 + SIGPIPE, as the shell reports it).
EXIT_BROKEN_PIPE = 141
#: Most records ``sluice dlq list --limit`` asks for: no store keeps more (the bound of
#: ``dead_letter.max_records``, ``policies.config.MAX_DEAD_LETTERS``, repeated here as the
#: config's modules are imported by each command only).
MAX_LIST_LIMIT = 10_000_000
#: Largest dead-letter id: SQLite's INTEGER is 64-bit signed (a larger number made the
#: commands raise OverflowError, and Redis refuse the stream id).
MAX_LETTER_ID = 2**63 - 1


def _hold_standard_descriptors() -> None:
    """Put ``/dev/null`` on a standard descriptor (0-2) the process was started without
    (``sluice serve >&-``): else the next file opened takes its number, and libuv aborts
    when it closes what it takes for its own (``uv__close: Assertion 'fd > STDERR_FILENO'``).
    Output to it is then counted as dropped (``sys.stdout`` stays ``None``)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one


def _load(path: str, *, stream: bool = False, writes: str | None = None) -> Config | None:
    """The config at ``path``, or ``None`` once its problems are printed to stderr.
    ``writes``: ``"refuse"`` (``serve``) or ``"warn"`` (``check-config``, which also warns
    of :func:`policies.config.advisories`) on the files a server of it would write and
    could not here (:func:`proxy.config.unwritable_files`); ``None`` (the read-only
    commands): not looked at."""
    from policies.config import advisories
    from proxy.config import ConfigError, dotted, key_line, load_config, unwritable_files
    from proxy.redact import redact

    lines: dict[Any, int] = {}
    try:
        config = load_config(path, stream=stream, lines=lines)
    except ConfigError as exc:
        # A rejected value may be a URL with a password or an ?api_key= (CI logs keep this).
        print("\n".join(redact(exc.problems)), file=sys.stderr)
        if path == DEFAULT_CONFIG and not os.path.exists(path):
            # Outside the clone, "cannot read: No such file" alone did not say that no
            # config was named, nor where one is (a new user's trial).
            print(f"sluice: no {DEFAULT_CONFIG} (the default config) in this directory, "
                  f"{os.getcwd()}: it ships in Sluice's repository, not in the installed "
                  "package; run from the clone or pass --config PATH", file=sys.stderr)
        return None
    if writes is not None and (problems := unwritable_files(config, path, lines)):
        if writes == "refuse":
            print("\n".join(redact(problems)), file=sys.stderr)
            return None
        print("\n".join(f"warning: {line} (where Sluice runs, it must be able to)"
                        for line in redact(problems)), file=sys.stderr)
    if writes == "warn":
        for key, advice in advisories(config):
            print(f"warning: {path}:{key_line(key, lines)}: {dotted(key)}: {advice}",
                  file=sys.stderr)
    return config


def _hold_signals() -> tuple[Callable[[], bool], Callable[[], bool]]:
    """Take the signals over while ``serve`` starts (from ``main``'s first step: imports,
    config, connections, about a second, more for a large config), until its event loop
    takes them: SIGTERM and SIGINT are remembered and stop the server as soon as it runs,
    with nothing to drain (exit 0); SIGHUP is remembered too (its default action would end
    the process) and reloads the config once the watch starts: the file may have changed
    after it was read. Returns whether a stop signal came, and whether a SIGHUP did."""
    came: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: came.append(signum))
    return (lambda: signal.SIGTERM in came or signal.SIGINT in came,
            lambda: signal.SIGHUP in came)


def _serve(args: argparse.Namespace) -> int:
    stop_requested, reload_requested = args.held or _hold_signals()
    _hold_standard_descriptors()
    import asyncio

    from proxy.output import logging_in_background
    from proxy.reload import fingerprint
    from proxy.server import serve

    # Taken before the file is read: a change made while it is read (and the server starts)
    # is then one the watch sees.
    read, read_since_ns = fingerprint(Path(args.config)), time.time_ns()
    config = _load(args.config, writes="refuse")
    if config is None:
        return EXIT_CONFIG_ERROR
    try:
        import uvloop
    except ImportError:  # uvloop is optional off Linux/macOS; asyncio's loop works too
        run = asyncio.run
    else:
        run = uvloop.run
    # Log lines are written by a thread of their own: a stderr nobody reads must not stop
    # the event loop (proxy/output.py); the event log's writer is the runtime's.
    with logging_in_background(sys.stderr):
        try:
            run(serve(config, args.config, stop_requested, reload_requested, read,
                      read_since_ns))
        except OSError as exc:  # a port already taken, or a file that cannot be opened
            from proxy.redact import redact

            print(f"sluice: cannot start: {redact(str(exc))}", file=sys.stderr)
            return EXIT_START_FAILED
    return 0


def _check_config(args: argparse.Namespace) -> int:
    path = args.path or args.config_option or DEFAULT_CONFIG
    config = _load(path, stream=True, writes="warn")  # /dev/stdin and <(...) are read too
    if config is None:
        return EXIT_CONFIG_ERROR
    print(f"{path}: ok ({len(config.routes)} route(s))")
    return 0


def _timeline(args: argparse.Namespace) -> int:
    from proxy.timeline import print_timeline

    paths = args.events
    from_config = not paths
    if from_config:
        config = _load(args.config)
        if config is None:
            return EXIT_CONFIG_ERROR
        if config.events.path is None:
            print(
                f"{args.config}: events.path is null, so events go to Sluice's stdout; pass the "
                "captured output with --events FILE, or --events - to read standard input "
                "(e.g. kubectl logs POD -c sluice | sluice timeline RUN_ID --events -)",
                file=sys.stderr,
            )
            return EXIT_CONFIG_ERROR
        paths = [config.events.path]
    try:
        return print_timeline(args.run_id, paths, sys.stdout, args.tenant)
    except OSError as exc:
        where = ""
        if from_config and not os.path.isabs(paths[0]):
            # Sluice opens a relative events.path from its own working directory, which may
            # not be this one (a new user's trial ran the timeline from another directory).
            where = (f" (events.path in {args.config}, relative to the working directory "
                     f"{os.getcwd()}: run this where Sluice runs, or pass --events FILE)")
        print(f"cannot read the event log {exc}{where}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


def _with_config(args: argparse.Namespace, run: Callable[[Config, argparse.Namespace], int]
                 ) -> int:
    """Load ``--config`` and hand it to a subcommand; a bad config is its problems, exit 2."""
    config = _load(args.config)
    if config is None:
        return EXIT_CONFIG_ERROR
    return run(config, args)


def _dlq(args: argparse.Namespace) -> int:
    from proxy.dlq import run

    if args.config is None:
        if args.file is not None and args.dlq_command != "replay":
            return run(None, args)  # the file is named, and only a replay needs the routes
        args.config = DEFAULT_CONFIG
        if args.file is not None and not os.path.exists(DEFAULT_CONFIG):
            # "config/sluice.yaml: cannot read" did not say why a replay of a file wants it
            # (a new user's trial, round 36).
            print(f"sluice dlq replay --file reads the letter's route from --config (default "
                  f"{DEFAULT_CONFIG}, not found here): pass --config PATH", file=sys.stderr)
            return EXIT_CONFIG_ERROR
    return _with_config(args, run)


def _runs(args: argparse.Namespace) -> int:
    from proxy.runs_cli import run

    if args.config is None:
        if args.admin:  # the address is given: no config is needed (the token from the env)
            return run(None, args)
        args.config = DEFAULT_CONFIG
    return _with_config(args, run)


def _demo(args: argparse.Namespace) -> int:
    from proxy.demo.cli import run

    return run(args)


def _whole(most: int) -> Callable[[str], int]:
    """An argument type: a whole number from 1 to ``most``, else argparse's usage error."""

    def parse(value: str) -> int:
        # ASCII digits only: int() also reads "1_2" as 12 and Arabic-Indic digits, so a typo
        # could name another letter.
        number = int(value) if value.isascii() and value.isdigit() else 0
        if not 1 <= number <= most:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a whole number from 1 to {most}")
        return number

    return parse


def _version() -> str:
    """The installed ``sluice`` distribution's version (``pyproject.toml``'s)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "(version unknown: not installed)"


def _name_choices(commands: argparse._SubParsersAction) -> None:
    """Name a subcommand by its choices in a usage error (``required: {list,show}``), where
    argparse names its dest, a word no user types (``required: runs_command``)."""
    commands.metavar = "{" + ",".join(commands.choices) + "}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="Backpressure sidecar for AI agents' LLM and tool calls."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help=f"default: {DEFAULT_CONFIG}")
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check-config", help="validate a config file (exit 2 if invalid)")
    check.add_argument("path", nargs="?", help=f"default: {DEFAULT_CONFIG}")
    # --config too, as every other command takes it.
    check.add_argument("--config", dest="config_option", metavar="PATH", help="same as PATH")
    check.set_defaults(func=_check_config)
    timeline = sub.add_parser("timeline", help="print one run's admission timeline")
    timeline.add_argument("run_id", metavar="RUN_ID", help="the run's X-Run-ID value")
    timeline.add_argument("--tenant", metavar="NAME",
                          help="only this tenant's run of that id (default: every tenant's)")
    timeline.add_argument("--config", default=DEFAULT_CONFIG,
                          help=f"names the event log (events.path); default: {DEFAULT_CONFIG}")
    timeline.add_argument("--events", metavar="FILE", action="append",
                          help="read this event log instead ('-' for standard input); again "
                               "for each file a rotated log was split into (*.gz read as gzip)")
    timeline.set_defaults(func=_timeline)
    dlq = sub.add_parser("dlq", help="inspect and replay dead-lettered work")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True)
    config_help = (f"the config naming the dead-letter store and the routes (default: "
                   f"{DEFAULT_CONFIG}; with --file, read by replay only, unless given)")
    listing = dlq_sub.add_parser("list", help="summaries of the stored records")
    listing.add_argument("--limit", type=_whole(MAX_LIST_LIMIT), default=100, metavar="N",
                         help="list the newest N records (default 100)")
    show = dlq_sub.add_parser("show", help="one record in full, as JSON")
    show.add_argument("id", type=_whole(MAX_LETTER_ID))
    show.add_argument("--unmask", action="store_true",
                      help="print the credentials some APIs take in the body (Anthropic's "
                           "mcp_servers[].authorization_token, an OpenAI mcp tool's "
                           "authorization and headers, Azure's data_sources[].parameters."
                           "authentication and its embedding_dependency.authentication) as "
                           "stored; masked by default")
    replay = dlq_sub.add_parser(
        "replay", help="re-send a record to its route's upstream and record the result"
    )
    replay.add_argument("id", type=_whole(MAX_LETTER_ID))
    replay.add_argument(
        "-H", "--header", action="append", default=[], metavar="'NAME: VALUE'",
        help="add or replace a header, e.g. the credentials removed when recording",
    )
    replay.add_argument(
        "--header-from-env", action="append", default=[], metavar="NAME=ENVVAR",
        help="add a header whose value is read from an environment variable",
    )
    replay.add_argument("--output", metavar="FILE", help="write the upstream's answer here")
    replay.add_argument("--again", action="store_true",
                        help="send it even though an earlier replay was answered (below 400, "
                             "and on an mcp route with no tool or JSON-RPC error)")
    delete = dlq_sub.add_parser("delete", help="delete one record, with its replays")
    delete.add_argument("id", type=_whole(MAX_LETTER_ID))
    dlq_sub.add_parser("purge", help="delete every record")
    for command in (listing, show, replay, delete, dlq_sub.choices["purge"]):
        command.add_argument("--config", help=config_help)
        command.add_argument("--file", metavar="PATH",
                             help="read the dead-letter SQLite file at PATH instead, whatever "
                                  "state.backend says (letters written with memory before a "
                                  "move to redis)")
    _name_choices(dlq_sub)
    dlq.set_defaults(func=_dlq)
    runs = sub.add_parser("runs", help="list, show and cancel agent runs (admin port)")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    run_commands = [runs_sub.add_parser("list", help="runs this replica knows")]
    for name, what in (("show", "one run: calls, spend, depth, live calls"),
                       ("cancel", "cancel a run and its descendants (needs the admin token)")):
        command = runs_sub.add_parser(name, help=what)
        command.add_argument("run", metavar="RUN", help="the run's X-Run-ID value")
        run_commands.append(command)
    for command in run_commands:
        command.add_argument("--tenant", metavar="NAME",
                             help="one tenant's runs only (default: every tenant's)")
        command.add_argument("--config",
                             help=f"names the admin port and token (default: {DEFAULT_CONFIG}, "
                                  "unless --admin is given)")
        command.add_argument("--admin", metavar="URL",
                             help="the admin port's URL instead of server.admin_listen")
    _name_choices(runs_sub)
    runs.set_defaults(func=_runs)
    demo = sub.add_parser(
        "demo",
        help="watch Sluice contain a retry storm on a local fake provider (~40 s; --quick ~20 s)"
    )
    demo.add_argument("--quick", action="store_true",
                      help="a shorter schedule (~10 s per run instead of ~20 s)")
    demo.add_argument("--plot", default="sluice-demo.png",
                      help="where to write the plot (default: sluice-demo.png)")
    demo.add_argument("--no-plot", action="store_true", help="do not write a plot")
    demo.add_argument("--json", metavar="FILE", help="also write the full record as JSON")
    demo.add_argument("--seed", type=int, default=1, help="random seed of the fleet (1)")
    demo.set_defaults(func=_demo)
    _name_choices(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sluice`` console script; returns the exit status."""
    # ``serve`` holds its signals before anything slow (building the parser reads the
    # installed version): a SIGHUP sent right after the start (a deploy tool's reload) ended
    # the process, SIGHUP's default action, before the hold (a hostile trial). No option
    # comes before a command but those that exit (--version, -h).
    words = sys.argv[1:] if argv is None else argv
    held = _hold_signals() if words[:1] == ["serve"] else None
    args = build_parser().parse_args(argv)
    args.held = held
    import logging

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        status = args.func(args)
        if sys.stdout is not None:  # None: started without one (">&-")
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (``sluice dlq list | head``): stop quietly, as a command killed by
        # SIGPIPE does, and keep the interpreter's own flush at exit from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
