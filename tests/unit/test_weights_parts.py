"""The pure parts of weight sharing: the bandwidth cap's token bucket, the weights protocol's messages, and the
partial file of a download (who sent which bytes, and which of them differ from the right ones)."""

from __future__ import annotations

import hashlib

import pytest

from swarm.errors import BadRequest, ConfigError
from swarm.net.wire import Blob, Message
from swarm.weights import messages
from swarm.weights.messages import CHUNK_BYTES, MAX_GET_BYTES, MAX_HAVE, Chunk, End, Get, Have, Held
from swarm.weights.partial import PartialFile
from swarm.weights.share import MIN_RATE, FileShare, TokenBucket

pytestmark = pytest.mark.unit
A, B = hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_lets_a_burst_through_then_paces_at_the_rate():
    clock = Clock()
    bucket = TokenBucket(1000.0 * 1024, burst=10 * 1024, clock=clock)
    assert bucket.reserve(10 * 1024) == 0  # the burst
    assert bucket.reserve(1024) == pytest.approx(1 / 1000)
    clock.now += 1.0  # a second refills the burst, never more
    assert bucket.reserve(10 * 1024) == 0
    assert bucket.reserve(20 * 1024) == pytest.approx(20 / 1000)


def test_concurrent_transfers_queue_behind_each_other_and_the_total_keeps_to_the_rate():
    clock = Clock()
    bucket = TokenBucket(1e6, clock=clock)
    assert bucket.burst == pytest.approx(1e5)  # a tenth of a second
    waits = [bucket.reserve(100_000) for _ in range(11)]  # eleven transfers ask at once
    assert waits[0] == 0 and waits == sorted(waits)
    assert waits[-1] == pytest.approx(1.0)  # 1.1 MB in all: the burst, then a second at the rate


def test_the_burst_and_the_chunk_size_follow_the_rate():
    assert TokenBucket(MIN_RATE).burst == 4096  # never below a few KiB
    assert TokenBucket(1e9).burst == CHUNK_BYTES  # nor above one chunk
    assert FileShare(rate=4e6).chunk_bytes == 400_000 and FileShare().chunk_bytes == CHUNK_BYTES
    for bad in (0, -1, MIN_RATE - 1, float("inf"), float("nan")):
        with pytest.raises(ConfigError):
            TokenBucket(bad)
    with pytest.raises(ConfigError):
        FileShare(max_transfers=0)


def test_messages_round_trip():
    for msg in (Have((A, B)), Held({A: 5, B: 0}), Get(A, 3, MAX_GET_BYTES), End(7), Chunk(b"xyz")):
        back = type(msg).from_message(msg.to_message())
        assert back == msg if not isinstance(msg, Chunk) else bytes(back.data) == b"xyz"


@pytest.mark.parametrize("msg", [
    Message("have", {"sha256s": []}),
    Message("have", {"sha256s": [A, A]}),
    Message("have", {"sha256s": [A.upper()]}),
    Message("have", {"sha256s": [hashlib.sha256(bytes([i % 256, i // 256])).hexdigest() for i in range(MAX_HAVE + 1)]}),
    Message("have", {"sha256s": [A]}, (Blob("int8", (1,), b"x"),)),
    Message("held", {"files": {A: -1}}),
    Message("held", {"files": {"x": 1}}),
    Message("held", {"files": [A]}),
    Message("get", {"sha256": A, "offset": 0, "length": MAX_GET_BYTES + 1}),
    Message("get", {"sha256": A, "offset": 1.5, "length": 1}),
    Message("get", {"sha256": A, "offset": True, "length": 1}),
    Message("get", {"sha256": A[:-1], "offset": 0, "length": 1}),
    Message("chunk", {}),
    Message("chunk", {}, (Blob("int8", (0,), b""),)),
    Message("chunk", {}, (Blob("int8", (CHUNK_BYTES + 1,), bytes(CHUNK_BYTES + 1)),)),
    Message("chunk", {}, (Blob("bool", (1,), b"\x01"),)),
    Message("end", {"length": -1}),
    Message("end", {}),
])
def test_malformed_messages_are_bad_requests(msg):
    cls = {"have": Have, "held": Held, "get": Get, "chunk": Chunk, "end": End}[msg.type]
    with pytest.raises(BadRequest):
        cls.from_message(msg)


def test_a_message_of_another_type_is_a_bad_request():
    with pytest.raises(BadRequest, match="expected a 'have' message"):
        Have.from_message(Get(A, 0, 1).to_message())


def test_a_partial_file_knows_who_sent_which_bytes_and_which_differ(tmp_path):
    data = bytes(range(256)) * 64
    path = tmp_path / "f.part"
    path.write_bytes(data[:1000])
    partial = PartialFile(path, len(data))
    partial.load()
    assert partial.length == 1000 and partial.sources == [(0, 1000, None)]
    partial.append(data[1000:3000], "peerA")
    partial.append(b"\x00" * 3000, "peerA")  # wrong bytes, same source: one range
    partial.append(data[6000:], "peerB")
    assert partial.sources == [(0, 1000, None), (1000, 6000, "peerA"), (6000, len(data), "peerB")]
    assert partial.hasher.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert partial.replace(0, data[:3000]) == set()  # the earlier run's and A's first bytes were right
    assert partial.replace(3000, data[3000:7000]) == {"peerA"}  # A's zeros differ; B's bytes in it do not
    partial.rehash("peerB")
    assert path.read_bytes() == data and partial.hasher.hexdigest() == hashlib.sha256(data).hexdigest()
    assert partial.sources == [(0, len(data), "peerB")]
    partial.close()
    assert path.exists()


def test_a_partial_longer_than_the_file_is_thrown_away_and_an_empty_one_removed(tmp_path):
    path = tmp_path / "f.part"
    path.write_bytes(b"x" * 20)
    partial = PartialFile(path, 10)
    partial.load()
    assert partial.length == 0 and path.stat().st_size == 0
    assert partial.hasher.hexdigest() == hashlib.sha256(b"").hexdigest()
    partial.close()
    assert not path.exists()


def test_a_share_takes_only_files_of_the_size_it_is_told(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"abc")
    share = FileShare()
    share.add(A, path, 3)
    with pytest.raises(ValueError):
        share.add(B, path, 4)
    with pytest.raises(ValueError):
        share.add("not-a-sha", path, 3)
    assert set(share.files) == {A}
    share.remove(A)
    share.remove(A)  # twice is fine
    assert share.files == {}
    assert messages.is_sha256(A) and not messages.is_sha256(A + "0")
