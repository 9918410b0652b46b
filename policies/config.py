"""The config schema: every section and policy block as a strict, frozen pydantic model.

This module is neutral ground: the policies (``policies/``) read their blocks from here and the
server (``proxy/``) loads files into them (``proxy/config.py``: YAML, line numbers, messages),
so neither has to import the other.

Durations are strings with a unit (``250ms``, ``5s``, ``10m``, ``24h``, ``1d``) and become
float seconds; rates are ``N/s``, ``N/min``, ``N/h``, ``N/day`` and become :class:`Rate`.
The models are strict, so a boolean or a number where a string belongs is an error (see
``proxy/config.py`` for the YAML 1.1 habits that makes matter).
"""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from multidict import istr
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from redis.asyncio.connection import ConnectionPool
from redis.exceptions import RedisError
from yarl import URL

from policies.bodies import shown
from policies.secrets import credential_header


class ConfigError(Exception):
    """The config file is unreadable or invalid.

    Attributes:
        problems: one ``FILE:LINE: KEY: PROBLEM`` line per problem found.
    """

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


# --- units -----------------------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
#: The longest duration a config may give, seconds (365 days).
MAX_DURATION_S = 365 * 86400.0
#: The most a budget may allow a window, or a rate a period (tokens, USD, requests): far
#: beyond any real limit, exact as a float, and never the infinity that 1 and 400 zeros is.
MAX_AMOUNT = 10**15
#: The most a price or a cost may be, USD (per million tokens, per call, per second): far
#: beyond any real one, and small enough that what a call costs stays a finite number.
MAX_USD = 1e6
#: The range of a tenant's fair-queueing weight: its inverse orders the queue, and that of a
#: subnormal weight (1e-320) is infinite.
MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6
_RATE = re.compile(r"^(\d+)/(s|min|h|day)$")
_RATE_PERIODS = {"s": 1, "min": 60, "h": 3600, "day": 86400}
_ALLOWANCE = re.compile(r"^(\d+(?:\.\d+)?)/(s|min|h|day|total)$")


@dataclass(frozen=True, slots=True)
class Rate:
    """``count`` events per ``period_s`` seconds, as written ``N/unit`` in the config."""

    count: int
    period_s: int
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class Allowance:
    """A budget: ``amount`` (tokens or USD) per UTC-aligned window of ``period_s`` seconds, or
    in total when ``period_s`` is ``None``; written ``N/min``, ``N/h``, ``N/day`` or ``N/total``.
    """

    amount: float
    period_s: int | None
    text: str

    def __str__(self) -> str:
        return self.text


def _parse_allowance(value: Any) -> Allowance:
    if isinstance(value, str) and (m := _ALLOWANCE.match(value.strip())):
        amount = float(m.group(1))
        if amount <= 0:
            raise ValueError(f"{value!r}: a budget must allow more than 0")
        if amount > MAX_AMOUNT:
            raise ValueError(f"{shown(value, 40)}: a budget may allow at most "
                             f"{MAX_AMOUNT:.0e} a window".replace("e+", "e"))
        unit = m.group(2)
        return Allowance(amount, None if unit == "total" else _RATE_PERIODS[unit], value.strip())
    raise ValueError(
        f"{shown(value, 80)} is not a budget: write N/min, N/h, N/day or N/total, e.g. 5000000/day"
    )


def _parse_duration(value: Any) -> float:
    if not isinstance(value, str) or not (m := _DURATION.match(value.strip())):
        raise ValueError(
            f"{shown(value, 80)} is not a duration: write a number and a unit, e.g. 250ms, 5s, "
            "10m, 24h"
        )
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if seconds > MAX_DURATION_S:
        # Past this, a timer or a Retry-After makes no sense (and the event loop's timers
        # overflow): a typo such as an extra zero, not a wish.
        raise ValueError(f"{value!r} is longer than 365d, the longest duration Sluice takes")
    return seconds


def _parse_rate(value: Any) -> Rate:
    if not isinstance(value, str) or not (m := _RATE.match(value.strip())):
        raise ValueError(
            f"{shown(value, 80)} is not a rate: write N/s, N/min, N/h or N/day, e.g. 600/min")
    count = int(m.group(1))
    if count < 1:
        raise ValueError(f"{value!r}: a rate must allow at least 1 per period")
    if count > MAX_AMOUNT:
        raise ValueError(f"{shown(value, 40)}: a rate may allow at most "
                         f"{MAX_AMOUNT:.0e} a period".replace("e+", "e"))
    return Rate(count, _RATE_PERIODS[m.group(2)], value.strip())


#: A host name as ``server.listen`` takes it: dot-separated labels of letters, digits, ``_``
#: and ``-`` (not at a label's ends), perhaps with the root's trailing dot.
_LISTEN_NAME = re.compile(
    r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?")


def _listen_host(host: str) -> bool:
    """Whether ``host`` is one ``sluice serve`` can bind as written: an IPv4 address, an IPv6
    one in brackets (a zone may follow ``%``), or a host name. A name whose last label is a
    number is read as an IPv4 address by resolvers (``256.0.0.1``), so it must be one."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    if not _LISTEN_NAME.fullmatch(host):
        return False
    if host.rstrip(".").rpartition(".")[2].isdigit():
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
    return True


def _parse_listen(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT, e.g. 127.0.0.1:8080")
    # Only the port was checked: 'http://127.0.0.1:8080' or a space beside the host passed
    # check-config, and serve could not start (a hostile trial).
    if not _listen_host(host):
        raise ValueError(
            f"{shown(host, 60)} is not a host to listen on: write an IPv4 address, an IPv6 one "
            "in brackets or a host name, then :PORT (no scheme, no spaces), e.g. "
            "127.0.0.1:8080 or [::1]:8080")
    return value


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be greater than 0")
    return value


Duration = Annotated[float, BeforeValidator(_parse_duration)]
PositiveDuration = Annotated[float, BeforeValidator(_parse_duration), AfterValidator(_positive)]
RateSpec = Annotated[Rate, BeforeValidator(_parse_rate), PlainSerializer(str)]  # dumps as written
AllowanceSpec = Annotated[Allowance, BeforeValidator(_parse_allowance)]
Listen = Annotated[str, AfterValidator(_parse_listen)]


#: An HTTP header name (RFC 9110 §5.6.2 token), as a whole string.
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _header_name(value: str) -> str:
    if not HEADER_NAME.fullmatch(value):
        raise ValueError(f"{value!r} is not an HTTP header name (RFC 9110 §5.1 token)")
    # An istr (a str) is looked up in a request's headers without being lower-cased again
    # on every look-up.
    return istr(value)


HeaderName = Annotated[str, AfterValidator(_header_name)]


def _identity_header_name(value: str) -> str:
    if credential_header(value):
        raise ValueError(
            f"{value!r} carries a credential, so it cannot name a tenant, run, priority or "
            "deadline: its values would be shown in /metrics, the admin API and the event "
            "log; map keys to tenants with identity.tenants instead")
    return value


#: A header whose values Sluice shows (tenants, runs): not one that carries a credential.
IdentityHeaderName = Annotated[HeaderName, AfterValidator(_identity_header_name)]


Path_ = tuple[str | int, ...]

#: Longest identity value (tenant, run, request id, parent run) accepted, characters.
MAX_IDENTITY_LENGTH = 128
#: What an identity value may be: visible ASCII (``!`` to ``~``), no spaces or control
#: characters. Such a value is safe as a JSON string, a metric label and an HTML text node
#: once escaped, whatever the caller's client did to encode it.
IDENTITY_VALUE = re.compile(r"[!-~]+")


def _identity_value(value: str) -> str:
    if len(value) > MAX_IDENTITY_LENGTH or not IDENTITY_VALUE.fullmatch(value):
        raise ValueError(
            f"{value[:MAX_IDENTITY_LENGTH]!r} is not an identity value: visible ASCII "
            f"(letters, digits, punctuation), no spaces, at most {MAX_IDENTITY_LENGTH} characters"
        )
    return value


IdentityValue = Annotated[str, AfterValidator(_identity_value)]

_HOST_PATTERN = re.compile(
    r"^(?:\*|(?:\*\.)?[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?(?:\.[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?)*\.?"
    r"|\[[0-9a-f:.]+\])$"
)
_ORIGIN_PATTERN = re.compile(r"^(?:\*|https?://[^/?#\s@]+)$")


def _host_name(value: str) -> str:
    lowered = value.strip().lower()
    if not _HOST_PATTERN.match(lowered):
        raise ValueError(
            f"{value!r} is not a host name: write a name (api.internal), *.suffix, an IPv4 "
            "address, [IPv6] or *; no port"
        )
    return lowered.rstrip(".")


def _origin(value: str) -> str:
    lowered = value.strip().lower()
    if not _ORIGIN_PATTERN.match(lowered):
        raise ValueError(
            f"{value!r} is not an origin: write scheme://host[:port], e.g. "
            "https://app.example.com, or *"
        )
    return lowered


HostName = Annotated[str, AfterValidator(_host_name)]
Origin = Annotated[str, AfterValidator(_origin)]


# --- the schema ------------------------------------------------------------------------------


class _Section(BaseModel):
    # allow_inf_nan: YAML reads 1e309 as infinity; taken as a price it made every cost NaN
    # (a usd budget that never refused), as a weight a bare Infinity in /admin/config.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    #: Keys where a written ``null`` means what their docs say (stdout, no file, the default,
    #: off). Every other key refuses it, whatever its default: a policy block or limit read
    #: as absent is no limit (``concurrency:`` with its keys commented out, or a file an
    #: in-place writer had cut there when a reload read it, lifted the limit: a hostile
    #: trial), and a key defaulting to a value could take null as "off" unseen. A key added
    #: later so refuses null unless listed here.
    NULLABLE: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="before")
    @classmethod
    def _not_empty(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if value is None and name is not None and name not in cls.NULLABLE:
            if cls.model_fields[name].default is None:
                raise ValueError("is empty (null), which would silently disable a limit: "
                                 "give it a value, or leave the key out")
            raise ValueError("is empty (null): give it a value, or leave the key out for "
                             "its default")
        return value


#: The most ``server.max_connections`` may be: far beyond what one process serves.
MAX_CONNECTIONS = 1_000_000


class ServerConfig(_Section):
    """``server``: the listeners and how the proxy port treats callers (``proxy/edge.py``)."""

    NULLABLE = frozenset({"allowed_hosts"})

    listen: Listen = "0.0.0.0:8080"
    admin_listen: Listen = "127.0.0.1:9901"
    drain_timeout: Duration = 30.0
    #: Largest request body accepted, bytes; bigger bodies get 413.
    max_request_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    #: Host header names served; others get 421. ``None``: the listen address's own names,
    #: plus loopback names when it is a loopback or wildcard address (see ``proxy/edge.py``).
    allowed_hosts: list[HostName] | None = None
    #: Origins a browser may call ``mcp`` routes from; others get 403. Empty: only requests
    #: without ``Origin`` or from the same host and port as the ``Host`` they call.
    allowed_origins: list[Origin] = Field(default_factory=list)
    #: A request's head (request line and headers) must arrive within this of its first byte
    #: (of the connection's opening, for its first request), seconds.
    header_timeout: PositiveDuration = 10.0
    #: A request body may pause at most this long, seconds; see ``min_body_rate``.
    body_timeout: PositiveDuration = 30.0
    #: Once ``body_timeout`` has passed, a body must average at least this many bytes a second
    #: since its headers; 0 checks pauses only.
    min_body_rate: int = Field(default=1024, ge=0)
    #: A keep-alive connection idle this long between requests is closed, seconds.
    idle_timeout: PositiveDuration = 75.0
    #: An idle connection to an upstream is kept for reuse this long, seconds. Below the
    #: upstream's own keep-alive timeout, or a request written on a connection the upstream
    #: is closing that moment gets no answer (a POST is then not retried: RFC 9112 §9.3.1).
    #: 4 s: under uvicorn's, Node's and Apache's 5 s (httpx, the MCP SDK's client, keeps 5).
    upstream_idle_timeout: PositiveDuration = 4.0
    #: A caller's EOF (a FIN) after whole requests ends them as a caller that left (HAProxy's
    #: ``option abortonclose``, Pingora's ``abort_on_close``). ``False``: it is read as a
    #: half-close (``shutdown(SHUT_WR)``) and the requests are answered; TCP cannot tell the
    #: two apart, so a caller that left is then seen only once its answer cannot be written.
    abort_on_close: bool = True
    #: Connections open at once on the proxy port; beyond it a new one takes the place of the
    #: oldest idle one, or is answered 503 ``too_many_connections`` and closed.
    #: At most :data:`MAX_CONNECTIONS`; also the listen backlog (a C int).
    max_connections: int = Field(default=1000, gt=0, le=MAX_CONNECTIONS)
    #: Request body bytes held at once, from the request's head to the end of its call,
    #: queued calls included; each body counts what has arrived of it, and at least its first
    #: 64 KiB (``proxy.edge.BodyHold``). A request with no room for that is refused 503
    #: ``buffers_full`` before its body is read, and one whose next bytes find no room as they
    #: arrive, so a burst of large bodies is turned away rather than the process killed for
    #: memory, and slow uploads hold only what they have sent.
    max_buffered_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    #: A call in flight with no bytes moved for longer than this counts as stalled
    #: (``sluice_stalled_requests``).
    stall_after: PositiveDuration = 30.0

    @model_validator(mode="after")
    def _bodies_fit(self) -> ServerConfig:
        if self.max_buffered_bytes < self.max_request_bytes:
            raise ValueError(f"max_buffered_bytes ({self.max_buffered_bytes}) is less than "
                             f"max_request_bytes ({self.max_request_bytes}): the largest "
                             f"body allowed could never be held")
        return self


def _redis_url(value: str) -> str:
    """A ``redis://``, ``rediss://`` or ``unix://`` URL, or ``env:NAME`` naming an environment
    variable that holds one (a Kubernetes Secret); never echoes a password in an error."""
    if value.startswith("env:"):
        if not value[4:]:
            raise ValueError("env: needs a variable name")
        return value
    scheme = value.partition("://")[0].lower()
    if scheme not in ("redis", "rediss", "unix") or "://" not in value:
        raise ValueError("must start with redis://, rediss:// or unix:// (or be env:NAME)")
    # Read as the client will: a query field redis-py does not take (?PASSWORD=, a typo)
    # passed here and ended `sluice serve` with a TypeError at start (a new user's trial).
    try:
        ConnectionPool.from_url(value).make_connection()
    except TypeError as exc:
        field = re.search(r"argument '([^']*)'", str(exc))
        raise ValueError(f"has a query field redis-py does not take"
                         f"{f' ({field.group(1)!r})' if field else ''}") from None
    except (ValueError, RedisError) as exc:
        # Its message names a field, or quotes a piece of the URL. A RedisError: a
        # protocol other than 2 or 3, an ssl_cert_reqs it does not know (check-config ended
        # in a traceback, a reload in "could not be read"; a hostile trial).
        raise ValueError(f"is not a Redis URL redis-py can read: "
                         f"{_unquoted_secret(str(exc), value)}") from None
    # redis-py reads the path as the database number and ignores one that is not a number:
    # a typo (/99x, /O) would silently use database 0, perhaps another deployment's.
    if scheme != "unix" and not _REDIS_DB.fullmatch(urllib.parse.urlsplit(value).path):
        raise ValueError("has a path that is no database number (redis://host:6379/0)")
    return value


def _without_userinfo(url: str) -> str:
    """``url`` with what may be its user info (``user:password@``) replaced by ``<redacted>``,
    for a message about a URL too malformed to parse (a space in the password, ``http:/``):
    everything between the scheme and the last ``@`` goes, too much rather than too little."""
    scheme = re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/{0,3}", url)
    start = scheme.end() if scheme else 0
    at = url.rfind("@", start)
    return url if at < 0 else f"{url[:start]}<redacted>{url[at:]}"


#: A shell or compose variable left in a URL (``${UPSTREAM_HOST}``, ``${HOST:-x}``; in the
#: host also ``$HOST``): Sluice expands none. Group 1 is its name.
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:[:?+-][^}]*)?\}")
_HOST_VARIABLE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


def _variable_in_upstream(value: str) -> str | None:
    """Why the upstream base URL ``value`` holds a shell-style variable (``${NAME}``
    anywhere, ``$NAME`` in its host: a file meant for envsubst, read unrendered), else
    ``None``. Only the name is shown: a default after it (``${PASS:-...}``) may be a secret.
    Checked before the port, which ``${PORT}`` is not (a review)."""
    host_port = value.partition("://")[2].partition("/")[0].rpartition("@")[2]
    variable = _VARIABLE.search(value) or _HOST_VARIABLE.search(host_port)
    if variable is None:
        return None
    name = variable.group(1)
    shown = f"${{{name}}}" if variable.re is _VARIABLE else f"${name}"
    return (f"{shown} is a variable, and Sluice expands none in its config (only the keys "
            "documented to take env:NAME, such as state.redis_url and identity.tenants, read "
            "the environment): write the value itself, or render the file before Sluice "
            "reads it (e.g. envsubst); a password holding ${ writes its $ as %24")


def _not_a_base_url(value: str) -> str:
    """Why the upstream ``value`` is not an ``http(s)://`` base URL with no query or fragment:
    a blank in one named where it is (``http://exa mple.com`` was told only the rule, a new
    user's trial), else the rule. Never quotes the user info."""
    shown = repr(_without_userinfo(value))
    scheme = re.match(r"\s*https?://", value)
    blank = re.search(r"\s", value)
    if scheme is None or blank is None:
        return f"{shown} must be an http:// or https:// base URL with no query or fragment"
    what = {"\t": "a tab", "\n": "a line break", "\r": "a line break"}.get(blank.group(),
                                                                         "a space")
    if value != value.strip():
        return f"{shown} starts or ends with {what}: leave it out"
    authority = re.match(r"[^/?#]*", value[scheme.end():]).group()  # type: ignore[union-attr]
    if blank.start() >= scheme.end() + len(authority):
        return f"{shown} has {what} after its host, which a URL cannot hold: write it %20"
    if blank.start() < scheme.end() + authority.rfind("@") + 1:
        return f"{shown} has {what} in its user info, which a URL cannot hold: write it %20"
    return f"{shown} has {what} in its host or port, which neither can hold"


def _unusable_upstream(value: str) -> str | None:
    """Why aiohttp would refuse every request to the upstream base URL ``value`` (already
    an ``http(s)://`` URL with a host and a valid port), else ``None``: what it does at the
    first request, done at load: such URLs passed the config and failed every call with a
    502, most with a "proxy error" and a traceback each (a hostile trial). Never quotes the
    user info.

    * the URL as ``proxy.forward.upstream_url`` builds it (``yarl.URL(..., encoded=True)``):
      ``[::1]x`` is no URL;
    * the host as aiohttp's connector uses it: a dotted-decimal IPv4 address must be
      canonical (``127.1`` is refused), and a name is encoded by ``getaddrinfo`` with the
      ``idna`` codec (an empty label, ``a..b``, or one over 63 characters is refused);
    * user info as aiohttp sends it, HTTP Basic credentials encoded as Latin-1.
    """
    try:
        url = URL(value, encoded=True)
        host = url.raw_host or ""
    except (ValueError, UnicodeError):
        url = None
        host = ""
    if url is None:
        return ("the host cannot be read as a URL's host (an IPv6 address goes in brackets "
                "with nothing but :PORT after them, e.g. http://[::1]:8080)")
    if "%25" in host:  # RFC 6874's zone, which aiohttp looks up as a name ("%25eth0")
        return ("an IPv6 zone written %25NAME is looked up as part of a name and never "
                "found: write it unencoded, e.g. http://[fe80::1%eth0]:8080")
    if ":" not in host and host.replace(".", "").isdigit():  # aiohttp's test for IPv4
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return ("the host is not an IPv4 address aiohttp connects to: write it as four "
                    "decimal numbers from 0 to 255 with no leading zeros, e.g. 127.0.0.1")
    elif ":" not in host:  # a name (an IPv6 address has a colon, and yarl checked it)
        try:
            host.encode("idna")
        except UnicodeError:
            return ("the host is not a name DNS can look up (its IDNA encoding fails: a "
                    "label, the text between dots, is empty or longer than 63 characters, "
                    "or holds a character IDNA forbids)")
    user, password = url.user, url.password
    if user is not None or password is not None:
        if ":" in (user or ""):
            return ("the user name in the URL holds ':' (encoded as %3A), which HTTP Basic "
                    "credentials cannot carry")
        try:
            f"{user or ''}:{password or ''}".encode("latin-1")
        except UnicodeEncodeError:
            return ("the user name or password in the URL has a character outside Latin-1, "
                    "which aiohttp cannot send as HTTP Basic credentials (percent-encoding "
                    "does not help: it is decoded first); send the credential in a header the "
                    "caller sets instead")
    return None


def _unquoted_secret(message: str, url: str) -> str:
    """``message`` with each quoted piece of ``url``'s user info redacted: redis-py quotes
    what it could not read, and a password holding ``/`` is read as the port
    (``redis://:pa/ss@host`` says ``... as 'pa'``). The password itself is redacted
    wherever it stands (as written or decoded): redis-py's words may repeat a query value
    (``ssl_cert_reqs``) unquoted, and that may be the password pasted in the wrong place."""
    secret = url.partition("://")[2].rpartition("@")[0]
    if not secret:
        return message
    message = re.sub(r"'([^']*)'", lambda quoted: "'<redacted>'"
                     if quoted.group(1) and quoted.group(1) in secret else quoted.group(0),
                     message)
    password = secret.partition(":")[2]
    for form in sorted({password, urllib.parse.unquote(password)}, key=len, reverse=True):
        if form:
            message = message.replace(form, "<redacted>")
    return message


#: The path of a ``redis://`` URL: none, or ``/`` and a database number.
_REDIS_DB = re.compile(r"(?:/[0-9]{0,5})?")


RedisUrl = Annotated[str, AfterValidator(_redis_url)]


#: ``state.lease`` is at least this many ``state.timeout``: renewals every ``lease / 3``, each
#: bounded by ``timeout``, so one that times out still leaves the next one time to land.
LEASE_PER_TIMEOUT = 4


def _short_lease(lease: float, timeout: float) -> str:
    return (f"lease of {lease:g}s is shorter than {LEASE_PER_TIMEOUT} x the timeout "
            f"of {timeout:g}s: a lease is renewed every third of it, each renewal taking up "
            "to the timeout, so a shorter one can lapse while its call runs; raise lease")


class StateConfig(_Section):
    """``state``: where limits, budgets, breakers and keys live (``policies/state/``).

    Restart-only: a reload keeps the running block and says so.
    """

    NULLABLE = frozenset({"redis_url"})

    #: ``memory`` (one process, the default) or ``redis`` (shared by every replica).
    backend: Literal["memory", "redis"] = "memory"
    #: The Redis server, or any node of a Redis Cluster (detected at start); may carry a
    #: password, redacted wherever the config is shown or logged. ``env:NAME`` reads it from
    #: the environment variable ``NAME``, checked whenever the file is loaded (``check-config``,
    #: start, reload): unset, it is a config error.
    redis_url: RedisUrl | None = Field(default=None, repr=False)
    #: The start of every key and channel; replicas sharing state must use the same prefix.
    key_prefix: str = Field(default="sluice", min_length=1, max_length=64,
                            pattern=r"^[A-Za-z0-9_.:-]+$")
    #: Bound on every Redis interaction on the request path, seconds.
    timeout: PositiveDuration = 0.05
    #: How long a concurrency slot, an idempotency key's in-flight marker or a half-open
    #: breaker's probe outlives a replica that stopped renewing it (killed, cut off),
    #: seconds. A call's lease is renewed every third of it, each renewal bounded by
    #: ``timeout``, so it must be at least :data:`LEASE_PER_TIMEOUT` times ``timeout``; when
    #: not set, that is the default if it is longer than 5 s.
    lease: PositiveDuration = 5.0
    #: With Redis unreachable: ``local`` enforces ``limit / replicas`` of every limit in each
    #: replica (and reconciles budget spend when Redis is back); ``reject`` answers 503
    #: ``state_unavailable``.
    on_unavailable: Literal["local", "reject"] = "local"
    #: How many replicas share the limits: each enforces its share of every limit while Redis
    #: is unreachable (``on_unavailable: local``). Accepted with either backend.
    replicas: int = Field(default=1, ge=1, le=10_000)
    #: Budget counters (one per tenant and window, per run total) the memory ledger keeps at
    #: most, ~150 bytes each. A counter is kept until its window ends, so its spend is never
    #: forgotten; a call needing a new one beyond the cap (a new tenant or run) is refused 503
    #: ``budget_counters_full`` while known tenants and runs keep working. Redis expires its
    #: counters itself: this bounds the memory backend and ``local`` fallback only.
    max_budget_counters: int = Field(default=1_000_000, ge=1)
    #: Rate buckets (one per tenant with ``rate.per_tenant``, a route's and an operation's
    #: own) the memory state keeps at most, ~0.4 KiB each with 100-character tenant ids. A
    #: bucket is kept until it drains, so no spent rate is given back; a call needing a new
    #: one beyond the cap (a new tenant) is refused 503 ``rate_buckets_full`` while known
    #: tenants keep working. Redis expires its buckets itself: this bounds the memory backend
    #: and ``local`` fallback only.
    max_rate_buckets: int = Field(default=250_000, ge=1)

    @model_validator(mode="after")
    def _coherent(self) -> StateConfig:
        if self.backend == "redis" and self.redis_url is None:
            raise ValueError("backend redis needs redis_url")
        if "lease" not in self.model_fields_set and self.lease < LEASE_PER_TIMEOUT * self.timeout:
            # The default follows a long timeout (frozen model: set once, while validating).
            object.__setattr__(self, "lease", LEASE_PER_TIMEOUT * self.timeout)
        return self

    @field_validator("lease")
    @classmethod
    def _long_enough(cls, lease: float, info: ValidationInfo) -> float:
        timeout = info.data.get("timeout")
        if timeout is not None and lease < LEASE_PER_TIMEOUT * timeout:
            raise ValueError(_short_lease(lease, timeout))
        return lease

    def resolved_url(self, environ: Mapping[str, str] | None = None) -> str:
        """``redis_url`` with ``env:NAME`` replaced by that variable's value.

        Raises:
            ValueError: no ``redis_url``, or the variable is unset or not a Redis URL.
        """
        url = self.redis_url
        if url is None:
            raise ValueError("state.redis_url is not set")
        if url.startswith("env:"):
            name = url[4:]
            value = (os.environ if environ is None else environ).get(name)
            if not value:
                raise ValueError(f"state.redis_url: environment variable {name} is not set")
            try:
                return _redis_url(value)
            except ValueError as exc:
                raise ValueError(f"state.redis_url: ${name} {exc}") from None
        return url


class IdentityConfig(_Section):
    """``identity``: who is calling (``proxy/identity.py``)."""

    NULLABLE = frozenset({"tenants", "unknown_key_tenant"})

    tenant_header: IdentityHeaderName = "X-Tenant-ID"
    run_header: IdentityHeaderName = "X-Run-ID"
    priority_header: IdentityHeaderName = "X-Priority"
    parent_run_header: IdentityHeaderName = "X-Parent-Run-ID"
    #: The caller's deadline in seconds from now; the SDKs' ``x-stainless-timeout`` is read
    #: too when this is absent.
    timeout_header: IdentityHeaderName = "X-Request-Timeout"
    default_tenant: IdentityValue = "default"
    #: Trusted identity: a file mapping SHA-256 hex digests of API keys to tenants (a path,
    #: relative to the config file), or ``env:NAME`` for the same text in an environment
    #: variable. With it a request's tenant comes from its credential.
    tenants: str | None = Field(default=None, min_length=1)
    #: With ``tenants``: the tenant of a request whose credential is not in the table (or that
    #: sends none); ``None`` refuses such requests with 401.
    unknown_key_tenant: IdentityValue | None = None
    # The table ``tenants`` names, as loaded with the config (``proxy/config.py``):
    # digest -> tenant. Never the keys themselves.
    _keys: dict[str, str] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _coherent(self) -> IdentityConfig:
        if self.unknown_key_tenant is not None and self.tenants is None:
            raise ValueError("unknown_key_tenant has no effect without tenants")
        return self

    @property
    def keys(self) -> dict[str, str] | None:
        """SHA-256 hex digest of an API key -> tenant, when ``tenants`` is set."""
        # Read from pydantic's dict directly: its private-attribute lookup goes through a
        # Python __getattr__ (about 3 µs), and the request path reads this on every call.
        return self.__pydantic_private__["_keys"]  # type: ignore[index]


class AdminConfig(_Section):
    """The admin port's mutating endpoints (``POST /admin/runs/{run}/cancel``)."""

    NULLABLE = frozenset({"token_file"})

    #: File holding the bearer token (a relative path is taken from the config file's
    #: directory). It must exist and hold a token whenever the config is loaded, and the
    #: token in force is the one read then: at start and at each reload that applies, which
    #: a change of the file triggers (so a rotated file applies within a poll); a reload
    #: that refuses the file keeps the token with the rest of the running config. The
    #: ``SLUICE_ADMIN_TOKEN`` environment variable is used when this is null; with neither,
    #: mutating endpoints answer 403.
    token_file: str | None = Field(default=None, min_length=1)
    # ``token_file`` resolved against the config file's directory, and the token read from
    # it, both set when the file is loaded (``proxy/config.py``); never shown (private).
    _path: str | None = PrivateAttr(default=None)
    _token: str | None = PrivateAttr(default=None)

    @property
    def token_path(self) -> str | None:
        """The token file to read: ``token_file`` as resolved at load, or as written."""
        return self._path or self.token_file

    @property
    def token(self) -> str | None:
        """The bearer token ``token_file`` held when this config was loaded (``None``: no
        ``token_file``, or a config not loaded from a file)."""
        return self._token


class EventsConfig(_Section):
    NULLABLE = frozenset({"path"})

    #: Where the admission timeline goes as JSON lines; ``None`` means stdout.
    path: str | None = None


class TimeoutsConfig(_Section):
    NULLABLE = frozenset({"deadline_header"})

    connect: PositiveDuration = 5.0
    total: PositiveDuration = 600.0
    #: On ``mcp`` routes, the GET stream (and ``subscriptions/listen``) has no total timeout:
    #: it is cut only after this long without a byte from the upstream (clients reconnect
    #: with ``Last-Event-ID``), seconds.
    idle: PositiveDuration = 600.0
    #: On ``http`` and ``mcp`` routes, the header that carries the caller's remaining deadline
    #: (seconds) upstream; null sends none. LLM upstreams read the SDKs' own headers instead.
    deadline_header: HeaderName | None = "X-Request-Timeout"


class ConcurrencyConfig(_Section):
    NULLABLE = frozenset({"aging"})

    limit: int = Field(gt=0)
    queue: int = Field(default=0, ge=0)
    max_wait: Duration = 5.0
    per_tenant: int | None = Field(default=None, gt=0)
    #: Weighted fair queueing across tenants within a priority class: a tenant's share of the
    #: slots is its weight over the waiting tenants' sum; tenants not named weigh 1. From
    #: :data:`MIN_WEIGHT` to :data:`MAX_WEIGHT`.
    #: Keyed by tenant names a caller can have (a typo like ``"team a"`` would leave the
    #: tenant it meant at weight 1 unseen).
    tenant_weights: dict[IdentityValue, Annotated[float, Field(ge=MIN_WEIGHT,
                                                                le=MAX_WEIGHT)]] = {}
    #: A call waiting longer than this moves up one priority class per interval (so
    #: best-effort work cannot starve); null: no aging.
    aging: PositiveDuration | None = 5.0

    @model_validator(mode="after")
    def _queue_can_wait(self) -> ConcurrencyConfig:
        if self.queue and not self.max_wait:
            raise ValueError(f"max_wait: 0s leaves the queue of {self.queue} unused: set "
                             "max_wait above 0, or queue: 0 to refuse at once")
        return self


class FanoutConfig(_Section):
    """``fanout``: per run, calls in flight (``width``) and delegation depth (``depth``)."""

    #: Calls of one run in flight at once; more wait (up to ``max_wait``) in the run's queue.
    width: int | None = Field(default=None, gt=0)
    #: Levels of delegation below a root run (a root is depth 0; its child 1, and so on).
    depth: int | None = Field(default=None, ge=0)
    #: Longest wait for a width slot, seconds.
    max_wait: Duration = 5.0

    @model_validator(mode="after")
    def _some_limit(self) -> FanoutConfig:
        if self.width is None and self.depth is None:
            raise ValueError("set width, depth or both")
        return self


class RunConfig(_Section):
    """``run``: limits on one run, its descendants' calls included (``policies/runs.py``)."""

    #: Wall time from the run's first call after which its calls are refused.
    max_duration: PositiveDuration | None = None
    #: Calls the run and its descendants may make.
    max_requests: int | None = Field(default=None, gt=0)
    #: Fraction of a limit used from which answers carry ``X-Sluice-Run-Warning``.
    warn_at: float = Field(default=0.8, gt=0, le=1)
    #: How long a cancelled run's new calls are refused (``POST /admin/runs/{run}/cancel``);
    #: read from the top-level block only, which may set nothing else.
    cancel_ttl: PositiveDuration = 600.0

    @model_validator(mode="after")
    def _some_setting(self) -> RunConfig:
        # ``run: {}`` limited nothing while ``fanout: {}`` was refused (a review).
        if (self.max_duration is None and self.max_requests is None
                and "cancel_ttl" not in self.model_fields_set):
            raise ValueError("set max_duration, max_requests or both (or, at the top level, "
                             "cancel_ttl)")
        return self


class TenantRateConfig(_Section):
    requests: RateSpec


class RateConfig(_Section):
    requests: RateSpec | None = None
    #: Tokens per period, each request weighted by its reserved worst case (policies/rate.py).
    tokens: RateSpec | None = None
    per_tenant: TenantRateConfig | None = None

    @model_validator(mode="after")
    def _some_limit(self) -> RateConfig:
        # ``rate: {}`` loaded as a block that limits nothing, while ``concurrency: {}``,
        # ``fanout: {}`` and ``budget: {}`` were refused (a review).
        if self.requests is None and self.tokens is None and self.per_tenant is None:
            raise ValueError("set at least one of requests, tokens, per_tenant")
        return self


class IdempotencyConfig(_Section):
    """Idempotency keys on a route (``policies/idempotency.py``; every key is documented there
    and in ``config/sluice.yaml``)."""

    mode: Literal["dedup", "forward", "serialize", "off"] = "dedup"
    ttl: PositiveDuration = 86400.0
    derive_from: list[HeaderName] = Field(default_factory=list)
    on_in_flight: Literal["wait", "reject"] = "wait"
    #: Longest a duplicate waits for its in-flight twin (or a serialized request for its
    #: turn), seconds; the caller's own timeout binds first. Past it: 409.
    max_wait: PositiveDuration = 60.0
    #: Duplicates that may wait at once for one in-flight key, in this process; one more gets
    #: 409 ``idempotency_conflict`` at once.
    max_waiters: int = Field(default=100, gt=0)
    max_entries: int = Field(default=10_000, gt=0)
    #: At least 4 KiB: a record and its tenant's bookkeeping are charged ~1.3 KB before any
    #: body, and a store that can hold none keeps not even the fact that a key ran.
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=4096)
    max_replay_bytes: int = Field(default=1024 * 1024, gt=0)

    @model_validator(mode="after")
    def _coherent(self) -> IdempotencyConfig:
        # A key the mode never reads would be a silent no-op: refuse it ("off" may keep any).
        unused = {"forward": ("on_in_flight", "max_replay_bytes", "max_wait", "max_waiters"),
                  "serialize": ("max_replay_bytes",)}
        for key in unused.get(self.mode, ()):
            if key in self.model_fields_set:
                raise ValueError(f"{key} has no effect in mode {self.mode}")
        if self.max_replay_bytes > self.max_bytes:
            raise ValueError(
                f"max_replay_bytes ({self.max_replay_bytes}) exceeds max_bytes ({self.max_bytes})"
            )
        if len(set(map(str.lower, self.derive_from))) != len(self.derive_from):
            raise ValueError("derive_from names a header twice")
        return self


class CircuitBreakerConfig(_Section):
    """``circuit_breaker``: one breaker per route upstream (see ``policies/breaker.py``)."""

    NULLABLE = frozenset({"tool_errors"})

    #: Consecutive upstream failures that open the breaker.
    fail_max: int = Field(default=5, gt=0)
    #: Optional failure-rate trip: the fraction of calls in the last ``window`` that failed,
    #: evaluated once ``min_calls`` calls are in the window (Resilience4j semantics, ``>=``).
    rate: float | None = Field(default=None, gt=0, le=1)
    window: PositiveDuration = 30.0
    min_calls: int = Field(default=10, gt=0)
    #: Time open before one probe is let through, seconds.
    reset_timeout: PositiveDuration = 30.0
    #: Successful probes in a row that close the breaker again.
    success_threshold: int = Field(default=1, gt=0)
    #: On a tool's block of an ``mcp`` route: a tool failure (an ``isError`` result, a
    #: JSON-RPC error other than invalid params) counts as a failure. A route's breaker
    #: counts only transport failures (5xx, no answer), so one tool cannot open it. Unset:
    #: true on a named tool, false on ``default``, whose one breaker every unnamed tool
    #: shares: a caller's made-up tool names (``isError`` "Unknown tool" from the official
    #: Python server) would open it for every caller and every unnamed tool.
    tool_errors: bool | None = None


class BackoffConfig(_Section):
    base: PositiveDuration = 0.25
    max: PositiveDuration = 8.0


class RetryBudgetConfig(_Section):
    """Retries in flight <= max(``min_concurrency``, ``ratio`` x active requests) (Envoy)."""

    ratio: float = Field(default=0.2, gt=0, le=1)
    min_concurrency: int = Field(default=3, ge=0)


def _retry_on(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and not 400 <= value <= 599:
        raise ValueError(f"{value} is not an error status (400-599)")
    return value


RetryOn = Annotated[int | Literal["connect_error", "timeout"], AfterValidator(_retry_on)]


class RetryConfig(_Section):
    """``retry``: Sluice's one retry layer (see ``policies/retry.py``)."""

    #: Upstream attempts in all, the first one included.
    attempts: int = Field(default=3, ge=1, le=10)
    #: Bound on one attempt, up to the upstream's response headers, seconds.
    per_try_timeout: PositiveDuration | None = None
    #: Bound on all attempts and the waits between them, seconds.
    deadline: PositiveDuration | None = None
    backoff: BackoffConfig = BackoffConfig()
    on: list[RetryOn] = Field(
        default_factory=lambda: [502, 503, 504, "connect_error", "timeout"], min_length=1
    )
    #: Longest upstream ``Retry-After`` Sluice waits for; a longer one ends the retries.
    max_retry_after: PositiveDuration = 60.0
    budget: RetryBudgetConfig = RetryBudgetConfig()
    #: The upstream deduplicates on ``Idempotency-Key``, so a POST carrying one (the caller's
    #: or one the ``idempotency`` block chose) is safe to retry. Off: only a key the caller
    #: sent itself makes a POST retryable (an MCP server, for one, ignores the header).
    honours_idempotency_key: bool = False


#: The most ``dead_letter.max_records`` may be (and so the most ``sluice dlq list`` can show).
MAX_DEAD_LETTERS = 10_000_000


class DeadLetterConfig(_Section):
    #: SQLite file for dead-lettered work (created on first use).
    path: str = Field(default="sluice-dlq.sqlite", min_length=1)
    #: Request bodies are kept up to this size, bytes; longer ones are cut and not replayable.
    max_body_bytes: int = Field(default=1024 * 1024, ge=0)
    #: Letters kept at most; the one written past it drops the oldest (with their replays).
    #: The store then holds up to ``max_records * (max_body_bytes + ~2 KiB)`` bytes: 10 GiB
    #: at the defaults if every body is 1 MiB, ~100 MiB for 8 KiB chat requests.
    max_records: int = Field(default=10_000, ge=1, le=MAX_DEAD_LETTERS)
    #: Letters one tenant keeps at most; its letter written past it drops that tenant's own
    #: oldest, so one caller's flood of failures cannot push out every other tenant's
    #: letters (a hostile trial: 60 self-timed-out 1 MiB calls left 50 of the attacker's
    #: letters, and the victim's outage letter was gone). At most ``max_records``. Unset (the
    #: default): no share, ``max_records`` alone. Opt-in: a call without ``X-Tenant-ID`` is
    #: tenant ``identity.default_tenant``, so any default share would hold a deployment
    #: without tenant headers below its ``max_records`` (and drop the rest on upgrade).
    max_records_per_tenant: int | None = Field(default=None, ge=1, le=MAX_DEAD_LETTERS)


class BudgetConfig(_Section):
    """One budget block (policies/budget.py): limits per unit, for one kind of scope."""

    NULLABLE = frozenset({"warn_at"})

    tokens: AllowanceSpec | None = None  # input + output tokens
    input_tokens: AllowanceSpec | None = None
    output_tokens: AllowanceSpec | None = None
    usd: AllowanceSpec | None = None  # priced from the top-level ``pricing`` table
    per: Literal["tenant", "run", "route"] = "tenant"
    #: Fraction of a limit spent (0 < warn_at <= 1) from which answers carry a warning header.
    warn_at: float | None = Field(default=None, gt=0, le=1)
    #: How long an idle run's ``N/total`` spend is remembered (memory is bounded by it).
    ttl: PositiveDuration = 86400.0

    @model_validator(mode="after")
    def _some_limit(self) -> BudgetConfig:
        if not self.limits():
            raise ValueError("set at least one of tokens, input_tokens, output_tokens, usd")
        return self

    def limits(self) -> list[tuple[str, Allowance]]:
        """``[(unit, allowance)]`` for each unit this block limits."""
        return [
            (unit, allowance)
            for unit in BUDGET_UNITS
            if (allowance := getattr(self, unit)) is not None
        ]


#: Units a budget can count, as they appear in config keys and metric labels.
BUDGET_UNITS = ("tokens", "input_tokens", "output_tokens", "usd")


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, dict) else value


def _some_budget(value: list[BudgetConfig]) -> list[BudgetConfig]:
    if not value:  # ``budget: []`` limited nothing
        raise ValueError("is an empty list: give at least one budget block, or leave the key "
                         "out")
    return value


class UsageConfig(_Section):
    """How an openai/anthropic route reads and shapes token usage (policies/usage.py)."""

    NULLABLE = frozenset({"default_max_tokens"})

    #: Output cap reserved for a request that sets none (max_tokens and the like), tokens;
    #: at most :data:`MAX_AMOUNT` (it is written into the request, where JSON encoders take
    #: 64 bits).
    default_max_tokens: int | None = Field(default=None, gt=0, le=MAX_AMOUNT)
    #: Write that cap into such requests, so the upstream cannot exceed the reservation.
    write_max_tokens: bool = True
    #: Ask OpenAI streams for their usage chunk; it is stripped if the client did not ask.
    stream_usage: bool = True


class ModelPrice(_Section):
    """USD per million tokens of one model (each at most :data:`MAX_USD`)."""

    NULLABLE = frozenset({"cache_read", "cache_write"})

    input: float = Field(ge=0, le=MAX_USD)
    output: float = Field(ge=0, le=MAX_USD)
    #: Input tokens read from a prompt cache; defaults to ``input``.
    cache_read: float | None = Field(default=None, ge=0, le=MAX_USD)
    #: Input tokens written to a prompt cache (Anthropic); defaults to ``input``.
    cache_write: float | None = Field(default=None, ge=0, le=MAX_USD)


class OperationConfig(_Section):
    """One operation's policy blocks (``tools:``, ``endpoints:`` or ``models:`` of a route;
    ``policies/operations.py``). They apply to that operation's calls *in addition to* the
    route's blocks: both the route's and the operation's ``concurrency``, ``rate`` and
    ``circuit_breaker`` must admit a call. ``idempotency``, ``retry`` and ``timeouts`` replace
    the route's for the operation's calls (one key, one retry loop, one client timeout)."""

    concurrency: ConcurrencyConfig | None = None
    rate: RateConfig | None = None
    circuit_breaker: CircuitBreakerConfig | None = None
    retry: RetryConfig | None = None
    idempotency: IdempotencyConfig | None = None
    timeouts: TimeoutsConfig | None = None
    #: USD charged per upstream attempt (every attempt, retries included) to the route's
    #: ``usd`` budgets; reserved before the call is forwarded.
    cost_per_call: float | None = Field(default=None, ge=0, le=MAX_USD)
    #: USD charged per second of upstream time (each attempt from its sending to the end of
    #: its answer) to the route's ``usd`` budgets, settled when the call ends.
    cost_per_second: float | None = Field(default=None, ge=0, le=MAX_USD)
    #: The operation's calls may be repeated safely (a read-only tool, a GET-like endpoint):
    #: ``retry`` repeats them as it repeats GETs. A route's ``idempotent: true`` already
    #: declares every operation so.
    idempotent: bool = False

    @field_validator("timeouts")
    @classmethod
    def _call_timeouts(cls, value: TimeoutsConfig | None) -> TimeoutsConfig | None:
        # Set here, they were ignored: ``idle`` bounds an MCP GET stream, which is no
        # operation's, and the deadline header is named once for the route's calls.
        unused = sorted({"idle", "deadline_header"} & (value.model_fields_set if value else set()))
        if unused:
            raise ValueError(f"an operation's timeouts take connect and total only; set "
                             f"{' and '.join(unused)} in the route's timeouts")
        return value


#: The key naming the policy of every operation of a route that no other key names.
DEFAULT_OPERATION = "default"

_ENDPOINT = re.compile(r"^([A-Z]+|\*) (/\S*)$")


class PathGlob:
    """A path pattern of ``endpoints:``: ``*`` matches within one segment, ``**`` across
    segments, anything else itself.

    :meth:`fullmatch` takes time linear in the path's length whatever the pattern. A
    backtracking regex does so with one wildcard only: with three ``**`` it took 1.3 s on an
    8 KB path (cubic), so one request could stall every call of the process. A pattern with
    one wildcard or none is therefore a regex (0.5 µs a typical match), any other runs as a
    bit-parallel NFA (shift-and; about 1 µs a character).
    """

    __slots__ = ("_accept", "_any", "_chars", "_closure_steps", "_regex", "_segment",
                 "pattern")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        tokens = [t for t in re.split(r"(\*\*|\*)", pattern) if t]
        wildcards = sum(t in ("*", "**") for t in tokens)
        self._regex = (re.compile("".join(
            ".*" if t == "**" else "[^/]*" if t == "*" else re.escape(t) for t in tokens))
            if wildcards <= 1 else None)
        # State i: the first i items matched. A literal item advances on its character; a
        # wildcard item stays on any character (``*``: but ``/``) and may be skipped (empty).
        items: list[str] = []
        for token in tokens:
            items.extend([token] if token in ("*", "**") else list(token))
        self._chars: dict[str, int] = {}
        self._segment = self._any = 0
        run = longest = 0
        for i, item in enumerate(items):
            bit = 1 << i
            if item == "**":
                self._any |= bit
            elif item == "*":
                self._segment |= bit
            else:
                self._chars[item] = self._chars.get(item, 0) | bit
            run = run + 1 if item in ("*", "**") else 0
            longest = max(longest, run)
        self._closure_steps = longest
        self._accept = 1 << len(items)

    def _closure(self, states: int) -> int:
        """``states`` plus those reached by skipping wildcards (an empty match)."""
        wild = self._segment | self._any
        for _ in range(self._closure_steps):
            states |= (states & wild) << 1
        return states

    def fullmatch(self, path: str) -> bool:
        """Whether the whole of ``path`` matches the pattern."""
        if self._regex is not None:
            return self._regex.fullmatch(path) is not None
        chars, segment, any_ = self._chars, self._segment, self._any
        states = self._closure(1)
        for c in path:
            states = (((states & chars.get(c, 0)) << 1) | (states & any_)
                      | (states & segment if c != "/" else 0))
            if not states:
                return False
            states = self._closure(states)
        return bool(states & self._accept)


def endpoint_pattern(key: str) -> tuple[str, PathGlob]:
    """``(method, path pattern)`` of an ``endpoints:`` key ``"METHOD /path"``: ``METHOD`` an
    upper-case HTTP method or ``*`` (any); in the path (the upstream's, after the route's
    prefix, without the query) ``*`` matches within one segment and ``**`` across segments.

    Raises:
        ValueError: the key is not of that shape.
    """
    m = _ENDPOINT.match(key)
    if m is None:
        raise ValueError(
            f"{key!r} is not an endpoint: write METHOD /path, e.g. \"POST /v1/jobs/*\" "
            f"(* within a segment, ** across segments; * for any method)"
        )
    method, path = m.groups()
    return method, PathGlob(path)


def _endpoint_keys(value: dict[str, OperationConfig]) -> dict[str, OperationConfig]:
    """Every ``endpoints:`` key is an endpoint (:func:`endpoint_pattern`), and no two are
    the same pattern but for case: patterns match case-insensitively
    (:mod:`policies.paths`), so the later one would never match a call (a review:
    ``POST /v1/Uploads/*`` silently shadowed ``POST /v1/uploads/*``)."""
    folded: dict[tuple[str, str], str] = {}
    for key in value:
        if key != DEFAULT_OPERATION:
            method, pattern = endpoint_pattern(key)
            first = folded.setdefault((method, pattern.pattern.lower()), key)
            if first != key:
                raise ValueError(
                    f"{key!r} is {first!r} but for case: patterns match paths "
                    f"case-insensitively, so it would never match a call; keep one")
    return value


def _some_operation(value: dict[str, OperationConfig]) -> dict[str, OperationConfig]:
    # ``tools: {}`` configured nothing and said nothing (a review).
    if not value:
        raise ValueError("names no operation: give at least one (or default), or leave the "
                         "key out")
    return value


Operations = Annotated[dict[Annotated[str, Field(min_length=1, max_length=200)],
                            OperationConfig], AfterValidator(_some_operation)]


class RouteConfig(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    path_prefix: str
    upstream: str
    protocol: Literal["openai", "anthropic", "mcp", "http"] = "http"
    timeouts: TimeoutsConfig = TimeoutsConfig()
    concurrency: ConcurrencyConfig | None = None
    rate: RateConfig | None = None
    idempotency: IdempotencyConfig | None = None
    circuit_breaker: CircuitBreakerConfig | None = None
    retry: RetryConfig | None = None
    #: One budget block, or a list of them (e.g. per tenant and per run).
    budget: Annotated[list[BudgetConfig], BeforeValidator(_one_or_many),
                      AfterValidator(_some_budget)] | None = None
    usage: UsageConfig = UsageConfig()
    fanout: FanoutConfig | None = None
    run: RunConfig | None = None
    #: Every call on this route may be repeated safely (e.g. a read-only tool server):
    #: ``retry`` repeats POSTs as it repeats GETs.
    idempotent: bool = False
    #: Request header fields taken out of what goes upstream (Envoy's route option of the
    #: same name), e.g. the identity headers a third-party provider need not see. Sluice has
    #: read them by then; a field Sluice sets itself (its ``Idempotency-Key``, the deadline
    #: header) is set after.
    request_headers_to_remove: list[HeaderName] = []
    #: Per-operation policy blocks (``policies/operations.py``), with ``default`` for the
    #: operations not named: by tool name on ``mcp`` routes, by ``"METHOD /path"`` pattern on
    #: ``http`` routes (the first in file order that matches), by model on ``openai`` and
    #: ``anthropic`` routes.
    tools: Operations | None = None
    endpoints: Annotated[Operations, AfterValidator(_endpoint_keys)] | None = None
    models: Operations | None = None

    @field_validator("run")
    @classmethod
    def _route_run(cls, value: RunConfig | None) -> RunConfig | None:
        # A route's cancel_ttl was never read: a cancel covers every route of the run.
        if value is not None and "cancel_ttl" in value.model_fields_set:
            raise ValueError("cancel_ttl is read from the top-level run block only: set it "
                             "there")
        return value

    @field_validator("path_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/") or not value.endswith("/") or "/../" in value:
            raise ValueError(f"{value!r} must start and end with '/', e.g. /openai/")
        return value

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str) -> str:
        # Checked here, not at the first request: aiohttp refuses a bad port or host only
        # when it connects, and every call would then fail 502.
        if not re.match(r"^https?://[^/?#\s]+(/[^?#\s]*)?$", value):
            raise ValueError(_not_a_base_url(value))
        variable = _variable_in_upstream(value)  # before the port: ${PORT} is no number
        if variable is not None:
            raise ValueError(variable)
        try:
            parts = urllib.parse.urlsplit(value)
            port = parts.port  # ValueError: not a number, or outside 0-65535
        except ValueError:
            port = 0
        # The messages do not quote the URL: its userinfo may hold a password.
        if port == 0:
            raise ValueError("the port after the host must be a number from 1 to 65535 (or "
                             "left out: 80 for http, 443 for https)")
        if not parts.hostname:
            raise ValueError("the URL has no host")
        unusable = _unusable_upstream(value)
        if unusable is not None:
            raise ValueError(unusable)
        return value.rstrip("/")

    def operations(self) -> tuple[str, dict[str, OperationConfig]]:
        """``(key, blocks)``: the key naming this route's operations (``tools``,
        ``endpoints`` or ``models``, by protocol) and the blocks under it (empty if none)."""
        key = OPERATION_KEYS[self.protocol]
        return key, getattr(self, key) or {}

    def timeouts_for(self, block: OperationConfig | None) -> TimeoutsConfig:
        """The upstream timeouts of a call under operation block ``block`` (``None``: no
        block applies): the block's own ``timeouts`` when it has one, which replaces the
        route's (a field it leaves out is the default, not the route's), else the route's
        own object (``proxy.attempts`` tells the two apart by identity)."""
        if block is not None and block.timeouts is not None:
            return block.timeouts
        return self.timeouts

    def retries(self) -> bool:
        """Some call of this route may be retried (the route's or an operation's ``retry``),
        so it may dead-letter one."""
        return self.retry is not None or any(
            op.retry is not None for op in self.operations()[1].values())

    def costs_usd(self) -> bool:
        """Some operation of this route has a cost (``cost_per_call``, ``cost_per_second``)."""
        return any(op.cost_per_call or op.cost_per_second
                   for op in self.operations()[1].values())


#: The key naming operations on each protocol's routes.
OPERATION_KEYS = {"mcp": "tools", "http": "endpoints", "openai": "models", "anthropic": "models"}


class Config(_Section):
    server: ServerConfig = ServerConfig()
    state: StateConfig = StateConfig()
    identity: IdentityConfig = IdentityConfig()
    admin: AdminConfig = AdminConfig()
    #: Fan-out and run limits across all routes together (a route's own blocks apply too).
    fanout: FanoutConfig | None = None
    run: RunConfig | None = None
    events: EventsConfig = EventsConfig()
    dead_letter: DeadLetterConfig = DeadLetterConfig()
    #: USD per million tokens, by model name as the request names it.
    pricing: dict[str, ModelPrice] = {}
    routes: list[RouteConfig] = Field(min_length=1)
    # What the config was read from, set when a file is loaded (``proxy/config.py``): each
    # file read (the config, then those it names: a tenants table, an admin token), as
    # (path, size in bytes, SHA-256 hex of its text). A reload whose files still hold those
    # texts has nothing to apply (``proxy/reload.py``).
    _read: tuple[tuple[str, int, str], ...] | None = PrivateAttr(default=None)

    @property
    def read_from(self) -> tuple[tuple[str, int, str], ...] | None:
        """The files this config was read from (path, bytes, SHA-256 hex), the config file
        first; ``None`` when it was not loaded from a file (parsed from text, a pipe)."""
        return self._read


def _port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def cross_checks(config: Config) -> Iterator[tuple[Path_, str]]:
    """Problems no single key shows: one port for both listeners, the same route name or prefix
    twice, budgets that could not bind, a tenant's share of the dead letters above the
    store's bound."""
    if _port(config.server.listen) == _port(config.server.admin_listen) != 0:
        yield ("server", "admin_listen"), (
            f"{config.server.admin_listen} uses the same port as listen ({config.server.listen})"
        )
    letters = config.dead_letter
    if letters.max_records_per_tenant is not None and (
            letters.max_records_per_tenant > letters.max_records):
        yield ("dead_letter", "max_records_per_tenant"), (
            f"{letters.max_records_per_tenant} exceeds max_records ({letters.max_records}): "
            f"no tenant can keep more letters than the store")
    seen: dict[tuple[str, str], int] = {}
    for index, route in enumerate(config.routes):
        for key in ("name", "path_prefix"):
            value = getattr(route, key)
            if (key, value) in seen:
                yield ("routes", index, key), (
                    f"{value!r} is already used by routes[{seen[key, value]}]"
                )
            seen.setdefault((key, value), index)
        retry = route.retry
        if retry is not None:
            if retry.backoff.base > retry.backoff.max:
                yield ("routes", index, "retry", "backoff", "base"), "must not exceed backoff.max"
            if retry.per_try_timeout and retry.deadline and retry.per_try_timeout > retry.deadline:
                yield ("routes", index, "retry", "per_try_timeout"), "must not exceed deadline"
        yield from budget_checks(config, index, route)
        yield from operation_checks(index, route)


def operation_checks(index: int, route: RouteConfig) -> Iterator[tuple[Path_, str]]:
    """Operation blocks under the key of the route's protocol only; token rates on models
    only; the same retry coherence as a route's."""
    own = OPERATION_KEYS[route.protocol]
    for key in ("tools", "endpoints", "models"):
        if key != own and getattr(route, key) is not None:
            yield ("routes", index, key), (
                f"{route.protocol} routes name their operations under {own}, not {key} "
                f"(tools: mcp; endpoints: http; models: openai, anthropic)"
            )
    for name, op in (getattr(route, own) or {}).items():
        at: Path_ = ("routes", index, own, name)
        if op.rate is not None and op.rate.tokens is not None and own != "models":
            yield (*at, "rate", "tokens"), (
                "token rates apply to models on openai or anthropic routes (Sluice reads "
                "usage from those only)"
            )
        retry = op.retry
        if retry is not None:
            if retry.backoff.base > retry.backoff.max:
                yield (*at, "retry", "backoff", "base"), "must not exceed backoff.max"
            if retry.per_try_timeout and retry.deadline and retry.per_try_timeout > retry.deadline:
                yield (*at, "retry", "per_try_timeout"), "must not exceed deadline"


def advisories(config: Config) -> Iterator[tuple[Path_, str]]:
    """What a valid config does that its author may not mean, for ``check-config`` to warn
    of: an ``openai`` route that limits tokens or spend (a budget, ``rate.tokens``, a
    model's ``rate.tokens``) with no
    ``usage.default_max_tokens`` refuses every call that names no output cap (400
    ``bad_request``), and most SDK calls name none (a new user's trial: a budget added
    quietly broke every call). Anthropic's API requires ``max_tokens``, so its routes are
    not named."""
    for index, route in enumerate(config.routes):
        if route.protocol != "openai" or route.usage.default_max_tokens is not None:
            continue
        models = [name for name, block in (route.models or {}).items()
                  if block.rate is not None and block.rate.tokens is not None]
        if route.budget:
            key: Path_ = ("routes", index, "budget")
        elif route.rate is not None and route.rate.tokens is not None:
            key = ("routes", index, "rate", "tokens")
        elif models:
            key = ("routes", index, "models", models[0], "rate", "tokens")
        else:
            continue
        yield key, ("this route limits tokens or spend and sets no usage.default_max_tokens: a "
                    "call that names no max_tokens (most SDK calls) is refused 400 "
                    "bad_request; set one, e.g. usage: {default_max_tokens: 4096}")


def budget_checks(config: Config, index: int, route: RouteConfig) -> Iterator[tuple[Path_, str]]:
    """Token limits only bind where Sluice can read usage, and each must be able to admit."""
    at: Path_ = ("routes", index)
    llm = route.protocol in ("openai", "anthropic")
    if route.rate is not None and route.rate.tokens is not None and not llm:
        yield (*at, "rate", "tokens"), (
            f"token limits need protocol openai or anthropic (Sluice reads usage from those "
            f"only), not {route.protocol}"
        )
    default_cap = route.usage.default_max_tokens
    if route.rate is not None and route.rate.tokens is not None and default_cap is not None:
        if default_cap > route.rate.tokens.count:
            yield (*at, "usage", "default_max_tokens"), (
                f"{default_cap} exceeds rate.tokens {route.rate.tokens}: every request without "
                f"max_tokens would be refused"
            )
    seen: dict[tuple[str, str, int | None], int] = {}
    for b, block in enumerate(route.budget or ()):
        where = (*at, "budget", b) if len(route.budget or ()) > 1 else (*at, "budget")
        for unit, allowance in block.limits():
            same = (unit, block.per, allowance.period_s)
            if same in seen:
                yield (*where, unit), (
                    f"budget[{seen[same]}] already limits {unit} per {block.per} over the same "
                    f"window; keep the smaller one"
                )
            seen.setdefault(same, b)
        if not llm and (block.usd is None or not route.costs_usd()):
            yield where, (
                f"budgets need protocol openai or anthropic (Sluice reads usage from those "
                f"only), or a usd limit and operations with cost_per_call or cost_per_second, "
                f"not {route.protocol}"
            )
        elif not llm and len(block.limits()) > 1:
            yield where, (
                f"only usd can be budgeted on a {route.protocol} route (its costs are the "
                f"operations' cost_per_call and cost_per_second; Sluice reads no tokens there)"
            )
        for unit, allowance in block.limits():
            if allowance.period_s is None and block.per != "run":
                yield (*where, unit), (
                    f"{allowance} needs per: run (a tenant's or route's all-time spend is not "
                    f"kept across restarts; use a window such as N/day)"
                )
            if unit == "usd" and llm and not config.pricing:
                yield (*where, unit), "a usd budget needs the top-level pricing table"
            if (
                default_cap is not None
                and unit in ("tokens", "output_tokens")
                and default_cap > allowance.amount
            ):
                yield (*at, "usage", "default_max_tokens"), (
                    f"{default_cap} exceeds the {unit} budget {allowance}: every request "
                    f"without max_tokens would be refused"
                )
        if "ttl" in block.model_fields_set and not any(
            a.period_s is None for _, a in block.limits()
        ):
            yield (*where, "ttl"), "ttl applies only to N/total budgets"
