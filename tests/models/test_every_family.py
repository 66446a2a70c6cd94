"""Every model type of transformers' causal-LM mapping is served exactly or refused with a reason.

Ground truth is each type's own model run by transformers in this process (see `tests/family_harness.py`
for the tiny configs and the comparison). A type is "exact" here exactly when `swarm/model/families.py` lists
it, so a type that breaks, or one that starts working, fails this test until the table is regenerated
with `python benchmarks/model_coverage.py` (which also writes docs/models.md).
"""

from __future__ import annotations

import pytest
from family_harness import check, model_types

from swarm.model.checkpoint import Checkpoint
from swarm.errors import UnsupportedModel
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


def test_per_layer_inputs_are_refused_before_any_weight_loads(tmp_path):
    """Gemma 4's smaller checkpoints feed every layer an input computed from the tokens; the wire does not
    carry it, so such a checkpoint is refused by its config alone (no weights are present here)."""
    from family_harness import tiny_config

    from swarm.model.checkpoint import Checkpoint
    from swarm.errors import UnsupportedModel

    config = tiny_config("gemma4_text")
    config.hidden_size_per_layer_input = 16
    config.vocab_size_per_layer_input = 256
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="gemma4_text.*per-layer inputs"):
        Checkpoint(tmp_path)
