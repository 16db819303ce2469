"""TOML from outside (a job spec, an agent config) parsed with its nesting bounded.

tomllib recurses once per nested array or inline table, so a document a few hundred levels
deep ends in RecursionError rather than a parse error; dotted keys and table headers nest
without recursing in the parser, but what reads the result (repr, json) recurses. Neither
kind of nesting has a use in our files beyond a handful of levels, so both are bounded: the
brackets before tomllib sees the text, the tables and lists after.
"""

from __future__ import annotations

import re
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Levels of tables and lists, the document itself counting as one. A job spec needs three
# (document, section, a list value).
MAX_DEPTH = 16

# Strings and comments first (their brackets do not nest), then one bracket. A multi-line
# string may end in up to two quotes of its own before its closing three.
_TOKEN = re.compile(
    r'"""(?:\\.|[^\\])*?"{3,5}'
    r"|'''.*?'{3,5}"
    r'|"(?:\\[^\n]|[^"\\\n])*"'
    r"|'[^'\n]*'"
    r"|#[^\n]*"
    r"|[\[\]{}]",
    re.S,
)


class TomlError(ValueError):
    """Not valid TOML, or nested too deep; the message starts with the source's name."""


class TooDeep(TomlError):
    pass


def _bracket_depth(text: str) -> int:
    depth = deepest = 0
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth = max(0, depth - 1)
    return deepest


def _value_depth(value: Any) -> int:
    """Levels of dicts and lists in `value`, counted without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def loads(text: str, source: str) -> dict[str, Any]:
    """`text` parsed; TomlError names `source` (a file name, or what the text is)."""
    too_deep = TooDeep(f"{source}: nested deeper than {MAX_DEPTH} levels of tables and lists")
    if _bracket_depth(text) > MAX_DEPTH:
        raise too_deep
    try:
        value = tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, or an integer of over 4300 digits
        raise TomlError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:  # a string the scan above reads otherwise than tomllib does
        raise too_deep from None
    if _value_depth(value) > MAX_DEPTH:
        raise too_deep
    return value
