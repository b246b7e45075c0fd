"""Stop sequences on streamed text: nothing past or inside a stop sequence is ever emitted."""

from __future__ import annotations


class StopMatcher:
    """Holds back the tail of the text that could still grow into a stop sequence.

    Text arrives in token-sized deltas, so a stop sequence may span several tokens; the tail
    that is a prefix of some stop sequence stays pending until it is ruled out.
    """

    def __init__(self, stops: list[str]):
        self.stops = [stop for stop in stops if stop]
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add text; return what is now safe to emit. Sets `stopped` when a stop is reached."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        self.pending += delta
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = self._held_back()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        """The end of generation: pending text can no longer become a stop sequence."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _first_stop(self) -> int | None:
        hits = [i for i in (self.pending.find(stop) for stop in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest suffix of pending text that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:size]):
                    best = size
                    break
        return best
