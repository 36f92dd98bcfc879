"""A regular expression as a byte-level automaton, for guided decoding (runtime.guided).

The whole completion must match (as Python's re.fullmatch). Supported: literals, `.` (any
character but a newline), classes `[a-z0-9_]`, `[^"]` (any Unicode ranges), the escapes
\\d \\w \\s \\D \\W \\S (ASCII sets, as re.ASCII reads them) and \\n \\t \\r \\f \\v \\uXXXX
\\xXX, groups `( )`, `(?: )` and `(?P<name> )`, `|`, and the quantifiers * + ? {n} {n,} {n,m}
(lazy ones too: a full match's language is the same). ^ / \\A and $ / \\Z are accepted at the
ends. Backreferences, lookarounds and word boundaries are refused (no finite automaton has
them), and so are inline flags, atomic groups, conditionals and \\N{...}.

Characters are matched as their UTF-8 bytes, so a token that ends inside a character is fine:
the automaton is in the middle of that character's bytes. Thompson's construction gives an NFA
over byte ranges; the DFA is built lazily, one transition at a time, from sets of NFA states
that can still reach the end (so the empty set, -1 here, is the only dead state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.regex_parse import parse, utf8_sequences

DEAD = -1
_UNKNOWN = -2  # a transition not built yet


@dataclass
class _NFA:
    eps: list[list[int]] = field(default_factory=list)
    edges: list[list[tuple[int, int, int]]] = field(default_factory=list)  # (lo, hi, to)

    def new(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node: tuple) -> tuple[int, int]:
        """(start, end) of a fragment for `node`."""
        kind = node[0]
        start, end = self.new(), self.new()
        if kind == "set":
            for low, high in node[1]:
                for seq in utf8_sequences(low, high):
                    at = start
                    for k, (lo, hi) in enumerate(seq):
                        to = end if k == len(seq) - 1 else self.new()
                        self.edges[at].append((lo, hi, to))
                        at = to
        elif kind == "cat":
            at = start
            for item in node[1]:
                s, e = self.build(item)
                self.eps[at].append(s)
                at = e
            self.eps[at].append(end)
        elif kind == "alt":
            for item in node[1]:
                s, e = self.build(item)
                self.eps[start].append(s)
                self.eps[e].append(end)
        else:  # rep
            _, item, low, high = node
            at = start
            for _ in range(low):
                s, e = self.build(item)
                self.eps[at].append(s)
                at = e
            if high is None:
                s, e = self.build(item)
                self.eps[at] += [s, end]
                self.eps[e] += [s, end]
            else:
                for _ in range(high - low):
                    s, e = self.build(item)
                    self.eps[at] += [s, end]
                    at = e
            self.eps[at].append(end)
        return start, end


class RegexDFA:
    """The lazily built DFA of a pattern: states are ints (DEAD = -1), step() one byte."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        nfa = _NFA()
        start, self._accept = nfa.build(parse(pattern))
        self._nfa = nfa
        self._live = self._can_reach_end()
        self._sets: list[frozenset[int]] = []
        self._ids: dict[frozenset[int], int] = {}
        self._next: list[dict[int, int]] = []
        # the transitions built so far as an array too, for walk_many
        self._table = np.full((16, 256), _UNKNOWN, dtype=np.int32)
        self.start = self._state(self._closure({start}))

    def _can_reach_end(self) -> frozenset[int]:
        back: dict[int, list[int]] = {}
        for q, targets in enumerate(self._nfa.eps):
            for t in targets:
                back.setdefault(t, []).append(q)
        for q, edges in enumerate(self._nfa.edges):
            for _, _, t in edges:
                back.setdefault(t, []).append(q)
        live, todo = {self._accept}, [self._accept]
        while todo:
            for q in back.get(todo.pop(), ()):
                if q not in live:
                    live.add(q)
                    todo.append(q)
        return frozenset(live)

    def _closure(self, states: set[int]) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for t in self._nfa.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen & self._live)

    def _state(self, states: frozenset[int]) -> int:
        if not states:
            return DEAD
        found = self._ids.get(states)
        if found is None:
            found = self._ids[states] = len(self._sets)
            self._sets.append(states)
            self._next.append({})
            if found >= len(self._table):
                self._table = np.concatenate([self._table, np.full_like(self._table,
                                                                        _UNKNOWN)])
        return found

    def step(self, state: int, byte: int) -> int:
        if state == DEAD:
            return DEAD
        table = self._next[state]
        found = table.get(byte)
        if found is None:
            targets = {to for q in self._sets[state] for lo, hi, to in self._nfa.edges[q]
                       if lo <= byte <= hi}
            found = table[byte] = self._state(self._closure(targets))
            self._table[state, byte] = found
        return found

    def walk(self, state: int, data: bytes) -> int:
        for byte in data:
            state = self.step(state, byte)
            if state == DEAD:
                break
        return state

    def walk_many(self, state: int, data: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """For each row of `data` ([n, width] uint8, row i's first lengths[i] bytes), whether
        the DFA is still alive after walking them from `state`: all rows a byte position at a
        time, transitions looked up in an array (those not built yet are built first)."""
        cur = np.full(len(data), state, dtype=np.int32)
        alive = np.ones(len(data), dtype=bool)
        for k in range(data.shape[1]):
            rows = np.flatnonzero(alive & (lengths > k))
            if not rows.size:
                break
            states, column = cur[rows], data[rows, k]
            found = self._table[states, column]
            if (unknown := found == _UNKNOWN).any():
                for s, b in set(zip(states[unknown].tolist(), column[unknown].tolist(),
                                    strict=True)):
                    self.step(s, b)
                found = self._table[states, column]
            cur[rows] = found
            alive[rows] = found != DEAD
        return alive

    def accepting(self, state: int) -> bool:
        return state != DEAD and self._accept in self._sets[state]

    @property
    def num_states(self) -> int:
        return len(self._sets)
