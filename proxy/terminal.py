"""Text Sluice's commands print to an operator's terminal: what callers chose (paths, queries,
header values, tenants, models) written so that it cannot drive the terminal."""

from __future__ import annotations

import re
from typing import Any

#: C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the bidi embedding,
#: override and isolate controls: ESC or CSI (U+009B) sequences clear or retitle a terminal,
#: CR, LF and U+2028 fake a line, and a bidi override shows text in another order than it is.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(value: Any) -> Any:
    """``value`` with every :data:`CONTROL` character of its strings written as an escape
    (``\\x1b``, ``\\u202e``); dicts (keys too) and lists are walked, anything else is
    returned as it is."""
    if isinstance(value, str):
        return CONTROL.sub(_escape, value) if CONTROL.search(value) else value
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable(v) for v in value]
    return value


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable_json(text: str) -> str:
    """JSON ``text`` with every :data:`CONTROL` character but LF written as a JSON
    ``\\uXXXX`` escape: the same document to a JSON reader, none of them raw on a terminal
    (orjson escapes C0 controls in strings, but writes DEL, C1 controls, U+2028/2029 and
    bidi controls as they are). LF is left as it is: an indented document's lines end with
    it, and a string never holds one raw."""
    return CONTROL.sub(_json_escape, text)


def _json_escape(match: re.Match[str]) -> str:
    found = match.group()
    return found if found == "\n" else f"\\u{ord(found):04x}"
