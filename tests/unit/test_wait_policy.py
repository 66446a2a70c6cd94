"""The client's side of waiting for blocks, load and a second look at a route, without sockets: the
bounded wait of `SwarmClient.wait_for_route` on a fake clock, a session's wait notice and load
accounting, its one re-route check after the first decode steps, the options, and the API's keepalive
comments while a started stream waits."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import aiohttp
import pytest
import torch

from client.api.gateway import Gateway
from client.api.served import ServedModel
from client.api.responses import ResponseBodies
from client.api.stream import Runs
from client.config import ApiConfig, ClientConfig
from client.generation import Delta
from client.inference.routing import REROUTE_AFTER, Hop, Offer
from client.inference.session import InferenceSession
from client.inference.swarm_client import SwarmClient
from swarm import http
from swarm.config import add_options, from_args
from swarm.errors import ConfigError, NoRoute, StepTimeout
from swarm.span import Span

pytestmark = pytest.mark.unit

GONE = NoRoute("no live peer serves blocks [3:6) of m; peers announcing them: 0", (3, 4, 5))


class FakeTime:
    """A clock that only `sleep` advances; every try of a route takes `try_s`."""

    def __init__(self, try_s: float = 0.0):
        self.t, self.try_s, self.sleeps = 0.0, try_s, []

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def client_with(routes, wait: float, clock: FakeTime | None = None) -> tuple[SwarmClient, list]:
    """A client (no node) whose `route` answers from `routes` in turn: an exception is raised, else returned."""
    client = SwarmClient(None, "m", 6, ClientConfig(wait_for_blocks=wait))
    calls = []

    async def route(span=None, **kw):
        calls.append(span)
        if clock is not None:
            clock.t += clock.try_s
        answer = routes[min(len(calls), len(routes)) - 1]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    client.route = route
    return client, calls


def test_waits_for_blocks_to_come_back_and_tells_once():
    clock, notices = FakeTime(try_s=0.25), []
    back = [Hop("new", Span(3, 6))]
    client, calls = client_with([GONE, GONE, GONE, back], wait=30, clock=clock)
    hops = asyncio.run(client.wait_for_route(Span(3, 6), on_wait=notices.append, clock=clock, sleep=clock.sleep))
    assert hops == back and len(calls) == 4
    assert notices == ["waiting up to 30 s for blocks [3:6) of m to be served again..."]
    assert clock.sleeps == pytest.approx([1.0, 0.75, 0.75])  # about once a second


def test_gives_up_after_the_wait_with_the_same_clear_error():
    clock = FakeTime(try_s=0.1)
    client, calls = client_with([GONE], wait=5, clock=clock)
    with pytest.raises(NoRoute, match=r"no live peer serves blocks \[3:6\) of m.*; waited 5\.1 s") as e:
        asyncio.run(client.wait_for_route(Span(3, 6), clock=clock, sleep=clock.sleep))
    assert e.value.missing == (3, 4, 5)
    assert 5 <= len(calls) <= 7 and clock.t == pytest.approx(5.2)  # the last try at the deadline


def test_a_wait_takes_the_seconds_it_is_given():
    clock = FakeTime(try_s=0.1)
    client, calls = client_with([GONE], wait=30, clock=clock)
    with pytest.raises(NoRoute, match=r"waited 2\.1 s"):
        asyncio.run(client.wait_for_route(Span(3, 6), clock=clock, sleep=clock.sleep, seconds=2.0))
    with pytest.raises(NoRoute) as e:
        asyncio.run(client.wait_for_route(Span(3, 6), on_wait=pytest.fail, seconds=0.0))  # none left: at once
    assert e.value is GONE


def test_no_wait_fails_at_once():
    client, calls = client_with([GONE], wait=0)
    with pytest.raises(NoRoute) as e:
        asyncio.run(client.wait_for_route(Span(3, 6), on_wait=pytest.fail))
    assert e.value is GONE and len(calls) == 1


def test_blocks_whose_only_peer_lied_fail_at_once_naming_it():
    client, calls = client_with([GONE], wait=30)
    client.offers = {"12D3KooWliarXYZ9": Offer("12D3KooWliarXYZ9", Span(3, 6))}
    client.ban("12D3KooWliarXYZ9", "wrong_output", 3600.0)
    with pytest.raises(NoRoute, match=r"no honest peer serves blocks \[3:6\) of m: peer \S*XYZ9 returned wrong "
                       r"outputs") as e:
        asyncio.run(client.wait_for_route(Span(3, 6), on_wait=pytest.fail))
    assert e.value.missing == (3, 4, 5) and len(calls) == 1


def test_options_are_derived_and_checked():
    parser = argparse.ArgumentParser()
    add_options(parser, ClientConfig)
    config = from_args(ClientConfig, parser.parse_args(["--wait-for-blocks", "2.5", "--route-seed", "7"]))
    assert (config.wait_for_blocks, config.route_seed) == (2.5, 7)
    assert from_args(ClientConfig, parser.parse_args([])).wait_for_blocks == 30.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--wait-for-blocks"):
            ClientConfig(wait_for_blocks=bad)


# ---- a session's notice, load and second look, over a fake view ----

def view(**config) -> SwarmClient:
    client = SwarmClient(None, "m", 6, ClientConfig(**config))
    client.offers = {p: Offer(p, Span(0, 6), throughput=100.0, cache_tokens_left=1000) for p in ("a", "b")}
    return client


def test_a_session_waiting_for_blocks_says_so_and_waiting_is_not_a_retry():
    async def run():
        client, notices = view(wait_for_blocks=0.3, max_retries=1), []
        session = InferenceSession(client, 16, on_wait=notices.append)
        session.live.batch, session.live.links = 1, session.live.adopt([Hop("a", Span(0, 6))])
        seen = []

        async def route(span=None, **kw):
            seen.append(session.waiting)
            if len(seen) < 2:
                raise GONE
            return [Hop("b", Span(0, 6))]

        client.route = route
        new = await session._replace(0, exclude=set())
        return session, client, notices, seen, new

    session, client, notices, seen, new = asyncio.run(run())
    assert new == ("[0:6) at b",) and session.route == [Hop("b", Span(0, 6))]
    assert seen[0] is None and seen[1:] == notices and len(notices) == 1  # 'waiting' while it waits, then None
    assert session.waiting is None
    assert client.own_load == {"b": 1}  # the replaced hop's load went with it



def test_a_step_waits_for_blocks_once_whatever_its_peer_does_after():
    """A peer that is served again and fails again does not get the step a second full wait: the waits of one
    step share `wait_for_blocks`."""
    async def run():
        client = view(wait_for_blocks=5.0)
        session = InferenceSession(client, 16)
        session.live.batch, session.live.links = 1, session.live.adopt([Hop("a", Span(0, 6))])
        asked = []

        async def wait_for_route(span, *, on_wait=None, seconds=None, **kw):
            asked.append(seconds)
            on_wait("waiting for blocks [0:6)")
            await asyncio.sleep(0.2)
            if len(asked) == 3:
                raise GONE
            return [Hop("a", Span(0, 6))]  # it came back

        async def open_session(link, position, mask):
            raise StepTimeout("it never opens")

        client.wait_for_route, session.live.open = wait_for_route, open_session
        with pytest.raises(NoRoute):
            await session._through(0, torch.zeros(1, 1, 8), 0, None)
        return asked

    asked = asyncio.run(run())
    assert asked[0] == 5.0 and asked[0] - 0.45 < asked[1] < asked[0] - 0.15 and asked[2] < asked[1] - 0.15


def test_load_of_concurrent_sessions_is_counted_and_released():
    async def run():
        client = view(route_seed=1)
        sessions = [InferenceSession(client, 16) for _ in range(8)]
        for session in sessions:
            session.live.batch = 1
            session.live.links = session.live.adopt(client.find(Span(0, 6), 16, rng=session.rng))
        counted = dict(client.own_load)
        for session in sessions:
            await session.close()
        return counted, client.own_load

    counted, after = asyncio.run(run())
    assert counted == {"a": 4, "b": 4} and not after


def test_seeded_sessions_break_ties_reproducibly():
    def choices():
        client = view(route_seed=42)
        return [client.find(Span(0, 6), rng=InferenceSession(client, 8).rng)[0].peer for _ in range(12)]

    assert choices() == choices() and set(choices()) == {"a", "b"}


def test_a_route_much_slower_than_announced_is_switched_once():
    client = view()
    client.offers["b"] = Offer("b", Span(0, 6), throughput=80.0, cache_tokens_left=1000)  # a little slower than "a"
    for peer in ("a", "b"):
        client.measurements.ping(peer, 1.0)
    session = InferenceSession(client, 16)
    session.live.batch, session.live.links = 1, session.live.adopt(client.find(Span(0, 6), 16))
    assert session.route == [Hop("a", Span(0, 6))]
    assumed = session.links[0].assumed_ms
    assert assumed == pytest.approx(1.0 + 6 * 1000 / (100 * 6))  # delay + 6 blocks at the announced speed
    session.decode_steps = REROUTE_AFTER
    for _ in range(REROUTE_AFTER):  # "a"'s steps take 4x what was assumed (its queue, its network side)
        session.links[0].detector.observe(4 * assumed, 1)
    session._reconsider()
    assert session.route == [Hop("b", Span(0, 6))] and session.reconsidered
    [moved] = session.reroutes
    assert (moved.failed_peer, moved.reason, moved.new_hops) == ("a", "rerouted", ("[0:6) at b",))
    assert session.failovers == [] and client.own_load == {"b": 1}


def test_no_switch_without_a_clear_gain_or_a_slow_hop():
    client = view()
    for peer in ("a", "b"):  # proven: their claims count
        client.measurements.ping(peer, 1.0)
    session = InferenceSession(client, 16)
    session.live.batch, session.live.links = 1, session.live.adopt(client.find(Span(0, 6), 16))
    assumed = session.links[0].assumed_ms
    for _ in range(REROUTE_AFTER):
        session.links[0].detector.observe(1.5 * assumed, 1)
    session._reconsider()  # 1.5x: within what was assumed
    assert session.route == [Hop("a", Span(0, 6))] and not session.reroutes
    client.offers["b"] = Offer("b", Span(0, 6), throughput=1.0, cache_tokens_left=1000)  # the alternative: slower
    session.reconsidered = False
    session.links[0].detector = type(session.links[0].detector)()
    for _ in range(REROUTE_AFTER):
        session.links[0].detector.observe(9 * assumed, 1)
    session._reconsider()
    assert session.route == [Hop("a", Span(0, 6))] and not session.reroutes


# ---- the API: a started stream that waits for blocks gets keepalive comments ----

WAITING = "waiting up to 30 s for blocks [3:6) of m to be served again..."


def test_a_started_stream_gets_comments_while_it_waits_for_blocks():
    async def run():
        gw = Gateway(ApiConfig(), [ServedModel("m", None, None, None, 128, [2])])
        gw.keepalive_s = 0.05
        gen = SimpleNamespace(first_token_s=0.01, prompt_tokens=3, completion_tokens=2, waiting=None, unchecked=[])

        async def events():
            yield [Delta(0, "Hel")]
            await asyncio.sleep(0.2)  # a step, not waiting: no comment
            gen.waiting = WAITING
            await asyncio.sleep(0.4)  # waiting for blocks
            gen.waiting = None
            yield [Delta(0, "lo", "stop")]

        async def handler(request):
            gen.run = events
            return await gw._respond(request, Runs([gen]), ResponseBodies("text_completion", "m", 1), stream=True,
                                     include_usage=False)

        app = gw.app()
        app.router.add_get("/stream", handler)
        server = await http.start(app, "127.0.0.1", 0, gw.config.limits)
        try:
            async with aiohttp.ClientSession() as client:
                async with client.get(f"{server.url}/stream", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    return (await resp.read()).decode()
        finally:
            await server.close()
            await gw.close()

    lines = [ln for ln in asyncio.run(run()).split("\n\n") if ln]
    comments = [i for i, ln in enumerate(lines) if ln.startswith(":")]
    assert 3 <= len(comments) <= 10 and all(lines[i] == f": {WAITING}" for i in comments)
    assert lines[0].startswith("data: ") and '"Hel"' in lines[0]  # comments only between the two chunks
    assert comments[0] > 0 and '"lo"' in lines[comments[-1] + 1] and lines[-1] == "data: [DONE]"


def test_a_route_that_visits_a_peer_twice_is_relayed_not_chained():
    """A route rebuilt around a failure can pass the same peer twice; peers refuse such a chain, so the
    session relays those hops itself."""
    from client.inference.chaining import can_chain
    from client.inference.hops import Link

    session = InferenceSession(view(), 16)
    opened = SimpleNamespace()  # a session that is open (chaining only checks that there is one)
    session.live.links = [Link(Hop("a", Span(0, 2)), session=opened), Link(Hop("b", Span(2, 4)), session=opened),
                     Link(Hop("a", Span(4, 6)), session=opened)]
    assert not can_chain(session.live, 0)
    assert can_chain(session.live, 1)  # from the second hop on, each peer once
