"""Room at the connection limit: a new connection takes the place of an old one that has not
sent a whole request, so that clients holding half-sent requests cannot lock others out.

Before a request's headers are in, nothing says whose it is: no key, no tenant. What is fair
then is by address and arrival. One address keeps at most `per_peer` connections that have not
sent a whole request (`--max-unfinished-per-address`, 0: no cap): `SETTLE_S` after each of its
arrivals, those that have waited that long are counted and its oldest beyond the cap make way.
A burst of clients that connect at once and send their requests at once is taken in before any
request is read, and they look alike until then. At `--max-connections` the oldest unfinished
connection makes way, the oldest of the address holding the most when that is over its cap, so
that a flood from one address pays for itself. A connection whose request is in and being
answered is never closed for another; when every connection is such, the newcomer is closed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Collection
from typing import Protocol

log = logging.getLogger("hotlora")

UNFINISHED_PER_PEER = 32  # the default of connections one address may hold without a request
# How long after a connection arrives its address's unfinished connections are counted: time for
# the requests of a burst that arrived with it to be read.
SETTLE_S = 1.0
LOG_EVERY_S = 10.0  # one line at most this often, however many connections make way

# The order connections begin to wait on their clients. Not the event loop's clock: uvloop's
# `time()` is read once a loop iteration (in milliseconds), so connections taken in one
# iteration would tie and the oldest among them be any.
_waits = itertools.count()


def waiting_order() -> int:
    """A number larger than every one given before: when a connection begins to wait."""
    return next(_waits)


class Holder(Protocol):
    """A connection as the limit sees it."""

    @property
    def open(self) -> bool:
        """Not closed nor closing: it holds a place."""
        ...

    @property
    def peer(self) -> str | None:
        """The client's address (its host, without the port)."""
        ...

    @property
    def unfinished_since(self) -> int | None:
        """Since when (a `waiting_order()`) it holds its place without a whole request sent:
        connected or answered and silent since, or part of a request sent; None while a
        request is in and being answered."""
        ...

    def make_way(self) -> None:
        """Close it for a newcomer (a request whose headers are in gets a 408)."""
        ...


def make_room(
    new: Holder, connections: Collection[Holder], limit: int, per_peer: int = UNFINISHED_PER_PEER
) -> bool:
    """Close what must close for `new` to stay within `limit`: the oldest unfinished connection,
    of the address that holds the most when it holds more than `per_peer` (0: no cap). False
    when nothing can make way and `new` must be refused. `connections` may hold `new` itself
    and connections already closing."""
    others = [c for c in connections if c is not new and c.open]
    if len(others) < limit:
        return True
    unfinished = sorted(
        (since, i) for i, c in enumerate(others) if (since := c.unfinished_since) is not None
    )
    if not unfinished:
        _record.refused()
        return False
    held = Counter(others[i].peer for _, i in unfinished)
    peer, most = held.most_common(1)[0]
    flooding = per_peer > 0 and most > per_peer
    oldest = next(others[i] for _, i in unfinished if not flooding or others[i].peer == peer)
    _record.made_way(oldest, "limit")
    oldest.make_way()
    return True


def keep_to_the_cap(
    peer: str | None, arrived: int, connections: Collection[Holder], per_peer: int
) -> None:
    """`SETTLE_S` after a connection from `peer` arrived (at `waiting_order()` `arrived`): of
    the address's connections that have waited since then or longer without a whole request,
    it keeps `per_peer`, its oldest making way; nothing when there is no cap (0). Those that
    began waiting since are not counted yet: a burst's requests may still be unread."""
    if per_peer <= 0 or peer is None:
        return
    waiting = [(c.unfinished_since, c) for c in connections if c.open and c.peer == peer]
    mine = sorted(
        ((since, c) for since, c in waiting if since is not None and since <= arrived),
        key=lambda pair: pair[0],
    )
    for _, connection in mine[: max(0, len(mine) - per_peer)]:
        _record.made_way(connection, "per_peer")
        connection.make_way()


class _Record:
    """Counts connections closed to make room and newcomers refused; says so at once, then in
    one line at most every `LOG_EVERY_S` (what happened since the last line)."""

    def __init__(self) -> None:
        self._reset(time.monotonic() - LOG_EVERY_S)
        self._later: asyncio.TimerHandle | None = None  # the line owed, once its time comes

    def _reset(self, now: float) -> None:
        self.reasons: Counter[str] = Counter()
        self.peers: Counter[str] = Counter()
        self.refusals = 0
        self.logged = now

    def made_way(self, connection: Holder, reason: str) -> None:
        self.reasons[reason] += 1
        self.peers[connection.peer or "?"] += 1
        self._flush()

    def refused(self) -> None:
        self.refusals += 1
        self._flush()

    def _flush(self) -> None:
        now = time.monotonic()
        if now - self.logged < LOG_EVERY_S:
            self._flush_later(self.logged + LOG_EVERY_S - now)
            return
        if self.reasons:
            peer, most = self.peers.most_common(1)[0]
            log.warning(
                "closed %d connections that had not sent a whole request, to make room for new "
                "ones (%d at --max-connections, %d beyond --max-unfinished-per-address from one "
                "address; most from %s: %d): a client opens connections and does not send its "
                "requests",
                sum(self.reasons.values()),
                self.reasons["limit"],
                self.reasons["per_peer"],
                peer,
                most,
            )
        if self.refusals:
            log.warning(
                "refused %d new connections: every connection is answering a request "
                "(--max-connections); raise it if the machine can serve more at once",
                self.refusals,
            )
        self._reset(now)

    def _flush_later(self, delay: float) -> None:
        """What happened since the last line is said once its time comes, whether or not
        anything more happens by then."""
        if self._later is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the server's loop (a check of the rule alone)
        self._later = loop.call_later(delay, self._flush_owed)

    def _flush_owed(self) -> None:
        self._later = None
        self._flush()


_record = _Record()
