"""Regular expressions for guided decoding, parsed into a small tree over code point ranges.

The syntax runtime.regex_dfa matches (see there): literals, `.`, classes, the escapes \\d \\w
\\s (ASCII sets) and their negations, \\n \\t \\r \\f \\v \\xXX \\uXXXX, groups, `|` and
the quantifiers. A node is ("set", ranges) | ("cat", [nodes]) | ("alt", [nodes]) |
("rep", node, low, high or None). utf8_sequences turns a range of code points into the UTF-8
byte ranges the automaton walks.
"""

from __future__ import annotations

import re

MAX_REPEAT = 1000  # {n,m} copies its operand: bounds beyond this are refused
_MAX_CODEPOINT = 0x10FFFF
_DIGITS = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_CLASS_ESCAPES = {"d": (_DIGITS, False), "D": (_DIGITS, True), "w": (_WORD, False),
                  "W": (_WORD, True), "s": (_SPACE, False), "S": (_SPACE, True)}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
Ranges = list[tuple[int, int]]


class RegexError(ValueError):
    """The pattern is not one this module reads; the message says where and why."""


def parse(pattern: str) -> tuple:
    """The tree of `pattern`; a RegexError says where it cannot be read."""
    return _Parser(pattern).parse()


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p, self.i = pattern, 0

    def fail(self, why: str, at: int | None = None) -> RegexError:
        """An error at `at` (the 0-based start of the construct, as Python's re counts), or at
        the current position."""
        return RegexError(f"regex {self.p!r} at position {self.i if at is None else at}: {why}")

    def parse(self) -> tuple:
        for start in ("^", "\\A"):  # the start of a full match anyway
            if self.p.startswith(start):
                self.i = len(start)
                break
        node = self.alternation()
        if self.i < len(self.p):
            raise self.fail("unbalanced ')'")
        return node

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def alternation(self) -> tuple:
        branches = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.concatenation())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def concatenation(self) -> tuple:
        items = []
        while (c := self.peek()) is not None and c not in "|)":
            if (c == "$" and self.i == len(self.p) - 1) or (
                    self.p.startswith("\\Z", self.i) and self.i == len(self.p) - 2):
                self.i = len(self.p)  # the end of a full match anyway
                break
            items.append(self.repeat(self.atom()))
        return ("cat", items)

    def repeat(self, node: tuple) -> tuple:
        while (c := self.peek()) is not None and c in "*+?{":
            if c == "{":
                bounds = self.braces()
                if bounds is None:
                    return node
                low, high = bounds
            else:
                self.i += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if self.peek() == "?":  # lazy: the same language
                self.i += 1
            node = ("rep", node, low, high)
        return node

    def braces(self) -> tuple[int, int | None] | None:
        end = self.p.find("}", self.i)
        body = self.p[self.i + 1:end] if end > 0 else ""
        low_text, comma, high_text = body.partition(",")
        if not (low_text.isdigit() or (comma and not low_text)) or not (
                high_text.isdigit() or not high_text):
            return None  # a literal "{", as Python's re reads it
        low, high = int(low_text or 0), (int(high_text) if high_text else None)
        high = low if not comma else high
        if high is not None and high < low:
            raise self.fail(f"{{{body}}}: the maximum is below the minimum")
        if max(low, high or 0) > MAX_REPEAT:
            raise self.fail(f"{{{body}}}: at most {MAX_REPEAT} repeats")
        self.i = end + 1
        return low, high

    def atom(self) -> tuple:
        start = self.i
        c = self.p[self.i]
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif (name := re.match(r"\?P<[^\W\d]\w*>", self.p[self.i:])) is not None:
                self.i += name.end()  # a named group: a group (nothing refers to it)
            elif self.peek() == "?":
                raise self.fail("only (?: ) and (?P<name> ) groups: lookarounds, inline "
                                "flags, atomic groups and conditionals are not supported", start)
            node = self.alternation()
            if self.peek() != ")":
                raise self.fail("missing ')'", start)
            self.i += 1
            return node
        if c in "*+?":
            raise self.fail(f"nothing to repeat before {c!r}", start)
        if c == "^":
            raise self.fail("^ only at the start (the whole completion is matched)", start)
        if c == "$":
            raise self.fail("$ only at the end (the whole completion is matched)", start)
        if c == ".":
            return ("set", _complement([(0x0A, 0x0A)]))
        if c == "[":
            return ("set", self.char_class())
        if c == "\\":
            return ("set", self.escape(in_class=False))
        return ("set", [(ord(c), ord(c))])

    def escape(self, in_class: bool) -> Ranges:
        start = self.i - 1  # the backslash
        if self.i >= len(self.p):
            raise self.fail("a pattern cannot end with a backslash", start)
        c = self.p[self.i]
        self.i += 1
        if c in _CLASS_ESCAPES:
            ranges, negated = _CLASS_ESCAPES[c]
            return _complement(ranges) if negated else list(ranges)
        if c in _CHAR_ESCAPES:
            return [(ord(_CHAR_ESCAPES[c]),) * 2]
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = self.p[self.i:self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"\\{c} takes {width} hex digits", start)
            self.i += width
            return [(int(digits, 16),) * 2]
        if c == "b" and in_class:
            return [(0x08, 0x08)]
        if c.isdigit():
            raise self.fail(f"\\{c} is a backreference: no finite automaton has one", start)
        if c in "AZ":
            raise self.fail(f"\\{c} only at the {'start' if c == 'A' else 'end'} (the whole "
                            "completion is matched)", start)
        if c in "bB":
            raise self.fail(f"\\{c} (a word boundary) is not supported: no finite automaton "
                            "has one", start)
        if c.isalnum():
            raise self.fail(f"\\{c} is not supported", start)
        return [(ord(c), ord(c))]

    def char_class(self) -> Ranges:
        negated = self.peek() == "^"
        self.i += negated
        ranges: Ranges = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.fail("missing ']'")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            low = self.class_item()
            if (self.peek() == "-" and self.i + 1 < len(self.p)
                    and self.p[self.i + 1] != "]" and len(low) == 1 and low[0][0] == low[0][1]):
                self.i += 1
                high = self.class_item()
                if len(high) != 1 or high[0][0] != high[0][1]:
                    raise self.fail("a range must end in one character")
                if high[0][0] < low[0][0]:
                    raise self.fail("a range's end is below its start")
                ranges.append((low[0][0], high[0][0]))
            else:
                ranges += low
        return _complement(ranges) if negated else _merge(ranges)

    def class_item(self) -> Ranges:
        c = self.p[self.i]
        self.i += 1
        if c == "\\":
            return self.escape(in_class=True)
        return [(ord(c), ord(c))]


def _merge(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for low, high in _merge(ranges):
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= _MAX_CODEPOINT:
        out.append((start, _MAX_CODEPOINT))
    return out


def utf8_sequences(low: int, high: int) -> list[list[tuple[int, int]]]:
    """The code points low..high (surrogates left out) as UTF-8 byte-range sequences: each a
    list of (first byte, last byte) per position, every combination a character in range."""
    out, todo = [], [(low, high)]
    while todo:
        low, high = todo.pop()
        if low > high:
            continue
        if low <= 0xDFFF and high >= 0xD800:  # surrogates are not characters
            todo += [(low, 0xD7FF), (0xE000, high)]
            continue
        split = next((b for b in (0x7F, 0x7FF, 0xFFFF) if low <= b < high), None)
        if split is not None:  # one encoded length at a time
            todo += [(low, split), (split + 1, high)]
            continue
        if high <= 0x7F:
            out.append([(low, high)])
            continue
        for i in range(1, len(chr(low).encode())):  # align the continuation bytes
            mask = (1 << (6 * i)) - 1
            if low & ~mask != high & ~mask:
                if low & mask:
                    todo += [(low, low | mask), ((low | mask) + 1, high)]
                    break
                if high & mask != mask:
                    todo += [(low, (high & ~mask) - 1), (high & ~mask, high)]
                    break
        else:
            out.append(list(zip(chr(low).encode(), chr(high).encode(), strict=True)))
    return out
