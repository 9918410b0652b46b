"""Hot reload: apply a changed config file while serving, without dropping a request.

**Triggers.** ``SIGHUP``, and a change of the file seen by polling ``os.stat`` every
``POLL_INTERVAL_S``. ``stat`` follows symlinks, so polling the device, inode, size, mtime and
ctime of the resolved file catches every way a file gets replaced: an editor's
write-and-rename, an in-place write (even one that keeps the size and sets the mtime back),
and a Kubernetes ConfigMap update, where the kubelet writes a new timestamped
directory and swaps the ``..data`` symlink to it (the mounted ``sluice.yaml ->
..data/sluice.yaml`` then resolves to a new inode). An inotify watch on the file would miss
that swap; one stat a second costs nothing and needs no dependency. A change is applied once
the file has stayed the same for ``SETTLE_S``, so a file being written is not read midway,
unless its writer stops for longer (the README says to rename a new file over it). The files
the config names and reads at load (the ``identity.tenants`` table, ``admin.token_file``)
are watched the same way: a rotated key table or token applies without a SIGHUP. A config
file that disappears is logged once; the running config stays in force.

**A reload** (:meth:`Reloader.reload`):

0. first reads the files the config in force was read from (the config file, and the tenants
   table and admin token file it names), in a daemon thread (:func:`abandonable`): if each
   still holds the same text byte for byte, there is nothing to apply (a touch, a chmod, a
   SIGHUP, the same text written again), and nothing is parsed or rebuilt:
   ``sluice_config_reloads_unchanged_total`` counts it, the ``config_unchanged`` event and a
   log line say so. At 1,000 routes a rebuild held the event loop 0.3-0.5 s (a hostile trial);
1. reads and validates the file in a daemon thread of its own (:func:`abandonable`), so a
   stop during the read does not wait for it. An invalid file changes nothing: each
   problem is logged as ``FILE:LINE: KEY: PROBLEM``, ``sluice_config_reload_failures_total``
   counts the attempt and ``sluice_config_last_reload_successful`` turns 0;
2. keeps the keys in ``RESTART_ONLY`` (listener addresses, body size limit, event log
   destination, state backend, dead-letter file) at their running values, with a warning
   naming each one that changed: a reload cannot move a bound socket or an open file.
   ``sluice_config_restart_pending`` is 1 from such a reload until one whose file asks for
   no such change (a refused file leaves it as it was);
3. applies the rest in two phases, on the event loop with no await between them:

   * **build** (:meth:`proxy.runtime.Runtime.build`): every new ``Route`` and policy object,
     the router and every setting derived from the config are constructed, and nothing live
     is touched: no gauge is bound, no running object reconfigured, no attribute of the
     runtime set. A fault here (only a bug, or a ``MemoryError``, can raise: the file is
     valid) leaves the running config serving exactly as before, its gauges included;
   * **commit** (:meth:`proxy.runtime.Runtime.commit`): only the live changes, in this order:
     the top-level ``fanout`` object adopts its new block in place (or retires, the block
     removed); each new route takes over the live state of the old route of the same name
     (:meth:`proxy.routes.Route.take_over`: a changed block reconfigures the running policy
     object in place, a removed one retires it); each route's gauges are bound
     (:meth:`proxy.routes.Route.bind_metrics`); series of removed routes are dropped (but for
     their calls' gauges, read from the routes still draining until they end:
     :meth:`proxy.runtime.Runtime.load`); last, routes, router and settings are swapped. A
     request already past route matching finishes under the route object it matched
     (upstream, timeouts, prefix); policy objects are shared, so its slot goes back to the
     same limiter the new route uses.

   A fault in either phase is handled as a refused file is (counted, logged with its
   traceback, ``last_attempt`` says ``(apply): not applied`` or ``partly applied``, the watch
   goes on), but what it leaves differs. After a build fault nothing of the new config
   applies. A commit fault cannot be rolled back: the commit changes objects that serve, and
   a change acts at once (a raised limit hands slots to queued calls, a shorter queue
   refuses newcomers), so putting the old block back would not undo what it did, and would
   run the same code that just failed. So a commit fault leaves what ran before it: the
   top-level fan-out's new block, the policy objects of the routes taken over so far
   reconfigured in place (and, if it came while binding gauges, some gauges reading the new,
   unswapped routes), under the running routes, router and settings, which are not swapped.
   Applying the same file again (a SIGHUP) completes it, since each route's blocks are still
   compared with the running route's. Going back to the old file restores the fan-out but
   not a route's reconfigured policy objects (their blocks compare equal, so they are kept
   as they are); a restart does. At startup a fault in either phase raises;
4. emits the ``config_reloaded`` event and counts ``sluice_config_reloads_total``.

**Carrying a policy's state over** is one line per policy in ``Route.take_over``, through the
reload's :class:`policies.operations.TakeOver` (``carry``), which applies
:func:`policies.operations.carry_over` and keeps the objects of removed blocks::

    self.budget = carry("budget", old.budget, self.budget, prev.budget, new.budget,
                        lambda budget, c: budget.reconfigure(c))

* config block unchanged: the old object is kept as it is (counters, stored keys, breaker
  state, queue);
* block changed: ``reconfigure(old_object, new_block)`` adopts the new limits in place and keeps
  the state; a policy given no ``reconfigure`` gets its fresh object instead (state reset), so
  give one to every policy whose state must survive a change of its own limits;
* block added or removed: the new object, or ``None``. A removed object that has ``retire()``
  and ``busy`` (limiters, fan-out widths) is retired (a limit raised without bound: its queued
  calls go at once, its calls in flight release into it) and kept with the route while busy;
  the block added back under the same key gets it again, reconfigured, so the calls still in
  flight under it count. Otherwise a limit added by a reload counts only the calls admitted
  after it.

A policy object may also have ``state() -> dict`` (JSON-ready); list its attribute in
``Route.POLICIES`` and ``/admin/routes`` and the status page show it. Top-level settings that the
request path reads from the ``Runtime`` (e.g. a pricing table) are computed in ``Runtime.build``
and set in ``Runtime.commit``; a gauge of a policy is bound in ``Route.bind_metrics``, never when
the policy is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from policies.config import Config, Path_
from proxy.config import (
    ConfigError,
    key_line,
    load_config,
    still_reads,
    unwritable_files,
)
from proxy.redact import redact
from proxy.runtime import Runtime

log = logging.getLogger("sluice")

#: How often the config file is checked for a change, seconds.
POLL_INTERVAL_S = 1.0
#: How long a changed file must stay unchanged before it is read, seconds.
SETTLE_S = 0.2
#: How much earlier than the start of the config's read a named file's change time may be
#: and still be taken for a change made during it (file times are a clock tick coarse).
CTIME_SLACK_NS = 50_000_000

#: Keys a reload cannot change (a bound socket, an app's body limit, an open file, a store).
RESTART_ONLY: tuple[tuple[str, ...], ...] = (
    ("server", "listen"),
    ("server", "admin_listen"),
    ("server", "max_request_bytes"),
    ("server", "upstream_idle_timeout"),  # the upstream connection pool's, set at its start
    ("events", "path"),
    ("state",),
    ("dead_letter",),
)

Fingerprint = tuple[int, int, int, int, int] | None

T = TypeVar("T")


async def abandonable(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` run in a daemon thread of its own, its result awaited.

    Cancelled (a stop while a reload reads its file), the wait ends at once and the thread's
    result is dropped; the process exits without waiting for it. ``asyncio.to_thread`` ran
    it on the default executor, whose threads ``asyncio.run`` and the interpreter join at
    exit: a SIGTERM during the read of a 4 MiB config kept a drained process up for about a
    minute, past the 10 s a ``docker stop`` allows (a hostile trial).

    Raises:
        whatever ``fn`` raises.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled: nobody waits for it any more
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args, **kwargs), None)
        except BaseException as exc:  # handed to the awaiting task, which decides
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: abandoned
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="sluice-config-read", daemon=True).start()
    return await future


def fingerprint(path: Path) -> Fingerprint:
    """Device, inode, size, mtime and ctime (ns) of the file ``path`` resolves to; ``None`` if
    absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    # ctime too: a write that keeps the size and sets the mtime back (``cp -p``, ``rsync
    # -t --inplace``, an unpacked archive) changes no other field, and was never reloaded (a
    # hostile trial). No one can set it back; a chmod changes it too, and costs one reload.
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def keep_restart_only(running: Config, new: Config) -> tuple[Config, list[str]]:
    """``new`` with the ``RESTART_ONLY`` keys set back to their ``running`` values.

    Returns:
        the config to apply, and the dotted names of the keys that were held back: for a
        whole section (``state``, ``dead_letter``), each of its keys that changed.
    """
    held: list[str] = []
    for path in RESTART_ONLY:
        value = _get(running, path)
        changed = _get(new, path)
        if changed != value:
            if isinstance(value, BaseModel):
                held += [".".join((*path, name)) for name in type(value).model_fields
                         if getattr(changed, name) != getattr(value, name)]
            else:
                held.append(".".join(path))
            new = _set(new, path, value)
    # The file was checked against its own max_request_bytes; a larger one in force until a
    # restart must still fit the bound on held bodies, or such bodies were refused for good.
    server = new.server
    if server.max_buffered_bytes < server.max_request_bytes:
        log.warning("config reload: server.max_buffered_bytes (%d) is less than the "
                    "max_request_bytes in force until a restart (%d); it is held at %d",
                    server.max_buffered_bytes, server.max_request_bytes,
                    running.server.max_buffered_bytes)
        new = _set(new, ("server", "max_buffered_bytes"), running.server.max_buffered_bytes)
    return new, held


def _get(model: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        model = getattr(model, key)
    return model


def _set(model: Any, path: tuple[str, ...], value: Any) -> Any:
    if len(path) == 1:
        return model.model_copy(update={path[0]: value})
    return model.model_copy(update={path[0]: _set(getattr(model, path[0]), path[1:], value)})


class Reloader:
    """Watches the config file and applies changes to a running :class:`Runtime`.

    Attributes:
        path: the config file as given on the command line (a symlink is followed each time).
        loaded_at: Unix time the config now serving was loaded.
        last_attempt: outcome of the last reload attempt for the admin API: ``at`` (Unix
            time), ``trigger``, ``ok``, and ``problems`` (``FILE:LINE: KEY: PROBLEM`` lines) or
            ``held`` (restart-only keys kept); ``None`` before the first attempt.
    """

    def __init__(self, runtime: Runtime, path: str | Path,
                 poll_interval_s: float = POLL_INTERVAL_S, read: Fingerprint = None,
                 read_since_ns: int | None = None) -> None:
        """``read``: the config file's fingerprint taken before the running config was read
        from it (``None``: now); a file changed since then is applied at the first poll.
        ``read_since_ns``: when that read began (``time.time_ns()``), for the files the config
        names, whose names are known only once it is read: one whose inode changed since
        (its ctime: a write, or a rename over it) is read again at the first poll."""
        self.runtime = runtime
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.loaded_at = time.time()
        self.last_attempt: dict[str, Any] | None = None
        applied = list(self._fingerprints())
        if read is not None:
            applied[0] = read
        if read_since_ns is not None:
            # File times are a clock tick coarse (a few ms): a change just after the read
            # began may carry a time just before it. A false alarm costs one reload.
            since = read_since_ns - CTIME_SLACK_NS
            for i, name in enumerate(self._named(), start=1):
                with contextlib.suppress(OSError):
                    if os.stat(self.path.parent / name).st_ctime_ns >= since:
                        applied[i] = None  # seen as changed at the first poll
        self._applied = tuple(applied)
        #: Polls in a row that found no config file.
        self._absent = 0
        #: The file and problems of the last refused attempt: a SIGHUP sent after an edit the
        #: watcher already refused finds the same ones, logged once.
        self._refused: tuple[Fingerprint, list[str]] | None = None
        #: The restart-only keys held back by the reload that put the config in force.
        self._held: list[str] = []
        #: A reload's commit failed part way: what runs is neither file, so the next reload
        #: applies whatever it reads, the text in force included (a review: the old file put
        #: back read as unchanged, and the faulty one's fan-out width stayed).
        self._partly = False
        self._signalled = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, signalled: bool = False) -> None:
        """Install the SIGHUP handler and start watching the file (inside the running loop);
        ``signalled``: a SIGHUP came before (the file is read again at once)."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._signalled.set)
        if signalled:
            self._signalled.set()
        self._task = asyncio.create_task(self._watch(), name="sluice-reload")

    async def stop(self) -> None:
        """Stop watching; SIGHUP is then ignored rather than fatal."""
        loop = asyncio.get_running_loop()
        loop.remove_signal_handler(signal.SIGHUP)
        loop.add_signal_handler(signal.SIGHUP, lambda: None)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        while True:
            try:
                await self._next()
            except asyncio.CancelledError:
                raise
            except Exception:  # never the end of reloading: the next change is tried again
                log.exception("config reload failed; the watch goes on")

    async def _next(self) -> None:
        """Wait for a SIGHUP or the next poll, and reload if signalled or the file changed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.poll_interval_s):
                await self._signalled.wait()
        if self._signalled.is_set():
            self._signalled.clear()
            self._applied = self._fingerprints()
            await self.reload("sighup")
            return
        seen = self._fingerprints()
        if seen[0] is None:  # briefly absent while being replaced, or deleted
            self._absent += 1
            if self._absent == 2:  # gone for a whole poll: not a replacement
                log.warning("config file %s is gone; the running config stays in force until "
                            "it is back (or a SIGHUP)", self.path)
            return
        self._absent = 0
        if seen == self._applied:
            return
        await asyncio.sleep(SETTLE_S)
        if self._fingerprints() != seen:
            return  # still being written: look again at the next poll
        self._applied = seen
        await self.reload("file")

    def _fingerprints(self) -> tuple[Fingerprint, ...]:
        """The config file's fingerprint, then those of the files the running config reads at
        load (a path, not ``env:NAME``), relative to the config file's directory."""
        return (fingerprint(self.path),
                *(fingerprint(self.path.parent / name) for name in self._named()))

    def _named(self) -> list[str]:
        """The files the running config reads at load (a path, not ``env:NAME``)."""
        config = self.runtime.config
        return [name for name in (config.identity.tenants, config.admin.token_file)
                if name is not None and not name.startswith("env:")]

    async def reload(self, trigger: str) -> bool:
        """Read, validate and apply the config file; True if it was applied.

        Never raises for a bad file: the running config stays in force and the problems are
        logged, counted and kept in ``last_attempt``; nor for a fault applying a valid one,
        counted and kept alike, and logged with its traceback.
        """
        metrics = self.runtime.metrics
        seen = fingerprint(self.path)
        in_force = self.runtime.config.read_from
        if (in_force is not None and not self._partly and in_force[0][0] == str(self.path)
                and await abandonable(still_reads, in_force)):
            return self._unchanged(trigger)
        try:
            lines: dict[Path_, int] = {}
            config = await abandonable(load_config, self.path, lines=lines)
            unwritable = unwritable_files(config, str(self.path), lines, self.runtime.config)
            if unwritable:
                raise ConfigError(unwritable)
        except Exception as exc:
            if not isinstance(exc, ConfigError):
                # A fault of ours, not the file's: logged with its traceback, and it must not
                # end the watch (later reloads) nor leave the old config half replaced.
                log.exception("config reload (%s): reading %s failed", trigger, self.path)
                exc = ConfigError([f"{self.path}:1: (file): could not be read "
                                   f"({type(exc).__name__}; see the log)"])
            return self._refuse(trigger, seen, exc.problems)
        running = self.runtime.config
        config, held = keep_restart_only(running, config)
        letters = await self.runtime.open_letters_for(config)
        if letters is not None:  # as the start refuses it
            return self._refuse(trigger, seen, [
                f"{self.path}:{key_line(('dead_letter', 'path'), lines)}: dead_letter.path: "
                f"cannot open {config.dead_letter.path!r}: {letters}; a route would retry, "
                "and its dead letters be lost (the path changes on a restart only)"])
        self._refused = None
        for key in held:
            path = tuple(key.split("."))
            section = _get(running, path[:-1])
            if type(section).model_fields[path[-1]].repr:
                value = _get(running, path)
                # The restart-only floats are durations: "4s" as written, not "4.0"; a key
                # left out is "unset", not Python's "None" (a new user's trial).
                if value is None:
                    shown = "unset"
                elif isinstance(value, float):
                    shown = f"{value:g}s"
                else:
                    shown = repr(value)
                log.warning("config reload: %s changed but cannot change while running; "
                            "still %s until a restart", key, shown)
            else:  # a value kept out of reprs (state.redis_url may hold a password)
                log.warning("config reload: %s changed but cannot change while running; "
                            "the running one stays until a restart", key)
        sections = [name for name in type(config).model_fields
                    if name != "routes" and getattr(config, name) != getattr(running, name)]
        try:
            built = self.runtime.build(config)
        except Exception as exc:
            return self._not_applied(trigger, exc, "failed building it: nothing of it is "
                                     "applied, the running config stays in force", "not applied")
        try:
            self._partly = True
            self.runtime.commit(built)
            self._partly = False
        except Exception as exc:
            return self._not_applied(
                trigger, exc, "failed while putting it in force: the changes made before the "
                "fault stay (shared policy objects reconfigured in place enforce its limits), "
                "the running routes and settings stay in force; a SIGHUP applies it again in "
                "full", "partly applied")
        summary = built.summary
        # The files this config names are watched from now: a newly named tenants table
        # would otherwise read as changed at the next poll and reload it all once more.
        self._applied = (self._applied[0], *self._fingerprints()[1:])
        self.loaded_at = time.time()
        metrics.config_reloads.inc()
        metrics.config_last_reload_successful.set(1)
        metrics.config_last_reload_success.set(self.loaded_at)
        # A held change is no failure (the rest applied), but what runs is not the file:
        # without this only a log line and /admin/config said so (a hostile trial).
        metrics.config_restart_pending.set(1 if held else 0)
        self._held = held
        self.last_attempt = {"at": self.loaded_at, "trigger": trigger, "ok": True, "held": held}
        self.runtime.events.emit_system(
            "config_reloaded", path=str(self.path), trigger=trigger,
            routes_added=summary["added"], routes_changed=summary["changed"],
            routes_removed=summary["removed"], sections_changed=sections,
            held_until_restart=held,
        )
        log.info(
            "config reloaded from %s (%s): %d route(s); changed %s, added %s, removed %s; "
            "other sections changed: %s%s",
            self.path, trigger, len(self.runtime.routes), summary["changed"] or "none",
            summary["added"] or "none", summary["removed"] or "none",
            ", ".join(sections) or "none",
            # Else a held change read as none changed, beside its warning (a new user).
            f" (held until a restart: {', '.join(held)})" if held else "",
        )
        return True

    def _unchanged(self, trigger: str) -> bool:
        """Count and log a reload that found the config file, and the files it names, holding
        the text of the config in force: nothing is parsed or rebuilt (at 1,000 routes a
        rebuild held the event loop 0.3-0.5 s, for a touch or a chmod; a hostile trial). The
        file in force is a good one, so ``sluice_config_last_reload_successful`` is 1 (a
        refused edit undone reads as fixed); ``sluice_config_reloads_total``, the time of the
        last reload and ``sluice_config_restart_pending`` stay as they were; the event is
        ``config_unchanged``. Returns False (nothing applied)."""
        metrics = self.runtime.metrics
        metrics.config_reloads_unchanged.inc()
        metrics.config_last_reload_successful.set(1)
        self._refused = None
        self.last_attempt = {"at": time.time(), "trigger": trigger, "ok": True,
                             "unchanged": True, "held": self._held}
        self.runtime.events.emit_system("config_unchanged", path=str(self.path),
                                        trigger=trigger)
        log.info("config reload (%s): %s and the files it names hold the config in force, "
                 "byte for byte: nothing to apply", trigger, self.path)
        return False

    def _refuse(self, trigger: str, seen: Fingerprint, problems: list[str]) -> bool:
        """Log, count and keep a refused file's ``problems`` (``FILE:LINE: KEY: PROBLEM``);
        ``seen``: its fingerprint, so an unchanged file refused again is logged in one line.
        Returns False."""
        problems = redact(problems)  # a rejected value may be a URL with a password
        metrics = self.runtime.metrics
        metrics.config_reload_failures.inc()
        metrics.config_last_reload_successful.set(0)
        self.last_attempt = {"at": time.time(), "trigger": trigger, "ok": False,
                             "problems": problems}
        if self._refused == (seen, problems):
            log.error("config reload (%s) refused: the file is unchanged since the last "
                      "refusal (its problems are above); the running config stays in force",
                      trigger)
            return False
        self._refused = (seen, problems)
        log.error("config reload (%s) refused, the running config stays in force:", trigger)
        for problem in problems:
            log.error("%s", problem)
        return False

    def _not_applied(self, trigger: str, exc: Exception, what: str, outcome: str) -> bool:
        """Log, count and keep a valid config that a fault (a bug of ours) kept from being
        applied: ``what`` it left, for the log; ``outcome`` in a word, for ``last_attempt``."""
        log.error("config reload (%s) from %s %s", trigger, self.path, what, exc_info=exc)
        metrics = self.runtime.metrics
        metrics.config_reload_failures.inc()
        metrics.config_last_reload_successful.set(0)
        self.last_attempt = {"at": time.time(), "trigger": trigger, "ok": False, "problems": [
            f"{self.path}:1: (apply): {outcome} ({type(exc).__name__}; see the log)"]}
        return False


RELOADER = web.AppKey("sluice_reloader", Reloader)
