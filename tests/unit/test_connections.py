"""Room at the connection limit: which connection makes way for a new one, and when a new one is
refused."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from hotlora.server.http import connections
from hotlora.server.http.connections import UNFINISHED_PER_PEER, make_room


@dataclass(eq=False)
class Conn:
    peer: str | None
    unfinished_since: float | None  # None: answering a request
    open: bool = True

    def make_way(self) -> None:
        assert self.open, "closed twice"
        self.open = False


@pytest.fixture(autouse=True)
def fresh_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connections, "_record", connections._Record())


def test_at_the_limit_the_oldest_unfinished_connection_makes_way():
    held = [Conn("10.0.0.1", 5.0), Conn("10.0.0.2", None), Conn("10.0.0.3", 2.0)]
    new = Conn("10.0.0.9", 9.0)
    assert make_room(new, [*held, new], limit=3)
    assert [c.open for c in held] == [True, True, False]  # 10.0.0.3 waited longest


def test_below_the_limit_nothing_is_closed():
    held = [Conn("10.0.0.1", 5.0), Conn("10.0.0.3", 2.0)]
    new = Conn("10.0.0.9", 9.0)
    assert make_room(new, [*held, new], limit=3)
    assert all(c.open for c in held)


def test_connections_already_closing_hold_no_place():
    held = [Conn("10.0.0.1", 1.0, open=False), Conn("10.0.0.2", None), Conn("10.0.0.3", 2.0)]
    new = Conn("10.0.0.9", 9.0)
    assert make_room(new, [*held, new], limit=3)
    assert held[2].open


def test_a_newcomer_is_refused_when_every_connection_is_answering(
    caplog: pytest.LogCaptureFixture,
):
    held = [Conn(f"10.0.0.{i}", None) for i in range(3)]
    new = Conn("10.0.0.9", 9.0)
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        assert not make_room(new, [*held, new], limit=3)
    assert all(c.open for c in held)
    assert "refused 1 new connections: every connection is answering" in caplog.text


def test_one_address_holds_a_bounded_number_of_unfinished_connections(
    caplog: pytest.LogCaptureFixture,
):
    mine = [Conn("10.0.0.1", float(i)) for i in range(UNFINISHED_PER_PEER)]
    busy = [Conn("10.0.0.1", None) for _ in range(4)]  # answering: not counted
    others = [Conn("10.0.0.2", -1.0)]  # older, but another address's
    new = Conn("10.0.0.1", 100.0)
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        assert make_room(new, [*others, *busy, *mine, new], limit=1000)
    assert [c.open for c in mine] == [False] + [True] * (UNFINISHED_PER_PEER - 1)
    assert all(c.open for c in [*others, *busy])
    assert "closed 1 connections that had not sent a whole request" in caplog.text
    assert "most from 10.0.0.1: 1" in caplog.text


def test_the_log_says_it_at_once_then_at_most_every_few_seconds(
    caplog: pytest.LogCaptureFixture,
):
    with caplog.at_level(logging.WARNING, logger="hotlora"):
        for i in range(50):
            held = [Conn("10.0.0.1", float(i))]
            new = Conn("10.0.0.2", 100.0)
            assert make_room(new, [*held, new], limit=1)
            assert not held[0].open
    assert len(caplog.records) == 1


@pytest.mark.parametrize("per_peer", [4, 0])
def test_the_per_address_cap_is_set_or_off(per_peer: int):
    """`--max-unfinished-per-address`: a proxy's keep-alive pool shares one address; 0 lets it
    keep every idle connection, and the connection limit alone makes way."""
    pool = [Conn("10.0.0.9", float(i)) for i in range(40)]  # idle between requests
    new = Conn("10.0.0.9", 100.0)
    assert make_room(new, [*pool, new], limit=1000, per_peer=per_peer)
    closed = sum(not c.open for c in pool)
    assert closed == (40 - per_peer + 1 if per_peer else 0)
    if not per_peer:
        assert make_room(new, [*pool, new], limit=40, per_peer=0)
        assert [c.open for c in pool] == [False] + [True] * 39
