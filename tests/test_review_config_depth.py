"""Configs nested too deep are refused at once, naming the line, whichever parser reads them
(from a hostile review: libyaml refuses some files PyYAML reads, and the depth check then
gave up, letting a 70-level file through and a 50,000-level one back onto PyYAML's slow path
with the line of the file's start)."""

from __future__ import annotations

import pytest
import yaml

from proxy.config import ConfigError, parse_config, parse_tenants

# Each of these libyaml refuses and PyYAML reads; the nesting is on line 3.
HEADS = ["%FOO bar\n---\n", "%YAML 1.3\n---\n", 'z: "\\ud800"\n---\n']


def _deep(head: str, levels: int) -> str:
    return head + "x: " + "[" * levels + "]" * levels + "\n"


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("levels", [70, 20_000])
def test_a_deep_config_libyaml_refuses_is_still_refused_for_its_depth_on_its_line(
        head: str, levels: int):
    with pytest.raises(ConfigError) as refused:
        parse_config(_deep(head, levels), "c.yaml")
    assert str(refused.value).startswith(
        "c.yaml:3: (yaml): nested too deeply (more than 64 levels"), str(refused.value)


@pytest.mark.parametrize("head", HEADS[:2])
def test_a_deep_tenants_table_libyaml_refuses_is_refused_on_its_line(head: str):
    with pytest.raises(ConfigError) as refused:
        parse_tenants(_deep(head, 70), "tenants.yaml")
    assert "tenants.yaml:3: identity.tenants: nested too deeply" in str(refused.value)


def test_without_libyaml_a_deep_config_is_refused_for_its_depth(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(yaml, "__with_libyaml__", False)
    with pytest.raises(ConfigError) as refused:
        parse_config(_deep("a: 1\n", 70), "c.yaml")
    assert str(refused.value).startswith("c.yaml:2: (yaml): nested too deeply (more than 64")


def _chain(anchors: int) -> str:
    """Each anchor a list of the one before it: one level deeper per line, none deep in text."""
    return "".join(["a0: &a0 [x]\n",
                    *(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, anchors))])


@pytest.mark.parametrize("anchors", [70, 2_000])
def test_a_depth_built_through_aliases_is_refused_naming_an_anchor_of_the_chain(anchors: int):
    # Each line nests one level, so the text check sees none too deep; 2,000 such anchors
    # ended in a RecursionError, reported at line 1.
    with pytest.raises(ConfigError) as refused:
        parse_config(_chain(anchors), "c.yaml")
    [problem] = refused.value.problems
    line = int(problem.split(":")[1])
    assert 60 <= line <= 70, problem  # the anchor where the chain passes 64 levels
    assert problem.endswith("nested too deeply once its aliases are expanded (more than 64 "
                            "levels of lists and mappings)"), problem


def test_a_depth_of_aliases_within_the_bound_reads_as_any_config():
    # 60 levels through aliases: not refused for depth; the unknown keys are what is wrong.
    with pytest.raises(ConfigError) as refused:
        parse_config(_chain(60), "c.yaml")
    assert "nested too deeply" not in str(refused.value)
    assert "c.yaml:60: a59: unknown key" in str(refused.value)
