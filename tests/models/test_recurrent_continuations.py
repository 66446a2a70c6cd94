"""Recurrent states across steps, forks and rollbacks, against transformers' forward over the whole sequence.

Mamba's and RecurrentGemma's code for several tokens ignores part of a state it continues from (transformers' Mamba
mixer scans from zero; RecurrentGemma's prefill convolution starts from zeros), so their blocks run such steps one
token at a time; RecurrentGemma also keeps its states in its modules, which must be the session's. Mamba-2 continues
a state over several tokens itself, and keeps running such steps in one forward. Every comparison is with
transformers' own model over the whole sequence, within the harness's tolerance."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import BadRequest
from swarm.span import Span

pytestmark = pytest.mark.models

TOLERANCE = 1e-4
STEPS = (5, 3, 1, 1)  # a prefill in two chunks (the second continues a state), two decode steps: ends 5, 8, 9, 10
_BUILT: dict = {}


def chain_of(model_type: str, tmp_path_factory):
    """(two-span chain, transformers' model) of a tiny checkpoint, built once per module."""
    if model_type not in _BUILT:
        from family_harness import build
        from transformers import AutoModelForCausalLM

        from client.inference.local_chain import LocalChain
        from swarm.model import families

        path = build(model_type, tmp_path_factory.mktemp(model_type) / "ckpt")
        inexact, families.INEXACT = families.INEXACT, {}  # the table may still list a type this makes exact
        try:
            chain = LocalChain(path, [Span(0, 3), Span(3, 6)])
        finally:
            families.INEXACT = inexact
        _BUILT[model_type] = chain, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _BUILT[model_type]


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def run_steps(chain, ids: torch.Tensor):
    """A session through `STEPS` of `ids`; its logits, concatenated."""
    session, outs, position = chain.session(1, 64), [], 0
    for n in STEPS:
        outs.append(session.step(ids[:, position:position + n], position))
        position += n
    return session, torch.cat(outs, dim=1)


def assert_exact(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < TOLERANCE
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("model_type", ["mamba", "recurrent_gemma"])
@torch.inference_mode()
def test_a_fork_at_a_kept_step_end_continues_as_transformers(model_type, tmp_path_factory):
    chain, reference = chain_of(model_type, tmp_path_factory)
    ids = tokens(10, 1)
    source, logits = run_steps(chain, ids)
    assert_exact(logits, reference(ids).logits)

    from client.inference.local_chain import LocalSession

    fork = LocalSession(chain, [cache.fork(8) for cache in source.caches])  # the end of the 3-token step
    source.step(tokens(2, 2), 10)  # the source goes on with other tokens meanwhile
    after = tokens(4, 3)
    ours = fork.step(after, 8)  # several tokens, continuing the fork's state
    assert_exact(ours, reference(torch.cat([ids[:, :8], after], dim=1)).logits[:, 8:])
    assert fork.position == 12 and source.position == 12


@pytest.mark.parametrize("model_type", ["mamba", "jamba"])
@torch.inference_mode()
def test_several_tokens_after_a_rollback_match_transformers(model_type, tmp_path_factory):
    chain, reference = chain_of(model_type, tmp_path_factory)
    assert all(blocks.one_token for blocks in chain.blocks)  # their Mamba mixer cannot continue over several tokens
    ids = tokens(10, 4)
    session, _ = run_steps(chain, ids)
    other = tokens(3, 5)
    ours = session.step(other, 5)  # back to the end of the first chunk, then 3 tokens
    assert_exact(ours, reference(torch.cat([ids[:, :5], other], dim=1)).logits[:, 5:])
    assert sorted(session.caches[0].snapshots) == [5, 8]  # the 3-token step kept its end only


@torch.inference_mode()
def test_a_family_that_continues_over_several_tokens_keeps_one_forward(tmp_path_factory):
    chain, reference = chain_of("mamba2", tmp_path_factory)
    assert not any(blocks.one_token for blocks in chain.blocks)
    ids = tokens(10, 6)
    _, logits = run_steps(chain, ids)
    assert_exact(logits, reference(ids).logits)


@pytest.mark.parametrize("model_type", ["mamba", "recurrent_gemma"])
@torch.inference_mode()
def test_a_fork_or_rollback_between_kept_step_ends_names_where_it_can_return(model_type, tmp_path_factory):
    chain, _ = chain_of(model_type, tmp_path_factory)
    session, _ = run_steps(chain, tokens(10, 7))
    cache = session.caches[0]
    # inside the 3-token step from 5 to 8, run one token at a time: no state was kept there
    with pytest.raises(BadRequest, match=r"ends of the last \d+ steps \(\[5, 8, 9, 10\]\) and at 10, not at 6"):
        cache.fork(6)
    with pytest.raises(BadRequest, match=r"ends of the last \d+ steps \(\[5, 8, 9, 10\]\), not to 7; replay from 0"):
        session.step(tokens(1, 8), 7)
    assert session.position == 10 and cache.fork(0).length == 0


@torch.inference_mode()
def test_blocks_that_reuse_layers_of_blocks_that_served_keep_module_held_states_per_session(tmp_path_factory):
    """A peer moving to an overlapping span builds its blocks on the layers it holds: those layers' modules hold no
    session's state between steps, so the new blocks find where the family keeps it, and two sessions stepped in
    turn on them each continue exactly as transformers."""
    from swarm.model.blocks import SpanBlocks

    chain, reference = chain_of("recurrent_gemma", tmp_path_factory)
    run_steps(chain, tokens(10, 9))  # the old blocks served a session
    old = chain.blocks[0]
    new = SpanBlocks(chain.checkpoint, old.span, reuse=old)
    assert set(new.held) == set(old.held) and new.one_token == old.one_token and new.held
    chain.blocks[0] = new
    try:
        a, b = tokens(10, 10), tokens(10, 11)
        sa, sb, outs = chain.session(1, 64), chain.session(1, 64), {0: [], 1: []}
        position = 0
        for n in STEPS:  # in turn: each step must find its own session's state
            outs[0].append(sa.step(a[:, position:position + n], position))
            outs[1].append(sb.step(b[:, position:position + n], position))
            position += n
        assert_exact(torch.cat(outs[0], dim=1), reference(a).logits)
        assert_exact(torch.cat(outs[1], dim=1), reference(b).logits)
    finally:
        chain.blocks[0] = old
