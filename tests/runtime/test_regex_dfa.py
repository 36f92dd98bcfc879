"""runtime.regex_parse / runtime.regex_dfa: UTF-8 ranges cover exactly their code points; the
lazy DFA accepts what re.fullmatch (ASCII classes) does, keeps every prefix of a match alive,
and refuses what no automaton has, naming where."""

from __future__ import annotations

import random
import re

import pytest

from runtime.regex_dfa import DEAD, RegexDFA
from runtime.regex_parse import RegexError, utf8_sequences


@pytest.mark.parametrize("low, high", [(0, 0x10FFFF), (0x41, 0x5A), (0x7F, 0x800),
                                       (0xD000, 0xE100), (0x80, 0x7FF), (0x3B1, 0x3C9),
                                       (0xFFF0, 0x10010), (0x10000, 0x10FFFF)])
def test_utf8_sequences_cover_exactly_the_range(low: int, high: int) -> None:
    sequences = utf8_sequences(low, high)
    points = [c for c in range(low, high + 1) if not 0xD800 <= c <= 0xDFFF]
    for c in random.Random(low).sample(points, min(len(points), 3000)):
        encoded = chr(c).encode()
        assert sum(len(s) == len(encoded) and all(a <= b <= z for b, (a, z) in zip(
            encoded, s, strict=True)) for s in sequences) == 1, hex(c)
    combinations = 0
    for s in sequences:
        count = 1
        for a, z in s:
            count *= z - a + 1
        combinations += count
    assert combinations == len(points)  # nothing else: every combination is in the range


PATTERNS = [r"\d{3}-\d{4}", r"(yes|no)", r"[A-Z][a-z]+( [A-Z][a-z]+)*",
            r'\{"name": "[^"]*", "age": \d+\}', r"[а-яё]+!", r"a.c", r"(ab)*c?", r"x{2,4}y",
            r"\w+@\w+\.com", r"[^a-z]{1,3}", r"(?:foo|bar){0,2}?baz", r"^\s*\S+\s*$",
            r"[\d\-.]+", r"é|ü+", r"a{,2}", r"a{,}b", r"a{x}", r"\Aa(?P<n>b|c)+\Z", r"[]a]+",
            r"[\]\\]x", r"\u00e9\x41"]
ALPHABET = "abcxyz0123456789-@.comAZ éü!{}\":,nameagefoobarbazyesnoйаяё\n]\\{,2}A"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_dfa_accepts_what_fullmatch_accepts(pattern: str) -> None:
    dfa, compiled = RegexDFA(pattern), re.compile(pattern, re.ASCII)
    rng = random.Random(pattern)
    matched = 0
    for _ in range(4000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 10)))
        data = text.encode()
        assert dfa.accepting(dfa.walk(dfa.start, data)) == bool(compiled.fullmatch(text)), text
        if compiled.fullmatch(text):
            matched += 1
            assert all(dfa.walk(dfa.start, data[:k]) != DEAD for k in range(len(data) + 1))
    if pattern in (r"(ab)*c?", r"[^a-z]{1,3}", r"[\d\-.]+"):
        assert matched > 0


def test_dead_is_exactly_where_no_match_can_start() -> None:
    """A finite language: a prefix is alive iff some word starts with it, byte by byte (inside
    characters too)."""
    words = ["Zürich", "Zug", "Paris", "Par", "пари"]
    dfa = RegexDFA("|".join(map(re.escape, words)))
    encoded = [w.encode() for w in words]
    prefixes = {w[:k] for w in encoded for k in range(len(w) + 1)}
    for data in prefixes | {b"Zx", b"Pari", b"Parisx", b"\xd0", b"\xd0\xbf\xd0", b"z"}:
        state = dfa.walk(dfa.start, data)
        assert (state != DEAD) == (data in prefixes), data
        assert dfa.accepting(state) == (data in encoded)


@pytest.mark.parametrize("pattern, message", [
    ("(a", "at position 0: missing ')'"), ("a)", "at position 1: unbalanced ')'"),
    (r"(\w)\1", r"at position 4: \1 is a backreference"),
    ("(?=a)b", "at position 0: only (?: ) and (?P<name> ) groups: lookarounds, inline flags"),
    ("(?i)ab", "at position 0: only (?: ) and (?P<name> ) groups"),
    ("[a", "missing ']'"), ("*a", "at position 0: nothing to repeat before '*'"),
    ("a{3,2}", "the maximum is below the minimum"),
    (r"x\bword", r"at position 1: \b (a word boundary) is not supported"),
    ("a^b", "at position 1: ^ only at the start"), ("a$b", "at position 1: $ only at the end"),
    (r"a\Ab", r"at position 1: \A only at the start"), ("[z-a]", "below its start"),
    ("a{1001}", "at most 1000 repeats"),
    ("\\", "at position 0: a pattern cannot end with a backslash"),
    (r"\N{EM DASH}", r"at position 0: \N is not supported"),
])
def test_what_no_automaton_has_is_refused(pattern: str, message: str) -> None:
    with pytest.raises(RegexError, match=re.escape(message)):
        RegexDFA(pattern)
