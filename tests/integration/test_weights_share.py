"""Peers give weight files to each other over the weights protocol, on real nodes (transport daemons on
127.0.0.1): a file is fetched whole and verified, resumed from a partial file, refused when sharing is off,
sent no faster than the cap; a holder that sends wrong bytes is banned and the file comes from an honest
one; bad requests get typed errors and the server goes on."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time

import pytest

from swarm.errors import BadRequest, Busy, NotServing, ProtocolError, WeightsUnavailable
from swarm.net import wire
from swarm.net.calls import exchange, raise_if_error
from swarm.net.identity import Identity
from swarm.net.transport import Node
from swarm.weights import messages
from swarm.weights.share import FileShare, fetch_file, find_holders
from weights_adversary import LyingHolder, Switch

pytestmark = pytest.mark.integration
SIZE = 5 * 2**20 + 12345  # a few chunks and a short last one


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def nodes(loop):
    """Three nodes, each connected to the others, each serving the weights protocol through a `Switch`:
    `honest` and `liar` hold files, `fetcher` downloads them."""
    switches = {name: Switch() for name in ("honest", "liar", "fetcher")}
    with contextlib.ExitStack() as stack:
        started: dict[str, Node] = {}
        for name, switch in switches.items():
            addrs = [a for node in started.values() for a in loop.run(node.maddrs())]
            node = Node(Identity.generate(), initial_peers=addrs)
            loop.run(node.__aenter__(), timeout=60)
            stack.callback(loop.run, node.__aexit__(None, None, None), timeout=30)
            loop.run(node.serve(wire.WEIGHTS_PROTOCOL, switch.handler))
            started[name] = node
        yield started, switches


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A file of a few MB and its sha256."""
    path = tmp_path_factory.mktemp("held") / "model-00001.safetensors"
    data = os.urandom(SIZE)
    path.write_bytes(data)
    return path, data, sha(data)


@pytest.fixture
def honest(nodes, weights):
    """The honest node's share holding the file (fresh for each test)."""
    (started, switches), (path, data, digest) = nodes, weights
    share = FileShare()
    share.add(digest, path, len(data))
    switches["honest"].target = share.handler
    yield share
    switches["honest"].target = None


@pytest.fixture
def liar(nodes, weights):
    """The liar's handler: claims the file and sends every byte flipped."""
    started, switches = nodes
    liar = LyingHolder({weights[2]: weights[1]})
    switches["liar"].target = liar.handler
    yield liar
    switches["liar"].target = None


def ids(nodes) -> dict[str, str]:
    return {name: node.peer_id for name, node in nodes[0].items()}


def test_a_file_is_fetched_whole_and_byte_identical(nodes, loop, tmp_path, weights, honest):
    _, data, digest = weights
    peer = ids(nodes)
    dest = tmp_path / "out.safetensors"
    seen = []
    t0 = time.monotonic()
    got = loop.run(fetch_file(nodes[0]["fetcher"], [peer["honest"]], digest, len(data), dest, banned=set(),
                              progress=lambda done, total: seen.append((done, total))))
    elapsed = time.monotonic() - t0
    assert got == peer["honest"]
    assert dest.read_bytes() == data
    assert not (tmp_path / "out.safetensors.part").exists()
    assert seen[0] == (0, len(data)) and seen[-1] == (len(data), len(data))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert honest.stats["sent_bytes"] == len(data) and honest.stats["gets"] == 1
    print(f"fetched {len(data)} bytes in {elapsed:.2f} s")


def test_have_lists_only_what_is_held(nodes, loop, weights, honest):
    peer = ids(nodes)
    other = sha(b"a file nobody holds")
    nobody = Identity.generate().peer_id  # not a node: it never answers
    found = loop.run(find_holders(nodes[0]["fetcher"], [peer["honest"], peer["liar"], nobody], [weights[2], other],
                                  timeout=5))
    # the liar's switch has no handler in this test: its stream closes unanswered, so it holds nothing
    assert found == {weights[2]: [(peer["honest"], len(weights[1]))], other: []}


def test_a_partial_file_is_resumed_from_its_length(nodes, loop, tmp_path, weights, honest):
    _, data, digest = weights
    dest = tmp_path / "out.safetensors"
    kept = 3 * 2**20 + 7
    (tmp_path / "out.safetensors.part").write_bytes(data[:kept])
    got = loop.run(fetch_file(nodes[0]["fetcher"], [ids(nodes)["honest"]], digest, len(data), dest, banned=set()))
    assert got == ids(nodes)["honest"] and dest.read_bytes() == data
    assert honest.stats["sent_bytes"] == len(data) - kept


def test_a_liar_is_banned_and_the_file_comes_from_an_honest_holder(nodes, loop, tmp_path, weights, honest, liar):
    _, data, digest = weights
    peer, banned = ids(nodes), set()
    dest = tmp_path / "out.safetensors"
    got = loop.run(fetch_file(nodes[0]["fetcher"], [peer["liar"], peer["honest"]], digest, len(data), dest,
                              banned=banned))
    assert got == peer["honest"] and dest.read_bytes() == data
    assert banned == {peer["liar"]} and liar.sent == len(data)
    assert honest.stats["sent_bytes"] == len(data)  # the liar's bytes were thrown away, not resumed from
    # a banned holder is not asked again
    dest.unlink()
    loop.run(fetch_file(nodes[0]["fetcher"], [peer["liar"], peer["honest"]], digest, len(data), dest, banned=banned))
    assert liar.sent == len(data) and dest.read_bytes() == data


def test_a_liar_that_breaks_off_is_found_out_and_the_honest_holder_is_not_blamed(
        nodes, loop, tmp_path, weights, honest, liar):
    """The liar sends 2 MiB of wrong bytes and breaks off; the honest holder sends the rest; the file is wrong, so
    the bytes before the honest holder's are fetched again from it and compared: the liar's differ."""
    _, data, digest = weights
    peer, banned = ids(nodes), set()
    liar.break_after = 2 * 2**20
    dest = tmp_path / "out.safetensors"
    got = loop.run(fetch_file(nodes[0]["fetcher"], [peer["liar"], peer["honest"]], digest, len(data), dest,
                              banned=banned))
    assert got == peer["honest"] and dest.read_bytes() == data
    assert banned == {peer["liar"]} and liar.sent == 2 * 2**20
    assert honest.stats["sent_bytes"] == len(data)  # the rest, then the first 2 MiB again


def test_a_wrong_partial_from_an_earlier_run_bans_no_one(nodes, loop, tmp_path, weights, honest):
    _, data, digest = weights
    peer, banned = ids(nodes), set()
    dest = tmp_path / "out.safetensors"
    (tmp_path / "out.safetensors.part").write_bytes(bytes(2**20))  # zeros: not the file's first MiB
    got = loop.run(fetch_file(nodes[0]["fetcher"], [peer["honest"]], digest, len(data), dest, banned=banned))
    assert got == peer["honest"] and dest.read_bytes() == data and not banned


def test_when_no_holder_delivers_the_error_names_the_file_and_each_holder(nodes, loop, tmp_path, weights, liar):
    _, data, digest = weights
    peer, banned = ids(nodes), set()
    nobody = Identity.generate().peer_id
    dest = tmp_path / "out.safetensors"
    with pytest.raises(WeightsUnavailable) as err:
        loop.run(fetch_file(nodes[0]["fetcher"], [peer["liar"], nobody, peer["honest"]], digest, len(data), dest,
                            banned=banned, timeout=5))
    assert err.value.sha256 == digest and digest in str(err.value)
    assert err.value.outcomes[peer["liar"]] == "sent wrong bytes: banned"
    assert err.value.outcomes[nobody].startswith(("connection_lost", "timeout"))
    assert err.value.outcomes[peer["honest"]].startswith("connection_lost")  # serves nothing in this test
    assert banned == {peer["liar"]} and not dest.exists()
    assert not (tmp_path / "out.safetensors.part").exists()  # the liar's bytes were thrown away: nothing is kept


def test_disabled_sharing_is_refused(nodes, loop, tmp_path, weights):
    """Off: every request is refused and a transfer in progress stops; on again: the fetch resumes."""
    (started, switches), (path, data, digest) = nodes, weights
    peer = ids(nodes)
    share = FileShare(rate=2_000_000, enabled=False)
    share.add(digest, path, len(data))
    switches["honest"].target = share.handler
    dest = tmp_path / "out.safetensors"
    try:
        with pytest.raises(NotServing, match="does not share weights"):
            loop.run(ask(nodes, messages.Have((digest,)).to_message()))
        assert loop.run(find_holders(started["fetcher"], [peer["honest"]], [digest])) == {digest: []}
        with pytest.raises(WeightsUnavailable, match="not_serving"):
            loop.run(fetch_file(started["fetcher"], [peer["honest"]], digest, len(data), dest, banned=set()))
        assert share.stats["sent_bytes"] == 0
        share.enabled = True
        assert loop.run(find_holders(started["fetcher"], [peer["honest"]], [digest])) == {
            digest: [(peer["honest"], len(data))]}

        async def stop_midway():
            fetch = asyncio.create_task(fetch_file(started["fetcher"], [peer["honest"]], digest, len(data), dest,
                                                   banned=set()))
            await asyncio.sleep(0.5)  # about 1 MB at 2 MB/s
            share.enabled = False
            return await fetch

        with pytest.raises(WeightsUnavailable, match="stopped sharing"):
            loop.run(stop_midway())
        kept = (tmp_path / "out.safetensors.part").stat().st_size
        assert 0 < kept < len(data) and share.stats["sent_bytes"] == kept
        uncapped = FileShare()  # on again, without the cap: the rest
        uncapped.add(digest, path, len(data))
        switches["honest"].target = uncapped.handler
        loop.run(fetch_file(started["fetcher"], [peer["honest"]], digest, len(data), dest, banned=set()))
        assert dest.read_bytes() == data and uncapped.stats["sent_bytes"] == len(data) - kept
    finally:
        switches["honest"].target = None


def test_the_rate_cap_holds_and_a_peer_at_its_transfers_is_busy(nodes, loop, tmp_path, weights):
    """2 MiB at 4 MB/s: at least (2 MiB - the bucket's burst of 0.1 s) / 4 MB/s = 0.42 s; meanwhile a second
    transfer is refused as busy (max_transfers=1), and the fetcher then takes the file elsewhere."""
    (started, switches), (path, data, digest) = nodes, weights
    peer = ids(nodes)
    small = path.parent / "small.bin"
    small.write_bytes(data[:2 * 2**20])
    small_digest = sha(data[:2 * 2**20])
    share = FileShare(rate=4_000_000, max_transfers=1)
    share.add(small_digest, small, 2 * 2**20)
    share.add(digest, path, len(data))
    switches["honest"].target = share.handler
    backup = FileShare()
    backup.add(digest, path, len(data))
    switches["liar"].target = backup.handler

    async def both():
        first = asyncio.create_task(fetch_file(started["fetcher"], [peer["honest"]], small_digest, 2 * 2**20,
                                               tmp_path / "small", banned=set()))
        t0 = time.monotonic()
        for _ in range(100):  # until the first transfer holds the one slot
            if share.transfers:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(Busy):
            await ask(nodes, messages.Get(digest, 0, 10).to_message())
        second = await fetch_file(started["fetcher"], [peer["honest"], peer["liar"]], digest, len(data),
                                  tmp_path / "big", banned=set())
        await first
        return second, time.monotonic() - t0

    try:
        second, elapsed = loop.run(both())
    finally:
        switches["honest"].target = switches["liar"].target = None
    assert second == peer["liar"] and (tmp_path / "big").read_bytes() == data
    assert (tmp_path / "small").read_bytes() == data[:2 * 2**20]
    assert 0.4 <= elapsed < 5, elapsed
    assert share.stats["errors"] == {"busy": 2}  # the raw request and the second fetch
    print(f"2 MiB at 4 MB/s took {elapsed:.2f} s")


async def ask(nodes, msg: wire.Message, stream=None) -> wire.Message:
    """One request to the honest node (on `stream` if given) and its reply, errors raised typed."""
    own = stream is None
    stream = stream or await nodes[0]["fetcher"].open(nodes[0]["honest"].peer_id, wire.WEIGHTS_PROTOCOL)
    try:
        return await exchange(stream, msg, 10, max_tensor_bytes=messages.CHUNK_BYTES)
    finally:
        if own:
            await stream.aclose()


def test_bad_requests_get_typed_errors_and_the_server_goes_on(nodes, loop, weights, honest):
    _, data, digest = weights
    bad = [
        (wire.Message("put", {"sha256": digest}), BadRequest, "unknown request"),
        (wire.Message("get", {"sha256": "XYZ", "offset": 0, "length": 1}), BadRequest, "'sha256'"),
        (wire.Message("get", {"sha256": digest, "offset": -1, "length": 1}), BadRequest, "'offset'"),
        (wire.Message("get", {"sha256": digest, "offset": 0}), BadRequest, "'length'"),
        (messages.Get(digest, len(data) - 5, 10).to_message(), BadRequest, "out of range"),
        (wire.Message("get", {"sha256": digest, "offset": 0, "length": messages.MAX_GET_BYTES + 1}), BadRequest,
         "'length'"),
        (messages.Get(sha(b"other"), 0, 1).to_message(), NotServing, "does not hold"),
        (wire.Message("have", {"sha256s": [digest] * 2}), BadRequest, "distinct"),
        (wire.Message("have", {"sha256s": [sha(bytes([i, j])) for i in range(2) for j in range(200)]}), BadRequest,
         "'sha256s'"),
        (wire.Message("have", {"sha256s": digest}), BadRequest, "'sha256s'"),
    ]

    async def one_stream():
        stream = await nodes[0]["fetcher"].open(nodes[0]["honest"].peer_id, wire.WEIGHTS_PROTOCOL)
        try:
            for msg, error, text in bad:
                with pytest.raises(error, match=text):
                    await ask(nodes, msg, stream)
            # the same stream still serves
            reply = await ask(nodes, messages.Get(digest, 100, 1000).to_message(), stream)
            assert messages.Chunk.from_message(reply).data == data[100:1100]
            end = await wire.read_message(stream.reader, 0)
            assert messages.End.from_message(end).length == 1000
        finally:
            await stream.aclose()

    async def broken_framing():
        stream = await nodes[0]["fetcher"].open(nodes[0]["honest"].peer_id, wire.WEIGHTS_PROTOCOL)
        try:
            stream.writer.write(b"\x00\x00\x00\x04\x01{not")  # a header frame that is not JSON
            await stream.writer.drain()
            with pytest.raises(ProtocolError, match="not JSON"):  # answered, then the server stops reading it
                raise_if_error(await asyncio.wait_for(wire.read_message(stream.reader, 0), 10))
        finally:
            await stream.aclose()

    loop.run(one_stream())
    loop.run(broken_framing())
    assert honest.stats["errors"] == {"bad_request": 9, "not_serving": 1, "protocol": 1}
    # and a new stream is served as ever
    reply = loop.run(ask(nodes, messages.Have((digest, sha(b"other"))).to_message()))
    assert messages.Held.from_message(reply).files == {digest: len(data)}


def test_a_slow_reader_holds_the_server_back(nodes, loop, tmp_path):
    """A client that reads one chunk of a 16 MiB get and then nothing for a while: the server waits for the
    transport to take each chunk before reading the next from disk, so it sends ahead by a few chunks at most
    (what the transport buffers), not the file."""
    (started, switches) = nodes
    data = os.urandom(16 * 2**20)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    share = FileShare()
    share.add(sha(data), path, len(data))
    switches["honest"].target = share.handler

    async def slow():
        stream = await started["fetcher"].open(started["honest"].peer_id, wire.WEIGHTS_PROTOCOL)
        try:
            await wire.write_message(stream.writer, messages.Get(sha(data), 0, len(data)).to_message())
            got = [messages.Chunk.from_message(await wire.read_message(stream.reader, messages.CHUNK_BYTES)).data]
            await asyncio.sleep(0.5)
            ahead = share.stats["sent_bytes"]
            for _ in range(len(data) // messages.CHUNK_BYTES + 1):
                msg = await asyncio.wait_for(wire.read_message(stream.reader, messages.CHUNK_BYTES), 10)
                if msg.type == messages.END:
                    break
                got.append(messages.Chunk.from_message(msg).data)
            return ahead, b"".join(got)
        finally:
            await stream.aclose()

    try:
        ahead, got = loop.run(slow())
    finally:
        switches["honest"].target = None
    assert got == data
    assert ahead <= 6 * 2**20, f"the server sent {ahead} bytes ahead of a reader that took 1 MiB"
    print(f"sent ahead of a stalled reader: {ahead / 2**20:.1f} MiB")


def test_a_reader_that_stalls_loses_its_transfer(nodes, loop, weights):
    """A client that asks for a file and takes nothing: after `stall_timeout` the server drops the stream and
    the transfer's slot is free again."""
    (started, switches), (path, data, digest) = nodes, weights
    share = FileShare(stall_timeout=0.3, max_transfers=1)
    share.add(digest, path, len(data))
    switches["honest"].target = share.handler

    async def stall():
        stream = await started["fetcher"].open(started["honest"].peer_id, wire.WEIGHTS_PROTOCOL)
        try:
            await wire.write_message(stream.writer, messages.Get(digest, 0, len(data)).to_message())
            began = False
            for _ in range(100):
                await asyncio.sleep(0.05)
                began |= share.transfers == 1
                if began and not share.transfers:
                    return True
            return False
        finally:
            await stream.aclose()

    try:
        assert loop.run(stall()), "the stalled transfer was never dropped"
        assert share.stats["sent_bytes"] < len(data) and share.stats["gets"] == 0
        reply = loop.run(ask(nodes, messages.Get(digest, 0, 10).to_message()))  # the slot is free again
        assert messages.Chunk.from_message(reply).data == data[:10]
    finally:
        switches["honest"].target = None
