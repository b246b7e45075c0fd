"""The wait list, shared fairly: each tenant's waiting rows in a queue of their own, admitted by
weight, so that one tenant's flood cannot hold another's first token.

A free batch slot goes to the waiting tenant that holds the fewest slots for its weight now
(rows prefilling or decoding over weight): a tenant with nothing running is admitted at the
next free slot however many rows another has waiting, and tenants that all flood end up holding
the batch in proportion to their weights. Between tenants holding alike, start-time fair
queueing on admissions decides: admitting `k` rows of a tenant of weight `w` moves its virtual
finish tag by `k / w`; the tenant whose next start tag (its finish tag, or the clock when it
has fallen behind) is lowest goes first, the older head on a tie. The clock is the start tag of
the rows admitted last, so a tenant back from idle starts level with the others rather than
with credit saved while it was away. With one tenant this is first come, first served.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from hotlora.server.engine.sequences import Row


@dataclass(frozen=True)
class Share:
    """Whose a request is, for the fair share: its tenant's name and weight (> 0)."""

    tenant: str = "default"
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"a tenant's weight must be above 0, not {self.weight}")


DEFAULT_SHARE = Share()


@dataclass(eq=False)
class TenantQueue:
    """One tenant's waiting rows, oldest first, with the sequence number each arrived with."""

    share: Share
    rows: deque[tuple[int, Row]] = field(default_factory=deque)
    finish: float = 0.0  # virtual finish tag of the rows admitted last

    @property
    def head(self) -> Row:
        return self.rows[0][1]


class FairQueue:
    """Rows waiting for the batch, one FIFO per tenant; `pick()` says whose go next."""

    def __init__(self) -> None:
        self._queues: dict[str, TenantQueue] = {}
        self._clock = 0.0
        self._arrivals = itertools.count()

    def extend(self, rows: Iterable[Row], share: Share = DEFAULT_SHARE) -> None:
        """Queue rows behind the tenant's own waiting rows (its latest weight applies)."""
        queue = self._queues.get(share.tenant)
        if queue is None:
            queue = self._queues[share.tenant] = TenantQueue(share)
        queue.share = share
        queue.rows.extend((next(self._arrivals), row) for row in rows)

    def pick(self, held: Mapping[str, int] | None = None) -> TenantQueue | None:
        """The queue whose head is admitted next, given the batch slots each tenant `held`;
        None when nothing waits."""
        held = held or {}
        waiting = [q for q in self._queues.values() if q.rows]
        if not waiting:
            return None
        return min(
            waiting,
            key=lambda q: (
                held.get(q.share.tenant, 0) / q.share.weight,
                max(q.finish, self._clock),
                q.rows[0][0],
            ),
        )

    def admit(self, queue: TenantQueue, count: int) -> list[Row]:
        """Take `count` rows from the head of `queue` (as `pick()` gave it), charging its
        tenant for as many batch slots."""
        start = max(queue.finish, self._clock)
        queue.finish = start + count / queue.share.weight
        self._clock = start
        rows = [queue.rows.popleft()[1] for _ in range(count)]
        self._forget_idle()
        return rows

    def keep(self, live: Callable[[list[Row]], list[Row]]) -> None:
        """Keep, in each tenant's queue, the rows `live` returns from it (in order)."""
        for queue in self._queues.values():
            numbers = {id(row): number for number, row in queue.rows}
            queue.rows = deque((numbers[id(row)], row) for row in live([r for _, r in queue.rows]))
        self._forget_idle()

    def clear(self) -> list[Row]:
        """Empty every queue; returns the rows they held."""
        rows = list(self)
        self._queues.clear()
        return rows

    def waiting_tenants(self) -> dict[str, int]:
        """Rows waiting, per tenant that has any."""
        return {name: len(q.rows) for name, q in self._queues.items() if q.rows}

    def _forget_idle(self) -> None:
        # A tenant with nothing waiting and no slots charged beyond the clock is level with a
        # newcomer: its tag can go (the table stays as small as the tenants with work).
        for name in [n for n, q in self._queues.items() if not q.rows and q.finish <= self._clock]:
            del self._queues[name]

    def __iter__(self) -> Iterator[Row]:
        for queue in self._queues.values():
            for _, row in queue.rows:
                yield row

    def __len__(self) -> int:
        return sum(len(q.rows) for q in self._queues.values())

    def __bool__(self) -> bool:
        return any(q.rows for q in self._queues.values())
