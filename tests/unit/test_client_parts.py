"""The client's settings and command-line plumbing: bad values are typed, one-line errors."""

from __future__ import annotations

import argparse

import pytest

from client.cli import generation_kwargs, sampling_options
from client.config import ClientConfig
from swarm.cli import build_parser, main
from swarm.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("field", ["step_timeout", "min_deadline", "deadline_factor", "max_retries", "ban_seconds",
                                   "slow_factor", "slow_steps", "refresh_interval", "ping_timeout", "open_timeout"])
def test_non_positive_settings_are_refused_by_name(field):
    with pytest.raises(ConfigError, match="--" + field.replace("_", "-")):
        ClientConfig(**{field: 0})


def test_unknown_dtype_is_refused():
    with pytest.raises(ConfigError, match="--dtype"):
        ClientConfig(dtype="int8")


def test_connection_without_initial_peers_is_a_config_error():
    from client.connection import SwarmConnection

    with pytest.raises(ConfigError, match="no initial peers"):
        SwarmConnection("tiny", 6, ClientConfig())


def test_status_without_initial_peers_prints_one_line(capsys):
    assert main(["status", "--model-id", "tiny", "--num-blocks", "6"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("swarm status: no initial peers") and "\n" not in err


def test_client_commands_parse_their_options():
    args = build_parser().parse_args(["generate", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--max-new-tokens",
                                      "5", "--temperature", "0.7", "--min-deadline", "0.5", "hello"])
    assert (args.prompt, args.max_new_tokens, args.temperature, args.min_deadline) == ("hello", 5, 0.7, 0.5)
    assert args.initial_peers == ["/ip4/127.0.0.1/tcp/1/p2p/x"]
    chat = build_parser().parse_args(["chat", "--system", "be brief"])
    assert chat.system == "be brief" and chat.max_length == 2048
    demo = build_parser().parse_args(["demo", "--peers", "2"])
    assert demo.peers == 2 and demo.prompt


class Tokenizer:
    eos_token_id, pad_token_id, unk_token_id = 2, None, 0

    def convert_tokens_to_ids(self, token):
        return {"<|im_end|>": 7}.get(token, 0)


def args(**kw):
    base = dict(max_new_tokens=8, temperature=None, top_p=None, top_k=None, seed=None)
    return argparse.Namespace(**{**base, **kw})


def test_generation_is_greedy_without_a_temperature():
    kwargs = generation_kwargs(args(), Tokenizer())
    assert kwargs["do_sample"] is False and kwargs["eos_token_id"] == [2, 7] and kwargs["pad_token_id"] == 2
    sampled = generation_kwargs(args(temperature=0.7, top_p=0.9, top_k=20, seed=1), Tokenizer())
    assert sampled["do_sample"] is True and (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.9, 20)
    assert "prompt_lookup_num_tokens" not in kwargs
    assert generation_kwargs(args(speculative_tokens=6), Tokenizer())["prompt_lookup_num_tokens"] == 6
    assert "prompt_lookup_num_tokens" not in generation_kwargs(args(speculative_tokens=6, temperature=0.5), Tokenizer())


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(max_new_tokens=0),
                                 dict(speculative_tokens=-1)])
def test_bad_generation_options_are_config_errors(bad):
    with pytest.raises(ConfigError):
        generation_kwargs(args(**bad), Tokenizer())


def test_generate_options_become_sampling_settings():
    assert sampling_options(args(speculative_tokens=8)) == dict(temperature=0.0, seed=None, speculate=8)
    sampled = sampling_options(args(temperature=0.7, top_p=0.9, top_k=20, seed=1, speculative_tokens=0))
    assert sampled == dict(temperature=0.7, top_p=0.9, top_k=20, seed=1, speculate=0)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(max_new_tokens=0),
                                 dict(speculative_tokens=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_generate_options_are_config_errors(bad):
    with pytest.raises(ConfigError):
        sampling_options(args(**{"speculative_tokens": 8, **bad}))
