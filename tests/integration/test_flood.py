"""A flood of sessions asking for more than the whole cache is refused fast while an honest session keeps
stepping; more sessions than the limit get `busy`; idle sessions give their cache back."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
import torch

from client.inference import peer_session
from peer.sessions import GROW_TOKENS
from swarm.errors import Busy, OutOfCache, UnknownSession
from swarm.span import Span
from swarm_harness import CACHE_TOKENS, IDLE_TIMEOUT, MAX_SESSIONS, MODEL_ID, wait_until

pytestmark = pytest.mark.integration
ATTACKERS, ROUNDS = 16, 16


def target(swarm, client, loop, name: str) -> tuple[str, Span]:
    info = loop.run(peer_session.info(client, swarm.procs[name].peer_id))
    return info.peer, Span(info.start, info.end)


def test_flood_of_whole_cache_sessions_is_refused_fast(swarm, client, loop):
    peer, span = target(swarm, client, loop, "peer2")

    async def run():
        honest = await peer_session.PeerSession.open(client, peer, MODEL_ID, span, max_length=64)
        x = torch.randn(1, 4, 64)
        expected = await honest.step(x, 0)
        latencies, refusals, honest_steps = [], [], []
        done = asyncio.Event()

        async def attacker():
            for _ in range(ROUNDS):
                started = time.perf_counter()
                try:
                    s = await peer_session.PeerSession.open(client, peer, MODEL_ID, span,
                                                           max_length=CACHE_TOKENS + 1)
                    await s.close()
                    refusals.append("opened")
                except OutOfCache as e:
                    refusals.append(e.code)
                latencies.append(time.perf_counter() - started)

        async def keep_stepping():  # all through the flood, and at least 5 steps
            while not done.is_set() or len(honest_steps) < 5:
                started = time.perf_counter()
                torch.testing.assert_close(await honest.step(x, 0), expected)
                honest_steps.append(time.perf_counter() - started)

        stepper = asyncio.create_task(keep_stepping())
        await asyncio.gather(*(attacker() for _ in range(ATTACKERS)))
        done.set()
        await stepper
        await honest.close()
        return latencies, refusals, honest_steps

    latencies, refusals, honest_steps = loop.run(run(), timeout=300)
    latencies.sort()
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (len(latencies) - 1))]
    print(f"\nflood: {len(latencies)} whole-cache opens from {ATTACKERS} concurrent clients: "
          f"p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms; "
          f"honest session: {len(honest_steps)} steps meanwhile, median {statistics.median(honest_steps) * 1e3:.1f} ms, "
          f"max {max(honest_steps) * 1e3:.1f} ms")
    assert refusals == ["out_of_cache"] * (ATTACKERS * ROUNDS)
    assert p99 < 0.200, f"p99 refusal latency {p99 * 1e3:.0f} ms"
    assert max(honest_steps) < 0.5, f"an honest step took {max(honest_steps) * 1e3:.0f} ms during the flood"


def test_sessions_beyond_the_limit_are_busy(swarm, client, loop):
    peer, span = target(swarm, client, loop, "peer2")

    async def run():
        results = await asyncio.gather(*(peer_session.PeerSession.open(client, peer, MODEL_ID, span, max_length=4)
                                         for _ in range(MAX_SESSIONS + 8)), return_exceptions=True)
        opened = [r for r in results if isinstance(r, peer_session.PeerSession)]
        busy = [r for r in results if isinstance(r, Busy)]
        for s in opened:
            await s.close()
        return len(opened), len(busy), [r for r in results if not isinstance(r, (peer_session.PeerSession, Busy))]

    opened, busy, other = loop.run(run())
    assert other == []
    assert opened == MAX_SESSIONS and busy == 8
    info = lambda: loop.run(peer_session.info(client, peer))  # noqa: E731
    wait_until(lambda: info().sessions == 0, 10, "closed sessions to be released")
    assert info().cache_tokens_left == CACHE_TOKENS


def test_idle_sessions_give_their_cache_back(swarm, client, loop):
    peer, span = target(swarm, client, loop, "peer0")
    session = loop.run(peer_session.PeerSession.open(client, peer, MODEL_ID, span, max_length=300))
    info = lambda: loop.run(peer_session.info(client, peer))  # noqa: E731
    assert info().cache_tokens_left == CACHE_TOKENS - GROW_TOKENS  # committed as it grows
    loop.run(session.step(torch.randn(1, 2, 64), 0))
    started = time.monotonic()
    # polled every 0.5 s (a new stream each time), not every 0.1 s: the probe is not what is tested
    wait_until(lambda: info().cache_tokens_left == CACHE_TOKENS, IDLE_TIMEOUT + 10, "the idle session's cache",
               interval=0.5)
    assert time.monotonic() - started >= IDLE_TIMEOUT - 1
    with pytest.raises(UnknownSession):
        loop.run(session.step(torch.randn(1, 1, 64), 2))
    loop.run(session.close())
