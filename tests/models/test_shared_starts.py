"""A model whose "shared" indexer blocks take the previous block's choice inside the family's layer loop
(`swarm.span.span_starts`): a local chain splits it only where a span may start, and stays exact against
transformers' own forward (`tests/family_harness.py`), where the even split would cut at shared blocks."""

from __future__ import annotations

import pytest
from family_harness import _compare, build

from client.inference.local_chain import LocalChain
from swarm.errors import BadRequest
from swarm.model.checkpoint import Checkpoint
from swarm.span import Span, span_starts, split_evenly

pytestmark = pytest.mark.models

KINDS = ["full", "full", "shared", "full", "shared", "shared"]  # the even cuts 2 and 4 are shared blocks


def test_a_chain_of_a_model_with_shared_blocks_cuts_at_starts_and_is_exact(tmp_path):
    path = build("glm_moe_dsa", tmp_path, indexer_types=KINDS)
    ckpt = Checkpoint(path)
    assert span_starts(ckpt.config) == (0, 1, 3)
    assert [b.span for b in LocalChain.from_path(path, 3).blocks] == [Span(0, 1), Span(1, 3), Span(3, 6)]
    with pytest.raises(BadRequest, match=r"start at block 2.*one of the blocks \[0, 1, 3\]"):
        LocalChain(path, split_evenly(6, 3))  # the even split, without the model's starts
    outcome = _compare(ckpt, path, LocalChain, split_evenly)
    assert outcome.result == "exact", outcome
