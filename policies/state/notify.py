"""Wake-ups across replicas: a waiter watches a channel, a state change publishes on it.

Used where a waiter on one replica needs to learn that something changed on another: a
concurrency slot was released (:mod:`policies.state.leases`), an idempotency key's first
request finished (:mod:`policies.state.idempotency`). The publisher is the Lua script that made
the change (``PUBLISH`` inside it, so the change and the wake-up are one round trip).

A wake-up is a hint, never the truth: the waiter re-reads the state after it (a slot may have
been taken by someone else meanwhile), and waits at most a poll interval for one, because a
message can be lost (Redis pub/sub is at-most-once: a reconnect, a subscriber that joined a
moment late, or a lease that lapsed without a release never publishes).

Usage::

    async with notifier.watch(channel) as signal:   # subscribed before the first check
        while not (await try_again()):
            await signal.wait(poll_s)                # True if woken, False on timeout
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from redis.asyncio import Redis

if TYPE_CHECKING:
    from redis.asyncio.client import PubSub

    from policies.state.connection import RedisState

log = logging.getLogger("sluice.state")

#: Longest a pub/sub connection may take to connect and subscribe, seconds.
SUBSCRIBE_TIMEOUT_S = 2.0
#: How long the listener blocks reading before it looks at its state again, seconds.
READ_TIMEOUT_S = 1.0


class Signal:
    """One waiter's wake-up: set by a message on the watched channel."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout_s: float) -> bool:
        """Wait for a wake-up for at most ``timeout_s`` seconds; True if one came (it is
        consumed), False on timeout."""
        if not self._event.is_set():
            try:
                async with asyncio.timeout(max(timeout_s, 0.0)):
                    await self._event.wait()
            except TimeoutError:
                return False
        self._event.clear()
        return True


class Notifier(Protocol):
    """Where waiters watch channels."""

    def watch(self, channel: str) -> contextlib.AbstractAsyncContextManager[Signal]:
        """Watch ``channel`` for the duration of the ``async with``."""
        ...

    async def close(self) -> None:
        ...


class MemoryNotifier:
    """Channels within one process; :meth:`publish` wakes every watcher at once."""

    def __init__(self) -> None:
        self._watchers: dict[str, set[Signal]] = {}

    @contextlib.asynccontextmanager
    async def watch(self, channel: str) -> AsyncIterator[Signal]:
        signal = Signal()
        watchers = self._watchers.setdefault(channel, set())
        watchers.add(signal)
        try:
            yield signal
        finally:
            watchers.discard(signal)
            if not watchers:
                self._watchers.pop(channel, None)

    def publish(self, channel: str) -> None:
        """Wake every watcher of ``channel``."""
        for signal in self._watchers.get(channel, ()):
            signal.set()

    async def close(self) -> None:
        self._watchers.clear()


class RedisNotifier:
    """Redis pub/sub on one dedicated connection per process, shared by every watcher.

    A channel is subscribed when its first watcher arrives (the watcher waits for the
    confirmation, bounded by the state timeout, so its first re-check happens after the
    subscription is live), and unsubscribed lazily: when a message comes for a channel nobody
    watches any more. The listener reconnects and re-subscribes after any failure; meanwhile
    waiters fall back on their poll interval.
    """

    def __init__(self, state: RedisState) -> None:
        self._state = state
        self._watchers: dict[str, set[Signal]] = {}
        self._subscribed: set[str] = set()
        self._confirm: dict[str, asyncio.Future[None]] = {}
        self._send = asyncio.Lock()
        self._pubsub: PubSub | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._home = state.prefix + ":notify"  # keeps the connection subscribed when idle
        self._closing = False

    @contextlib.asynccontextmanager
    async def watch(self, channel: str) -> AsyncIterator[Signal]:
        signal = Signal()
        watchers = self._watchers.setdefault(channel, set())
        watchers.add(signal)
        try:
            await self._subscribe(channel)
            yield signal
        finally:
            watchers.discard(signal)
            if not watchers:
                self._watchers.pop(channel, None)

    async def close(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            await stop_listener(task, "the pub/sub listener")

    async def _subscribe(self, channel: str) -> None:
        """Subscribe ``channel`` if it is not; best effort, bounded by the state timeout."""
        if channel in self._subscribed or self._closing:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._listen(), name="sluice-state-notify")
        loop = asyncio.get_running_loop()
        future = self._confirm.get(channel)
        if future is None:
            future = self._confirm[channel] = loop.create_future()
        try:
            async with asyncio.timeout(self._state.timeout_s):
                await self._connected.wait()
                pubsub = self._pubsub
                if pubsub is not None and channel not in self._subscribed:
                    async with self._send:
                        await pubsub.subscribe(channel)
                    await asyncio.shield(future)
        except Exception as exc:  # the poll interval covers a subscription that is late
            log.debug("subscribing %s: %r", channel, exc)
        finally:
            if self._confirm.get(channel) is future and future.done():
                del self._confirm[channel]

    async def _listen(self) -> None:
        while not self._closing:
            try:
                async with subscription(self._state, self._home, *self._watchers) as pubsub:
                    self._pubsub = pubsub
                    self._connected.set()
                    while not self._closing:
                        message = await pubsub.get_message(timeout=READ_TIMEOUT_S)
                        if message is not None:
                            await self._dispatch(pubsub, message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # StateUnavailable before the first connection, too
                log.debug("pub/sub listener: %r; reconnecting", exc)
            finally:
                self._connected.clear()
                self._pubsub = None
                self._subscribed.clear()
            await asyncio.sleep(self._state.probe_interval_s)

    async def _dispatch(self, pubsub: PubSub, message: dict[str, Any]) -> None:
        kind = message["type"]
        channel = message["channel"]
        if isinstance(channel, bytes):
            channel = channel.decode("utf-8", "surrogateescape")
        if kind == "subscribe":
            self._subscribed.add(channel)
            future = self._confirm.get(channel)
            if future is not None and not future.done():
                future.set_result(None)
        elif kind == "message":
            watchers = self._watchers.get(channel)
            if watchers:
                for signal in watchers:
                    signal.set()
            elif channel != self._home and channel in self._subscribed:
                # Nobody watches it any more. Forget it first, so that a watcher arriving
                # while this is sent subscribes again (after it, on the same connection).
                self._subscribed.discard(channel)
                async with self._send:
                    await pubsub.unsubscribe(channel)



async def stop_listener(task: asyncio.Task[None], what: str) -> None:
    """Cancel a task reading a Redis pub/sub connection until it has ended.

    A cancellation can be lost inside redis-py's pub/sub read (seen with redis 8.1 on Python
    3.11: the task stays "cancelling" and reads on), so cancel again every 50 ms; such a loop
    also stops by itself at its next read timeout (``READ_TIMEOUT_S``). ``what`` names the
    task in the warning logged if it has not stopped by then.
    """
    for _ in range(int(READ_TIMEOUT_S / 0.05) + 10):
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.05)
        if done:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
            return
    log.warning("%s did not stop", what)


@contextlib.asynccontextmanager
async def subscription(state: RedisState, *channels: str,
                       confirmed: bool = False) -> AsyncIterator[PubSub]:
    """A pub/sub connection of its own (a cluster's: on the node of ``state``'s URL),
    subscribed to ``channels`` within ``max(SUBSCRIBE_TIMEOUT_S, state.timeout_s)``, closed
    quietly on exit. ``confirmed``: also read the subscribe confirmation within that bound, so
    every message published from then on reaches the caller.

    Raises:
        TimeoutError, redis.RedisError, StateUnavailable: it could not connect or subscribe.
    """
    client: Redis | None = None
    pubsub: PubSub | None = None
    try:
        async with asyncio.timeout(max(SUBSCRIBE_TIMEOUT_S, state.timeout_s)):
            client = Redis(connection_pool=state.node_pool())
            pubsub = client.pubsub()
            await pubsub.subscribe(*channels)
            while confirmed and (await pubsub.get_message(timeout=READ_TIMEOUT_S)) is None:
                pass
        yield pubsub
    finally:
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
                await client.connection_pool.disconnect()
