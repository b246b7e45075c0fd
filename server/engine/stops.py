"""Stop sequences on streamed text: nothing past or inside a stop sequence is ever emitted."""

from __future__ import annotations


class StopMatcher:
    """Holds back the tail of the text that could still grow into a stop sequence.

    Text arrives in token-sized deltas, so a stop sequence may span several tokens; the tail
    that is a prefix of some stop sequence stays pending until it is ruled out.
    """

    def __init__(self, stops: list[str], *, include: bool = False):
        self.stops = [stop for stop in stops if stop]
        self.include = include  # the stop sequence itself is emitted, and nothing after it
        self.pending = ""
        self.stopped = False
        self.emitted = 0  # UTF-8 bytes returned so far: the text a client has, at its size

    def feed(self, delta: str, *, armed: bool = True) -> str:
        """Add text; return what is now safe to emit. Sets `stopped` when a stop is reached.
        Text fed while not `armed` goes out unchecked (vLLM's `min_tokens`)."""
        if self.stopped:
            return ""
        if not self.stops:
            return self._emit(delta)
        if not armed:
            out, self.pending = self.pending + delta, ""
            return self._emit(out)
        self.pending += delta
        found = self._first_stop()
        if found is not None:
            cut, stop = found
            self.stopped = True
            end = cut + len(stop) if self.include else cut
            out, self.pending = self.pending[:end], ""
            return self._emit(out)
        keep = self._held_back()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return self._emit(out)

    def flush(self) -> str:
        """The end of generation: pending text can no longer become a stop sequence."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return self._emit(out)

    def _emit(self, out: str) -> str:
        """`out`, counted into `emitted`."""
        self.emitted += len(out.encode())
        return out

    def _first_stop(self) -> tuple[int, str] | None:
        """Where the earliest stop sequence starts in the pending text, and which it is (the
        longest of those starting there)."""
        hits = [
            (at, -len(stop), stop) for stop in self.stops if (at := self.pending.find(stop)) >= 0
        ]
        if not hits:
            return None
        at, _, stop = min(hits)
        return at, stop

    def _held_back(self) -> int:
        """Length of the longest suffix of pending text that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:size]):
                    best = size
                    break
        return best
