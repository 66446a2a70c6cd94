"""The eclipse plant: an attacker with one valid key and one DHT node of its own stores an older record
of its own at the honest DHT nodes and a newer one at its node only. A reader that has seen the newer
one must still get the honest peers' records of that block from the honest nodes: only the attacker's
older entry of each reply is refused, never the reply.

A DHT of its own (three honest nodes, the attacker's node, a reader); no peers: the records are stored
by test nodes.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from swarm import __version__

from swarm.net import records, transport
from swarm.net.identity import Identity
from swarm.net.transport import Node, key_id
from swarm_harness import client_node

pytestmark = pytest.mark.integration

MODEL = "eclipse-test"
KEY = records.block_key(MODEL, 0)
HONEST_NODES = 3


@contextlib.contextmanager
def server_node(loop, initial_peers=()):
    node = Node(Identity.generate(), initial_peers=initial_peers)
    loop.run(node.__aenter__(), timeout=60)
    try:
        yield node
    finally:
        loop.run(node.__aexit__(None, None, None), timeout=30)


@contextlib.contextmanager
def attacker_node(loop, initial_peers):
    """The attacker's DHT node (a test helper, not our node): it stores nothing others send it and
    answers every read with what `plant` put in its storage."""
    hm = transport._hm()

    class StoresNothing(hm.RecordValidatorBase):
        def validate(self, record) -> bool:
            return False

    async def start():
        p2p = await hm.P2P.create(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  auto_nat=False, nat_port_map=False)
        try:
            return p2p, await hm.DHTNode.create(p2p=p2p, initial_peers=initial_peers, record_validator=StoresNothing(),
                                                cache_locally=False, cache_nearest=0)
        except BaseException:
            await p2p.shutdown()
            raise

    async def stop(p2p, dht):
        await dht.shutdown()
        await p2p.shutdown()

    p2p, dht = loop.run(start(), timeout=60)
    try:
        yield dht
    finally:
        loop.run(stop(p2p, dht), timeout=30)


async def plant(dht, key: str, subkey: str, value: bytes, expiration: float) -> None:
    hm = transport._hm()
    assert dht.protocol.storage.store(hm.DHTID.generate(source=key), hm.MSGPackSerializer.dumps(value), expiration,
                                      subkey=subkey)


def sealed(identity: Identity, seq: int, expiration: float) -> bytes:
    now = time.time()
    ann = records.Announcement(identity.peer_id, MODEL, 0, 2, "online", 10.0, 100.0, 1024, __version__, seq, now)
    return records.seal(identity, ann, key_id(KEY), expiration)


def seqs(found: dict[str, tuple[bytes, float]]) -> dict[str, int]:
    return {sub: records.Announcement.from_payload(records.open_envelope(value)[1]).seq
            for sub, (value, _) in found.items()}


def test_a_planted_older_record_hides_no_other_record(loop):
    honest = [Identity.generate() for _ in range(2)]
    attacker = Identity.generate()
    now = time.time()
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(server_node(loop))
        addrs = loop.run(first.maddrs())
        nodes = [first] + [stack.enter_context(server_node(loop, addrs)) for _ in range(HONEST_NODES - 1)]
        # the older record is stored while no honest node has seen the newer one; the newer one expires
        # first, so no honest node's storage would ever prefer it
        items = [(KEY, who.peer_id, sealed(who, 1, now + 250), now + 250) for who in honest]
        items.append((KEY, attacker.peer_id, sealed(attacker, 1, now + 250), now + 250))
        assert all(loop.run(nodes[0].put_records(items)).values())
        evil = stack.enter_context(attacker_node(loop, addrs))
        loop.run(plant(evil, KEY, attacker.peer_id, sealed(attacker, 2, now + 150), now + 150))
        reader = stack.enter_context(client_node(loop, addrs))

        deadline = time.monotonic() + 30
        while seqs(loop.run(reader.get_records([KEY]))[KEY]).get(attacker.peer_id) != 2:
            assert time.monotonic() < deadline, "the reader never saw the attacker's newer record"
            time.sleep(0.2)
        for _ in range(3):
            found = seqs(loop.run(reader.get_records([KEY]))[KEY])
            assert {who.peer_id for who in honest} <= found.keys(), (
                f"honest records hidden by the attacker's plant: got {sorted(found)}")
            assert found[attacker.peer_id] == 2
        assert reader.counters["rejected"] > 0, "the plant was never refused: the test did not attack"
