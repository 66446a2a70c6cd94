"""Adversarial peers for tests: the real peer with one behaviour altered by patching, run as
`python tests/adversary.py MODE <swarm command line>` (`LocalSwarm.start_peer(..., program=adversary("MODE"))`).
These are test helpers only: the real peer has no such options.

Modes:
- `tamper-push`: adds noise to the hidden states it pushes on to the next peer of a chained step; its
  replies to the client stay honest, so only the check of what the next hop computed on can catch it.
- `blackhole`: takes session streams and never answers `open` (it answers pings).
- `noisy` (or `noisy:P`): adds noise to every step's output (or to each with probability P), in its replies
  and its pushes alike (a consistent lie that only a recomputation elsewhere can catch), and claims to be
  100 times faster than it is. Its stateless forwards are honest.
- `liar`: as `noisy`, and its stateless forwards carry noise too (a lie consistent across every way the
  client can ask it, which only other peers can expose).
- `self-contradicting`: the same lie each time (a fixed pattern, a function of the true output) on its sessions
  and on stateless forwards of its whole span, honest forwards of any part of it: only its own answers
  chained together expose it.
- `other-weights` (or `other-weights:SEED`): computes honestly with weights of its own (each block's weights
  perturbed by 5% noise from SEED, default 0): a consistent liar, the same in sessions, pushes and forwards of
  any span, that only a computation of the true weights can expose. Two of them with one seed agree with each
  other (colluding).
- `stall`: answers pings and opens sessions, never answers a step, and claims 1e9 tokens/s.
- `forgetful`: answers `unknown_session` to every second step of a session, however busy (as if it had
  reclaimed it), so that a client that took it at its word would reopen and replay the whole history each time.
- `zeros`, `constant`, `nan`: every step's and every stateless forward's output is all zeros, has each row
  constant (at the row's honest RMS, so norms look right and only the spread is gone), or is all NaN: in
  its replies and its pushes alike.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import random
import sys
from pathlib import Path

import torch

from peer import capacity, servicer
from swarm import errors
from swarm.model import blocks
from swarm import cli
from swarm.net import messages

MODES = ("tamper-push", "blackhole", "noisy", "liar", "self-contradicting", "other-weights", "forgetful", "stall",
         "zeros", "constant", "nan")
DEGENERATE = {
    "zeros": torch.zeros_like,
    "constant": lambda x: (x.pow(2).mean(-1, keepdim=True).sqrt()).expand_as(x).contiguous(),
    "nan": lambda x: torch.full_like(x, float("nan")),
}


def adversary(mode: str) -> tuple[str, ...]:
    """The `program` that runs a peer in `mode`."""
    assert mode.split(":")[0] in MODES, mode
    return (str(Path(__file__).resolve()), mode)


def _tamper_push() -> None:
    original = servicer.Servicer._push

    async def push(self, step, output, chain):
        x = output.hidden.decode().float()
        altered = x + 0.5 * x.abs().mean() * torch.randn_like(x)
        hidden = messages.Hidden.encode(altered, output.hidden.encoding)
        return await original(self, step, dataclasses.replace(output, hidden=hidden), chain)

    servicer.Servicer._push = push


def _noisy(p: float = 1.0) -> None:
    original = servicer.Servicer._step

    async def step(self, session, msg):
        output = await original(self, session, msg)
        if random.random() >= p:
            return output
        x = output.hidden.decode().float()
        altered = x + 0.5 * x.abs().mean() * torch.randn_like(x)
        return dataclasses.replace(output, hidden=messages.Hidden.encode(altered, output.hidden.encoding))

    servicer.Servicer._step = step
    speed = capacity.Capacity.throughput
    capacity.Capacity.throughput = lambda self, blocks: 100 * speed(self, blocks)


def _forwards(alter) -> None:
    """Stateless forwards' outputs altered by `alter` (a forward's reply is the one output with no step)."""
    to_message = messages.Output.to_message

    def forward_reply(self):
        if self.step is not None:
            return to_message(self)
        return to_message(dataclasses.replace(self, hidden=messages.Hidden.encode(
            alter(self.hidden.decode().float()), self.hidden.encoding)))

    messages.Output.to_message = forward_reply


def _liar() -> None:
    _noisy()
    _forwards(lambda x: x + 0.5 * x.abs().mean() * torch.randn_like(x))


_TARGET: contextvars.ContextVar = contextvars.ContextVar("target", default=None)


def _pattern(x: torch.Tensor) -> torch.Tensor:
    """A lie that is the same for the same output: a fixed pattern scaled to its magnitude."""
    wave = torch.cos(torch.arange(x.shape[-1], dtype=x.dtype))
    return x + 0.5 * x.abs().mean(-1, keepdim=True) * wave


def _self_contradicting() -> None:
    check_target = servicer.Servicer._check_target

    def target(self, model, start, end, digest=None):
        span = check_target(self, model, start, end, digest)
        _TARGET.set(span == self.served.span)  # a forward's reply is made in this task: it knows
        return span

    servicer.Servicer._check_target = target
    original = servicer.Servicer._step

    async def step(self, session, msg):
        output = await original(self, session, msg)
        return dataclasses.replace(output, hidden=messages.Hidden.encode(
            _pattern(output.hidden.decode().float()), output.hidden.encoding))

    servicer.Servicer._step = step
    to_message = messages.Output.to_message

    def forward_reply(self):
        if self.step is not None or not _TARGET.get():
            return to_message(self)
        return to_message(dataclasses.replace(self, hidden=messages.Hidden.encode(
            _pattern(self.hidden.decode().float()), self.hidden.encoding)))

    messages.Output.to_message = forward_reply


def _other_weights(seed: float = 0) -> None:
    init = blocks.SpanBlocks.__init__

    def perturbed(self, *args, **kwargs):
        init(self, *args, **kwargs)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.is_floating_point() and p.numel() > 1:
                    g = torch.Generator().manual_seed(int(seed) * 7919 + sum(map(ord, name)))
                    p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g).to(p.dtype))

    blocks.SpanBlocks.__init__ = perturbed


def _stall() -> None:
    async def step(self, session, msg):
        await asyncio.sleep(3600)

    servicer.Servicer._step = step
    capacity.Capacity.throughput = lambda self, blocks: 1e9


def _forgetful() -> None:
    original = servicer.Servicer._step
    steps: dict[int, int] = {}

    async def step(self, session, msg):
        steps[id(session)] = steps.get(id(session), 0) + 1
        if steps[id(session)] % 2 == 0:
            raise errors.UnknownSession("no such session here")
        return await original(self, session, msg)

    servicer.Servicer._step = step


def _degenerate(mode: str) -> None:
    alter = DEGENERATE[mode]

    def altered(hidden: messages.Hidden) -> messages.Hidden:
        return messages.Hidden.encode(alter(hidden.decode().float()), hidden.encoding)

    original_step = servicer.Servicer._step

    async def step(self, session, msg):
        output = await original_step(self, session, msg)
        return dataclasses.replace(output, hidden=altered(output.hidden))

    servicer.Servicer._step = step
    _forwards(alter)


def _blackhole() -> None:
    async def serve_session(self, stream):
        await asyncio.sleep(3600)  # holds the stream, reads nothing, answers nothing

    servicer.Servicer.serve_session = serve_session


if __name__ == "__main__":
    mode, argv = sys.argv[1], sys.argv[2:]
    name, _, arg = mode.partition(":")
    if name in DEGENERATE:
        _degenerate(name)
    else:
        {"tamper-push": _tamper_push, "blackhole": _blackhole, "noisy": _noisy, "liar": _liar,
         "self-contradicting": _self_contradicting, "other-weights": _other_weights, "forgetful": _forgetful,
         "stall": _stall}[name](
            *map(float, filter(None, [arg])))
    sys.exit(cli.main(argv))
