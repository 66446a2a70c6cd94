"""Every model type of transformers' causal-LM mapping is served exactly or refused with a reason.

Ground truth is each type's own model run by transformers in this process (see `tests/family_harness.py`
for the tiny configs and the comparison). A type is "exact" here exactly when `swarm/model/families.py` lists
it, so a type that breaks, or one that starts working, fails this test until the table is regenerated
with `python benchmarks/model_coverage.py` (which also writes docs/models.md).
"""

from __future__ import annotations

import pytest
from family_harness import BASES, UNCHECKED, build, check, model_types, open_config_alone
from transformers import AutoConfig

from swarm.model import families
from swarm.model.checkpoint import Checkpoint
from swarm.model.head import ModelHead
from swarm.errors import CheckpointError, UnsupportedModel
from swarm.model.families import EXACT, INEXACT

pytestmark = pytest.mark.models


@pytest.mark.parametrize("model_type", model_types())
def test_served_exactly_or_refused_with_a_reason(model_type, tmp_path):
    outcome = check(model_type, tmp_path / "ckpt")
    assert outcome.result in ("exact", "inexact", "refused", "unchecked"), \
        f"{model_type}: {outcome.result}: {outcome.detail}"
    # Measured inexact exactly where the table says so; the table makes the real checks refuse it.
    assert (outcome.result == "inexact") == (model_type in INEXACT), f"{model_type}: {outcome.result}"
    if outcome.result == "inexact":
        with pytest.raises(UnsupportedModel, match=f"{model_type}.*not computed exactly"):
            Checkpoint(tmp_path / "ckpt")
    if model_type in EXACT:
        assert outcome.result == "exact", f"{model_type} is listed as exact but is {outcome.result}: {outcome.detail}"
    else:
        assert outcome.result != "exact", f"{model_type} is now exact: regenerate swarm/model/families.py"
    if outcome.result == "refused":
        assert "model type" in outcome.detail, f"the refusal of {model_type} does not name it: {outcome.detail}"


def test_per_layer_inputs_are_exact(tmp_path):
    """Gemma 4's smaller checkpoints feed every layer an input computed from the tokens: the client's head computes
    them and they cross every span boundary after the hidden states (`swarm.model.streams`), exactly."""
    from client.inference.local_chain import LocalChain
    from family_harness import _compare

    from swarm.span import split_evenly

    path = build("gemma4_text", tmp_path, hidden_size_per_layer_input=16, vocab_size_per_layer_input=256)
    ckpt = Checkpoint(path)
    assert [s.arg for s in ckpt.boundary.streams] == ["per_layer_input"]
    outcome = _compare(ckpt, path, LocalChain, split_evenly)
    assert outcome.result == "exact", outcome


def tied_by_default() -> list[str]:
    """Types whose default config ties weights (`tie_word_embeddings`: the LM head to the embeddings, and for
    some families weights between layers). The sweep above builds every type untied."""
    tied = []
    for model_type in model_types():
        if model_type in UNCHECKED:
            continue
        try:
            config = AutoConfig.for_model(model_type, **BASES.get(model_type, {}))
        except Exception:  # noqa: BLE001 - no default config: the sweep above records the type
            continue
        if getattr(config.get_text_config(decoder=True), "tie_word_embeddings", False):
            tied.append(model_type)
    return tied


@pytest.mark.parametrize("model_type", tied_by_default())
def test_tied_checkpoints_open_or_are_refused_with_a_typed_error(model_type, tmp_path, monkeypatch):
    """Every type whose checkpoints come tied, built tied, and opened as a client does (the checkpoint, then
    its head, where transformers ties the weights): it opens, or it is refused with a typed error that names
    the model type; never an untyped failure. The table of inexact types is set aside, so that what lies
    behind it is opened too."""
    monkeypatch.setattr(families, "INEXACT", {})
    try:
        build(model_type, tmp_path, tie_word_embeddings=True)
    except Exception:  # noqa: BLE001 - transformers cannot build it small: its config alone is opened
        problem = open_config_alone(model_type, tmp_path, tie_word_embeddings=True)
        assert not problem, f"{model_type}: {problem}"
        return
    try:
        ModelHead(Checkpoint(tmp_path))
    except (UnsupportedModel, CheckpointError) as exc:
        assert "model type" in str(exc), f"the refusal of {model_type} does not name it: {exc}"
