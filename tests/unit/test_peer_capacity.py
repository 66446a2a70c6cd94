"""A peer's block cost: the cache file per (model, device, dtype) and the moving figure under load."""

from __future__ import annotations

import json

import pytest

from peer.capacity import MAX_AGE, BlockCost, Capacity, CapacityCache

pytestmark = pytest.mark.unit


def test_the_cache_keeps_one_figure_per_key(tmp_path):
    cache = CapacityCache(tmp_path / "sub" / "capacity.json")
    key = cache.key("m", "cpu", "float32")
    assert cache.get(key, 100.0) is None
    cache.put(key, BlockCost(2.5, 0.1, 100.0))
    cache.put(cache.key("m", "cpu", "bfloat16"), BlockCost(1.0, 0.05, 100.0))
    assert cache.get(key, 200.0) == BlockCost(2.5, 0.1, 100.0)
    assert cache.get(cache.key("other", "cpu", "float32"), 200.0) is None
    assert "threads=" in key  # a figure measured with other thread counts is another machine


def test_stale_broken_or_absurd_figures_are_measured_again(tmp_path):
    path = tmp_path / "capacity.json"
    cache = CapacityCache(path)
    key = cache.key("m", "cpu", "float32")
    cache.put(key, BlockCost(2.5, 0.1, 0.0))
    assert cache.get(key, MAX_AGE + 1) is None  # too old
    assert cache.get(key, -10.0) is None  # from the future
    path.write_text(json.dumps({key: {"decode_ms": -1, "prefill_ms": 0.1, "measured_at": 0.0}}))
    assert cache.get(key, 1.0) is None
    path.write_text("{not json")
    assert cache.get(key, 1.0) is None
    cache.put(key, BlockCost(2.5, 0.1, 1.0))  # a broken file is replaced
    assert cache.get(key, 2.0) == BlockCost(2.5, 0.1, 1.0)
    assert CapacityCache(None).get(key, 1.0) is None  # no file: nothing cached, nothing written


def test_the_live_figure_follows_real_steps():
    capacity = Capacity(BlockCost(decode_ms=1.0, prefill_ms=0.1, measured_at=0.0))
    assert capacity.speed == pytest.approx(1000.0) and capacity.throughput(4) == pytest.approx(250.0)
    for _ in range(200):  # the machine became 4x slower: 4 ms per block over a 5-block span
        capacity.observe(compute_ms=20.0, blocks=5)
    assert capacity.decode_ms == pytest.approx(4.0, rel=0.01)
    assert capacity.throughput(5) == pytest.approx(50.0, rel=0.01)
    capacity.observe(compute_ms=float("nan"), blocks=5)
    capacity.observe(compute_ms=5.0, blocks=0)
    assert capacity.observed == 200  # nonsense is ignored
