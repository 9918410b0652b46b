"""Loading and validating the YAML config file.

Every problem is reported as ``FILE:LINE: KEY: PROBLEM`` (all of them at once, not only the
first), and :class:`ConfigError` is raised so the caller can keep its old config serving.

Two YAML 1.1 habits of PyYAML are closed off here because each one silently changes a limit:

* duplicate keys: PyYAML keeps the last one without a word (yaml/pyyaml#165);
* implicit types: ``on``/``no`` become booleans, ``1:30`` becomes 90 (sexagesimal), ``0755``
  becomes 493, ``2024-01-01`` a date. :class:`StrictLoader` resolves scalars the YAML 1.2 core
  way instead (``true``/``false`` only, decimal numbers only, no timestamps), and the pydantic
  models are strict, so a boolean or a number where a string belongs is an error.

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
        unit = m.group(2)
        return Allowance(amount, None if unit == "total" else _RATE_PERIODS[unit], value.strip())
    raise ValueError(
        f"{value!r} is not a budget: write N/min, N/h, N/day or N/total, e.g. 5000000/day"
    )


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
RateSpec = Annotated[Rate, BeforeValidator(_parse_rate)]
AllowanceSpec = Annotated[Allowance, BeforeValidator(_parse_allowance)]
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
    #: Tokens per period, each request weighted by its reserved worst case (policies/rate.py).
    tokens: RateSpec | None = None
    per_tenant: TenantRateConfig | None = None


class BudgetConfig(_Section):
    """One budget block (policies/budget.py): limits per unit, for one kind of scope."""

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


class UsageConfig(_Section):
    """How an openai/anthropic route reads and shapes token usage (policies/usage.py)."""

    #: Output cap reserved for a request that sets none (max_tokens and the like), tokens.
    default_max_tokens: int | None = Field(default=None, gt=0)
    #: Write that cap into such requests, so the upstream cannot exceed the reservation.
    write_max_tokens: bool = True
    #: Ask OpenAI streams for their usage chunk; it is stripped if the client did not ask.
    stream_usage: bool = True


class ModelPrice(_Section):
    """USD per million tokens of one model."""

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    #: Input tokens read from a prompt cache; defaults to ``input``.
    cache_read: float | None = Field(default=None, ge=0)
    #: Input tokens written to a prompt cache (Anthropic); defaults to ``input``.
    cache_write: float | None = Field(default=None, ge=0)


class RouteConfig(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    path_prefix: str
    upstream: str
    protocol: Literal["openai", "anthropic", "mcp", "http"] = "http"
    timeouts: TimeoutsConfig = TimeoutsConfig()
    concurrency: ConcurrencyConfig | None = None
    rate: RateConfig | None = None
    #: One budget block, or a list of them (e.g. per tenant and per run).
    budget: Annotated[list[BudgetConfig], BeforeValidator(_one_or_many)] | None = None
    usage: UsageConfig = UsageConfig()

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
    #: USD per million tokens, by model name as the request names it.
    pricing: dict[str, ModelPrice] = {}
    routes: list[RouteConfig] = Field(min_length=1)


def _cross_checks(config: Config) -> Iterator[tuple[Path_, str]]:
    """Problems no single key shows: the same route name or prefix twice, budgets that could
    not bind."""
    seen: dict[tuple[str, str], int] = {}
    for index, route in enumerate(config.routes):
        for key in ("name", "path_prefix"):
            value = getattr(route, key)
            if (key, value) in seen:
                yield ("routes", index, key), (
                    f"{value!r} is already used by routes[{seen[key, value]}]"
                )
            seen.setdefault((key, value), index)
        yield from _budget_checks(config, index, route)


def _budget_checks(config: Config, index: int, route: RouteConfig) -> Iterator[tuple[Path_, str]]:
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
        if not llm:
            yield where, (
                f"budgets need protocol openai or anthropic (Sluice reads usage from those "
                f"only), not {route.protocol}"
            )
        for unit, allowance in block.limits():
            if allowance.period_s is None and block.per != "run":
                yield (*where, unit), (
                    f"{allowance} needs per: run (a tenant's or route's all-time spend is not "
                    f"kept across restarts; use a window such as N/day)"
                )
            if unit == "usd" and not config.pricing:
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




def _walk(node: yaml.Node, path: Path_, marks: dict[Path_, int], dupes: list[tuple[Path_, int]]):
    """Index the 1-based line of every key path, and collect duplicate keys."""
    marks[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key in seen:
                dupes.append(((*path, key), line))
            seen.add(key)
            marks[(*path, key)] = line
            _walk(value_node, (*path, key), marks, dupes)
            marks[(*path, key)] = line  # the key's own line, not its value's
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), marks, dupes)


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
        path = _user_path(item["loc"], marks)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key (a typo here would silently disable a limit)"
        elif item["type"] == "missing":
            message = "required key is missing"
        yield f"{filename}:{_nearest_line(path, marks)}: {_dotted(path)}: {message}"


def _user_path(loc: tuple[str | int, ...], marks: dict[Path_, int]) -> Path_:
    """``loc`` as the user wrote it: pydantic adds union members' validator names, and a list
    index where one block stood for a one-item list; keep config keys and what the file has
    (such as model names under ``pricing``)."""
    path: list[str | int] = []
    for part in loc:
        if (*path, part) in marks or (isinstance(part, str) and part in _KNOWN_KEYS):
            path.append(part)
    return tuple(path)


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
            dupes: list[tuple[Path_, int]] = []
            _walk(node, (), marks, dupes)
            if dupes:
                raise ConfigError(
                    [f"{filename}:{line}: {_dotted(p)}: duplicate key" for p, line in dupes]
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
