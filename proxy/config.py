"""Loading and validating the YAML config file.

Every problem is reported as ``FILE:LINE: KEY: PROBLEM`` (all of them at once, not only the
first), and :class:`ConfigError` is raised so the caller can keep its old config serving.

Two YAML 1.1 habits of PyYAML are closed off here because each one silently changes a limit:

* duplicate keys: PyYAML keeps the last one without a word (yaml/pyyaml#165);
* implicit types: ``on``/``no`` become booleans, ``1:30`` becomes 90 (sexagesimal), ``0755``
  becomes 493, ``2024-01-01`` a date. :class:`StrictLoader` resolves scalars the YAML 1.2 core
  way instead (``true``/``false`` only, decimal numbers only, no timestamps), and the pydantic
  models are strict, so a boolean or a number where a string belongs is an error. A plain
  ``on``/``off``/``yes``/``no``, a leading-zero number or a base-60 one (``1:30``) is refused
  wherever it appears: the file would mean something else to every YAML 1.1 tool (and
  reader) that sees it.

Durations are strings with a unit (``250ms``, ``5s``, ``10m``, ``24h``, ``1d``) and become
float seconds; rates are ``N/s``, ``N/min``, ``N/h``, ``N/day`` and become :class:`Rate`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import stat
import sys
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from policies.config import (
    IDENTITY_VALUE,
    MAX_IDENTITY_LENGTH,
    Config,
    ConfigError,
    Path_,
    cross_checks,
)
from policies.wording import counted
from proxy.redact import redact

# --- YAML with YAML 1.2 scalars, duplicate-key errors and line numbers ----------------------


class StrictConstructor(yaml.constructor.SafeConstructor):
    """SafeConstructor whose integers too long to convert are errors on their line."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """An integer, or a :class:`yaml.constructor.ConstructorError` on its line for one
        longer than Python converts (4300 digits): its ``ValueError`` named no line."""
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            digits = sum(c.isdigit() for c in str(node.value))
            raise yaml.constructor.ConstructorError(
                None, None, f"a number of {digits} digits (at most "
                f"{sys.get_int_max_str_digits()} are read)", node.start_mark) from None


StrictConstructor.add_constructor("tag:yaml.org,2002:int", StrictConstructor.construct_yaml_int)


class StrictResolver(yaml.resolver.Resolver):
    """Resolves plain scalars as the YAML 1.2 core schema does."""


StrictResolver.yaml_implicit_resolvers = {}
StrictResolver.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
StrictResolver.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789")
)
StrictResolver.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+.0123456789"),
)
StrictResolver.add_implicit_resolver(
    "tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]
)


class StrictLoader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser,
                   yaml.composer.Composer, StrictConstructor, StrictResolver):
    """SafeLoader resolving plain scalars as the YAML 1.2 core schema does (PyYAML's own
    Python parser: the one whose words and lines every config error quotes)."""

    def __init__(self, stream: str) -> None:
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        StrictConstructor.__init__(self)
        StrictResolver.__init__(self)


if yaml.__with_libyaml__:
    class FastStrictLoader(yaml.cyaml.CParser, StrictConstructor, StrictResolver):
        """:class:`StrictLoader` on libyaml's parser (C): the same nodes, read ~5x faster
        (3,000 routes: 2 s of CPU against 11 s in PyYAML's parser, on a reload's thread).
        It words errors its own way, so a file it refuses is read again by
        :class:`StrictLoader`, which names the fault (or reads a file only libyaml refuses:
        ``%YAML 1.3``, a quoted lone surrogate). The files it reads that PyYAML refused have
        a tab where YAML allows one as white space (1.2 §6.2): after a key's colon, inside a
        flow collection, before a comment, at a line's end; indenting with one is refused."""

        def __init__(self, stream: str) -> None:
            yaml.cyaml.CParser.__init__(self, stream)
            StrictConstructor.__init__(self)
            StrictResolver.__init__(self)


#: Plain scalars PyYAML and other YAML 1.1 readers take for booleans; YAML 1.2 for strings.
_YAML11_BOOL = re.compile(r"^(?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF)$")
#: Plain integers with a leading zero: octal to YAML 1.1 readers, decimal to YAML 1.2.
_YAML11_OCTAL = re.compile(r"^[-+]?0[0-9]+$")
#: Plain base-60 numbers (``1:30``): 90 to YAML 1.1 readers (its int and float types'
#: sexagesimal forms, yaml.org/type/int.html and float.html), a string to YAML 1.2.
#: The int form starts with 1-9 (``0:30`` and ``00:30`` are strings to YAML 1.1 too); the
#: float form needs its point (``0:30.5``).
_YAML11_SEXAGESIMAL = re.compile(
    r"^[-+]?(?:[1-9][0-9_]*(?::[0-5]?[0-9])+|[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*)$")


def _ambiguous(node: yaml.ScalarNode) -> str | None:
    """Why a plain scalar means one thing to YAML 1.1 readers and another here, if it does."""
    if node.style:  # quoted or block scalars are strings to every reader (plain: None or "")
        return None
    value = node.value
    if _YAML11_BOOL.match(value):
        return (f"{value!r} is a boolean to YAML 1.1 readers and a string to YAML 1.2: "
                "write true or false, or quote the string")
    if _YAML11_OCTAL.match(value):
        if value.lstrip("+-").isdigit() and not set(value) & {"8", "9"}:
            meaning = f"octal to YAML 1.1 readers ({int(value, 8)})"
        else:  # 08, 09: no octal number, so a string to YAML 1.1 readers
            meaning = "a string to YAML 1.1 readers"
        return (f"{value!r} is {meaning} and decimal to YAML 1.2: drop the leading zero, or "
                "quote the string")
    if _YAML11_SEXAGESIMAL.match(value):
        return (f"{value!r} is {_base60(value):g} (base 60) to YAML 1.1 readers and a string "
                "to YAML 1.2: write the number, a duration with a unit (90s), or quote the "
                "string")
    return None


def _base60(value: str) -> float:
    """A YAML 1.1 sexagesimal number's value: ``1:30`` is 90, ``-1:30.5`` is -90.5."""
    sign = -1 if value.startswith("-") else 1
    total = 0.0
    for part in value.lstrip("+-").replace("_", "").split(":"):
        total = total * 60 + float(part)
    return sign * total


#: Values a config may hold once its YAML aliases are expanded: far beyond a real one (a
#: tenant weight each for 100k tenants), and a bound on an alias bomb (``&a [*b, *b, ...]``
#: nine levels deep is 10^9 values, which validating would take gigabytes to build).
MAX_CONFIG_VALUES = 1_000_000


class _TooManyValues(Exception):
    pass


#: The YAML errors that name where in the text they are (:func:`yaml_problem`).
PLACED_YAML_ERRORS = (yaml.MarkedYAMLError, yaml.reader.ReaderError)


def yaml_problem(exc: yaml.MarkedYAMLError | yaml.reader.ReaderError, text: str
                 ) -> tuple[int, str]:
    """The 1-based line to name for a YAML syntax error, and what to say of it.

    PyYAML marks where it noticed the error (``problem_mark``) and, for most, where the
    construct it was reading began (``context_mark``). A scanner's context ("while scanning a
    quoted scalar") is a token that began there and never ended: the mistake is at its start,
    though noticed lines later (an unclosed quote is found at the end of the file). A parser's
    ("while parsing a block mapping") is an enclosing collection: the mistake is where it was
    noticed. The other line is named in the text when they differ. Only PyYAML's own words
    are used, never its snippet of the file, which could quote a secret. A character YAML
    does not allow is placed in ``text`` (:func:`reader_problem`)."""
    if isinstance(exc, yaml.reader.ReaderError):
        return reader_problem(exc, text)
    problem = exc.problem or "unreadable"
    found = exc.problem_mark.line + 1 if exc.problem_mark else None
    began = exc.context_mark.line + 1 if exc.context_mark and exc.context else None
    line = found or began or 1
    if began is not None and found is not None and began != found:
        if exc.context.startswith("while scanning"):
            line, problem = began, f"{exc.context}: {problem} (line {found})"
        else:
            problem = f"{problem} ({exc.context} that starts on line {began})"
    for said, hint in _YAML_HINTS:
        if (exc.problem or "").startswith(said):
            problem += f"; {hint}"
            break
    return line, problem


#: What YAML 1.1 counts as a line break (§5.4), as PyYAML's marks count lines.
_LINE_BREAKS = re.compile("\r\n|[\r\n\x85\u2028\u2029]")


def reader_problem(exc: yaml.reader.ReaderError, text: str) -> tuple[int, str]:
    """The 1-based line of a character YAML does not allow (a NUL, a control character,
    U+FFFE), and what to say of it. PyYAML checks the whole text before parsing and reports
    only the character's offset (``position``, in characters of ``text``); its message also
    ends in a second line (``in "<unicode string>", position N``) that names nothing useful.
    YAML 1.1 §5.1 lists the characters allowed."""
    position = max(0, min(exc.position, len(text)))
    breaks = list(_LINE_BREAKS.finditer(text, 0, position))
    line = len(breaks) + 1
    column = position - (breaks[-1].end() if breaks else 0) + 1
    character = exc.character if isinstance(exc.character, int) else ord(exc.character)
    return line, (f"unacceptable character #x{character:04x} at column {column}: "
                  f"{exc.reason} (YAML allows only printable characters, tab and line breaks)")


#: What PyYAML's words for the commonest slips in a config usually mean (a new user's trial
#: and a hostile review), added to its message.
_YAML_HINTS = (
    ("expected <block end>", "check this line's indentation against the lines around it, "
     "and for a quote left open above it (closed by one further down)"),
    ("found character '\\t' that cannot start any token", "indent with spaces, not tabs"),
    ("mapping values are not allowed here",
     "quote a value that holds ': ', or indent this line no deeper than its key"),
    ("expected the node content",
     "quote a value that starts with [ or { and is no list or mapping (e.g. '[::1]:8080')"),
)


class _TooDeep(Exception):
    """Lists and mappings nest too deeply once aliases are expanded; ``line``: 1-based, of
    the node (for one reached through an alias, its anchor's) at the level past the bound."""

    def __init__(self, line: int) -> None:
        super().__init__(line)
        self.line = line


#: Deepest nesting of lists and mappings a config may have: far beyond a real one (under 10).
MAX_CONFIG_DEPTH = 64


def _too_deep(text: str) -> int | None:
    """The line (1-based) where ``text`` nests lists or mappings more than
    :data:`MAX_CONFIG_DEPTH` deep, read by libyaml's parser (C); ``None`` if it does not, or
    if the parsers find another fault first (the full parse then reports that).

    PyYAML's own scanner takes time quadratic in the depth of flow collections on one line
    (``[[[...``: its simple-key bookkeeping is scanned at each token), so refusing a file of
    50,000 such levels took 3 to 9 s of a reload thread; libyaml takes 2 ms. A file libyaml
    refuses though PyYAML reads it (an unknown ``%`` directive, ``%YAML 1.3``, a quoted
    lone surrogate), or any file without libyaml, is read by PyYAML's parser instead, which
    stops at the level too deep, long before the full parse would end (under a second for
    50,000)."""
    parsers = (yaml.CSafeLoader, yaml.SafeLoader) if yaml.__with_libyaml__ else (
        yaml.SafeLoader,)
    for loader in parsers:
        depth = 0
        try:
            for event in yaml.parse(text, Loader=loader):
                if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                    depth += 1
                    if depth > MAX_CONFIG_DEPTH:
                        return event.start_mark.line + 1
                elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                    depth -= 1
            return None
        except yaml.MarkedYAMLError as exc:
            # libyaml's own bound (1,000 levels) is met while scanning ahead, before the events.
            if "nesting depth" in str(exc.problem) and exc.problem_mark is not None:
                return exc.problem_mark.line + 1
        except (yaml.YAMLError, UnicodeEncodeError):  # a lone surrogate: libyaml encodes
            pass
    return None


def _values(node: yaml.Node, counted: dict[int, tuple[int, int]], open_: set[int],
            level: int = 1) -> int:
    """How many values ``node`` holds once its aliases are expanded, itself included, each
    node counted once (``counted``: by node id, its values and the levels of lists and
    mappings it nests), so an alias bomb is measured in the time of its own few nodes, not
    of the 10^9 it expands to (:func:`_walk` took seconds to reach its budget). A node met
    again inside itself (a loop, ``open_``) counts 1: :func:`_walk` names the loop.
    ``level``: ``node``'s own, the document's being 1.

    Raises:
        _TooDeep: aliases nest lists and mappings more than :data:`MAX_CONFIG_DEPTH` deep,
            which :func:`_too_deep` cannot see in the text (each anchor nests one level
            more): 2,000 such levels ended in a ``RecursionError`` after ~1.2 s, at line 1.
    """
    key = id(node)
    known = counted.get(key)
    if known is None and key in open_:
        return 1
    if known is None:
        total, depth = 1, 0
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            if level > MAX_CONFIG_DEPTH:
                raise _TooDeep(node.start_mark.line + 1)
            open_.add(key)
            items = (value for _, value in node.value) if isinstance(node, yaml.MappingNode) \
                else node.value
            for item in items:
                total += _values(item, counted, open_, level + 1)
                depth = max(depth, counted.get(id(item), (0, 0))[1])
            depth += 1
            open_.discard(key)
        counted[key] = known = (total, depth)
    if level - 1 + known[1] > MAX_CONFIG_DEPTH:  # met again, through an alias, deeper
        raise _TooDeep(node.start_mark.line + 1)
    return known[0]


_MERGE_TAG = "tag:yaml.org,2002:merge"
#: YAML 1.1's merge key (``<<: *defaults``) is refused in both spellings: plain, it was an
#: unknown key here, and tagged (``!!merge <<``) PyYAML merged it, so one file had two
#: readings (a hostile trial). YAML 1.2 has no merge key, and a merged block's keys would have
#: no line of their own to name in a problem.
_NO_MERGE_KEYS = ("merge keys (<<) are not supported: write the keys out in this block, or "
                  "make the whole block an alias (*name) of one written once")


def _walk(node: yaml.Node, path: Path_, marks: dict[Path_, int],
          problems: list[tuple[Path_, int, str]], budget: list[int],
          inside: frozenset[int] = frozenset()) -> None:
    """Index the 1-based line of every key path; collect duplicate keys, YAML 1.1 traps and
    aliases to a node they are inside (``x: &a [*a]``, which nothing could read).
    ``budget``: ``[values left]``, taken one per node visited (aliases expanded);
    ``inside``: the ids of the collections ``node`` is in.

    Raises:
        _TooManyValues: more than the budget's values.
    """
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooManyValues
    # The line of the key holding the alias (the composer keeps no mark of an alias itself:
    # in a list, the anchor's line is the one known).
    if id(node) in inside:
        problems.append((path, marks.get(path, node.start_mark.line + 1),
                         "an alias to a list or mapping it is inside (a loop)"))
        return
    marks[path] = node.start_mark.line + 1
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        inside |= {id(node)}
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):  # ``? [a, b]: x``, a complex key
                problems.append((path, line, "a key must be a plain name, not a list or mapping"))
                continue
            key = key_node.value
            if key_node.tag == _MERGE_TAG or (not key_node.style and key == "<<"):
                problems.append(((*path, key), line, _NO_MERGE_KEYS))
                continue
            if key in seen:
                problems.append(((*path, key), line, "duplicate key"))
            seen.add(key)
            marks[(*path, key)] = line
            _walk(value_node, (*path, key), marks, problems, budget, inside)
            marks[(*path, key)] = line  # the key's own line, not its value's
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), marks, problems, budget, inside)
    elif (isinstance(node, yaml.ScalarNode) and (why := _ambiguous(node))
          and (path[-1:], node.value) not in _ENUM_WORDS):
        problems.append((path, node.start_mark.line + 1, why))


def dotted(path: Path_) -> str:
    """A key path as messages name it: ``routes[0].budget``; ``(top)`` for the root."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        name = str(part)
        if not _PLAIN_KEY.match(name):  # empty, spaces, control characters: show it quoted
            name = json.dumps(name[:60] + ("..." if len(name) > 60 else ""))
        out += f".{name}" if out else name
    return out or "(top)"


_PLAIN_KEY = re.compile(r"^[!-~]{1,60}$")


def key_line(path: Path_, lines: dict[Path_, int]) -> int:
    """The line of key ``path`` in a file whose key ``lines`` :func:`load_config` gave (or
    the parse found), else of the nearest key above it that the file has; 1 if none."""
    for cut in range(len(path), -1, -1):
        if path[:cut] in lines:
            return lines[path[:cut]]
    return 1


def _problems(err: ValidationError, marks: dict[Path_, int], filename: str) -> list[str]:
    """One ``FILE:LINE: KEY: PROBLEM`` line per error, in the file's order (pydantic's is the
    models' fields', which put line 10 before line 9)."""
    lines = sorted(_located(err, marks), key=lambda found: found[0])
    return [f"{filename}:{line}: {text}" for line, text in lines]


def _located(err: ValidationError, marks: dict[Path_, int]) -> Iterator[tuple[int, str]]:
    errors = [(_error_path(item, marks), item) for item in err.errors()]
    # pydantic puts the Annotated validator's name in the path for union members (dropped
    # above, so the path reads as the user wrote it), and each member refuses the value on
    # its own: retry.on's `[502, "on"]` got "a valid integer", then "'connect_error' or
    # 'timeout'". One line says all it could be (a new user's trial, stop 38).
    # Grouped by the value too: two values never share a line, even where their paths
    # could not be told apart.
    by_path: dict[tuple[Path_, str], list[dict]] = {}
    for path, item in errors:
        by_path.setdefault((path, repr(item["input"])), []).append(item)
    for (path, _), items in by_path.items():
        wanted = [_wanted(item) for item in items]
        value = items[0]["input"]
        if None in wanted or not _scalar(value):
            for item in items:
                yield key_line(path, marks), f"{dotted(path)}: {_message(item)}"
            continue
        # Quoted back as the admin API would show it: a URL with a password pasted into the
        # wrong key (`backend: redis://:pw@host`) must not reach the log (a review).
        shown = _shown(redact(value, str(path[-1]) if path else ""))
        message = f"{shown} should be {' or '.join(dict.fromkeys(wanted))}"  # type: ignore[arg-type]
        yield key_line(path, marks), f"{dotted(path)}: {message}{_closest(value, items)}"


def _error_path(item: dict, marks: dict[Path_, int]) -> Path_:
    """The key an error is about, as the user wrote it; an unknown key is, by definition,
    not a known one: named all the same."""
    loc = item["loc"]
    if item["type"] == "extra_forbidden":
        return (*_user_path(loc[:-1], marks), loc[-1])
    return _user_path(loc, marks)


def _message(item: dict) -> str:
    """pydantic's words for an error, where no plainer ones are known."""
    if item["type"] == "extra_forbidden":
        loc = item["loc"]
        return ("unknown key (a typo here would otherwise be silently ignored)"
                + _suggestion(str(loc[-1]), _block_at(loc[:-1])))
    if item["type"] == "missing":
        return "required key is missing"
    if item["type"] == "finite_number":  # 1e309, or a tagged !!float .inf or .nan
        if item["input"] != item["input"]:
            return "must be a finite number, not NaN"
        return ("must be a finite number; this one is beyond a float's range (about 1.8e308), "
                "which YAML reads as infinity")
    ctx = item.get("ctx") or {}
    if item["type"] == "too_short" and "min_length" in ctx:
        # pydantic's "List should have at least 1 item after validation, not 0"
        return (f"needs at least {counted(ctx['min_length'], 'item')}, "
                f"has {ctx.get('actual_length', 0) or 'none'}")
    return item["msg"].removeprefix("Value error, ")


#: pydantic's error types for a value of the wrong kind, said as what the key takes.
_KINDS = {"int_parsing": "a whole number", "int_type": "a whole number",
          "int_from_float": "a whole number", "float_parsing": "a number",
          "float_type": "a number", "bool_parsing": "true or false", "bool_type": "true or false",
          "string_type": "a string (quote it)"}
#: pydantic's bound errors, with their ``ctx`` key, said as what the key takes.
_BOUNDS = {"greater_than": ("gt", "more than {}"), "greater_than_equal": ("ge", "{} or more"),
           "less_than": ("lt", "less than {}"), "less_than_equal": ("le", "{} or less")}


def _wanted(item: dict) -> str | None:
    """What a value refused for its kind or a bound should be (``a whole number``,
    ``'connect_error' or 'timeout'``, ``0 or more``); ``None`` for any other error."""
    ctx = item.get("ctx") or {}
    if item["type"] == "literal_error" and "expected" in ctx:
        return str(ctx["expected"])
    bound = _BOUNDS.get(item["type"])
    if bound is not None and bound[0] in ctx:
        limit = ctx[bound[0]]
        return bound[1].format(f"{limit:g}" if isinstance(limit, float) else limit)
    return _KINDS.get(item["type"])


def _closest(value: object, items: list[dict]) -> str:
    """``; did you mean 'timeout'?`` for a string close to one of the words a literal
    takes, else nothing."""
    if not isinstance(value, str):
        return ""
    words = [word for item in items if item["type"] == "literal_error"
             for word in re.findall(r"'([^']*)'", str(item["ctx"]["expected"]))]
    close = difflib.get_close_matches(value, words, n=1, cutoff=0.75)
    return f"; did you mean '{close[0]}'?" if close else ""


def _scalar(value: object) -> bool:
    """A value short and plain enough to quote back: never a mapping, a list or a long
    string (a block pasted in the wrong place, or a secret)."""
    return (value is None or isinstance(value, (bool, int, float))
            or (isinstance(value, str) and len(value) <= 40))


def _shown(value: object) -> str:
    """A scalar as YAML writes it (``true``, ``null``, ``'8'``, ``1.5``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _user_path(loc: tuple[str | int, ...], marks: dict[Path_, int]) -> Path_:
    """``loc`` as the user wrote it: pydantic adds union members' validator names, and a list
    index where one block stood for a one-item list; keep config keys and what the file has
    (such as model names under ``pricing``)."""
    path: list[str | int] = []
    for part in loc:
        if (*path, part) in marks or (isinstance(part, str) and part in _KNOWN_KEYS):
            path.append(part)
        elif isinstance(part, int) and (*path, str(part)) in marks:
            path.append(str(part))  # a mapping key YAML read as a number (pricing: {1: ...})
    return tuple(path)


def _block_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model of the config block at pydantic's ``loc``, found by following it down from
    :class:`Config` through lists, mappings and optional blocks; ``None`` where it cannot
    be told."""
    model: type[BaseModel] = Config
    named = False  # the part is a mapping's own key (a tool's, an endpoint's, a model's name)
    for part in loc:
        if named or isinstance(part, int) or part not in model.model_fields:
            named = False
            continue  # that, a list index, or a validator's name
        annotation = model.model_fields[part].annotation
        nested = _blocks_of(annotation)
        if not nested:
            return None
        model = nested[0]
        # A tool named "retry" is no retry block: the key after a mapping field is a name.
        named = any(typing.get_origin(arg) in (dict, Mapping)
                    for arg in _type_args(annotation))
    return model


def _blocks_of(annotation: Any) -> list[type[BaseModel]]:
    return [arg for arg in _type_args(annotation)
            if isinstance(arg, type) and issubclass(arg, BaseModel)]


def _suggestion(key: str, block: type[BaseModel] | None) -> str:
    """What an unknown ``key`` of ``block`` may have meant, as the end of its message: the
    block's nearest key (difflib), else the blocks inside it that have ``key`` itself (a
    ``limit`` written beside ``concurrency`` rather than in it); empty when neither."""
    if block is None:
        return ""
    close = difflib.get_close_matches(key, list(block.model_fields), n=1)
    if close:
        return f"; did you mean {close[0]}?"
    inside = [f"{name}.{key}" for name, field in block.model_fields.items()
              if any(key in nested.model_fields for nested in _blocks_of(field.annotation))]
    if inside:
        return f"; did you mean {' or '.join(inside[:3])}?"
    return ""


def _all_keys(model: type[BaseModel]) -> set[str]:
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        keys.add(name)
        for nested in _blocks_of(field.annotation):
            keys |= _all_keys(nested)
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


def parse_config(text: str, filename: str = "<config>", base: Path | None = None,
                 lines: dict[Path_, int] | None = None,
                 read: dict[str, str] | None = None) -> Config:
    """Parse and validate config ``text``; ``filename`` is used in messages, and the files
    it names are found relative to ``base`` (default: ``filename``'s directory). ``lines``,
    if given, gets the 1-based line of each key path (see :func:`key_line`), for a problem
    found later (a reload's); ``read``, the text of each file it names that was read (a
    tenants table, an admin token file), by path.

    Raises:
        ConfigError: with every problem found, each as ``FILE:LINE: KEY: PROBLEM``.
    """
    try:
        return _parse_config(text, filename, Path(filename).parent if base is None else base,
                             lines, {} if read is None else read)
    except RecursionError:  # the composer and the models recurse once per level
        raise ConfigError([f"{filename}:1: (yaml): nested too deeply"]) from None
    except _TooManyValues:
        raise ConfigError([f"{filename}:1: (yaml): more than {MAX_CONFIG_VALUES:,} values once "
                           "its aliases are expanded"]) from None
    except _TooDeep as deep:
        raise ConfigError([f"{filename}:{deep.line}: (yaml): nested too deeply once its aliases "
                           f"are expanded (more than {MAX_CONFIG_DEPTH} levels of lists and "
                           "mappings)"]) from None


def _compose(text: str) -> tuple[StrictLoader | FastStrictLoader, yaml.Node | None]:
    """``text``'s one document as nodes, and the loader to construct it with: libyaml's
    where it reads the text, else PyYAML's own.

    Raises:
        yaml.YAMLError: PyYAML's parser refuses ``text`` (its words, its line).
    """
    if yaml.__with_libyaml__:
        try:
            fast = FastStrictLoader(text)  # a lone surrogate: UnicodeEncodeError here
        except UnicodeEncodeError:
            pass
        else:
            try:
                return fast, fast.get_single_node()
            except yaml.YAMLError:
                fast.dispose()
    loader = StrictLoader(text)
    try:
        return loader, loader.get_single_node()
    except BaseException:
        loader.dispose()
        raise


def _parse_config(text: str, filename: str, base: Path, lines: dict[Path_, int] | None,
                  read: dict[str, str]) -> Config:
    deep = _too_deep(text)
    if deep is not None:
        raise ConfigError([f"{filename}:{deep}: (yaml): nested too deeply (more than "
                           f"{MAX_CONFIG_DEPTH} levels of lists and mappings)"])
    try:
        loader, node = _compose(text)
        try:
            if node is None:
                raise ConfigError([f"{filename}:1: (top): the file is empty"])
            if _values(node, {}, set()) > MAX_CONFIG_VALUES:
                raise _TooManyValues
            marks: dict[Path_, int] = {}
            found: list[tuple[Path_, int, str]] = []
            _walk(node, (), marks, found, [MAX_CONFIG_VALUES])
            if found:
                raise ConfigError(
                    [f"{filename}:{line}: {dotted(p)}: {problem}" for p, line, problem in found]
                )
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except PLACED_YAML_ERRORS as exc:
        line, problem = yaml_problem(exc, text)
        raise ConfigError([f"{filename}:{line}: (yaml): {problem}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{filename}:1: (yaml): {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{filename}:1: (top): the file must be a mapping of sections"])
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_problems(exc, marks, filename)) from None
    problems = [
        f"{filename}:{key_line(path, marks)}: {dotted(path)}: {message}"
        for path, message in cross_checks(config)
    ]
    if problems:
        raise ConfigError(problems)
    spec = config.identity.tenants
    if spec is not None:
        at = f"{filename}:{key_line(('identity', 'tenants'), marks)}: identity.tenants"
        config.identity._keys = load_tenants(spec, base, at, read)
        if not config.identity._keys and config.identity.unknown_key_tenant is None:
            # Every caller would be refused 401 unknown_api_key, with nothing in the log: an
            # empty secret, or a file caught half-written by a reload (a new user's trial).
            raise ConfigError([f"{at}: the table holds no API key, so every caller would be "
                               "refused; list at least one digest, or set "
                               "identity.unknown_key_tenant"])
    _check_sources(config, filename, marks, base, read)
    if lines is not None:
        lines.update(marks)
    return config


def _check_sources(config: Config, filename: str, marks: dict[Path_, int], base: Path,
                   read: dict[str, str]) -> None:
    """Read what the config names outside itself now, so a missing one is a config error
    (``check-config``, a refused reload) rather than a crash at start or a 403 later.

    * ``state.redis_url: env:NAME``: the variable must be set and hold a Redis URL (only
      checked with ``backend: redis``, the one that reads it). The message never shows the
      value, which may carry a password.
    * ``admin.token_file``: the file must be readable and hold a token (a missing one would
      leave the admin endpoints answering 403 "no admin token is configured"); a relative
      path is taken from the config file's directory (see :func:`load_token`). The token
      read is kept with the config (``AdminConfig.token``): it is the one in force.

    Raises:
        ConfigError: ``FILE:LINE: KEY: PROBLEM`` per source that cannot be read.
    """
    problems: list[str] = []
    state = config.state
    if state.backend == "redis" and (state.redis_url or "").startswith("env:"):
        try:
            state.resolved_url()
        except ValueError as exc:
            line = key_line(("state", "redis_url"), marks)
            problems.append(f"{filename}:{line}: {exc}")
    token_file = config.admin.token_file
    if token_file is not None:
        path = base / token_file
        try:
            config.admin._token = load_token(path, read)
        except ValueError as exc:
            line = key_line(("admin", "token_file"), marks)
            problems.append(f"{filename}:{line}: admin.token_file: {exc} "
                            f"({unquoted_path(token_file, base)})")
        config.admin._path = str(path)
    if problems:
        raise ConfigError(problems)


def unwritable_files(config: Config, filename: str, lines: Mapping[Path_, int],
                     in_force: Config | None = None) -> list[str]:
    """``FILE:LINE: KEY: PROBLEM`` for each file a server of ``config`` writes that this
    process could not create or write (:func:`_unwritable`): ``events.path``, and
    ``dead_letter.path`` when a route retries and letters go to a file (not Redis). Both are
    restart-only: a reload to one in a missing directory was held "until a restart" and
    reported a success, and that restart exited 1 (a hostile trial). A path equal to
    ``in_force``'s (the running server's, which has it open) is not checked: a directory
    gone since must not refuse every later reload. Only ``serve`` and a reload refuse on it;
    ``check-config`` (often run elsewhere: CI) and the read-only commands do not. Relative
    paths are read from the working directory, as the server opens them."""
    files: list[tuple[Path_, str, bool]] = []
    if config.events.path is not None:
        files.append((("events", "path"), config.events.path, False))
    if config.state.backend != "redis" and any(route.retries() for route in config.routes):
        files.append((("dead_letter", "path"), config.dead_letter.path, True))
    problems = []
    for key, name, beside in files:
        if in_force is not None and _get_path(in_force, key) == name:
            continue
        unwritable = _unwritable(name, beside=beside)
        if unwritable is not None:
            unset = "" if key in lines else f" (not set: the default, {name!r})"
            problems.append(f"{filename}:{key_line(key, dict(lines))}: {dotted(key)}{unset}: "
                            f"{unwritable}")
    return problems


def _get_path(config: Config, key: Path_) -> object:
    """The value at ``key`` (a section, then a field) of ``config``."""
    section, field = key
    return getattr(getattr(config, str(section)), str(field))


def _unwritable(name: str, *, beside: bool) -> str | None:
    """Why the server could not open the file ``name`` (relative: from the working
    directory) for writing, creating it if absent, else ``None``. ``beside``: it writes
    files beside it too (SQLite's ``-wal`` and ``-shm``), so the directory must be writable
    even when the file exists. A file that is no regular one (``/dev/stdout``) need only be
    writable itself."""
    path = Path(name)
    directory = path.parent
    where = "" if path.is_absolute() else f" (relative to the working directory, {Path.cwd()})"
    if not directory.is_dir():
        return (f"the directory {str(directory)!r} does not exist{where}: Sluice creates the "
                "file, not its directory")
    if path.is_dir():
        return f"is a directory{where}: name a file in it"
    if path.exists():
        writable = os.access(path, os.W_OK) and (
            not beside or not path.is_file() or os.access(directory, os.W_OK | os.X_OK))
    else:
        writable = os.access(directory, os.W_OK | os.X_OK)
    return None if writable else f"this user cannot write it or its directory{where}"


#: The environment variable holding the admin token when ``admin.token_file`` is null.
TOKEN_ENV = "SLUICE_ADMIN_TOKEN"


def env_token() -> str | None:
    """:data:`TOKEN_ENV`'s token (surrounding whitespace stripped), ``None`` if it is unset
    or blank: read so by the server (``proxy.admin``) and the CLI (``proxy.runs_cli``) alike.

    Raises:
        ValueError: it holds whitespace, a control character or a character outside ASCII
            inside (:func:`check_token`; the message never quotes it).
    """
    token = os.environ.get(TOKEN_ENV, "").strip()
    return check_token(token, TOKEN_ENV) if token else None


def load_token(path: Path, read: dict[str, str] | None = None) -> str:
    """The admin bearer token in the file ``path`` (surrounding whitespace stripped);
    ``read``, if given, gets the file's text by its path.

    Raises:
        ValueError: the file cannot be read, or holds only whitespace (the message never
            quotes the file's content).
    """
    try:
        text = read_text_file(path, MAX_TOKEN_BYTES)
    except (OSError, ValueError) as exc:  # ValueError also for a NUL in the path
        raise ValueError(f"cannot read the file it names: {_why(exc)}") from None
    if read is not None:
        read[str(path)] = text
    token = text.strip()
    if not token:
        raise ValueError("the file it names is empty: it must hold the admin bearer token")
    return check_token(token, "the file it names")


def check_token(token: str, where: str) -> str:
    """``token`` if it can be sent as ``Authorization: Bearer TOKEN``; ``where`` names its
    source in the error (``the file it names``, ``SLUICE_ADMIN_TOKEN``).

    Raises:
        ValueError: it holds whitespace or a control character inside (a token file with a
            second, comment line; an environment variable with a newline). No client could
            send it, and http.client's refusal quoted the header, token and all (a hostile
            trial); the message never quotes it.
    """
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(f"{where} holds whitespace or a control character inside the token "
                         "(a second line? a byte order mark?): it must hold the admin bearer "
                         "token alone, on one line")
    if not token.isascii():  # an HTTP header carries no other (http.client refuses it)
        raise ValueError(f"{where} holds a character outside ASCII in the token: it must "
                         "hold the admin bearer token in ASCII letters, digits and signs")
    return token


def unquoted_path(written: str, base: Path) -> str:
    """Which file a key's value ``written`` names (relative to ``base``), said without
    quoting any of it: a token or key pasted where its file's path belongs was printed
    whole by check-config, the start and the reload log (a hostile trial), and a base64
    token may hold a ``/``, so not even its directory part is shown."""
    if Path(written).is_absolute():
        return "an absolute path"
    said = f"a path relative to the config file's directory, {os.path.abspath(base)}"
    if "/" not in written:
        said += (", with no directory part: if the value is the secret itself, write it to a "
                 "file and name that file")
    return said


# --- identity.tenants: API-key digests -> tenants --------------------------------------------

_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")
_NOT_A_DIGEST = (
    "this key is not a SHA-256 hex digest (64 hex characters); store the digest of each API "
    "key (printf %s \"$KEY\" | sha256sum), never the key itself"
)


def load_tenants(spec: str, base: Path, at: str,
                 read: dict[str, str] | None = None) -> dict[str, str]:
    """The ``identity.tenants`` table: SHA-256 hex digest (lower case) -> tenant.

    ``spec`` is a file path (relative to ``base``, the config file's directory) or
    ``env:NAME``, an environment variable holding the same text. The text is YAML (or JSON):
    one mapping of digests to tenants::

        # printf %s "$KEY" | sha256sum
        9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08: team-a

    ``at`` (``FILE:LINE: KEY`` of the config's ``tenants`` line) prefixes a problem with the
    source itself (unreadable, unset); ``read``, if given, gets a file's text by its
    path. A key that is not a digest is reported by its line only: it may be an API key
    pasted by mistake, and must not reach a log.

    Raises:
        ConfigError: ``SOURCE:LINE: identity.tenants: PROBLEM`` lines, SOURCE being the file
            or ``env:NAME``.
    """
    if spec.startswith("env:"):
        source = spec
        text = os.environ.get(spec[4:])
        if text is None:
            raise ConfigError([f"{at}: environment variable {spec[4:]!r} is not set"])
    else:
        path = base / spec
        source = str(path)
        try:
            text = read_text_file(path, MAX_TENANTS_BYTES)
        except (OSError, ValueError) as exc:  # ValueError also for a NUL in the path
            raise ConfigError([f"{at}: cannot read the file it names: {_why(exc)} "
                               f"({unquoted_path(spec, base)})"]) from None
        if read is not None:
            read[source] = text
    return parse_tenants(text, source)


def parse_tenants(text: str, source: str) -> dict[str, str]:
    """Parse a tenants table (see :func:`load_tenants`); ``source`` names it in messages.

    Raises:
        ConfigError: one ``SOURCE:LINE: identity.tenants: PROBLEM`` line per problem.
    """
    where = f"{source}:{{}}: identity.tenants"
    deep = _too_deep(text)
    if deep is not None:
        raise ConfigError([f"{where.format(deep)}: nested too deeply"])
    try:
        loader, node = _compose(text)
        loader.dispose()
    except PLACED_YAML_ERRORS as exc:
        line, problem = yaml_problem(exc, text)
        raise ConfigError([f"{where.format(line)}: not valid YAML ({problem})"]) from None
    except yaml.YAMLError:
        raise ConfigError([f"{where.format(1)}: not valid YAML"]) from None
    except RecursionError:
        raise ConfigError([f"{where.format(1)}: nested too deeply"]) from None
    if node is None:
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError([f"{where.format(node.start_mark.line + 1)}: must be a mapping of "
                           "API-key SHA-256 digests to tenants"])
    table: dict[str, str] = {}
    problems: list[str] = []
    for key_node, value_node in node.value:
        line = where.format(key_node.start_mark.line + 1)
        digest = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            problems.append(f"{line}: {_NOT_A_DIGEST}")
            continue
        digest = digest.lower()
        tenant = value_node.value if isinstance(value_node, yaml.ScalarNode) else None
        if not isinstance(tenant, str) or not tenant or (
            len(tenant) > MAX_IDENTITY_LENGTH or not IDENTITY_VALUE.fullmatch(tenant)
        ):
            problems.append(f"{line}: the tenant must be visible ASCII (no spaces), 1 to "
                            f"{MAX_IDENTITY_LENGTH} characters")
        elif digest in table:
            problems.append(f"{line}: this digest is listed twice")
        else:
            table[digest] = tenant
    if problems:
        raise ConfigError(problems)
    return table


#: Largest config file read, bytes: far beyond a real one, and a bound on what a path
#: swapped for ``/dev/zero`` or a runaway generator can make a reload hold in memory.
MAX_CONFIG_BYTES = 4 * 1024 * 1024
#: Largest ``identity.tenants`` file or admin token file read, bytes.
MAX_TENANTS_BYTES = 64 * 1024 * 1024
MAX_TOKEN_BYTES = 64 * 1024


def read_text_file(path: Path, limit: int, *, stream: bool = False) -> str:
    """The UTF-8 text of the regular file at ``path``, of at most ``limit`` bytes.

    ``stream``: a pipe or character device is read too, to its end or ``limit`` (for
    ``check-config /dev/stdin`` or ``<(envsubst < tpl.yaml)``, where waiting is expected);
    never for what a server reads while it serves.

    Raises:
        OSError: it cannot be opened or read.
        ValueError: it is not a regular file (a FIFO, which is opened without waiting for a
            writer, a device such as ``/dev/zero``, a directory) and ``stream`` is false or
            it is a directory, it is longer than ``limit`` bytes, or it is not UTF-8
            (:class:`UnicodeDecodeError`).
    """
    return read_file(path, limit, stream=stream).decode("utf-8")


def read_file(path: str | Path, limit: int, *, stream: bool = False) -> bytes:
    """The bytes :func:`read_text_file` decodes (``stream`` and errors as there, less the
    UTF-8 one); :func:`still_reads` compares them undecoded, so one reader serves both."""
    flags = os.O_RDONLY | os.O_CLOEXEC
    if not (stream and stat.S_ISFIFO(os.stat(path).st_mode)):
        # Opened without waiting for a writer (a FIFO in a server's path must not hold it);
        # a FIFO to stream is opened waiting, as a shell reader would: opened without
        # waiting, one whose writer has not come yet reads as empty.
        flags |= os.O_NONBLOCK
    fd = os.open(path, flags)
    mode = os.fstat(fd).st_mode
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(mode):
            if not stream or not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
                raise ValueError("not a regular file")
            os.set_blocking(fd, True)
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"longer than {limit} bytes")
    return data


def _why(exc: Exception) -> str:
    """A reading error in words that never quote the file's content (a byte that is not
    UTF-8 is named by its value and place only)."""
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    if isinstance(exc, UnicodeDecodeError):
        line, column = _place(exc)
        return f"not UTF-8 (byte 0x{exc.object[exc.start]:02x} at line {line}, column {column})"
    return str(exc)


def _place(exc: UnicodeDecodeError) -> tuple[int, int]:
    """The 1-based line and column (in characters) of the first byte that is not UTF-8:
    it was said at line 1 with nothing naming where, for a Latin-1 byte in a comment
    (a hostile trial). Lines are counted as YAML breaks them (:data:`_LINE_BREAKS`)."""
    before = bytes(exc.object[:exc.start]).decode("utf-8")  # all UTF-8, up to the byte
    breaks = list(_LINE_BREAKS.finditer(before))
    return len(breaks) + 1, len(before) - (breaks[-1].end() if breaks else 0) + 1


def load_config(path: str | Path, *, stream: bool = False,
                lines: dict[Path_, int] | None = None) -> Config:
    """Read and validate the config file at ``path`` (``stream``: see
    :func:`read_text_file`; ``lines``: see :func:`parse_config`).

    Raises:
        ConfigError: the file is missing, unreadable (see :func:`read_text_file`) or invalid.
    """
    path = Path(path)
    try:
        text = read_text_file(path, MAX_CONFIG_BYTES, stream=stream)
    except (OSError, ValueError) as exc:
        line = _place(exc)[0] if isinstance(exc, UnicodeDecodeError) else 1
        raise ConfigError([f"{path}:{line}: (file): cannot read: {_why(exc)}"]) from None
    # A pipe's directory (/dev, /dev/fd) is no place for the files a config names: those
    # are then found from the working directory, as the shell that made the pipe would.
    # /dev/stdin redirected from a file (`< sluice.yaml`) is that file: /proc/self/fd/0
    # links to it, so its files are found beside it (they were looked for in /dev).
    if not stream:
        base = path.parent
    else:
        base = path.resolve().parent if path.is_file() else Path.cwd()
    named: dict[str, str] = {}
    config = parse_config(text, str(path), base, lines, named)
    if not stream:  # a pipe cannot be read again to be compared
        files = [(str(path), text.encode()), *((name, read.encode())
                                                for name, read in named.items())]
        config._read = tuple((name, len(data), hashlib.sha256(data).hexdigest())
                             for name, data in files)
    return config


def still_reads(read: tuple[tuple[str, int, str], ...]) -> bool:
    """Whether every file in ``read`` (:attr:`policies.config.Config.read_from`) holds the
    text it held then, byte for byte: a config loaded from them now would be the same, so a
    reload has nothing to apply (a touch, a chmod, a rewrite of the same text). False if one
    cannot be read.

    Each is read to one byte past its size then, so a file grown large is not read whole.
    """
    for name, size, digest in read:
        try:
            # Gone, no longer a regular file, or grown past its size then: not that text.
            data = read_file(name, size)
        except (OSError, ValueError):
            return False
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            return False
    return True
