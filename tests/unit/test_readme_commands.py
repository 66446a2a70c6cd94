"""Every `swarm` command line the README shows parses and passes its command's configuration checks, so a
documented command is never refused. Placeholders (DIR, ADDR, a shortened peer id) become valid values;
bracketed optional parts are included. Nothing starts: the parser and the configs' validation run alone."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from bootstrap.config import BootstrapConfig, MonitorConfig
from client.cli import prompt_after_peers, sampling_options
from client.config import ApiConfig, ClientConfig
from peer.config import PeerConfig
from swarm.cli import build_parser
from swarm.config import from_args
from swarm.errors import ConfigError
from swarm.model import precision

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[2] / "README.md"
ADDR = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWNaZfGsLVfK8mSd9hChxMi13D6aeFTnLjsrK6rbKEJMmU"
CONFIGS = {"peer": (PeerConfig,), "bootstrap": (BootstrapConfig,), "monitor": (MonitorConfig,),
           "generate": (ClientConfig,), "chat": (ClientConfig,), "status": (ClientConfig,),
           "api": (ClientConfig, ApiConfig), "demo": (), "demo-model": ()}


def readme_commands() -> list[str]:
    """The `swarm` lines of the README's sh blocks, comments dropped, optional parts expanded."""
    lines, in_sh = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_sh = line.strip() == "```sh" and not in_sh
            continue
        text = line.strip()
        if in_sh and (text.startswith(".venv/bin/swarm ") or text.startswith("swarm ")):
            lines.append(re.sub(r"\[([^\]]*)\]", r"\1", text))
    return lines


def argv_of(line: str, directory: Path) -> list[str]:
    words = shlex.split(line, comments=True)[1:]
    values = {"DIR": str(directory), "ADDR": ADDR}
    return [ADDR if w.startswith("/ip4/") and w.endswith("...") else values.get(w, w) for w in words]


def check_precision(config: PeerConfig, monkeypatch) -> None:
    """The peer's device, dtype and weight format, as on a machine that has the device the line names (with
    bitsandbytes for CUDA, as the README says)."""
    monkeypatch.setattr(precision, "resolve_device",
                        lambda name: torch.device("cpu" if name == "auto" else name))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    precision.Precision.of(config.device, config.dtype, config.quant)


def test_a_prompt_after_the_initial_peers_is_the_prompt():
    args = build_parser().parse_args(["generate", "--initial-peers", ADDR, ADDR, "The capital of France is"])
    prompt_after_peers(args)
    assert (args.prompt, args.initial_peers) == ("The capital of France is", [ADDR, ADDR])
    args = build_parser().parse_args(["generate", "--initial-peers", ADDR])
    with pytest.raises(ConfigError, match="PROMPT"):
        prompt_after_peers(args)


def test_the_readme_shows_every_command():
    shown = {shlex.split(line, comments=True)[1] for line in readme_commands()}
    assert set(CONFIGS) <= shown | {"--help"}, set(CONFIGS) - shown


@pytest.mark.parametrize("line", readme_commands())
def test_a_readme_command_passes_its_checks(line, tmp_path, monkeypatch):
    argv = argv_of(line, tmp_path)
    parser = build_parser()
    if argv == ["--help"]:
        with pytest.raises(SystemExit) as done:
            parser.parse_args(argv)
        assert done.value.code == 0
        return
    args = parser.parse_args(argv)
    assert args.command in CONFIGS, f"no checks known for `swarm {args.command}`: add them here"
    if args.command == "generate":
        prompt_after_peers(args)
        assert args.prompt and all(a.startswith("/") for a in args.initial_peers)
    configs = [from_args(cls, args) for cls in CONFIGS[args.command]]  # each runs its validation
    if args.command in ("generate", "demo"):
        sampling_options(args)
    if args.command == "demo":
        assert args.peers >= 1
    if args.command == "peer":
        check_precision(configs[0], monkeypatch)
