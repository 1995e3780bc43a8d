"""Stop strings on a text stream (OpenAI ``stop``): cut the output at the first stop string.

Text arrives in deltas of arbitrary size, and a stop string may be split over several of them
("</ans" + "wer>"). The matcher therefore holds back the longest tail of the stream that is a
proper prefix of some stop string, until the next delta shows whether the stop string completes.

Which stop string wins when several match: the one whose occurrence *ends* first (that is the
first one a token-by-token stream can see complete), and among those ending at the same place,
the longest (it starts earliest and cuts the most). This rule depends only on the text, never on
how it was split into deltas.

Cost per delta: one ``str.find`` per stop string over (held-back tail + delta), plus a suffix
check bounded by the longest stop string.
"""
from __future__ import annotations

from collections.abc import Iterable


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
        self._pending = ""  # held-back tail: the longest suffix that is a proper stop prefix
        # Every proper prefix of every stop string, and the characters they can start with.
        self._prefixes = frozenset(s[:k] for s in self.stop_strings for k in range(1, len(s)))
        self._first_chars = frozenset(s[0] for s in self.stop_strings)
        self._max_hold = max((len(s) for s in self.stop_strings), default=1) - 1

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Process the next piece of text; return ``(text safe to emit, stop string hit)``."""
        if self.matched is not None:
            return "", True
        if not self.stop_strings:
            return delta, False
        text = self._pending + delta
        # The held-back tail contains no complete stop string (it would have hit already) and
        # every stop string that can still complete starts inside it or later, so searching
        # ``text`` finds exactly the occurrences that end in this delta.
        best: tuple[int, int, str] | None = None  # (end, -length, stop) of the winning match
        for stop in self.stop_strings:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is not None:
            end, _, stop = best
            self.matched = stop
            self._pending = ""
            return text[:end] if self.include_stop_str else text[:end - len(stop)], True
        hold = self._held_suffix_len(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """End of stream: the held-back text (``""`` if a stop string hit)."""
        out, self._pending = ("" if self.matched is not None else self._pending), ""
        return out

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        n = len(text)
        for k in range(min(n, self._max_hold), 0, -1):
            if text[n - k] in self._first_chars and text[n - k:] in self._prefixes:
                return k
        return 0
