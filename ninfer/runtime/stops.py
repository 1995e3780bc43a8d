"""Stop strings on a text stream (OpenAI ``stop``): cut the output at the first stop string.

Text arrives in deltas of arbitrary size, and a stop string may be split over several of them
("</ans" + "wer>"). The matcher therefore holds back the longest tail of the stream that is a
proper prefix of some stop string, until the next delta shows whether the stop string completes.

Which stop string wins when several match: the one whose occurrence *ends* first (that is the
first one a token-by-token stream can see complete), and among those ending at the same place,
the longest (it starts earliest and cuts the most). This rule depends only on the text, never on
how it was split into deltas.

Each stop string runs its own Knuth-Morris-Pratt automaton: its state is the length of the longest
prefix of the stop string that the stream currently ends with, which is exactly what must be held
back, and a state equal to the stop string's length is a hit. The failure table is built lazily, one
entry each time the state first gets that far, so memory is linear in the stop strings' total length
(and in practice in how far the stream ever matched them), never quadratic, and a huge stop string
costs nothing until the output actually resembles it. Work per character is amortized constant per
*active* stop string (one the stream currently ends with a prefix of); characters that cannot start
any stop string are skipped by one regular-expression search, at C speed.
"""
from __future__ import annotations

import re
from array import array
from collections import deque
from collections.abc import Iterable


class _StopAutomaton:
    """KMP over one stop string: ``state`` characters of it match the stream's end (0 <= state <= length)."""

    __slots__ = ("stop", "length", "state", "_fail")

    def __init__(self, stop: str) -> None:
        self.stop, self.length = stop, len(stop)
        self.state = 0
        # _fail[i]: length of the longest proper border of stop[:i + 1]. Known up to the longest match seen
        # (the state grows by one character at a time, so each step adds at most one entry); 4 bytes an entry.
        self._fail = array("i", [0])

    @property
    def hit(self) -> bool:
        return self.state == self.length

    def step(self, char: str) -> None:
        """Advance by one character of the stream (never called once the whole stop string matched)."""
        stop, fail, q = self.stop, self._fail, self.state
        while q and stop[q] != char:
            q = fail[q - 1]
        if stop[q] == char:
            q += 1
            if len(fail) < q < self.length:  # fail[q - 1] is needed from now on
                k = fail[q - 2]
                while k and stop[q - 1] != stop[k]:
                    k = fail[k - 1]
                fail.append(k + 1 if stop[q - 1] == stop[k] else k)
        self.state = q

    def pass_hit(self) -> None:
        """After a hit that must not stop the stream: continue as KMP does, from the stop string's longest
        proper border (built here: the table never needed its last entry before)."""
        stop, fail, q = self.stop, self._fail, self.length
        if len(fail) < q:
            k = fail[q - 2] if q > 1 else 0
            while k and stop[q - 1] != stop[k]:
                k = fail[k - 1]
            fail.append(k + 1 if q > 1 and stop[q - 1] == stop[k] else k)
        self.state = fail[q - 1]


class StopStringMatcher:
    """Filters a text stream, holding back possible stop-string prefixes and cutting at a hit.

    ``feed(delta) -> (text, hit)``: ``text`` is safe to emit now; on the hit it is everything
    before the stop string (the stop string itself is dropped unless ``include_stop_str``), and
    every later ``feed`` returns ``("", True)``. ``flush()`` returns the held-back tail at the
    end of a stream that was not stopped. ``matched`` is the stop string that hit, or None.
    Empty stop strings are ignored; with no stop strings the matcher passes text straight through.
    """

    def __init__(self, stop_strings: Iterable[str], *, include_stop_str: bool = False) -> None:
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop_strings if s))
        self.include_stop_str = include_stop_str
        self.matched: str | None = None
        # The held-back tail (the longest suffix that is a proper stop prefix) as pieces, the first one
        # starting at _offset: releasing its front or growing it never copies what stays held.
        self._pending: deque[str] = deque()
        self._offset = 0
        self._held = 0
        self._by_first: dict[str, list[_StopAutomaton]] = {}
        for stop in self.stop_strings:
            self._by_first.setdefault(stop[0], []).append(_StopAutomaton(stop))
        self._active: list[_StopAutomaton] = []  # automata in a state > 0
        self._first_char = re.compile("[" + "".join(map(re.escape, self._by_first)) + "]") if self._by_first else None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str, armed: bool = True) -> tuple[str, bool]:
        """Process the next piece of text; return ``(text safe to emit, stop string hit)``. With ``armed``
        False (``min_tokens`` not reached) a stop string completed in ``delta`` is passed over, while one
        that it only begins can still complete, and stop, in a later armed delta."""
        if self.matched is not None:
            return "", True
        if self._first_char is None:
            return delta, False
        held_before, i, n = self._held, 0, len(delta)
        self._hold(delta)
        while i < n:
            if not self._active:  # nothing to continue: jump to the next character that can start a stop string
                found = self._first_char.search(delta, i)
                if found is None:
                    break
                i = found.start()
            hit = self._advance(delta[i])
            i += 1
            if hit is not None and not armed:
                for a in self._active:
                    if a.hit:
                        a.pass_hit()
                self._active = [a for a in self._active if a.state]
            elif hit is not None:
                self.matched = hit.stop
                end = held_before + i
                out = self._release(end if self.include_stop_str else end - len(hit.stop))
                self._reset()
                return out, True
        keep = max((a.state for a in self._active), default=0)
        return self._release(self._held - keep), False

    def flush(self) -> str:
        """End of stream: the held-back text (``""`` if a stop string hit)."""
        out = self._release(self._held) if self.matched is None else ""
        self._reset()
        return out

    def _advance(self, char: str) -> _StopAutomaton | None:
        """Feed one character to every automaton it concerns; the longest stop string completed by it, if any."""
        hit: _StopAutomaton | None = None
        dropped = False
        for a in self._active:
            a.step(char)
            if a.state == 0:
                dropped = True
            elif a.state == a.length and (hit is None or a.length > hit.length):
                hit = a
        if dropped:
            self._active = [a for a in self._active if a.state]
        # An active automaton whose stop string starts with ``char`` cannot be left in state 0 by it, so
        # those in state 0 here are exactly the ones this character starts.
        for a in self._by_first.get(char, ()):
            if a.state == 0:
                a.step(char)
                self._active.append(a)
                if a.state == a.length and (hit is None or a.length > hit.length):
                    hit = a
        return hit

    def _hold(self, text: str) -> None:
        if text:
            self._pending.append(text)
            self._held += len(text)

    def _release(self, count: int) -> str:
        """The first ``count`` held characters, no longer held."""
        out: list[str] = []
        self._held -= count
        while count:
            piece, off = self._pending[0], self._offset
            take = min(count, len(piece) - off)
            out.append(piece[off:off + take] if off or take < len(piece) else piece)
            count -= take
            if off + take == len(piece):
                self._pending.popleft()
                self._offset = 0
            else:
                self._offset = off + take
        return "".join(out)

    def _reset(self) -> None:
        for a in self._active:
            a.state = 0
        self._active = []
        self._pending.clear()
        self._offset = self._held = 0
