"""The peer's view of the swarm between reads: a quiet swarm is read less often, and in between only the
sole servers of some block are pinged (`peer.balancer.SwarmView`). The records and the answers to the
pings are given here; the DHT and the calls behind them are tested in the integration tests."""

from __future__ import annotations

import asyncio
import types

import pytest

from peer import balancer
from swarm.errors import ConnectionLost, StepTimeout
from swarm.net.records import Announcement
from swarm.span import Span
from swarm.net.messages import Info

pytestmark = pytest.mark.unit

ME = "me"


def ann(peer: str, start: int, end: int, seq: int = 1) -> Announcement:
    return Announcement(peer=peer, model="m", start=start, end=end, state="online", throughput=1.0, prefill_tps=1.0,
                        cache_tokens_left=100, version="0.1.0", seq=seq, issued_at=0.0)


class Swarm:
    """What the view's reads find and which peers answer an info call; counts both."""

    def __init__(self, monkeypatch, *records: Announcement):
        self.records, self.down, self.silent, self.reads, self.pinged = list(records), set(), set(), 0, []
        self.flaky: dict[str, int] = {}  # peer -> info calls that still fail to reach it
        monkeypatch.setattr(balancer.discovery, "announcements", self._announcements)
        monkeypatch.setattr(balancer.calls, "info", self._info)

    async def _announcements(self, node, model_id, num_blocks):
        self.reads += 1
        out = {b: [] for b in range(num_blocks)}
        for a in self.records:
            for b in a.span:
                out[b].append(a)
        return out

    async def _info(self, node, peer, timeout):
        self.pinged.append(peer)
        if peer in self.down or self.flaky.get(peer, 0) > 0:
            self.flaky[peer] = self.flaky.get(peer, 0) - 1
            raise ConnectionLost(f"{peer} is down")
        if peer in self.silent:
            raise StepTimeout(f"{peer} sent no reply")
        mine = max((a for a in self.records if a.peer == peer), key=lambda a: a.seq)  # what it serves now
        return Info(peer, "m", mine.start, mine.end)


def view() -> balancer.SwarmView:
    return balancer.SwarmView(types.SimpleNamespace(peer_id=ME), "m", 6)


def spans(served) -> dict[str, Span]:
    return {s.peer: s.span for s in served}


def test_reads_of_the_same_swarm_count_as_quiet_and_a_change_resets(monkeypatch):
    swarm, v = Swarm(monkeypatch, ann("a", 0, 3), ann("b", 3, 6), ann("c", 0, 6)), view()
    for expected in (0, 1, 2):  # the first read differs from nothing
        asyncio.run(v.read())
        assert v.quiet_reads == expected
    swarm.records[2] = ann("c", 0, 6, seq=2)  # re-announced, same span and state: still quiet
    asyncio.run(v.read())
    assert v.quiet_reads == 3
    swarm.records[1] = ann("b", 4, 6, seq=2)  # moved
    asyncio.run(v.read())
    assert v.quiet_reads == 0


def test_a_check_pings_only_sole_servers_and_reads_nothing(monkeypatch):
    swarm, v = Swarm(monkeypatch, ann("a", 0, 3), ann("b", 3, 6), ann("c", 0, 3)), view()
    asyncio.run(v.read())
    reads, swarm.pinged = swarm.reads, []
    served = asyncio.run(v.check())
    assert swarm.reads == reads and swarm.pinged == ["b"]  # a and c share [0:3)
    assert spans(served) == {"a": Span(0, 3), "b": Span(3, 6), "c": Span(0, 3)}


def test_a_sole_server_that_stops_answering_leaves_a_hole_until_it_announces_again(monkeypatch):
    swarm, v = Swarm(monkeypatch, ann("a", 0, 3), ann("b", 3, 6)), view()
    asyncio.run(v.read())
    swarm.down.add("b")
    assert spans(asyncio.run(v.check())) == {"a": Span(0, 3)}
    swarm.pinged = []
    assert spans(asyncio.run(v.check())) == {"a": Span(0, 3)} and swarm.pinged == ["a"]  # b is not pinged again
    swarm.down.clear()
    assert spans(asyncio.run(v.read())) == {"a": Span(0, 3)}  # its old records still do not count
    swarm.records[1] = ann("b", 3, 6, seq=2)  # back, announcing again
    assert spans(asyncio.run(v.read())) == {"a": Span(0, 3), "b": Span(3, 6)}


def test_a_sole_server_that_moved_makes_the_check_a_read(monkeypatch):
    swarm, v = Swarm(monkeypatch, ann("a", 0, 3), ann("b", 3, 6), ann("c", 0, 3)), view()
    asyncio.run(v.read())
    swarm.records[1] = ann("b", 0, 3, seq=2)  # b left [3:6) (still alive): only a read shows the hole
    reads = swarm.reads
    served = asyncio.run(v.check())
    assert swarm.reads == reads + 1 and spans(served) == {"a": Span(0, 3), "b": Span(0, 3), "c": Span(0, 3)}
    assert v.quiet_reads == 0


def test_reads_of_a_quiet_swarm_come_further_apart_up_to_a_limit(monkeypatch):
    Swarm(monkeypatch, ann("a", 0, 3), ann("b", 3, 6))
    v = view()
    assert v.read_due(0.0, 3.0)  # never read
    gaps = []
    for _ in range(6):
        asyncio.run(v.read())
        gaps.append(next(g for g in range(1, 100) if v.read_due(v.read_at + 3.0 * g, 3.0)))
    assert gaps == [1, 2, 4, 8, 8, 8]  # in check intervals: doubling while quiet, then capped
    v.stale()  # a hole showed
    assert v.read_due(v.read_at, 3.0) and v.quiet_reads == 0


def test_a_silent_sole_server_is_gone_only_after_several_pings_a_lost_one_at_once(monkeypatch):
    swarm, v = Swarm(monkeypatch, ann("a", 0, 3), ann("b", 3, 6)), view()
    asyncio.run(v.read())
    swarm.silent.add("b")  # busy under its quota, or frozen: its info call times out
    for _ in range(balancer.SILENT_PINGS - 1):
        assert spans(asyncio.run(v.check())) == {"a": Span(0, 3), "b": Span(3, 6)}
    assert spans(asyncio.run(v.check())) == {"a": Span(0, 3)}
    swarm.silent.clear()
    swarm.down.add("a")  # killed: nothing listens
    assert spans(asyncio.run(v.check())) == {}


def test_one_failed_dial_is_tried_again_before_the_peer_counts_as_gone(monkeypatch):
    monkeypatch.setattr(balancer, "LOST_RETRY_S", 0.0)
    swarm, v = Swarm(monkeypatch, ann("a", 0, 3), ann("b", 3, 6)), view()
    asyncio.run(v.read())
    swarm.flaky["b"] = 1  # one dial fails (the daemon busy), the next one answers
    assert spans(asyncio.run(v.check())) == {"a": Span(0, 3), "b": Span(3, 6)}
    swarm.flaky["b"] = 2  # both fail: nothing listens
    assert spans(asyncio.run(v.check())) == {"a": Span(0, 3)}


def test_an_answer_resets_the_silence(monkeypatch):
    swarm, v = Swarm(monkeypatch, ann("b", 3, 6)), view()
    asyncio.run(v.read())
    for _ in range(3):
        swarm.silent.add("b")
        for _ in range(balancer.SILENT_PINGS - 1):
            asyncio.run(v.check())
        swarm.silent.clear()
        assert spans(asyncio.run(v.check())) == {"b": Span(3, 6)}
