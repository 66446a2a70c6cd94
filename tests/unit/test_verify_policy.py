"""The comparison behind checked outputs (`client.inference.verify`): tolerances by format, and distances that catch a
lie of the size the tests' liar tells while honest rounding passes; and the free check of every output
(`client.inference.hops.implausible`) with its bounds derived from the model."""

from __future__ import annotations

import pytest
import torch

from client.inference.hops import MAX_SHRINK, check_plausible, implausible, output_floor, plausible
from client.inference.routing import Hop
from client.inference.verify import distances, tolerance
from swarm.errors import WrongOutput
from swarm.span import Span

pytestmark = pytest.mark.unit


def test_the_loosest_format_involved_sets_the_tolerance():
    assert tolerance(("float32", "float32")) == 1e-3
    assert tolerance(("float32", "bfloat16")) == 0.03
    assert tolerance(("int8/bfloat16", "float32", "float16")) == 0.06
    assert tolerance(("nf4/bfloat16", "int8")) == 0.15


def test_rounding_of_a_format_passes_and_a_lie_does_not():
    torch.manual_seed(0)
    want = torch.randn(2, 5, 576) * 3
    want[:, 0, :4] = 400.0  # the massive activations of a sequence's first position
    assert distances(want.to(torch.bfloat16), want).max() < tolerance(("bfloat16",))
    assert distances(want.to(torch.float16), want).max() < tolerance(("float16",))
    lie = want + 0.5 * want.abs().mean() * torch.randn_like(want)
    far = distances(lie, want)
    assert far.shape == (5,) and (far > tolerance(("float32",))).all()
    # a position dominated by a few huge activations hides a lie of a few percent of its norm from the int8
    # tolerance (docs/security.md); the liar's other positions give it away
    assert (far[1:] > tolerance(("int8/bfloat16",))).all() and far[0] < tolerance(("int8/bfloat16",))


def test_distances_take_the_worst_sequence_of_a_batch():
    want = torch.ones(3, 2, 8)
    got = want.clone()
    got[1, 1] += 1.0
    assert distances(got, want).tolist() == [0.0, pytest.approx(1.0)]


def test_implausible_outputs_are_refused_before_any_use():
    x = torch.randn(1, 3, 64)
    assert plausible(x, x + 0.1 * torch.randn_like(x))
    assert plausible(x, 50 * x)  # blocks may grow activations a lot
    assert not plausible(x, x * 1e7)
    assert not plausible(x, torch.full_like(x, float("nan")))
    assert not plausible(x, torch.full_like(x, float("inf")))


def test_degenerate_outputs_are_refused_as_wrong_output():
    torch.manual_seed(0)
    x, floor = torch.randn(2, 3, 64), output_floor()
    assert not plausible(x, torch.zeros_like(x), floor)
    constant = x.pow(2).mean(-1, keepdim=True).sqrt().expand_as(x)  # the honest RMS, no spread
    assert not plausible(x, constant, floor)
    assert not plausible(x, 1e-5 * torch.randn_like(x), floor)  # norms far below the model's range
    one_row = x.clone()
    one_row[1, 2] = 0.0
    assert "1 of 6 hidden vectors degenerate" in implausible(x, one_row, floor)
    with pytest.raises(WrongOutput, match=r"peer \S+ returned wrong outputs for blocks \[15:30\): non-finite"):
        check_plausible(Hop("12D3KooWpeer", Span(15, 30)), x, torch.full_like(x, float("nan")), floor)
    assert WrongOutput.code == "wrong_output" and WrongOutput.retryable


def test_a_refusal_needs_both_the_model_floor_and_a_collapse_of_the_input():
    floor = output_floor()
    tiny_input = 1e-6 * torch.randn(1, 4, 64)  # an input degenerate itself: small outputs are its own
    assert plausible(tiny_input, 1e-7 * torch.randn(1, 4, 64), floor)
    zero_input = torch.zeros(1, 4, 64)  # a padding token's zero embedding gives zeros through bias-free blocks
    assert plausible(zero_input, torch.zeros(1, 4, 64), floor)
    x = torch.randn(1, 4, 64)
    assert plausible(x, 0.5 * floor * torch.randn_like(x) + 10 * MAX_SHRINK * x, floor)  # under the floor only
    assert plausible(x, 2 * floor * torch.randn_like(x), floor)  # a large shrink, above the floor


def test_the_floor_is_read_from_the_models_norm_epsilon():
    from types import SimpleNamespace

    assert output_floor(SimpleNamespace(rms_norm_eps=1e-6)) == pytest.approx(1e-3)
    assert output_floor(SimpleNamespace(layer_norm_epsilon=1e-5)) == pytest.approx(10 ** -2.5)
    assert output_floor(SimpleNamespace(norm_eps=1e-4, model_type="x")) == pytest.approx(1e-2)
    assert output_floor(SimpleNamespace()) == output_floor() == pytest.approx(1e-3)  # no epsilon: the default

    class Nested:  # a composite config: the text decoder's epsilon
        def get_text_config(self, decoder=False):
            return SimpleNamespace(rms_norm_eps=1e-6)

    assert output_floor(Nested()) == pytest.approx(1e-3)
