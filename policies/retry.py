"""Sluice's one retry layer (config key ``retry``).

When a route has a ``retry`` block, Sluice owns retries for it (Google SRE: retry at one layer
only). An attempt that fails with a status or error kind listed in ``on`` is retried while all
of these hold:

* attempts remain (``attempts`` counts the first one);
* it is safe (:func:`retry_is_safe`, RFC 9110 §9.2.2): an idempotent method, a request that
  never left, or a POST the upstream is known to deduplicate (the caller sent its own
  ``Idempotency-Key``, or ``honours_idempotency_key: true``) or that is declared
  ``idempotent: true``; a key Sluice invented is not enough by itself;
* the wait fits: the upstream's ``retry-after-ms``/``Retry-After`` if it sent one (a longer one
  than ``max_retry_after`` ends the retries: the upstream will not be back in time), otherwise
  exponential back-off with full jitter, ``U[0, min(backoff.max, backoff.base * 2^n))`` for
  retry ``n`` (AWS Architecture Blog, "Exponential Backoff and Jitter"; Envoy's default);
  and the next attempt would start before the deadline;
* the retry budget has room (:class:`RetryBudget`).

Never retried: a request that is itself an SDK's retry (``x-stainless-retry-count`` > 0: the
client already owns that retry and stacking Sluice's on it multiplies attempts), and anything
after response bytes reached the caller (only the phase up to the upstream's response headers
is retried).

``deadline`` bounds all attempts and the waits between them (Envoy's route timeout includes
retries). ``per_try_timeout`` bounds each attempt up to its response headers (Envoy's
per-try timeout); the caller's own timeout (``x-stainless-timeout``) caps both.

When retries end on a failure Sluice retried, the answer carries ``x-should-retry: false``
(the OpenAI and Anthropic SDKs obey it before their own rules) so the caller's SDK does not
add its own three attempts on top of Sluice's; a failure it did not retry (not in ``on``, or
not safe) goes back without it, for the SDK's own rules: one layer retries, never two.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from unicodedata import decimal

from multidict import istr

from policies.config import RetryConfig

#: Methods RFC 9110 §9.2.2 defines as idempotent.
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
#: The request header that makes a non-idempotent request safe to repeat (IETF
#: draft-ietf-httpapi-idempotency-key-header).
IDEMPOTENCY_HEADER = istr("Idempotency-Key")
#: Sent by the Stainless-generated SDKs (openai, anthropic): 0 on a first attempt.
CLIENT_RETRY_HEADER = istr("x-stainless-retry-count")
#: Jitter on an upstream-requested wait: ``U[d, 1.25 d]``, never earlier than asked.
HINT_JITTER = 0.25


def retry_is_safe(method: str, sent: bool, *, callers_key: bool = False,
                  upstream_dedups: bool = False, declared_idempotent: bool = False) -> bool:
    """True when repeating the request cannot apply it twice (RFC 9110 §9.2.2).

    A key alone proves nothing: an upstream that ignores ``Idempotency-Key`` (every MCP
    server, most tool APIs) executes each copy. So a non-idempotent request is repeated only
    on evidence that the upstream deduplicates, or that repeating is harmless.

    Args:
        method: the HTTP method, upper case.
        sent: the request may have reached the upstream (False only when the connection
            was never made).
        callers_key: the caller sent its own ``Idempotency-Key`` and it goes upstream: the
            caller chose to rely on the upstream honouring it.
        upstream_dedups: the request carries a key (the caller's or one Sluice chose) and
            the route says the upstream honours it (``retry.honours_idempotency_key``).
        declared_idempotent: the route or the call's operation is declared idempotent
            (``idempotent: true``).
    """
    return (not sent or method in IDEMPOTENT_METHODS or callers_key or upstream_dedups
            or declared_idempotent)


def is_client_retry(headers: Mapping[str, str]) -> bool:
    """True when an SDK says this request is its own retry (``x-stainless-retry-count`` > 0).

    A count is decimal digits (of any script, as ``int()`` reads them), not all zeros; anything
    else is no retry. The answer is the request's: where several steps of one call need it,
    compute it once per call.
    """
    if CLIENT_RETRY_HEADER not in headers:
        return False  # not a Stainless SDK (they send 0 on a first attempt)
    count = headers[CLIENT_RETRY_HEADER]
    # Not int(count) > 0: int() refuses "²", which isdigit() takes, and counts of more than
    # sys.int_max_str_digits (4300) digits, and a request must not fail on either.
    return count != "0" and count.isdecimal() and any(map(decimal, count))


def upstream_retry_after(headers: Mapping[str, str]) -> float | None:
    """The wait an upstream answer asks for, seconds, or ``None``.

    ``retry-after-ms`` (float milliseconds, the OpenAI/Anthropic extension) is read first, then
    ``Retry-After`` as delay-seconds or an HTTP-date (RFC 9110 §10.2.3). Fractional seconds
    are accepted as the SDKs accept them; negative or unparsable values are ignored.
    """
    raw = headers.get("retry-after-ms")
    if raw is not None:
        try:
            value = float(raw) / 1000
        except ValueError:
            value = -1.0
        if value >= 0:
            return value
    raw = headers.get("Retry-After")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            value = parsedate_to_datetime(raw).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):  # a zone of +99999999999999999999
            return None
    if math.isnan(value):
        return None
    return max(value, 0.0)


class RetryBudget:
    """Retries in flight <= ``max(min_concurrency, ratio * active requests)``.

    Envoy's ``retry_budget`` (``budget_percent`` 20 %, ``min_retry_concurrency`` 3): under a
    storm most requests fail at once, and a ratio of the active ones bounds the extra load the
    retries add, while the floor still lets a quiet route retry. A retry is in flight from the
    decision to retry until its attempt has an outcome, back-off wait included.
    """

    __slots__ = ("in_flight", "min_concurrency", "ratio")

    def __init__(self, ratio: float, min_concurrency: int) -> None:
        self.ratio = ratio
        self.min_concurrency = min_concurrency
        self.in_flight = 0

    def try_acquire(self, active: int) -> bool:
        """Take a slot for one retry if the budget has room; ``active`` = requests in flight."""
        if self.in_flight >= max(self.min_concurrency, self.ratio * active):
            return False
        self.in_flight += 1
        return True

    def hold(self) -> None:
        """Count a retry that happens anyway (an SDK's own), so Sluice's retries leave room."""
        self.in_flight += 1

    def release(self) -> None:
        """End one retry taken with ``try_acquire`` or ``hold``."""
        self.in_flight -= 1


class RetryPolicy:
    """The ``retry`` block of one route, resolved once at load."""

    __slots__ = ("attempts", "backoff_base", "backoff_max", "budget", "deadline",
                 "honours_idempotency_key", "max_retry_after", "on_connect_error",
                 "on_statuses", "on_timeout", "per_try_timeout")

    def __init__(self, config: RetryConfig) -> None:
        self.attempts = config.attempts
        self.per_try_timeout = config.per_try_timeout
        self.deadline = config.deadline
        self.backoff_base = config.backoff.base
        self.backoff_max = config.backoff.max
        self.on_statuses = frozenset(v for v in config.on if isinstance(v, int))
        self.on_connect_error = "connect_error" in config.on
        self.on_timeout = "timeout" in config.on
        self.max_retry_after = config.max_retry_after
        self.honours_idempotency_key = config.honours_idempotency_key
        self.budget = RetryBudget(config.budget.ratio, config.budget.min_concurrency)

    def retries_error(self, kind: str) -> bool:
        """True when a failure with no answer is in ``on``: ``timeout``, or ``connect_error``,
        which covers ``connection_lost`` too (a reset after the request left; whether such a
        request may be repeated is :func:`retry_is_safe`'s to say)."""
        return self.on_timeout if kind == "timeout" else self.on_connect_error

    def wait(self, retry_index: int, retry_after: float | None) -> float | None:
        """Seconds to wait before retry number ``retry_index`` (0 for the first retry).

        Returns:
            The upstream's wait jittered up by at most 25 %, or full-jitter back-off when it
            sent none; ``None`` when it asked for longer than ``max_retry_after``.
        """
        if retry_after is not None:
            if retry_after > self.max_retry_after:
                return None
            return retry_after * (1 + HINT_JITTER * random.random())
        cap = min(self.backoff_max, self.backoff_base * (2 ** retry_index))
        return random.uniform(0, cap)
