"""A JSON schema as a regular expression (runtime.regex_parse's syntax), for guided_json.

The completion is one JSON value of the schema, written compactly: at most one space where JSON
allows whitespace (around `:` and `,`, inside brackets), as structured-output libraries do by
default so that a model cannot pad forever. Objects have the schema's properties in its order:
the required ones always, the others where the model writes them; no others
(additionalProperties is taken as false).

Read: type (one or a list), enum, const, anyOf / oneOf, $ref into $defs / definitions (not
recursive), properties / required, items / prefixItems with minItems / maxItems, string
minLength / maxLength / pattern / format (date, time, date-time, uuid), and the annotations
(title, description, default, examples, ...). Keywords that constrain values otherwise
(minimum, multipleOf, uniqueItems, ...) are refused, naming where: a completion would not be
held to them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from runtime.regex_parse import MAX_REPEAT, RegexError, parse

WS = "[ ]?"
_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_FORMATS = {
    "date": r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])",
    # RFC 3339's full-time: the offset is part of it
    "time": r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-][0-9]{2}:[0-9]{2})",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
_FORMATS["date-time"] = _FORMATS["date"] + "T" + _FORMATS["time"]
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                "deprecated", "readOnly", "writeOnly", "$defs", "definitions"}
_READ = {"type", "enum", "const", "anyOf", "oneOf", "$ref", "properties", "required",
         "additionalProperties", "items", "prefixItems", "minItems", "maxItems", "minLength",
         "maxLength", "pattern", "format"}


class SchemaError(ValueError):
    """The schema cannot be turned into a pattern; the message names the keyword's place."""


def schema_regex(schema_text: str) -> str:
    """The pattern of the JSON values `schema_text` (a JSON schema, as text) allows."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"guided JSON schema is not JSON: {exc}") from None
    return _Compiler(schema).value(schema, "#", ())


class _Compiler:
    def __init__(self, root: Any) -> None:
        self.root = root

    def value(self, schema: Any, where: str, refs: tuple[str, ...]) -> str:
        if schema is True or schema == {}:
            raise SchemaError(f"guided JSON schema at {where}: any value is allowed there; give "
                              "it a type")
        if not isinstance(schema, dict):
            raise SchemaError(f"guided JSON schema at {where}: a schema is an object, got "
                              f"{json.dumps(schema)}")
        unread = sorted(set(schema) - _READ - _ANNOTATIONS)
        if unread:
            raise SchemaError(f"guided JSON schema at {where}: {unread[0]!r} is not supported "
                              "(the completion would not be held to it)")
        if "$ref" in schema:
            return self.ref(schema["$ref"], where, refs)
        if "const" in schema:
            return re.escape(json.dumps(schema["const"], ensure_ascii=False))
        if "enum" in schema:
            return _alternatives([re.escape(json.dumps(v, ensure_ascii=False))
                                  for v in schema["enum"]], where)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return _alternatives([self.value(s, f"{where}/{key}/{i}", refs)
                                      for i, s in enumerate(schema[key])], where)
        kinds = schema.get("type")
        if kinds is None:
            kinds = "object" if "properties" in schema else None
        if isinstance(kinds, list):
            return _alternatives([self.typed(schema, k, where, refs) for k in kinds], where)
        if kinds is None:
            raise SchemaError(f"guided JSON schema at {where}: no type")
        return self.typed(schema, kinds, where, refs)

    def ref(self, ref: Any, where: str, refs: tuple[str, ...]) -> str:
        if ref == "#" or ref in refs:
            raise SchemaError(f"guided JSON schema at {where}: {ref} refers to itself; "
                              "recursive schemas have no regular expression")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise SchemaError(f"guided JSON schema at {where}: only local $refs (#/...)")
        target: Any = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"guided JSON schema at {where}: {ref} names nothing")
            target = target[part]
        return self.value(target, ref, (*refs, ref))

    def typed(self, schema: dict, kind: Any, where: str, refs: tuple[str, ...]) -> str:
        if kind == "string":
            return self.string(schema, where)
        if kind in ("integer", "number"):
            return _INTEGER if kind == "integer" else _NUMBER
        if kind == "boolean":
            return "(?:true|false)"
        if kind == "null":
            return "null"
        if kind == "array":
            return self.array(schema, where, refs)
        if kind == "object":
            return self.object(schema, where, refs)
        raise SchemaError(f"guided JSON schema at {where}: unknown type {json.dumps(kind)}")

    def string(self, schema: dict, where: str) -> str:
        if "pattern" in schema:
            return f'"(?:{_string_pattern(schema["pattern"], where)})"'
        if "format" in schema:
            if schema["format"] not in _FORMATS:
                raise SchemaError(f"guided JSON schema at {where}: format "
                                  f"{schema['format']!r} is not supported (only "
                                  f"{', '.join(sorted(_FORMATS))})")
            return f'"{_FORMATS[schema["format"]]}"'
        low, high = _count(schema, "minLength", "maxLength", where)
        return f'"{_STRING_CHAR}{_repeat(low, high)}"'

    def array(self, schema: dict, where: str, refs: tuple[str, ...]) -> str:
        fixed = [self.value(s, f"{where}/prefixItems/{i}", refs)
                 for i, s in enumerate(schema.get("prefixItems", []))]
        if fixed:
            if "items" in schema and schema["items"] is not False:
                raise SchemaError(f"guided JSON schema at {where}: prefixItems with items: "
                                  "only a fixed tuple (items false)")
            return rf"\[{WS}" + f"{WS},{WS}".join(fixed) + rf"{WS}\]"
        if "items" not in schema:
            raise SchemaError(f"guided JSON schema at {where}: an array needs items")
        item = self.value(schema["items"], f"{where}/items", refs)
        low, high = _count(schema, "minItems", "maxItems", where)
        more = f"(?:{WS},{WS}{item}){_repeat(max(low - 1, 0), None if high is None else high - 1)}"
        items = f"{item}{more}"
        return rf"\[{WS}" + (items if low > 0 else f"(?:{items})?") + rf"{WS}\]"

    def object(self, schema: dict, where: str, refs: tuple[str, ...]) -> str:
        # additionalProperties is not read: an object of the listed properties only satisfies
        # any value of it
        properties = schema.get("properties") or {}
        if not properties:
            raise SchemaError(f"guided JSON schema at {where}: an object needs properties")
        required = set(schema.get("required", []))
        if unknown := sorted(required - set(properties)):
            raise SchemaError(f"guided JSON schema at {where}: required {unknown[0]!r} is not "
                              "among its properties")
        items = [(f'{re.escape(json.dumps(name, ensure_ascii=False))}{WS}:{WS}'
                  + self.value(sub, f"{where}/properties/{name}", refs), name in required)
                 for name, sub in properties.items()]
        return rf"\{{{WS}" + _members(items) + rf"{WS}\}}"


def _members(items: list[tuple[str, bool]]) -> str:
    """The properties in order, comma-separated, the optional ones maybe left out: `after`
    (something came before) is a plain sequence of pieces; `first` (nothing yet) chooses the
    first one present, then continues as `after`."""
    after = [""]
    for pattern, needed in reversed(items):
        piece = f"{WS},{WS}{pattern}"
        after.insert(0, (piece if needed else f"(?:{piece})?") + after[0])
    first = ""
    for i in reversed(range(len(items))):
        pattern, needed = items[i]
        here = pattern + after[i + 1]
        first = here if needed else f"(?:{here}|{first})" if first else f"(?:{here})?"
    return first


def _string_pattern(pattern: Any, where: str) -> str:
    """A string's `pattern`, checked, as the whole string must match it: JSON Schema's patterns
    are searched for, so a whole match is one of the strings it allows; ^ / $ anchors are
    dropped (the whole string is matched anyway)."""
    if not isinstance(pattern, str):
        raise SchemaError(f"guided JSON schema at {where}/pattern: a pattern is a string")
    for start in ("^", "\\A"):
        if pattern.startswith(start):
            pattern = pattern[len(start):]
    for end in ("$", "\\Z"):
        if pattern.endswith(end) and not pattern.endswith("\\" + end):
            pattern = pattern[:-len(end)]
    try:
        parse(pattern)
    except RegexError as exc:
        raise SchemaError(f"guided JSON schema at {where}/pattern: {exc}") from None
    return pattern


def _count(schema: dict, low_key: str, high_key: str, where: str) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    if not isinstance(low, int) or (high is not None and not isinstance(high, int)) or (
            high is not None and high < low) or low < 0:
        raise SchemaError(f"guided JSON schema at {where}: {low_key} / {high_key} must be "
                          f"counts with {low_key} <= {high_key}")
    if max(low, high or 0) > MAX_REPEAT:
        raise SchemaError(f"guided JSON schema at {where}: {low_key} / {high_key} of at most "
                          f"{MAX_REPEAT} (each count is a state of the automaton)")
    return low, high


def _repeat(low: int, high: int | None) -> str:
    if high is None:
        return "*" if low == 0 else f"{{{low},}}"
    return f"{{{low},{high}}}"


def _alternatives(patterns: list[str], where: str) -> str:
    if not patterns:
        raise SchemaError(f"guided JSON schema at {where}: an empty enum or anyOf allows nothing")
    return "(?:" + "|".join(patterns) + ")"
