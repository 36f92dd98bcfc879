"""runtime.json_schema: the pattern of a schema matches the compact JSON of values it allows
(with or without single spaces), not values it does not, and refuses what it cannot hold."""

from __future__ import annotations

import json
import re

import pytest

from runtime.json_schema import SchemaError, schema_regex
from runtime.regex_dfa import RegexDFA

PERSON = {
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                       "born": {"type": "string",
                                                                "format": "date"}},
                      "required": ["kind"]}},
    "title": "Person", "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8, "description": "given"},
        "age": {"type": "integer"},
        "height": {"type": ["number", "null"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"},
                 "maxItems": 2},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}, "minItems": 1},
        "point": {"type": "array", "prefixItems": [{"type": "integer"}, {"const": "x"}],
                  "items": False},
        "ok": {"type": "boolean"},
        "at": {"type": "string", "format": "date-time"},
    },
    "required": ["name", "pets"],
}
GOOD = [
    {"name": "Ann", "pets": [{"kind": "cat"}]},
    {"name": "Bo \u00e9\"\\", "age": -3, "pets": [{"kind": "dog", "born": "2020-02-29"},
                                                   {"kind": "cat"}], "ok": False},
    {"name": "C", "height": None, "tags": [], "pets": [{"kind": "cat"}], "point": [4, "x"]},
    {"name": "D", "age": 0, "height": 1.5e-3, "tags": ["ab", "c"], "pets": [{"kind": "dog"}],
     "point": [-1, "x"], "ok": True, "at": "2024-01-01T10:00:00.5+02:00"},
]
BAD = [
    {"pets": [{"kind": "cat"}]},  # name required
    {"name": "", "pets": [{"kind": "cat"}]},  # minLength
    {"name": "ninechars", "pets": [{"kind": "cat"}]},  # maxLength
    {"name": "A", "pets": []},  # minItems
    {"name": "A", "pets": [{"kind": "cow"}]},  # enum
    {"name": "A", "age": 1.5, "pets": [{"kind": "cat"}]},  # integer
    {"name": "A", "tags": ["A"], "pets": [{"kind": "cat"}]},  # pattern
    {"name": "A", "tags": ["a", "b", "c"], "pets": [{"kind": "cat"}]},  # maxItems
    {"name": "A", "pets": [{"kind": "cat", "born": "2020-13-01"}]},  # format
    {"name": "A", "pets": [{"kind": "cat"}], "at": "2024-01-01T10:00:00"},  # no offset
    {"name": "A", "pets": [{"kind": "cat"}], "extra": 1},  # only the listed properties
    {"pets": [{"kind": "cat"}], "name": "A"},  # the schema's order
    {"name": "A", "pets": [{"kind": "cat"}], "point": [1, "y"]},  # const
]


def test_values_the_schema_allows_match_and_others_do_not() -> None:
    pattern = schema_regex(json.dumps(PERSON))
    dfa = RegexDFA(pattern)
    for value in GOOD:
        for separators in ((",", ":"), (", ", ": ")):
            text = json.dumps(value, separators=separators, ensure_ascii=False)
            assert re.fullmatch(pattern, text), text
            assert dfa.accepting(dfa.walk(dfa.start, text.encode())), text
    for value in BAD:
        text = json.dumps(value, separators=(", ", ": "), ensure_ascii=False)
        assert not re.fullmatch(pattern, text), text
        assert not dfa.accepting(dfa.walk(dfa.start, text.encode())), text
    assert not re.fullmatch(pattern, json.dumps(GOOD[0], indent=2))  # compact only


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": 3}, "at #: 'minimum' is not supported"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}},
     "at #/properties/a: # refers to itself"),
    ({"$defs": {"N": {"type": "array", "items": {"$ref": "#/$defs/N"}}}, "$ref": "#/$defs/N"},
     "at #/$defs/N/items: #/$defs/N refers to itself"),
    ({}, "at #: any value is allowed there"),
    ({"type": "array"}, "at #: an array needs items"),
    ({"type": "object"}, "at #: an object needs properties"),
    ({"type": "string", "format": "email"}, "format 'email' is not supported"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["b"]},
     "required 'b' is not among its properties"),
    ({"enum": []}, "an empty enum or anyOf allows nothing"),
    ({"type": "strin"}, 'unknown type "strin"'),
    ({"$ref": "#/$defs/X"}, "#/$defs/X names nothing"),
    ({"type": "object", "properties": {"n": {"type": "string", "pattern": "a(?=b)"}}},
     "at #/properties/n/pattern: regex 'a(?=b)' at position 1"),
    ({"type": "array", "items": {"type": "null"}, "maxItems": 1001},
     "at #: minItems / maxItems of at most 1000"),
    ({"type": "string", "maxLength": -1}, "minLength / maxLength must be counts"),
])
def test_what_it_cannot_hold_is_refused_naming_where(schema: dict, message: str) -> None:
    with pytest.raises(SchemaError, match=re.escape(message)):
        schema_regex(json.dumps(schema))
    with pytest.raises(SchemaError, match="is not JSON"):
        schema_regex("{'type': 'string'}")
