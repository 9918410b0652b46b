"""The config is read by libyaml's parser where it can be (a large file loads several times
faster), and by PyYAML's own where libyaml refuses it, so every error keeps PyYAML's words and
line. These tests hold the two to the same reading of any file libyaml accepts."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config import StrictLoader, parse_config

pytestmark = pytest.mark.skipif(not yaml.__with_libyaml__, reason="PyYAML built without libyaml")

if yaml.__with_libyaml__:
    from proxy.config import FastStrictLoader

#: Lines that are valid, invalid, or read differently by YAML 1.1 and 1.2 readers: anchors,
#: merge keys, tags, directives, flow collections left open, the line breaks YAML 1.1 adds
#: (NEL, LS), a byte order mark, block scalars.
FRAGMENTS = [
    "a: 1\n", "b:\n  - x\n  - y\n", "  c: 2\n", "d: 'q\n", 'e: "\\x41"\n', "f: [1, {g: 2}]\n",
    "%YAML 1.1\n---\n", "%FOO bar\n", "---\n", "...\n", "h: &x 3\n", "i: *x\n", "? k\n: v\n",
    "j: |\n  t\n", "- 1\n", "<<: {a: 1}\n", "m: !!str 3\n", "n: !foo 3\n", "o: 1:30\n", "#c\n",
    "p: \xa0\n", "q: \u2028r\n", "s: \x85\n", "t: {a: 1,}\n", "u: [a,]\n", "v: ''\n", "w: -\n",
    "x: @\n", "z: \ufeff\n", " \n", "\r\n", "aa: bb: cc\n", "k2: >\n  folded\n", "! a: 1\n",
    "&a b: 1\n", "*x : 2\n", "l: [\n", "m: {\n", "'k': v\n", '"k": v\n', "o: 1 # c\n",
    "p: a#b\n", "- - 1\n", "r: 0x1F\n", "s: .inf\n", "t: 1e3\n", "u: ~\n", "v: 2024-01-01\n",
    "w: 'it''s'\n", "x: \"\\ud800\"\n", "y: 007\n", "z: yes\n",
]


def _nodes(loader_class: type, text: str) -> object:
    """``text``'s nodes as plain tuples (tag, value, plain or not, line), or the error's class."""
    def walk(node: yaml.Node) -> object:
        if isinstance(node, yaml.ScalarNode):
            return node.tag, node.value, not node.style, node.start_mark.line
        if isinstance(node, yaml.SequenceNode):
            return node.tag, node.start_mark.line, [walk(item) for item in node.value]
        return node.tag, node.start_mark.line, [(walk(k), walk(v)) for k, v in node.value]
    try:
        loader = loader_class(text)
        node = loader.get_single_node()
    except (yaml.YAMLError, UnicodeEncodeError) as exc:
        return type(exc)
    return None if node is None else walk(node)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=6))
def test_a_file_libyaml_reads_is_read_the_same_by_pyyaml(fragments: list[str]) -> None:
    text = "".join(fragments)
    fast = _nodes(FastStrictLoader, text)
    if isinstance(fast, type):  # refused: PyYAML's own parser reads it (or words the error)
        return
    assert _nodes(StrictLoader, text) == fast


def test_a_tab_after_a_key_s_colon_is_read_as_yaml_allows_it() -> None:
    # The differences found: PyYAML's scanner refuses a tab as white space ("found character
    # '\t' that cannot start any token": before a value, in a flow collection, before a
    # comment, at a line's end), which YAML allows (1.2 §6.2 s-separate-in-line); libyaml
    # reads it. Indenting with tabs is still refused.
    config = parse_config("server:\n  listen:\t127.0.0.1:8080\nroutes:\n"
                          "  - {name: a, path_prefix: /a/, upstream: http://127.0.0.1:9}\n")
    assert config.server.listen == "127.0.0.1:8080"
