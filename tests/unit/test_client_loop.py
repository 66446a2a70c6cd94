"""The client's plumbing below the network: the loop thread and reply deadlines."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from client.loop import LoopThread
from swarm import wire
from swarm.calls import exchange
from swarm.errors import StepTimeout
from swarm.transport import Stream

pytestmark = pytest.mark.unit


def test_a_timed_out_call_is_cancelled_not_left_running():
    state = {}

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    with LoopThread() as lt:
        with pytest.raises(TimeoutError):
            lt.run(slow(), timeout=0.1)
        deadline = time.monotonic() + 5
        while "cancelled" not in state and time.monotonic() < deadline:
            time.sleep(0.01)
    assert state == {"cancelled": True}


def test_a_silent_peer_is_a_step_timeout_not_a_lost_connection():
    async def run():
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        try:
            with pytest.raises(StepTimeout, match="no reply within"):
                await exchange(Stream(reader, writer, "peer"), wire.Message(wire.INFO), 0.1)
        finally:
            writer.close()
            theirs.close()

    asyncio.run(run())
