"""One client cannot take a peer's whole cache or compute: a hog that fills the cache with sessions it keeps
stepping, and floods the peer with large forwards, loses sessions to an honest client, which gets
transformers' greedy tokens; the announced cache figures come back at once when the hog lets go."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from client.inference import peer_session
from client.model import DistributedModelForCausalLM
from swarm.net import discovery
from swarm.model.blocks import SpanBlocks
from swarm.errors import Busy, ConnectionLost, OutOfCache, SwarmError, UnknownSession
from swarm.span import Span
from swarm_harness import MODEL_ID, LocalSwarm, client_node, wait_until

pytestmark = pytest.mark.integration

CACHE, SHARE, HOG_LENGTH, ANNOUNCE = 1024, 256, 256, 6.0
ALL = Span(0, 6)
PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
OPTIONS = ("--blocks", "0:6", "--model-id", MODEL_ID, "--cache-tokens", str(CACHE), "--max-length", "512",
           "--max-sessions", "8", "--client-share", str(SHARE / CACHE), "--reclaim-idle", "2",
           "--announce-interval", str(ANNOUNCE), "--record-ttl", "20")


@pytest.fixture(scope="module")
def fair_swarm(tmp_path_factory, tiny_llama):
    net = LocalSwarm(tmp_path_factory.mktemp("fair-swarm"))
    try:
        net.start_bootstrap()
        net.start_peer("peer", tiny_llama, *OPTIONS)
        yield net
    finally:
        net.stop_all()


class Hog:
    """A client script holding as many sessions as the peer lets it, each filled to `HOG_LENGTH` tokens and
    stepped again and again so none ever looks idle; meanwhile it sends large forwards, 4 at a time."""

    def __init__(self, node, peer: str):
        self.node, self.peer = node, peer
        self.sessions: list[peer_session.PeerSession] = []
        self.refused: Exception | None = None
        self.reclaimed = 0
        self.forwards = self.failed_forwards = 0

    async def fill(self) -> None:
        for _ in range(8):
            try:
                s = await peer_session.PeerSession.open(self.node, self.peer, MODEL_ID, ALL, max_length=512)
            except (OutOfCache, Busy) as e:
                self.refused = e
                return
            self.sessions.append(s)
            await s.step(torch.randn(1, HOG_LENGTH, 64), 0)

    async def keep_busy(self, s: peer_session.PeerSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await s.step(torch.randn(1, 1, 64), HOG_LENGTH - 1)
            except UnknownSession:
                self.reclaimed += 1
                return
            await asyncio.sleep(0.1)

    async def flood(self, stop: asyncio.Event) -> None:
        """Large forwards, one after another; a hog goes on whatever answer it gets."""
        while not stop.is_set():
            try:
                await peer_session.forward(self.node, self.peer, MODEL_ID, ALL, torch.randn(8, 512, 64))
            except SwarmError:
                self.failed_forwards += 1
                await asyncio.sleep(0.05)
                continue
            self.forwards += 1


def timed_generate(net: LocalSwarm, tiny_llama) -> tuple[torch.Tensor, float]:
    """A fresh honest client's greedy tokens, and how long `generate` took (joining the swarm not counted)."""
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, net.bootstrap_addrs, model_id=MODEL_ID) as model:
        started = time.monotonic()
        return model.generate(PROMPT, max_new_tokens=8, do_sample=False, pad_token_id=0), time.monotonic() - started


def announced(node, loop) -> int:
    """The peer's cache tokens left, as its record for block 0 says now."""
    anns = loop.run(discovery.announcements(node, MODEL_ID, 1))[0]
    return anns[0].cache_tokens_left if anns else -1


def test_a_large_forward_runs_in_short_jobs_to_the_same_numbers(fair_swarm, tiny_llama, loop):
    # jobs of 4 rows x 1 block (`peer.compute.forward_parts`): rows 0-3 through each block, then row 4
    hidden = torch.randn(5, 512, 64)
    mask = torch.ones(5, 512, dtype=torch.int64)
    mask[4, :100] = 0  # left padding
    with client_node(loop, fair_swarm.bootstrap_addrs) as node:
        out = loop.run(peer_session.forward(node, fair_swarm.procs["peer"].peer_id, MODEL_ID, ALL, hidden, mask))
    torch.testing.assert_close(out, SpanBlocks(tiny_llama, ALL)(hidden, attention_mask=mask), atol=1e-5, rtol=1e-5)


def test_a_hog_cannot_lock_an_honest_client_out(fair_swarm, tiny_llama, loop):
    peer = fair_swarm.procs["peer"].peer_id
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    expected = local.generate(PROMPT, max_new_tokens=8, do_sample=False, pad_token_id=0)
    alone, idle_s = timed_generate(fair_swarm, tiny_llama)
    assert alone.tolist() == expected.tolist()
    with client_node(loop, fair_swarm.bootstrap_addrs) as node:
        hog = Hog(node, peer)
        loop.run(hog.fill())
        assert len(hog.sessions) == CACHE // HOG_LENGTH and isinstance(hog.refused, OutOfCache), hog.refused
        stop = asyncio.Event()
        background = [asyncio.run_coroutine_threadsafe(job, loop.loop) for job in
                      [hog.keep_busy(s, stop) for s in hog.sessions] + [hog.flood(stop) for _ in range(4)]]
        # a new client may still take its share here: the record says so, and routing trusts it
        wait_until(lambda: SHARE <= announced(node, loop) < CACHE, ANNOUNCE + 5,
                   "the record to offer a new client its share")
        got, took = timed_generate(fair_swarm, tiny_llama)
        loop.loop.call_soon_threadsafe(stop.set)
        for job in background:
            job.result(60)
        print(f"\nhonest generation: {idle_s:.2f} s alone, {took:.2f} s beside the hog; hog: {hog.reclaimed} "
              f"sessions reclaimed, {hog.forwards} forwards of 8 x 512 tokens")
        assert got.tolist() == expected.tolist()
        assert hog.reclaimed >= 1 and hog.forwards >= 4

        for s in hog.sessions:
            loop.run(s.close())
        released = time.monotonic()
        wait_until(lambda: announced(node, loop) == CACHE, ANNOUNCE, "the released cache in the record")
        print(f"released cache announced after {time.monotonic() - released:.1f} s (interval {ANNOUNCE:.0f} s)")


def test_free_identities_holding_every_slot_at_their_share_cannot_lock_a_newcomer_out(fair_swarm, tiny_llama, loop):
    """Four identities (key pairs cost nothing) each hold 2 of the peer's 8 slots, their share, and step them so
    none is idle: an honest newcomer still generates, exactly, by taking one busy session of one of them."""
    peer = fair_swarm.procs["peer"].peer_id
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    expected = local.generate(PROMPT, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with contextlib.ExitStack() as stack:
        holders = [Hog(stack.enter_context(client_node(loop, fair_swarm.bootstrap_addrs)), peer) for _ in range(4)]

        async def hold(hog: Hog) -> None:
            for _ in range(2):
                hog.sessions.append(await peer_session.PeerSession.open(hog.node, peer, MODEL_ID, ALL, max_length=64))
                await hog.sessions[-1].step(torch.randn(1, 63, 64), 0)

        async def keep_busy(hog: Hog, s: peer_session.PeerSession, stop: asyncio.Event) -> None:
            while not stop.is_set():
                try:
                    await s.step(torch.randn(1, 1, 64), 62)
                except UnknownSession:
                    hog.reclaimed += 1
                    return
                await asyncio.sleep(0.1)

        for hog in holders:
            loop.run(hold(hog))
        with pytest.raises(Busy):  # the peer is full: one more session of a holder is over its share
            loop.run(peer_session.PeerSession.open(holders[0].node, peer, MODEL_ID, ALL, max_length=16))
        stop = asyncio.Event()
        busy = [asyncio.run_coroutine_threadsafe(keep_busy(hog, s, stop), loop.loop)
                for hog in holders for s in hog.sessions]
        got, _ = timed_generate(fair_swarm, tiny_llama)
        loop.loop.call_soon_threadsafe(stop.set)
        for job in busy:
            job.result(60)
        assert got.tolist() == expected.tolist()

        async def gone(s: peer_session.PeerSession) -> bool:
            """Whether the peer closed it (its step in flight when it was taken may still have been answered); a
            session told so has its stream closed by the peer after that answer."""
            try:
                await s.step(torch.randn(1, 1, 64), 62)
            except (UnknownSession, ConnectionLost):
                return True
            return False

        taken = [loop.run(gone(s)) for hog in holders for s in hog.sessions]
        assert any(taken)  # a busy session of one of them made the room
        for hog in holders:
            for s in hog.sessions:
                loop.run(s.close())
