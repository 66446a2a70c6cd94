"""The comparison behind checked outputs (`client.inference.verify`): tolerances by format, and distances that catch a
lie of the size the tests' liar tells while honest rounding passes."""

from __future__ import annotations

import pytest
import torch

from client.inference.hops import plausible
from client.inference.verify import distances, tolerance

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
