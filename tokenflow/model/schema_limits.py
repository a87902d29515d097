"""What a structured output's JSON Schema may ask of the grammar compiler, checked before it
compiles: a short schema can take minutes and hundreds of MB to compile.

Measured with xgrammar 0.2.9 on the embedded model's vocabulary (2 cores): a pattern's nested
repetition costs about the product of its counts cubed (`([a-z0-9]{1,8}){1,8}` 0.9 s,
`{1,16}` inside `{1,16}` 5.2 s, `{1,20}` inside `{1,20}` 26 s), while one level is cheap
(`[a-z]{1,1000}` 0.1 s); 300 optional properties compile in 0.07 s and 2,000 in 94 s; a
5,000-value enum in 0.13 s, and 20,000 values make an 83 MB grammar.  The bounds below sit well
inside the cheap side; the compile deadline (`grammar_compile.py`) catches what they miss.

Keywords xgrammar accepts but does not enforce are refused by name, so that a client is never
told its schema holds when the output may break it: `not`, `if`/`then`/`else`, `uniqueItems`,
`dependentRequired`, `dependentSchemas`, `contains` without `minContains`, and `multipleOf` on
numbers that are not integers (each seen accepting a value its keyword forbids).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MAX_SCHEMA_CHARS = 64 << 10
MAX_DEPTH = 32  # schemas nested in schemas
MAX_PROPERTIES_PER_OBJECT = 256
MAX_PROPERTIES = 1024  # over the whole schema
MAX_ENUM_VALUES = 4096  # enum values over the whole schema
MAX_NESTED_REPEAT = 64  # a pattern's product of nested repetition counts
MAX_REPEAT = 4096  # one repetition count in a pattern

UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "uniqueItems")
UNENFORCED_KEYWORDS += ("dependentRequired", "dependentSchemas")

# Where a schema holds schemas: a keyword -> how its value holds them.
_ONE = ("items", "additionalProperties", "propertyNames", "contains", "additionalItems")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "$defs", "definitions", "patternProperties")


class GrammarError(ValueError):
    """A structured output that cannot be compiled (the message names the problem)."""


class SchemaTooComplex(GrammarError):
    """A schema over a bound, or with a keyword that would not be enforced (the message names
    which, in the client's terms)."""


@dataclass
class _Totals:
    num_properties: int = 0
    num_enum_values: int = 0


def check_schema(schema_text: str, origin: str) -> None:
    """SchemaTooComplex naming the first bound `schema_text` (from `origin`, e.g.
    "response_format.json_schema.schema") is over; nothing if it may be compiled."""
    _check_chars(schema_text, origin, "schema")
    try:
        schema = json.loads(schema_text)
    except ValueError:
        raise GrammarError(
            f"{origin}: the JSON schema cannot be compiled: not valid JSON"
        ) from None
    totals = _Totals()
    for path, node, depth in _schemas(schema, origin, 0):
        if depth > MAX_DEPTH:
            raise SchemaTooComplex(f"{path}: schemas nest deeper than {MAX_DEPTH} levels")
        _check_node(node, path, totals)


def check_regex(pattern: str, origin: str) -> None:
    """SchemaTooComplex when a regular expression (vLLM's `guided_regex`) is over the bounds a
    schema's `pattern` has, or longer than a schema may be."""
    _check_chars(pattern, origin, "regular expression")
    _check_pattern(pattern, origin)


def check_grammar(grammar: str, origin: str) -> None:
    """SchemaTooComplex when an EBNF grammar (vLLM's `guided_grammar`) is longer than a schema
    may be or nests repetitions past a pattern's bound (its `{m,n}` read as a pattern's)."""
    _check_chars(grammar, origin, "grammar")
    _check_pattern(grammar, origin)


def _check_chars(text: str, origin: str, what: str) -> None:
    if len(text) > MAX_SCHEMA_CHARS:
        raise SchemaTooComplex(
            f"{origin}: the {what} has {len(text)} characters; at most {MAX_SCHEMA_CHARS} "
            "are accepted"
        )


def _schemas(node: Any, path: str, depth: int) -> Iterator[tuple[str, dict[str, Any], int]]:
    """Every schema object inside `node` (itself first), with its path and nesting depth."""
    if not isinstance(node, dict):
        return
    yield path, node, depth
    for keyword in _ONE:
        yield from _schemas(node.get(keyword), f"{path}.{keyword}", depth + 1)
    for keyword in _LISTS:
        value = node.get(keyword)
        if isinstance(value, list):
            for index, child in enumerate(value):
                yield from _schemas(child, f"{path}.{keyword}[{index}]", depth + 1)
    for keyword in _MAPS:
        value = node.get(keyword)
        if isinstance(value, dict):
            for name, child in value.items():
                yield from _schemas(
                    child, f"{path}.{keyword}.{shortened(str(name), 40)}", depth + 1
                )


def _check_node(node: dict[str, Any], path: str, totals: _Totals) -> None:
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in node:
            raise _unenforced(path, keyword)
    if "contains" in node and "minContains" not in node:
        raise _unenforced(path, "contains", " without minContains")
    if "multipleOf" in node and node.get("type") != "integer":
        raise _unenforced(path, "multipleOf", ' on a type other than "integer"')
    properties = node.get("properties")
    if isinstance(properties, dict):
        if len(properties) > MAX_PROPERTIES_PER_OBJECT:
            raise SchemaTooComplex(
                f"{path}: {len(properties)} properties; at most {MAX_PROPERTIES_PER_OBJECT} "
                "in one object"
            )
        totals.num_properties += len(properties)
        if totals.num_properties > MAX_PROPERTIES:
            raise SchemaTooComplex(f"{path}: more than {MAX_PROPERTIES} properties in all")
    enum = node.get("enum")
    if isinstance(enum, list):
        totals.num_enum_values += len(enum)
        if totals.num_enum_values > MAX_ENUM_VALUES:
            raise SchemaTooComplex(f"{path}: more than {MAX_ENUM_VALUES} enum values in all")
    patterns = [("pattern", node.get("pattern"))]
    if isinstance(node.get("patternProperties"), dict):
        patterns += [("patternProperties", p) for p in node["patternProperties"]]
    for keyword, pattern in patterns:
        if isinstance(pattern, str):
            _check_pattern(pattern, f"{path}.{keyword}")


def _check_pattern(pattern: str, path: str) -> None:
    repeat = nested_repeat(pattern)
    if repeat > MAX_NESTED_REPEAT:
        raise SchemaTooComplex(
            f"{path}: the pattern's nested repetition counts multiply to {repeat}; at most "
            f"{MAX_NESTED_REPEAT} are accepted (repeat a group or its contents, not both)"
        )


def nested_repeat(pattern: str) -> int:
    """The largest product of repetition counts along one nesting of `pattern`'s groups where
    a repetition repeats another (`{m,n}` counts n, `{m}` m, `{m,}` m + 1; `*`, `+` and `?`
    count 1: a loop, not an unrolling); 1 without such nesting.  One count alone is bounded by
    MAX_REPEAT (SchemaTooComplex beyond it)."""
    stack, last, i = [1], 1, 0  # stack[d]: the largest product inside the group open at d
    nested = 1
    while i < len(pattern):
        char = pattern[i]
        if char == "{" and (count := _count(pattern, i)) is not None:
            num, i = count
            if num > MAX_REPEAT:
                raise SchemaTooComplex(f"a repetition count of {num}; at most {MAX_REPEAT}")
            if last > 1:  # a repetition of something that repeats already
                nested = max(nested, last * num)
            last *= num  # the quantified atom (a group: its inside's product) unrolled
            continue
        stack[-1], last = max(stack[-1], last), 1  # the previous atom is complete
        if char == "\\":
            i += 2
        elif char == "[":
            i = _class_end(pattern, i)
        elif char == "(":
            stack.append(1)
            i += 1
        elif char == ")" and len(stack) > 1:
            last = stack.pop()
            i += 1
        else:
            i += 1
    return nested


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class that opens at `start`."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1  # a leading ] is a member
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _count(pattern: str, start: int) -> tuple[int, int] | None:
    """(the count a `{m,n}` quantifier at `start` unrolls to, the index after it), or None
    when the brace is a literal."""
    end = pattern.find("}", start)
    if end < 0:
        return None
    low, comma, high = pattern[start + 1 : end].partition(",")
    if not low.strip().isdigit() or (high.strip() and not high.strip().isdigit()):
        return None
    if not comma:
        return int(low), end + 1
    return (int(high) if high.strip() else int(low) + 1), end + 1


def _unenforced(path: str, keyword: str, where: str = "") -> SchemaTooComplex:
    return SchemaTooComplex(
        f"{path}: the keyword {keyword!r}{where} is not supported (the output would not be "
        "held to it); remove it or express it another way"
    )


def shortened(text: str, limit: int = 200) -> str:
    """A client's text as an error quotes it: at most `limit` characters (never echoed whole)."""
    return text if len(text) <= limit else text[:limit] + "..."
