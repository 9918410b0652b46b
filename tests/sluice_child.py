"""``sluice serve``, and the other ``sluice`` commands, in a child forked from a warm
interpreter, for the test harness.

Starting ``python -m proxy`` costs about a second of imports on a busy machine, and the suite
runs Sluice hundreds of times (servers, and ``dlq`` commands). A ``forkserver`` that has
imported Sluice once forks each in tens of milliseconds instead; the child then runs the same
entry point as the console script (``proxy.cli.main``) with its own stdin, stdout, stderr,
working directory and environment, so it is still a separate process that signals, exit
codes and crashes reach.

When the test run is measured by coverage (``pytest --cov``, the default in pyproject.toml),
each server measures itself and saves its data when it exits; the harness stops servers with
SIGTERM (a drain) before SIGKILL, so their data is kept.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable

#: The clone's root, where the commands run unless told otherwise.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Set to the test run's coverage data file when the run is measured (see ``_start_coverage``).
COVERAGE_ENV = "COVERAGE_SLUICE_DATA"
#: Imported once by the fork server, so each child starts warm.
PRELOAD = ["tests.sluice_child", "proxy.cli", "proxy.server", "uvloop", "pytest"]


def _serve(config_path: str, stderr_path: str, cwd: str, env: dict[str, str]) -> None:
    _run(["serve", "--config", config_path], cwd, env, os.devnull, stderr_path)


def _run(args: list[str], cwd: str, env: dict[str, str], stdout_path: str,
         stderr_path: str) -> None:
    """``sluice ARGS`` run as the console script runs it, from ``cwd``, with exactly ``env``
    (not the fork server's, which may hold a variable a test has removed since), stdin
    empty, stdout and stderr into those files, and the exit status of ``main``. Ctrl-C
    works as in a new interpreter (a suite started with SIGINT ignored passes that on), down
    to dying of SIGINT where nothing handled it (exit -2, 130 in a shell), not multiprocessing's
    exit 1 and traceback."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)  # coverage reads its config and sources from the clone's root
    coverage = _start_coverage()
    os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    from proxy.cli import main

    interrupted = False
    code = None
    try:
        code = main(args)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if coverage is not None:  # multiprocessing ends the child with os._exit: no atexit
            coverage.stop()
            coverage.save()
    if interrupted:  # as CPython ends on an unhandled KeyboardInterrupt
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(code)


def coverage_env() -> dict[str, str]:
    """The environment that makes a Sluice child measure itself, if this run is measured."""
    import coverage

    current = coverage.Coverage.current()
    if current is None:
        return {}
    return {COVERAGE_ENV: os.path.abspath(current.config.data_file)}


def _start_coverage():  # type: ignore[no-untyped-def]
    """Measure this server when the test run is measured (``COVERAGE_SLUICE_DATA`` names the
    run's data file; this child writes a parallel file beside it, combined at the end)."""
    data_file = os.environ.get(COVERAGE_ENV)
    if not data_file:
        return None
    import coverage

    inherited = coverage.Coverage.current()
    if inherited is not None:  # a fork server measured under ``patch = subprocess``
        inherited.stop()
    cov = coverage.Coverage(data_file=data_file, data_suffix=True,
                            config_file=os.path.join(REPO, "pyproject.toml"))
    cov.start()
    return cov


def _start_fork_server() -> None:
    """Start the fork server (and multiprocessing's resource tracker, which it starts) out
    of coverage's sight: measured as subprocesses (``patch = subprocess``), they saved their
    data when they exited with the test run, after it had been combined, and left a
    ``.coverage.<host>.pid*`` file each behind every run (two new users saw eight). They only
    fork; each server forked measures itself (:func:`_start_coverage`)."""
    from multiprocessing import forkserver

    saved = {name: os.environ.pop(name)
             for name in ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START")
             if name in os.environ}
    try:
        forkserver.ensure_running()
    finally:
        os.environ.update(saved)


_context: multiprocessing.context.ForkServerContext | None = None


def _fork_context() -> multiprocessing.context.ForkServerContext:
    """The fork server's context, started (with Sluice imported) on first use."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _start_fork_server()
        _context = context
    return _context


class _Forked:
    """One child forked by the fork server to run ``target(*args)``: ``pid``,
    ``returncode``, ``send_signal`` and ``kill``, as a subprocess handle has them."""

    def __init__(self, target: Callable[..., None], args: tuple[object, ...]) -> None:
        self._process = _fork_context().Process(
            target=target, args=args,
            daemon=True,  # never left running after the session, even if a test leaks it
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _child_env(env: dict[str, str] | None) -> dict[str, str]:
    """A forked child's whole environment: this process's, its coverage collection's, and
    the test's own ``env`` over both."""
    return {**os.environ, **coverage_env(), **(env or {})}


class ForkedSluice(_Forked):
    """A ``subprocess.Popen``-like handle (``pid``, ``poll``, ``wait``, ``send_signal``,
    ``returncode``) on one forked ``sluice serve``."""

    def __init__(self, config_path: str, stderr_path: str, cwd: str,
                 env: dict[str, str]) -> None:
        super().__init__(_serve, (config_path, stderr_path, cwd, _child_env(env)))

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"sluice pid {self.pid}", timeout or 0)
        return self._process.exitcode


class ForkedCli(_Forked):
    """``sluice ARGS`` (any command but ``serve``) in a forked child, with the parts of
    :class:`asyncio.subprocess.Process` the tests use: ``pid``, ``returncode``,
    ``send_signal``, ``kill`` and ``communicate`` (stdout and stderr, whole, once it ended).
    Its output goes to files, read at the end: a command that prints more than a pipe holds
    cannot block on it."""

    def __init__(self, args: list[str], cwd: str, env: dict[str, str] | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="sluice-cli-")
        self._out = os.path.join(self._dir.name, "stdout")
        self._err = os.path.join(self._dir.name, "stderr")
        super().__init__(_run, (list(args), cwd, _child_env(env), self._out, self._err))

    async def wait(self) -> int:
        while self._process.exitcode is None:
            await asyncio.sleep(0.01)
        return self._process.exitcode

    async def communicate(self) -> tuple[bytes, bytes]:
        try:
            await self.wait()
            with open(self._out, "rb") as out, open(self._err, "rb") as err:
                return out.read(), err.read()
        finally:
            self._dir.cleanup()


async def sluice_cli(*args: str, cwd: str = REPO, timeout: float = 60) -> tuple[int, str, str]:
    """``sluice ARGS`` in a forked child (:class:`ForkedCli`), run from ``cwd``, without
    blocking the event loop: its exit status, stdout and stderr (:func:`ended`)."""
    return await ended(ForkedCli(list(args), cwd), timeout)


async def ended(proc: ForkedCli, timeout: float = 60) -> tuple[int, str, str]:
    """``proc``'s exit status, stdout and stderr once it ends.

    Raises:
        TimeoutError: it had not ended after ``timeout`` seconds (it is killed).
    """
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
