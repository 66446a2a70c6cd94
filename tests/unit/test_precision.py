"""Devices, dtypes and weight formats: what `--device`, `--dtype` and `--quant` resolve to (or refuse, in one
line), how formats rank and route (a minimum precision; one format per span on failover), which wire
encodings a session chooses from its route, and what a quantized block is counted at in the memory budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from client.inference.encodings import Encodings, choose_encodings
from client.inference.routing import FORMAT_PENALTY_MS, Bans, Measurements, Offer, find_route
from swarm.model import precision
from swarm.errors import ConfigError, NoRoute
from swarm.formats import format_name, precision_rank
from swarm.model.precision import Precision, check_quant, resolve_device, resolve_dtype
from swarm.span import Span

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


@pytest.mark.parametrize("name, match", [
    ("cuda", "no CUDA device is available here"), ("cuda:1", "no CUDA device is available here"),
    ("mps", "MPS is not available"), ("tpu", "is not a device"), ("cuda:x", "is not a device"),
])
def test_a_device_that_is_not_here_is_a_one_line_configuration_error(name, match, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "_mps_available", lambda: False)
    with pytest.raises(ConfigError, match=match) as info:
        resolve_device(name)
    assert "\n" not in str(info.value)


def test_auto_device_and_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "_mps_available", lambda: False)
    assert resolve_device("auto") == CPU and resolve_device("CPU") == CPU
    monkeypatch.setattr(precision, "cpu_computes_bfloat16", lambda: True)
    assert resolve_dtype("auto", CPU) == "bfloat16"
    monkeypatch.setattr(precision, "cpu_computes_bfloat16", lambda: False)
    assert resolve_dtype("auto", CPU) == "float32"
    assert resolve_dtype("float16", CPU) == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "float16"  # an older GPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype("auto", torch.device("mps")) == "float16"
    with pytest.raises(ConfigError, match="--dtype"):
        resolve_dtype("float64", CPU)


def test_quantization_choices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Precision.of("cpu", "auto", "int8") == Precision(CPU, "bfloat16", "int8")  # int8 weights, bf16 compute
    with pytest.raises(ConfigError, match="nf4 needs CUDA"):
        check_quant("nf4", CPU, "bfloat16")
    with pytest.raises(ConfigError, match="computes in 16 bits"):
        check_quant("int8", CPU, "float32")
    with pytest.raises(ConfigError, match="not available on mps"):
        check_quant("int8", torch.device("mps"), "float16")
    with pytest.raises(ConfigError, match="--quant must be"):
        check_quant("int4", CPU, "float32")


def test_formats_rank_from_nf4_to_float32():
    ranks = [precision_rank(*f) for f in (("bfloat16", "nf4"), ("float16", "int8"), ("float32", "int8"),
                                          ("bfloat16", "none"), ("float16", "none"), ("float32", "none"))]
    assert ranks == [0, 1, 1, 2, 2, 3]
    assert format_name("float32", "int8") == "int8/float32" and format_name("bfloat16", "none") \
        == "bfloat16"


# ---- routing with mixed formats ----

MIXED = [Offer("f32", Span(0, 6)), Offer("bf16", Span(0, 6), dtype="bfloat16"),
         Offer("int8", Span(0, 6), dtype="bfloat16", quant="int8")]


def fastest_is(peer: str) -> Measurements:
    m = Measurements()
    for offer in MIXED:
        m.step(offer.peer, rtt_ms=1.0 if offer.peer == peer else 30.0, compute_ms=0.5, tokens=1, blocks=6)
    return m


def test_a_minimum_precision_keeps_coarser_formats_out_of_routes():
    m = fastest_is("int8")
    assert [h.peer for h in find_route(MIXED, Span(0, 6), m, Bans())] == ["int8"]
    assert [h.peer for h in find_route(MIXED, Span(0, 6), m, Bans(), min_rank=2)] in (["bf16"], ["f32"])
    assert [h.peer for h in find_route(MIXED, Span(0, 6), m, Bans(), min_rank=3)] == ["f32"]
    with pytest.raises(NoRoute, match=r"2 in a format below float32 \(bfloat16, int8/bfloat16\)"):
        find_route(MIXED, Span(0, 6), m, Bans(), min_rank=3, exclude={"f32"})


def test_failover_prefers_the_span_s_format_and_changes_it_only_when_it_must():
    m = fastest_is("bf16")  # the fastest, but not the format the span was opened with
    assert [h.peer for h in find_route(MIXED, Span(0, 6), m, Bans(), prefer="float32")] == ["f32"]
    assert [h.peer for h in find_route(MIXED, Span(0, 6), m, Bans(), prefer="int8/bfloat16")] == ["int8"]
    # no peer of the format left: the cheapest of the others, rather than no route
    assert [h.peer for h in find_route(MIXED, Span(0, 6), m, Bans(), prefer="float32", exclude={"f32"})] == ["bf16"]
    assert FORMAT_PENALTY_MS >= 1000  # far above any real hop: a format change is the last resort


# ---- wire encodings chosen from the route ----

def options(wire="auto", prefill_wire="auto", tokens=64):
    return SimpleNamespace(wire=wire, prefill_wire=prefill_wire, prefill_wire_tokens=tokens)


@pytest.mark.parametrize("formats, expected", [
    ([("float32", "none")] * 3, Encodings("float32", "float32")),
    ([("bfloat16", "none")] * 3, Encodings("bfloat16", "int8")),
    ([("float16", "none"), ("float32", "none")], Encodings("float16", "int8")),
    ([("float16", "none"), ("bfloat16", "none")], Encodings("bfloat16", "int8")),
    ([("bfloat16", "int8"), ("float32", "none")], Encodings("bfloat16", "int8")),
])
def test_default_encodings_are_never_coarser_than_the_peers_compute(formats, expected):
    assert choose_encodings(options(), formats) == expected


def test_encodings_can_be_set_and_pick_by_step_size():
    chosen = choose_encodings(options("float16", "int8", 16), [("float32", "none")])
    assert chosen == Encodings("float16", "int8", 16)
    assert [chosen.for_tokens(n) for n in (1, 15, 16, 2048)] == ["float16", "float16", "int8", "int8"]
    assert chosen.all == ("float16", "int8", "float32")  # float32: what a replay travels in
    assert Encodings().all == ("float32",)


# ---- memory: a quantized block counts at its format's size ----

def test_quantized_blocks_count_smaller_in_the_budget(tiny_checkpoint):
    from swarm.model.checkpoint import Checkpoint

    ckpt = Checkpoint(tiny_checkpoint("llama"))
    full = ckpt.block_bytes(0, torch.float32)
    int8 = ckpt.block_bytes(0, torch.float32, "int8")
    half = ckpt.block_bytes(0, torch.bfloat16)
    assert half == full // 2 and int8 < 0.3 * full


def test_a_quantized_peer_takes_proportionally_more_blocks_in_the_same_budget(tiny_checkpoint):
    from pathlib import Path

    from peer.config import PeerConfig
    from peer.server import memory_blocks
    from swarm.model.checkpoint import Checkpoint

    path = tiny_checkpoint("llama")
    ckpt = Checkpoint(path)
    budget = 3 * ckpt.block_bytes(0, torch.float32)  # three float32 blocks, no cache
    config = PeerConfig(model=Path(path), memory_budget=budget, cache_tokens=1)
    counts = {fmt: memory_blocks(ckpt, config, Precision(CPU, *fmt)) for fmt in
              (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"))}
    assert counts[("float32", "none")] == 2  # two blocks and the cache's share fit, not three
    assert counts[("bfloat16", "none")] >= 5 and counts[("bfloat16", "int8")] == 6  # capped at the model's 6


def test_quantized_weights_without_a_chosen_dtype_get_the_16_bit_type_they_compute_in(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for computes_bfloat16 in (True, False):  # int8 on the CPU computes in bfloat16, native or not
        monkeypatch.setattr(precision, "cpu_computes_bfloat16", lambda: computes_bfloat16)
        assert Precision.of("cpu", None, "int8") == Precision(CPU, "bfloat16", "int8")
    assert Precision.of("cpu", None, "none") == Precision(CPU, "float32", "none")  # unquantized: exact float32
    with pytest.raises(ConfigError, match="nf4 needs CUDA"):  # no dtype makes nf4 work on the CPU
        Precision.of("cpu", None, "nf4")


def test_a_chosen_dtype_that_the_weights_cannot_compute_in_is_still_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="use --dtype auto, bfloat16 or float16"):
        Precision.of("cpu", "float32", "int8")
    assert Precision.of("cpu", "float16", "int8") == Precision(CPU, "float16", "int8")


def test_quantized_weights_on_cuda_without_a_chosen_dtype_compute_in_its_16_bit_type(monkeypatch):
    monkeypatch.setattr(precision, "resolve_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # bitsandbytes "installed"
    assert Precision.of("cuda", None, "nf4") == Precision(torch.device("cuda", 0), "float16", "nf4")
    with pytest.raises(ConfigError, match="computes in 16 bits"):
        Precision.of("cuda", "float32", "int8")


def test_peer_config_leaves_the_dtype_unchosen_by_default():
    from pathlib import Path

    from peer.config import PeerConfig

    assert PeerConfig(model=Path("m")).dtype is None and PeerConfig(model=Path("m"), quant="int8").dtype is None
    with pytest.raises(ConfigError, match="--dtype"):
        PeerConfig(model=Path("m"), dtype="float64")
