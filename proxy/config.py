"""Loading and validating the YAML config file.

Every problem is reported as ``FILE:LINE: KEY: PROBLEM`` (all of them at once, not only the
first), and :class:`ConfigError` is raised so the caller can keep its old config serving.

Two YAML 1.1 habits of PyYAML are closed off here because each one silently changes a limit:

* duplicate keys: PyYAML keeps the last one without a word (yaml/pyyaml#165);
* implicit types: ``on``/``no`` become booleans, ``1:30`` becomes 90 (sexagesimal), ``0755``
  becomes 493, ``2024-01-01`` a date. :class:`StrictLoader` resolves scalars the YAML 1.2 core
  way instead (``true``/``false`` only, decimal numbers only, no timestamps), and the pydantic
  models are strict, so a boolean or a number where a string belongs is an error. A plain
  ``on``/``off``/``yes``/``no`` or a leading-zero number is refused wherever it appears: the
  file would mean something else to every YAML 1.1 tool (and reader) that sees it.

Durations are strings with a unit (``250ms``, ``5s``, ``10m``, ``24h``, ``1d``) and become
float seconds; rates are ``N/s``, ``N/min``, ``N/h``, ``N/day`` and become :class:`Rate`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)


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
_RATE = re.compile(r"^(\d+)/(s|min|h|day)$")
_RATE_PERIODS = {"s": 1, "min": 60, "h": 3600, "day": 86400}


@dataclass(frozen=True, slots=True)
class Rate:
    """``count`` events per ``period_s`` seconds, as written ``N/unit`` in the config."""

    count: int
    period_s: int
    text: str

    def __str__(self) -> str:
        return self.text


def _parse_duration(value: Any) -> float:
    if not isinstance(value, str) or not (m := _DURATION.match(value.strip())):
        raise ValueError(
            f"{value!r} is not a duration: write a number and a unit, e.g. 250ms, 5s, 10m, 24h"
        )
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def _parse_rate(value: Any) -> Rate:
    if not isinstance(value, str) or not (m := _RATE.match(value.strip())):
        raise ValueError(f"{value!r} is not a rate: write N/s, N/min, N/h or N/day, e.g. 600/min")
    count = int(m.group(1))
    if count < 1:
        raise ValueError(f"{value!r}: a rate must allow at least 1 per period")
    return Rate(count, _RATE_PERIODS[m.group(2)], value.strip())


def _parse_listen(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT, e.g. 127.0.0.1:8080")
    return value


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be greater than 0")
    return value


Duration = Annotated[float, BeforeValidator(_parse_duration)]
PositiveDuration = Annotated[float, BeforeValidator(_parse_duration), AfterValidator(_positive)]
RateSpec = Annotated[Rate, BeforeValidator(_parse_rate), PlainSerializer(str)]  # dumps as written
Listen = Annotated[str, AfterValidator(_parse_listen)]


Path_ = tuple[str | int, ...]


# --- the schema ------------------------------------------------------------------------------


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ServerConfig(_Section):
    listen: Listen = "0.0.0.0:8080"
    admin_listen: Listen = "127.0.0.1:9901"
    drain_timeout: Duration = 30.0
    #: Largest request body accepted, bytes; bigger bodies get 413.
    max_request_bytes: int = Field(default=32 * 1024 * 1024, gt=0)


class StateConfig(_Section):
    backend: Literal["memory"] = "memory"


class IdentityConfig(_Section):
    tenant_header: str = "X-Tenant-ID"
    run_header: str = "X-Run-ID"
    priority_header: str = "X-Priority"
    default_tenant: str = Field(default="default", min_length=1)


class EventsConfig(_Section):
    #: Where the admission timeline goes as JSON lines; ``None`` means stdout.
    path: str | None = None


class TimeoutsConfig(_Section):
    connect: PositiveDuration = 5.0
    total: PositiveDuration = 600.0


class ConcurrencyConfig(_Section):
    limit: int = Field(gt=0)
    queue: int = Field(default=0, ge=0)
    max_wait: Duration = 5.0
    per_tenant: int | None = Field(default=None, gt=0)


class TenantRateConfig(_Section):
    requests: RateSpec


class RateConfig(_Section):
    requests: RateSpec | None = None
    per_tenant: TenantRateConfig | None = None


_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def _header_name(value: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{value!r} is not an HTTP header name (RFC 9110 §5.1 token)")
    return value


HeaderName = Annotated[str, AfterValidator(_header_name)]


class IdempotencyConfig(_Section):
    """Idempotency keys on a route (``policies/idempotency.py``; every key is documented there
    and in ``config/sluice.yaml``)."""

    mode: Literal["dedup", "forward", "serialize", "off"] = "dedup"
    ttl: PositiveDuration = 86400.0
    derive_from: list[HeaderName] = Field(default_factory=list)
    on_in_flight: Literal["wait", "reject"] = "wait"
    max_entries: int = Field(default=10_000, gt=0)
    max_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    max_replay_bytes: int = Field(default=1024 * 1024, gt=0)

    @model_validator(mode="after")
    def _coherent(self) -> IdempotencyConfig:
        # A key the mode never reads would be a silent no-op: refuse it ("off" may keep any).
        unused = {"forward": ("on_in_flight", "max_replay_bytes"),
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


class DeadLetterConfig(_Section):
    #: SQLite file for dead-lettered work (created on first use).
    path: str = Field(default="sluice-dlq.sqlite", min_length=1)
    #: Request bodies are kept up to this size, bytes; longer ones are cut and not replayable.
    max_body_bytes: int = Field(default=1024 * 1024, ge=0)


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

    @field_validator("path_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/") or not value.endswith("/") or "/../" in value:
            raise ValueError(f"{value!r} must start and end with '/', e.g. /openai/")
        return value

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str) -> str:
        if not re.match(r"^https?://[^/?#\s]+(/[^?#\s]*)?$", value):
            raise ValueError(
                f"{value!r} must be an http:// or https:// base URL with no query or fragment"
            )
        return value.rstrip("/")


class Config(_Section):
    server: ServerConfig = ServerConfig()
    state: StateConfig = StateConfig()
    identity: IdentityConfig = IdentityConfig()
    events: EventsConfig = EventsConfig()
    dead_letter: DeadLetterConfig = DeadLetterConfig()
    routes: list[RouteConfig] = Field(min_length=1)


def _cross_checks(config: Config) -> Iterator[tuple[Path_, str]]:
    """Problems no single key shows: the same route name or prefix twice."""
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


# --- YAML with YAML 1.2 scalars, duplicate-key errors and line numbers ----------------------


class StrictLoader(yaml.SafeLoader):
    """SafeLoader resolving plain scalars as the YAML 1.2 core schema does."""


StrictLoader.yaml_implicit_resolvers = {}
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789")
)
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+.0123456789"),
)
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]
)




#: Plain scalars PyYAML and other YAML 1.1 readers take for booleans; YAML 1.2 for strings.
_YAML11_BOOL = re.compile(r"^(?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF)$")
#: Plain integers with a leading zero: octal to YAML 1.1 readers, decimal to YAML 1.2.
_YAML11_OCTAL = re.compile(r"^[-+]?0[0-9]+$")


def _ambiguous(node: yaml.ScalarNode) -> str | None:
    """Why a plain scalar means one thing to YAML 1.1 readers and another here, if it does."""
    if node.style is not None:  # quoted or block scalars are strings to every reader
        return None
    value = node.value
    if _YAML11_BOOL.match(value):
        return (f"{value!r} is a boolean to YAML 1.1 readers and a string to YAML 1.2: "
                "write true or false, or quote the string")
    if _YAML11_OCTAL.match(value):
        return (f"{value!r} is octal to YAML 1.1 readers ({int(value, 8)}) and decimal to "
                "YAML 1.2: drop the leading zero, or quote the string")
    return None


def _walk(node: yaml.Node, path: Path_, marks: dict[Path_, int],
          problems: list[tuple[Path_, int, str]]) -> None:
    """Index the 1-based line of every key path; collect duplicate keys and YAML 1.1 traps."""
    marks[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key in seen:
                problems.append(((*path, key), line, "duplicate key"))
            seen.add(key)
            marks[(*path, key)] = line
            _walk(value_node, (*path, key), marks, problems)
            marks[(*path, key)] = line  # the key's own line, not its value's
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), marks, problems)
    elif (isinstance(node, yaml.ScalarNode) and (why := _ambiguous(node))
          and (path[-1:], node.value) not in _ENUM_WORDS):
        problems.append((path, node.start_mark.line + 1, why))


def _dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top)"


def _nearest_line(path: Path_, marks: dict[Path_, int]) -> int:
    for cut in range(len(path), -1, -1):
        if path[:cut] in marks:
            return marks[path[:cut]]
    return 1


def _problems(err: ValidationError, marks: dict[Path_, int], filename: str) -> Iterator[str]:
    for item in err.errors():
        # pydantic puts the Annotated validator's name in the path for union members; drop
        # anything that is not a config key so the path reads as the user wrote it.
        loc = item["loc"]
        path = tuple(p for p in loc if isinstance(p, int) or p in _KNOWN_KEYS)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            # The unknown key is, by definition, not a known one: name it all the same.
            path = (*(p for p in loc[:-1] if isinstance(p, int) or p in _KNOWN_KEYS), loc[-1])
            message = "unknown key (a typo here would silently disable a limit)"
        elif item["type"] == "missing":
            message = "required key is missing"
        yield f"{filename}:{_nearest_line(path, marks)}: {_dotted(path)}: {message}"


def _all_keys(model: type[BaseModel]) -> set[str]:
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        keys.add(name)
        for arg in _type_args(field.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                keys |= _all_keys(arg)
    return keys


def _type_args(tp: Any) -> Iterator[Any]:
    yield tp
    for arg in getattr(tp, "__args__", ()):
        yield from _type_args(arg)


_KNOWN_KEYS = _all_keys(Config)


def _enum_words(model: type[BaseModel]) -> set[tuple[tuple[str], str]]:
    """``((key,), word)`` for every word a ``Literal`` field accepts, e.g. ``mode: off``.

    Such a word is what the user meant even where YAML 1.1 would read a boolean, so the
    YAML 1.1 check lets it pass (the field accepts nothing else that could be confused).
    """
    words: set[tuple[tuple[str], str]] = set()
    for name, field in model.model_fields.items():
        for arg in _type_args(field.annotation):
            if getattr(arg, "__origin__", None) is Literal:
                words |= {((name,), word) for word in arg.__args__ if isinstance(word, str)}
            elif isinstance(arg, type) and issubclass(arg, BaseModel):
                words |= _enum_words(arg)
    return words


_ENUM_WORDS = _enum_words(Config)


def parse_config(text: str, filename: str = "<config>") -> Config:
    """Parse and validate config ``text``; ``filename`` is used in messages.

    Raises:
        ConfigError: with every problem found, each as ``FILE:LINE: KEY: PROBLEM``.
    """
    try:
        loader = StrictLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                raise ConfigError([f"{filename}:1: (top): the file is empty"])
            marks: dict[Path_, int] = {}
            found: list[tuple[Path_, int, str]] = []
            _walk(node, (), marks, found)
            if found:
                raise ConfigError(
                    [f"{filename}:{line}: {_dotted(p)}: {problem}" for p, line, problem in found]
                )
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise ConfigError([f"{filename}:{line}: (yaml): {exc.problem or exc}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{filename}:1: (yaml): {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{filename}:1: (top): the file must be a mapping of sections"])
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(list(_problems(exc, marks, filename))) from None
    problems = [
        f"{filename}:{_nearest_line(path, marks)}: {_dotted(path)}: {message}"
        for path, message in _cross_checks(config)
    ]
    if problems:
        raise ConfigError(problems)
    return config


def load_config(path: str | Path) -> Config:
    """Read and validate the config file at ``path``.

    Raises:
        ConfigError: the file is missing, unreadable or invalid.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}:1: (file): cannot read: {exc}"]) from None
    return parse_config(text, str(path))
