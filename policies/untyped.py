"""Answers relayed as their upstream sent them, with no ``Content-Type`` when it sent none.

aiohttp gives every answer with a body ``Content-Type: application/octet-stream`` unless it
has one (RFC 9110 §8.3 lets a *recipient* assume that type; a proxy adding it tells the caller
something the upstream did not say, and Envoy and HAProxy add none). An answer relayed
(:func:`proxy.forward.relay`) or replayed from its idempotency key's record
(:func:`policies.idempotency.replay_response`) whose upstream sent none is made with one of
these classes, which drop the one aiohttp adds; every other answer is made as before.
"""

from __future__ import annotations

from aiohttp import hdrs, web


class UntypedStreamResponse(web.StreamResponse):
    """A :class:`aiohttp.web.StreamResponse` sent without ``Content-Type``."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self._headers.popall(hdrs.CONTENT_TYPE, None)


class UntypedResponse(web.Response):
    """A :class:`aiohttp.web.Response` sent without ``Content-Type``."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self._headers.popall(hdrs.CONTENT_TYPE, None)
