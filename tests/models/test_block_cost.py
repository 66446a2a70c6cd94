"""Measuring what a block costs: real steps through a real block, for a minimum wall time."""

from __future__ import annotations

import time

import pytest

from peer.capacity import measure_block
from swarm.model.blocks import SpanBlocks
from swarm.span import Span

pytestmark = pytest.mark.models


def test_the_measurement_lasts_long_enough_and_is_per_block(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    one, three = SpanBlocks(path, Span(0, 1)), SpanBlocks(path, Span(0, 3))
    started = time.perf_counter()
    cost = measure_block(one, min_seconds=0.2, now=123.0)
    assert time.perf_counter() - started >= 0.2  # spans scheduler periods: a CPU quota shows
    assert 0 < cost.decode_ms < 1000 and 0 < cost.prefill_ms < cost.decode_ms and cost.measured_at == 123.0
    assert cost.speed == pytest.approx(1000 / cost.decode_ms)
    per_block = measure_block(three, min_seconds=0.2).decode_ms
    assert per_block == pytest.approx(cost.decode_ms, rel=0.75)  # divided by the span's length
