"""Stop strings found in streamed text in one pass: an Aho-Corasick automaton over them.

A `StopAutomaton` is built once per set of stop strings (and shared: it is immutable); a
`StopMatcher` walks it over a request's output text as it is decoded, chunk by chunk.
Each character is read once, so the work per token is its own text (plus at most the
longest stop string of fail-link steps), whatever the output's length or the number of
stop strings. After a chunk the matcher knows:

- the earliest stop string that ends in the text so far (where the output is cut), and
- `num_held`: the longest end of the text that is the start of a stop string, which may
  not be streamed yet (the automaton's state is exactly that end).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from functools import lru_cache


class StopAutomaton:
    """The trie of the stop strings with fail links (immutable once built).

    State 0 is the root (the empty string); state s stands for the string of `depth[s]`
    characters that spells its path from the root. Flat arrays and one dict of edges
    keep it near 130 bytes a state (a state per character of the stop strings)."""

    def __init__(self, stops: Sequence[str]):
        assert all(stops), f"stop strings must not be empty: {stops!r}"
        self.edges: dict[int, int] = {}  # _key(state, char) -> next state (trie edges)
        self.depth = array("l", [0])  # state -> characters of its string
        children: list[list[tuple[int, int]]] = [[]]  # state -> (char, state): build only
        is_stop = [False]
        for s in stops:
            state = 0
            for ch in s:
                key = _key(state, ord(ch))
                child = self.edges.get(key)
                if child is None:
                    child = self.edges[key] = len(self.depth)
                    self.depth.append(self.depth[state] + 1)
                    children[state].append((ord(ch), child))
                    children.append([])
                    is_stop.append(False)
                state = child
            is_stop[state] = True
        # fail[s]: the longest proper suffix of s's string that is a state;
        # match_len[s]: the longest stop string that is a suffix of s's string (0 = none)
        self.fail = array("l", [0]) * len(self.depth)
        self.match_len = array("l", [0]) * len(self.depth)
        queue = deque(child for _, child in children[0])
        while queue:  # breadth first: a state's fail link is shallower, so already set
            state = queue.popleft()
            f = self.fail[state]
            self.match_len[state] = self.depth[state] if is_stop[state] else self.match_len[f]
            for o, child in children[state]:
                self.fail[child] = self.step(f, o) if state else 0
                queue.append(child)

    def step(self, state: int, o: int) -> int:
        """The state after reading the character of code point `o` in `state`."""
        edges, fail = self.edges, self.fail
        while (nxt := edges.get(_key(state, o))) is None:
            if not state:
                return 0
            state = fail[state]
        return nxt


def _key(state: int, o: int) -> int:
    return state << 21 | o  # NOTE: code points are below 2**21


@lru_cache(maxsize=32)
def create_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of `stops`, built once for every request that names the same ones."""
    return StopAutomaton(stops)


class StopMatcher:
    """Where one stream of text meets its stop strings. Mutated by `feed`."""

    def __init__(self, stops: tuple[str, ...]):
        self.automaton = create_automaton(stops)
        self.state = 0
        self.num_chars = 0  # characters fed so far

    @property
    def num_held(self) -> int:
        """Characters at the end of the text fed that may begin a stop string."""
        return self.automaton.depth[self.state]

    def feed(self, text: str) -> int | None:
        """Read `text` (what follows the text fed before); return where the earliest stop
        string that ends in it starts, as an offset into the whole text fed, or None.
        NOTE: one that ends in an earlier chunk was returned then; such a start is never
        before `num_chars - num_held` of the previous call."""
        a, state, start = self.automaton, self.state, None
        for i, ch in enumerate(text, self.num_chars + 1):  # i: characters read with ch
            state = a.step(state, ord(ch))
            if a.match_len[state] and (start is None or i - a.match_len[state] < start):
                start = i - a.match_len[state]
        self.state = state
        self.num_chars += len(text)
        return start
