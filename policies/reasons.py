"""Every reason Sluice answers a caller itself instead of forwarding, named once.

A policy that cannot admit a request raises :class:`Rejected`; the server turns it into the
response the SPEC fixes (status, ``Retry-After``, ``retry-after-ms``, ``x-should-retry``,
``X-Sluice-Reason`` and a body in the route protocol's error shape).

Status rule (SPEC, "A caller that cannot be served now"): 429 when the caller's own quota is
spent, 503 when the route is overloaded or unavailable, 409/422 for idempotency-key conflicts.
The request faults and upstream faults at the end are not admission decisions but share the
same rendering, so that every answer Sluice writes itself looks alike.
"""

from __future__ import annotations

import enum

#: The answer field naming the reason of an answer Sluice writes itself.
REASON_HEADER = "X-Sluice-Reason"
#: Longest wait a refusal tells a caller to retry after, seconds: a longer one says
#: ``x-should-retry: false`` (``proxy/rejections.py`` says why: the OpenAI SDK drops a wait
#: over 120 s for its own short back-off, and the Anthropic SDK dropped one over 60 s).
SDK_RETRY_AFTER_CAP_S = 60.0


class Reason(enum.Enum):
    """A reason code, its HTTP status, and a one-line explanation for people."""

    # The caller's own quota is spent: 429.
    RATE_LIMITED = ("rate_limited", 429, "request rate limit reached")
    TOKEN_RATE_LIMITED = ("token_rate_limited", 429, "token rate limit reached")
    BUDGET_EXHAUSTED = ("budget_exhausted", 429, "budget spent for now")
    TENANT_CONCURRENCY = ("tenant_concurrency", 429, "too many requests of this tenant in flight")
    FANOUT_LIMITED = (
        "fanout_limited", 429, "the run has too many calls in flight or delegates too deep"
    )
    RUN_BUDGET_EXHAUSTED = (
        "run_budget_exhausted", 429, "the run (with its descendants) used its time or calls"
    )
    # The caller's run was cancelled (POST /admin/runs/{run}/cancel): 409, never retried.
    RUN_CANCELLED = ("run_cancelled", 409, "the run was cancelled")
    # The route is overloaded or unavailable: 503.
    QUEUE_FULL = ("queue_full", 503, "all slots busy and the queue is full")
    QUEUE_TIMEOUT = ("queue_timeout", 503, "no slot freed within the queue's max_wait")
    DRAINING = ("draining", 503, "Sluice is shutting down")
    CIRCUIT_OPEN = ("circuit_open", 503, "the upstream is failing and its circuit breaker is open")
    BUDGET_COUNTERS_FULL = (
        "budget_counters_full", 503,
        "Sluice keeps state.max_budget_counters budget counters and a new tenant or run needs one",
    )
    RATE_BUCKETS_FULL = (
        "rate_buckets_full", 503,
        "Sluice keeps state.max_rate_buckets rate buckets and a new tenant needs one",
    )
    STATE_UNAVAILABLE = (
        "state_unavailable", 503,
        "the shared state (Redis) cannot be used: it does not answer, or refuses Sluice (a "
        "wrong password); Sluice's /readyz says which",
    )
    DEADLINE_UNREACHABLE = (
        "deadline_unreachable", 503, "the upstream could not answer within the request's deadline"
    )
    # Idempotency-key conflicts (draft-ietf-httpapi-idempotency-key-header-06 §2.7): 409/422.
    IDEMPOTENCY_CONFLICT = (
        "idempotency_conflict", 409, "this Idempotency-Key is held by another request"
    )
    IDEMPOTENCY_MISMATCH = (
        "idempotency_mismatch", 422, "this request's idempotency key was already used for "
        "another request"
    )
    # The request itself cannot be forwarded.
    NO_ROUTE = ("no_route", 404, "no route matches this path")
    BAD_REQUEST = ("bad_request", 400, "the request cannot be forwarded as sent")
    BODY_TOO_LARGE = ("request_too_large", 413, "the request body exceeds the proxy's limit")
    EXCEEDS_LIMIT = (
        "exceeds_limit", 400, "the request's worst case exceeds a whole limit, so it never fits"
    )
    UNPRICED_MODEL = (
        "unpriced_model", 400, "the model has no price and this route has a usd budget"
    )
    WEBSOCKET_NOT_SUPPORTED = (
        "websocket_not_supported", 501,
        "Sluice does not relay WebSockets: it proxies HTTP requests and their answers only",
    )
    # The caller or its connection, refused at the door (proxy/edge.py, proxy/identity.py).
    UNKNOWN_API_KEY = (
        "unknown_api_key", 401, "Sluice could not tell the caller's tenant from an API key"
    )
    TENANT_MISMATCH = ("tenant_mismatch", 403, "the request names more than one tenant")
    FORBIDDEN_ORIGIN = (
        "forbidden_origin", 403, "this Origin may not call this route (server.allowed_origins)"
    )
    REQUEST_TIMEOUT = ("request_timeout", 408, "the request did not arrive in time")
    EXPECTATION_FAILED = (
        "expectation_failed", 417, "Sluice meets no expectation but Expect: 100-continue"
    )
    MISDIRECTED = (
        "misdirected_request", 421, "Sluice does not serve this Host"
    )
    HEADERS_TOO_LARGE = (
        "headers_too_large", 431,
        "the request head, a header line, or the number of headers is too large"
    )
    BUFFERS_FULL = (
        "buffers_full", 503,
        "the request bodies Sluice holds at once would pass server.max_buffered_bytes",
    )
    TOO_MANY_CONNECTIONS = (
        "too_many_connections", 503, "Sluice has as many connections open as it serves at once"
    )
    INTERNAL_ERROR = ("internal_error", 500, "Sluice failed to handle this request")
    # Faults of the upstream itself, written by Sluice because no upstream answer exists.
    # (Whatever kept an answer from the caller, named in the detail: no connection, a
    # connection ended or reset, or an answer that is not valid HTTP or cannot be relayed.)
    UPSTREAM_UNREACHABLE = (
        "upstream_unreachable", 502, "the upstream gave no answer Sluice could relay"
    )
    UPSTREAM_TIMEOUT = ("upstream_timeout", 504, "the upstream did not answer in time")

    def __init__(self, code: str, status: int, summary: str) -> None:
        self.code = code
        self.status = status
        self.summary = summary


#: Statuses of refusals that no retry of the same request can turn into a success: what the
#: request says (its path, host, headers, size, key or model) is what is refused.
AS_SENT_NEVER = frozenset({400, 401, 403, 404, 413, 417, 421, 422, 431, 501})


class Rejected(Exception):
    """A policy refused the request now.

    Attributes:
        reason: why, from :class:`Reason`.
        retry_after: seconds until a retry can succeed, as truthfully as the policy can tell
            (from the limit that denied, never another one's reset); ``None`` when retrying
            will not help.
        detail: a sentence for the caller, naming the limit (e.g. ``"limit 8 per tenant"``).
        policy: ``(name, quota, window_s, remaining)`` of the limit that denied, for the IETF
            ``RateLimit-Policy``/``RateLimit`` fields (``remaining``: the whole units it has
            left, ``r``; under the request's need, or 0); ``None`` when no such quota applies.
        retry: ``False`` when retrying this request as sent cannot succeed soon (a spent
            total budget), so ``x-should-retry: false`` is sent whatever ``retry_after``
            says; ``None`` leaves it to ``retry_after``. Always ``False`` for a reason whose
            status is in :data:`AS_SENT_NEVER` (a request bigger than a limit, a bad path).
    """

    __slots__ = ("detail", "policy", "reason", "retry", "retry_after")

    def __init__(
        self,
        reason: Reason,
        retry_after: float | None,
        detail: str = "",
        policy: tuple[str, int, int, int] | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(reason.code)
        self.reason = reason
        self.retry_after = retry_after
        self.detail = detail
        self.policy = policy
        self.retry = False if reason.status in AS_SENT_NEVER else retry
