"""Room at the connection limit: which connection makes way for a new one, and when a new one is
refused."""

from __future__ import annotations

import asyncio
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from uvicorn.server import ServerState

from hotlora.server.http import connections
from hotlora.server.http.connections import UNFINISHED_PER_PEER, make_room
from hotlora.server.http.lifecycle import BoundedH11Protocol, ClientTimeouts, ServerConfig

from tests.support.sockets import closed


@dataclass(eq=False)
class Conn:
    peer: str | None
    unfinished_since: int | None  # None: answering a request
    open: bool = True

    def make_way(self) -> None:
        assert self.open, "closed twice"
        self.open = False


@pytest.fixture(autouse=True)
def fresh_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connections, "_record", connections._Record())


def test_at_the_limit_the_oldest_unfinished_connection_makes_way():
    held = [Conn("10.0.0.1", 5), Conn("10.0.0.2", None), Conn("10.0.0.3", 2)]
    new = Conn("10.0.0.9", 9)
    assert make_room(new, [*held, new], limit=3)
    assert [c.open for c in held] == [True, True, False]  # 10.0.0.3 waited longest


def test_below_the_limit_nothing_is_closed():
    held = [Conn("10.0.0.1", 5), Conn("10.0.0.3", 2)]
    new = Conn("10.0.0.9", 9)
    assert make_room(new, [*held, new], limit=3)
    assert all(c.open for c in held)


def test_connections_already_closing_hold_no_place():
    held = [Conn("10.0.0.1", 1, open=False), Conn("10.0.0.2", None), Conn("10.0.0.3", 2)]
    new = Conn("10.0.0.9", 9)
    assert make_room(new, [*held, new], limit=3)
    assert held[2].open


def test_a_newcomer_is_refused_when_every_connection_is_answering(
    caplog: pytest.LogCaptureFixture,
):
    held = [Conn(f"10.0.0.{i}", None) for i in range(3)]
    new = Conn("10.0.0.9", 9)
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        assert not make_room(new, [*held, new], limit=3)
    assert all(c.open for c in held)
    assert "refused 1 new connections: every connection is answering" in caplog.text


def test_at_the_limit_an_address_over_its_cap_makes_way_first():
    """A flood from one address pays for itself: its oldest goes, not another's older one; an
    address within its cap (a proxy's pool) is no flood, and the oldest overall goes."""
    others = [Conn("10.0.0.2", 0), Conn("10.0.0.3", 1)]  # idle, the oldest
    flood = [Conn("10.0.0.1", 10 + i) for i in range(5)]
    new = Conn("10.0.0.1", 100)
    assert make_room(new, [*others, *flood, new], limit=7, per_peer=4)
    assert [c.open for c in [*others, *flood]] == [True, True, False] + [True] * 4
    assert make_room(new, [*others, *flood, new], limit=6, per_peer=4)  # 4 left: within
    assert [c.open for c in [*others, *flood]] == [False, True, False] + [True] * 4


def test_one_address_holds_a_bounded_number_of_unfinished_connections(
    caplog: pytest.LogCaptureFixture,
):
    mine = [Conn("10.0.0.1", i) for i in range(UNFINISHED_PER_PEER)]
    busy = [Conn("10.0.0.1", None) for _ in range(4)]  # answering: not counted
    others = [Conn("10.0.0.2", -1)]  # older, but another address's
    new = Conn("10.0.0.1", 100)
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        assert make_room(new, [*others, *busy, *mine, new], limit=1000)
        assert all(c.open for c in mine)  # none counted yet: a burst's requests may be unread
        everyone = [*others, *busy, *mine, new]
        connections.keep_to_the_cap("10.0.0.1", 100, everyone, UNFINISHED_PER_PEER)
    assert [c.open for c in mine] == [False] + [True] * (UNFINISHED_PER_PEER - 1)
    assert all(c.open for c in [*others, *busy])
    assert "closed 1 connections that had not sent a whole request" in caplog.text
    assert "most from 10.0.0.1: 1" in caplog.text


def test_the_log_says_it_at_once_then_at_most_every_few_seconds(
    caplog: pytest.LogCaptureFixture,
):
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        for i in range(50):
            held = [Conn("10.0.0.1", i)]
            new = Conn("10.0.0.2", 100)
            assert make_room(new, [*held, new], limit=1)
            assert not held[0].open
    assert len(caplog.records) == 1


def test_the_cap_counts_only_connections_that_had_their_time():
    """A hundred clients that connect at once are taken in before any request is read. The
    look a second after an earlier arrival counts none of them (they came after it); the look
    after their own arrival finds their requests in, and counts only those that sent none."""
    early = Conn("10.0.0.1", 0)
    burst = [Conn("10.0.0.1", 10 + i) for i in range(3 * UNFINISHED_PER_PEER)]
    everyone = [early, *burst]
    for conn in everyone:
        assert make_room(conn, everyone, limit=1000)
    connections.keep_to_the_cap("10.0.0.1", 0, everyone, UNFINISHED_PER_PEER)  # early's look
    assert all(c.open for c in everyone)
    for conn in burst[UNFINISHED_PER_PEER + 1 :]:
        conn.unfinished_since = None  # its request read, and being answered
    last = burst[-1]
    connections.keep_to_the_cap("10.0.0.1", 10 + len(burst) - 1, everyone, UNFINISHED_PER_PEER)
    # 34 silent (early and 33 of the burst) against a cap of 32: the two oldest go.
    assert [c.open for c in everyone] == [False, False] + [True] * (len(everyone) - 2)
    assert last.open
    connections.keep_to_the_cap("10.0.0.1", 10_000, everyone, 0)  # no cap
    assert sum(not c.open for c in everyone) == 2


def test_a_line_owed_is_said_when_its_time_comes(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(connections, "LOG_EVERY_S", 0.2)

    async def two_closed_at_once() -> None:
        for i in range(2):
            held = [Conn("10.0.0.1", i)]
            new = Conn("10.0.0.2", 100)
            assert make_room(new, [*held, new], limit=1)
        await asyncio.sleep(0.4)  # nothing more happens

    with caplog.at_level(logging.WARNING, logger="hotlora"), ThreadPoolExecutor(1) as thread:
        thread.submit(asyncio.run, two_closed_at_once()).result()  # a loop of its own
    said = [r.getMessage() for r in caplog.records]
    assert [line.split(" that")[0] for line in said] == ["closed 1 connections"] * 2


@pytest.mark.parametrize("per_peer", [4, 0])
def test_the_per_address_cap_is_set_or_off(per_peer: int):
    """`--max-unfinished-per-address`: a proxy's keep-alive pool shares one address; 0 lets it
    keep every idle connection, and the connection limit alone makes way."""
    pool = [Conn("10.0.0.9", i) for i in range(40)]  # idle between requests
    new = Conn("10.0.0.9", 100)
    assert make_room(new, [*pool, new], limit=1000, per_peer=per_peer)
    connections.keep_to_the_cap("10.0.0.9", 100, [*pool, new], per_peer)
    closed = sum(not c.open for c in pool)
    assert closed == (40 - per_peer + 1 if per_peer else 0)
    if not per_peer:
        assert make_room(new, [*pool, new], limit=40, per_peer=0)
        assert [c.open for c in pool] == [False] + [True] * 39


def test_connections_taken_in_one_loop_iteration_make_way_oldest_first(
    monkeypatch: pytest.MonkeyPatch,
):
    """uvloop reads its clock once a loop iteration: connections accepted together must still
    be told apart by their arrival, so that the oldest make way and never the newest."""
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.setattr(connections, "SETTLE_S", 0.1)
    per_peer, count = 4, 24
    config = ServerConfig(
        _no_app, timeouts=ClientTimeouts(), max_connections=1000, unfinished_per_peer=per_peer
    )
    loop = uvloop.new_event_loop()
    state = ServerState()
    try:
        server = loop.run_until_complete(
            loop.create_server(
                lambda: BoundedH11Protocol(config, state, {}, loop), "127.0.0.1", 0, backlog=64
            )
        )
        port = server.sockets[0].getsockname()[1]
        # Connected and half-sent while the loop is stopped: all wait in the backlog, and the
        # loop then takes them in one iteration.
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
        for client in clients:
            client.sendall(b"GET / HTTP/1.1\r\nHo")
        loop.run_until_complete(asyncio.sleep(0.5))  # counted, and the cap kept
        orders = sorted(c.unfinished_since for c in state.connections)
        assert len(set(orders)) == len(orders) == per_peer  # the others closed
        expected = [True] * (count - per_peer) + [False] * per_peer
        assert [closed(c, wait=0.2) for c in clients] == expected
        for client in clients:
            client.close()
        server.close()
        loop.run_until_complete(server.wait_closed())
    finally:
        loop.close()


async def _no_app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("no request is ever whole")
