"""Answers relayed as their upstream sent them (relayed by :func:`proxy.forward.relay`, or
replayed from its idempotency key's record by :func:`policies.idempotency.replay_response`).

They are made with these classes, and every answer Sluice writes itself with aiohttp's own,
so that two fields aiohttp adds to any answer without them are told apart:

* ``Content-Type``: aiohttp gives every answer with a body ``application/octet-stream``
  unless it has one (RFC 9110 §8.3 lets a *recipient* assume that type; a proxy adding it
  tells the caller something the upstream did not say, and Envoy and HAProxy add none). An
  answer whose upstream sent none is made with an ``Untyped`` class, which drops it.
* ``Server``: aiohttp names itself and Python with their versions (``Python/3.11
  aiohttp/3.14.5``) in every answer without one. A relayed answer carries the upstream's
  own, or none when it sent none; an answer of Sluice's own says ``Server: sluice``
  (:class:`proxy.edge.EdgeRequest` tells them apart by :class:`Relayed`).
"""

from __future__ import annotations

from aiohttp import hdrs, web


class Relayed:
    """Marks an answer as its upstream's: sent with the upstream's ``Server`` or none."""

    __slots__ = ()


class RelayedStreamResponse(Relayed, web.StreamResponse):
    """A streamed answer relayed from the upstream."""


class RelayedResponse(Relayed, web.Response):
    """A whole answer relayed from the upstream (or replayed from its key's record)."""


class UntypedStreamResponse(RelayedStreamResponse):
    """A :class:`RelayedStreamResponse` sent without ``Content-Type``."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self._headers.popall(hdrs.CONTENT_TYPE, None)


class UntypedResponse(RelayedResponse):
    """A :class:`RelayedResponse` sent without ``Content-Type``."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self._headers.popall(hdrs.CONTENT_TYPE, None)
