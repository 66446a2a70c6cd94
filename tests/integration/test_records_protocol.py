"""The records protocol on a real swarm: peers and the bootstrap answer with the signed records they read,
and a reader that checks them itself finds what the DHT holds, for every block and in the directory."""

from __future__ import annotations

import pytest

from swarm.net import discovery, record_messages, record_service, records
from swarm.errors import SwarmError
from swarm_harness import MODEL_ID

pytestmark = pytest.mark.integration
BLOCKS = 6


def sources(swarm) -> list[str]:
    return [swarm.procs["bootstrap"].peer_id, *(p.peer_id for n, p in swarm.procs.items() if n.startswith("peer"))]


def test_peers_and_the_bootstrap_serve_the_records_of_every_block(swarm, client, loop):
    keys = [records.block_key(MODEL_ID, b) for b in range(BLOCKS)]
    dht = loop.run(discovery.announcements(client, MODEL_ID, BLOCKS))
    for source in sources(swarm):
        found = loop.run(record_service.read(client, [source], keys, min_sources=1))
        assert found.refused == 0 and not found.truncated
        for block, key in enumerate(keys):
            assert set(found.announcements.get(key, {})) == {a.peer for a in dht[block]}, (source, block)
            assert all(a.start <= block < a.end for a in found.announcements[key].values())


def test_a_reply_says_where_the_signers_are(swarm, client, loop):
    peers = {p.peer_id for n, p in swarm.procs.items() if n.startswith("peer")}
    found = loop.run(record_service.read(client, sources(swarm)[:1], [records.block_key(MODEL_ID, b)
                                                                       for b in range(BLOCKS)], min_sources=1))
    assert peers <= set(found.addrs)  # the bootstrap is connected to every peer
    assert all(a.startswith("/ip4/127.0.0.1/tcp/") for p in peers for a in found.addrs[p])


def test_the_directory_through_the_protocol(swarm, client, loop):
    found = loop.run(record_service.read(client, sources(swarm)[:2], list(records.DIRECTORY_KEYS)))
    listed = {ann.peer for bucket in found.announcements.values() for ann in bucket.values()}
    assert {p.peer_id for n, p in swarm.procs.items() if n.startswith("peer")} <= listed


def test_a_source_that_does_not_answer_is_skipped_and_none_answering_is_an_error(swarm, client, loop):
    from swarm.net.identity import Identity

    nobody = Identity.generate().peer_id
    key = records.block_key(MODEL_ID, 0)
    found = loop.run(record_service.read(client, [nobody, sources(swarm)[0]], [key], timeout=5, min_sources=1))
    assert found.announcements[key]
    with pytest.raises(SwarmError):
        loop.run(record_service.read(client, [nobody], [key], timeout=5))


def test_a_malformed_request_gets_a_typed_error(swarm, client, loop):
    from swarm.net import wire
    from swarm.net.calls import exchange
    from swarm.errors import BadRequest

    async def ask():
        stream = await client.open(sources(swarm)[1], wire.RECORDS_PROTOCOL)
        try:
            return await exchange(stream, wire.Message(wire.GET_RECORDS, {"keys": ["x" * 500]}), 10)
        finally:
            await stream.aclose()

    with pytest.raises(BadRequest):
        loop.run(ask())
    assert record_messages.MAX_RECORD_KEYS >= len(records.DIRECTORY_KEYS)  # the directory is one request
