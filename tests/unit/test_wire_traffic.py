"""The wire's traffic counters: every byte of every frame written and read, headers included."""

from __future__ import annotations

import asyncio

import torch

from swarm.net import wire


class Sink:
    def __init__(self):
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += bytes(data)

    async def drain(self) -> None:
        pass


def test_counts_what_is_written_and_read():
    msg = wire.Message(wire.STEP, {"step": 1}, (wire.blob_of(torch.randn(1, 3, 8)),))

    async def main():
        before = wire.traffic()
        sink = Sink()
        await wire.write_message(sink, msg)
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(sink.data))
        reader.feed_eof()
        got = await wire.read_message(reader, 2**20)
        after = wire.traffic()
        return sink.data, got, before, after

    data, got, before, after = asyncio.run(main())
    assert got.fields == {"step": 1}
    assert after["sent"] - before["sent"] == len(data) == after["received"] - before["received"]
    assert len(data) > 3 * 8 * 4 + 2 * 5  # tensor bytes and two frame headers at least
