"""``sluice serve`` in a child forked from a warm interpreter, for the test harness.

Starting ``python -m proxy`` costs about a second of imports on a busy machine, and the suite
starts Sluice some forty times. A ``forkserver`` that has imported Sluice once forks each
server in tens of milliseconds instead; the child then runs the same entry point as the
console script (``proxy.cli.main``) with its own stdout, stderr, working directory and
environment, so it is still a separate process that signals, exit codes and crashes reach.

When the test run is measured by coverage (``pytest --cov``, the default in pyproject.toml),
each server measures itself and saves its data when it exits; the harness stops servers with
SIGTERM (a drain) before SIGKILL, so their data is kept.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys

#: Set to the test run's coverage data file when the run is measured (see ``_start_coverage``).
COVERAGE_ENV = "COVERAGE_SLUICE_DATA"
#: Imported once by the fork server, so each child starts warm.
PRELOAD = ["tests.sluice_child", "proxy.cli", "proxy.server", "uvloop", "pytest"]


def _serve(config_path: str, stderr_path: str, cwd: str, env: dict[str, str]) -> None:
    os.chdir(cwd)
    os.environ.update(env)
    for fd, path, flags in ((1, os.devnull, os.O_WRONLY),
                            (2, stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    coverage = _start_coverage()
    from proxy.cli import main

    try:
        code = main(["serve", "--config", config_path])
    finally:
        if coverage is not None:  # multiprocessing ends the child with os._exit: no atexit
            coverage.stop()
            coverage.save()
    sys.exit(code)


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
                            config_file=os.path.join(os.getcwd(), "pyproject.toml"))
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


class ForkedSluice:
    """A ``subprocess.Popen``-like handle (``pid``, ``poll``, ``wait``, ``send_signal``,
    ``returncode``) on one forked ``sluice serve``."""

    _context: multiprocessing.context.ForkServerContext | None = None

    def __init__(self, config_path: str, stderr_path: str, cwd: str,
                 env: dict[str, str]) -> None:
        if ForkedSluice._context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _start_fork_server()
            ForkedSluice._context = context
        self._process = ForkedSluice._context.Process(
            target=_serve, args=(config_path, stderr_path, cwd, env),
            daemon=True,  # never left running after the session, even if a test leaks it
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"sluice pid {self.pid}", timeout or 0)
        return self._process.exitcode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
