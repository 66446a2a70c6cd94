"""`swarm demo`'s parts that need no swarm: its verbosity, and the block count read before torch loads."""

from __future__ import annotations

import json
import logging

import pytest

from client.demo import num_blocks
from swarm.cli import build_parser

pytestmark = pytest.mark.unit


def test_the_demo_is_quiet_unless_verbose_wherever_the_flag_stands():
    parser = build_parser()
    quiet = parser.parse_args(["demo"])
    assert not quiet.verbose and quiet.log_level == logging.ERROR
    assert parser.parse_args(["-v", "demo"]).verbose and parser.parse_args(["demo", "-v"]).verbose
    assert parser.parse_args(["demo", "--verbose"]).verbose
    assert not hasattr(parser.parse_args(["bootstrap"]), "log_level")  # other commands log as before


def test_the_block_count_comes_from_the_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30}))
    assert num_blocks(tmp_path) == 30
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 26}}))
    assert num_blocks(tmp_path) == 26


def test_a_directory_without_a_config_is_refused_by_the_checkpoint_reader(tmp_path):
    from swarm.errors import CheckpointError

    with pytest.raises(CheckpointError, match="no config.json"):
        num_blocks(tmp_path)
