"""The light client's address book (`client.light.addresses`) and its connects (`LightNode._connect`): a lying
record source cannot make an honest peer unreachable, and a cancelled connect leaves no waiter hanging."""

from __future__ import annotations

import asyncio

import pytest

from client.light.addresses import BAD_S, PER_PEER, AddressBook
from client.light.node import LightNode
from swarm.errors import ConnectionLost

pytestmark = pytest.mark.unit

PEER = "12D3KooWPeer"


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_addresses_a_liar_planted_give_way_to_the_right_one():
    clock = Clock()
    book = AddressBook(clock=clock)
    junk = [f"/ip4/10.0.0.{i}/tcp/1" for i in range(PER_PEER + 2)]
    book.heard(PEER, junk)
    book.heard(PEER, ["/ip4/127.0.0.1/tcp/5"])  # the right one: no room yet
    assert book.get(PEER) == junk[:PER_PEER]
    for addr in book.get(PEER):
        book.failed(PEER, addr)
    book.heard(PEER, junk + ["/ip4/127.0.0.1/tcp/5"])  # the liar says the same again: not taken back
    assert book.get(PEER) == junk[PER_PEER:] + ["/ip4/127.0.0.1/tcp/5"]
    book.connected(PEER, "/ip4/127.0.0.1/tcp/5")
    assert book.get(PEER)[0] == "/ip4/127.0.0.1/tcp/5"
    clock.now += BAD_S
    book.failed(PEER, junk[PER_PEER])
    book.failed(PEER, junk[PER_PEER + 1])
    book.heard(PEER, junk[:1])  # a while later a failed address may be tried again
    assert book.get(PEER) == ["/ip4/127.0.0.1/tcp/5", junk[0]]


def test_the_addresses_the_user_gave_are_never_dropped():
    book = AddressBook([("/ip4/127.0.0.1/tcp/1", PEER)])
    book.failed(PEER, "/ip4/127.0.0.1/tcp/1")
    assert book.get(PEER) == ["/ip4/127.0.0.1/tcp/1"]


def test_a_cancelled_connect_leaves_no_waiter_hanging():
    async def main():
        node = LightNode([f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"])
        node._loop = asyncio.get_running_loop()
        dialing = asyncio.Event()

        async def call(afn, *args):  # a dial that takes long
            dialing.set()
            await asyncio.sleep(30)

        node.call = call
        first = asyncio.create_task(node._connect(PEER))
        await dialing.wait()
        second = asyncio.create_task(node._connect(PEER))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(ConnectionLost, match="cancelled"):
            await asyncio.wait_for(second, 2)
        return node.addrs.get(PEER)

    assert asyncio.run(main()) == ["/ip4/127.0.0.1/tcp/1"]


def test_a_stream_nobody_reads_is_not_read_past_its_bound_and_ends(monkeypatch):
    """A peer that writes without end on a stream the client does not read: the client stops reading at the
    bound (the transport then holds the sender back) and ends the stream after `FULL_S`."""
    import trio

    from client.light import node as light

    monkeypatch.setattr(light, "FULL_S", 0.2)
    loop = asyncio.new_event_loop()
    reader = asyncio.StreamReader(limit=light.STREAM_LIMIT, loop=loop)
    reads, ended = [], []

    class Flood:
        async def read(self, n):
            reads.append(n)
            await trio.sleep(0)
            return b"x" * n

        async def reset(self):
            ended.append("reset")

    class Host:
        async def new_stream(self, peer, protocol):
            return Flood()

    class Node:
        _host = Host()

        def _feed(self, reader, data):
            reader.feed_eof() if data is None else reader.feed_data(data)

    async def main():
        node = Node()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                node._nursery = nursery
                await light._new_stream(node, PEER, "/test", reader)

    try:
        trio.run(main)
    finally:
        loop.close()
    assert len(reads) * light.READ_BYTES <= light.MAX_BUFFERED + light.READ_BYTES
    assert ended == ["reset"] and reader.at_eof() is False and reader._eof
