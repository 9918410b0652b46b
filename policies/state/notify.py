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
from collections import deque
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
    subscription is live), and unsubscribed when its last watcher leaves: a channel per
    run's width queue, or per idempotency key, would otherwise stay subscribed for good
    once nothing publishes on it any more (a hostile trial: one per cancelled run).

    Every ``SUBSCRIBE`` and ``UNSUBSCRIBE`` is decided and sent under one lock, on the one
    connection, and Redis confirms each in the order sent: so a watcher arriving while its
    channel's ``UNSUBSCRIBE`` is on its way sends ``SUBSCRIBE`` after it and waits for the
    confirmation of that one, not of an earlier ``SUBSCRIBE`` (after which the channel was
    dropped again), and a watcher arriving before the ``UNSUBSCRIBE`` is sent keeps the
    channel (it is not sent). The listener reconnects and re-subscribes every watched
    channel after any failure; meanwhile waiters fall back on their poll interval.
    """

    def __init__(self, state: RedisState) -> None:
        self._state = state
        self._watchers: dict[str, set[Signal]] = {}
        #: Channels whose last command sent on the connection is ``SUBSCRIBE``.
        self._wanted: set[str] = set()
        #: Per channel, its commands sent and not confirmed yet, in order: a
        #: ``SUBSCRIBE``'s future (done at its confirmation), ``None`` for an
        #: ``UNSUBSCRIBE``. A channel in :attr:`_wanted` and not here is subscribed.
        self._unconfirmed: dict[str, deque[asyncio.Future[None] | None]] = {}
        self._send = asyncio.Lock()
        self._pubsub: PubSub | None = None
        self._task: asyncio.Task[None] | None = None
        self._drops: set[asyncio.Task[None]] = set()
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
            if not watchers and self._watchers.get(channel) is watchers:
                del self._watchers[channel]
                self._drop(channel)

    async def close(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            await stop_listener(task, "the pub/sub listener")
        for drop in list(self._drops):
            drop.cancel()

    async def _subscribe(self, channel: str) -> None:
        """Subscribe ``channel`` if it is not, and wait for the confirmation; best effort,
        bounded by the state timeout."""
        if self._closing or (channel in self._wanted and channel not in self._unconfirmed):
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._listen(), name="sluice-state-notify")
        try:
            async with asyncio.timeout(self._state.timeout_s):
                await self._connected.wait()
                # Shielded: a command decided is sent whole, its bookkeeping with it, even if
                # this watcher is cancelled or times out meanwhile.
                future = await asyncio.shield(self._send_subscribe(channel))
                if future is not None:
                    await asyncio.shield(future)
        except Exception as exc:  # the poll interval covers a subscription that is late
            log.debug("subscribing %s: %r", channel, exc)

    async def _send_subscribe(self, channel: str) -> asyncio.Future[None] | None:
        """Send ``SUBSCRIBE`` unless the last command of ``channel`` is one; returns the
        future its confirmation completes (``None``: subscribed already, or no
        connection)."""
        async with self._send:
            pubsub = self._pubsub
            # Its watchers may have left while this waited for the lock: then none is sent.
            if pubsub is None or channel not in self._watchers:
                return None
            sent = self._unconfirmed.get(channel)
            if channel in self._wanted:
                return sent[-1] if sent else None
            future = asyncio.get_running_loop().create_future()
            self._wanted.add(channel)
            self._unconfirmed.setdefault(channel, deque()).append(future)
            try:
                await pubsub.subscribe(channel)
            except Exception as exc:  # the listener sees the connection gone, and starts anew
                log.debug("subscribing %s: %r", channel, exc)
                return None
            return future

    def _drop(self, channel: str) -> None:
        """Unsubscribe ``channel``, which nobody watches any more (never awaits)."""
        if channel in self._wanted and not self._closing:
            task = asyncio.create_task(self._unsubscribe(channel),
                                       name="sluice-state-notify-drop")
            self._drops.add(task)
            task.add_done_callback(self._drops.discard)

    async def _unsubscribe(self, channel: str) -> None:
        try:
            async with self._send:
                pubsub = self._pubsub
                # A watcher came back meanwhile: the subscription is its.
                if pubsub is None or channel in self._watchers or channel not in self._wanted:
                    return
                self._wanted.discard(channel)
                self._unconfirmed.setdefault(channel, deque()).append(None)
                await pubsub.unsubscribe(channel)
        except Exception as exc:  # the connection broke: the next one subscribes only watched
            log.debug("unsubscribing %s: %r", channel, exc)

    async def _listen(self) -> None:
        while not self._closing:
            channels = list(self._watchers)
            try:
                async with subscription(self._state, self._home, *channels) as pubsub:
                    loop = asyncio.get_running_loop()
                    self._wanted = set(channels)
                    self._unconfirmed = {channel: deque([loop.create_future()])
                                         for channel in channels}
                    self._pubsub = pubsub
                    self._connected.set()
                    for channel in channels:  # its watchers left while this connected
                        if channel not in self._watchers:
                            self._drop(channel)
                    while not self._closing:
                        if pubsub.connection is None or not pubsub.connection.is_connected:
                            # A failed send dropped it. Reconnected by redis-py's next read,
                            # it would subscribe again unseen by the bookkeeping: start anew.
                            raise ConnectionError("pub/sub connection lost")
                        message = await pubsub.get_message(timeout=READ_TIMEOUT_S)
                        if message is not None:
                            self._dispatch(message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # StateUnavailable before the first connection, too
                log.debug("pub/sub listener: %r; reconnecting", exc)
            finally:
                self._connected.clear()
                self._pubsub = None
                # Watchers waiting for a confirmation that will not come re-check now.
                for sent in self._unconfirmed.values():
                    for future in sent:
                        if future is not None and not future.done():
                            future.set_result(None)
                self._unconfirmed = {}
                self._wanted = set()
            await asyncio.sleep(self._state.probe_interval_s)

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        channel = message["channel"]
        if isinstance(channel, bytes):
            channel = channel.decode("utf-8", "surrogateescape")
        if kind in ("subscribe", "unsubscribe"):
            sent = self._unconfirmed.get(channel)
            if sent:  # confirmations come in the order the commands were sent
                future = sent.popleft()
                if not sent:
                    del self._unconfirmed[channel]
                if future is not None and not future.done():
                    future.set_result(None)
        elif kind == "message":
            for signal in self._watchers.get(channel, ()):
                signal.set()


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
