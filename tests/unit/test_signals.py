"""What each SIGTERM or Ctrl-C does, counted as it comes: the first drains, the second ends the
requests in flight at once, a third (or one after the drain) exits without waiting."""

from __future__ import annotations

import asyncio
import signal

import uvicorn

from hotlora.server.http.lifecycle import DrainingServer


def started_server(
    drained: list[str], hurried: list[bool]
) -> tuple[DrainingServer, asyncio.AbstractEventLoop]:
    async def drain() -> None:
        drained.append("began")
        await asyncio.sleep(0)

    server = DrainingServer(
        uvicorn.Config(app=lambda *_: None), drain=drain, hurry=lambda: hurried.append(True)
    )
    loop = asyncio.new_event_loop()
    server._loop, server.started = loop, True
    return server, loop


def test_two_signals_before_the_loop_runs_drain_then_hurry():
    drained: list[str] = []
    hurried: list[bool] = []
    server, loop = started_server(drained, hurried)
    try:
        server.handle_exit(signal.SIGTERM, None)
        server.handle_exit(signal.SIGTERM, None)  # before the loop took the first
        loop.run_until_complete(asyncio.sleep(0.01))
        assert drained == ["began"] and hurried == [True]
        assert server.should_exit and not server.force_exit  # the drain ended; no force
        server.handle_exit(signal.SIGINT, None)
        assert server.force_exit
    finally:
        loop.close()


def test_a_second_signal_after_the_drain_exits_at_once():
    drained: list[str] = []
    hurried: list[bool] = []
    server, loop = started_server(drained, hurried)
    try:
        server.handle_exit(signal.SIGTERM, None)
        loop.run_until_complete(asyncio.sleep(0.01))  # the drain runs and ends
        assert drained == ["began"] and not server.force_exit
        server.handle_exit(signal.SIGTERM, None)
        assert server.force_exit and hurried == []
    finally:
        loop.close()
