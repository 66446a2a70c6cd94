"""What crosses a span boundary: the hidden states, and a family's other per-token streams after them.

Most families' layers take the hidden states of the layer before and nothing else per token. Some take more:

- inputs the model computes once from the tokens and hands to every layer (Gemma 3n's and Gemma 4's per-layer
  inputs, one slice per layer; Zamba2's word embeddings, which its hybrid layers concatenate with the hidden
  states). The client's head holds the tables they come from: it computes them with the family's own forward
  (what the layer list receives) and every span takes its layers' part and passes them on unchanged;
- state a layer returns beside its hidden states for the next layer (ZAYA's router state): each span's first
  layer takes what the last span's last layer returned, and the span returns what its own last layer returned.

So what a span takes and returns, and what the wire carries as its hidden states, is the *boundary tensor*
`[batch, tokens, width]`: the hidden states followed by the streams, in `Boundary.streams` order, along the last
dimension. The head's final norm and LM head take the hidden part alone.

The hidden states themselves are whatever the family's first layer takes, of any shape `[batch, tokens, ...]`:
families with hyper-connections pass several residual streams from layer to layer (`[batch, tokens, 4, hidden]`),
built from the embeddings before the layer loop and collapsed after it by the family's own forward (the head's
part). On the boundary they are flattened to `[batch, tokens, hidden]` (`Boundary.shape`, read off the family's
forward by `swarm.model.frame.probe`): a span unflattens them for its first layer and flattens its last layer's
output; the head unflattens them for the family's collapse and final norm.

Invariants:
- A family's boundary is read off its layers' own signatures, its config (`streams_of`) and what its forward hands
  the first layer, the same for every peer and client of a checkpoint: `Boundary.width` is the one width every
  party checks, and `flatten` and `unflatten` are the one mapping between the layers' shape and the boundary's.
- Passed-through streams come out of a span exactly as they went in (`passthrough`): a client can check that.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stream:
    """One per-token input of the layers besides the hidden states."""

    arg: str  # the name of the layer argument it feeds
    width: int  # per token, on the boundary
    per_layer: int = 0  # > 0: that many equal parts, part i feeding the layer of block i (else: all of it, every layer)
    carried: bool = False  # the layers return it (second output) for the next layer; else the head computes it
    forward_kwarg: str = ""  # the family forward's argument that would compute it otherwise (given zeros, unused)


@dataclass(frozen=True)
class Boundary:
    """The layout of the boundary tensor: `hidden` hidden-state channels, then each stream's."""

    hidden: int
    streams: tuple[Stream, ...] = ()
    shape: tuple[int, ...] = ()  # per token, what the layers pass on (of `hidden` elements); () is [hidden]

    def __post_init__(self):
        if self.shape and math.prod(self.shape) != self.hidden:
            raise ValueError(f"hidden states of shape {list(self.shape)} per token do not have {self.hidden} channels")

    def flatten(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states as the layers pass them, [batch, tokens, *shape], as the boundary holds them."""
        return hidden.flatten(hidden.ndim - len(self.shape)) if len(self.shape) > 1 else hidden

    def unflatten(self, hidden: torch.Tensor) -> torch.Tensor:
        """The boundary's hidden part [batch, tokens, hidden] as the layers pass it, [batch, tokens, *shape]."""
        return hidden.unflatten(-1, self.shape) if len(self.shape) > 1 else hidden

    @property
    def width(self) -> int:
        return self.hidden + sum(s.width for s in self.streams)

    def split(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The hidden states and each stream's part of a boundary tensor."""
        parts = tensor.split([self.hidden, *(s.width for s in self.streams)], dim=-1)
        return parts[0], list(parts[1:])

    def join(self, hidden: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        if not self.streams:
            return hidden
        return torch.cat([hidden, *(p.to(hidden.dtype) for p in parts)], dim=-1)

    def passthrough(self) -> list[tuple[int, int]]:
        """Channel ranges [start, end) of the streams a span returns unchanged."""
        out, at = [], self.hidden
        for s in self.streams:
            if not s.carried:
                out.append((at, at + s.width))
            at += s.width
        return out

    def layer_args(self, stream: Stream, part: torch.Tensor, block: int) -> torch.Tensor:
        """What the layer of `block` takes of `stream` (its `part` of the boundary tensor)."""
        if not stream.per_layer:
            return part
        size = stream.width // stream.per_layer
        return part[..., block * size:(block + 1) * size]

    def forward_kwargs(self, batch: int, tokens: int, dtype: torch.dtype, device) -> dict:
        """Zeros for the family forward's arguments that would otherwise compute the streams from the tokens (the
        layers get the real values from the boundary; the zeros only keep the forward from looking for tokens)."""
        out = {}
        for s in self.streams:
            if s.forward_kwarg:
                shape = (batch, tokens, s.per_layer, s.width // s.per_layer) if s.per_layer else (batch, tokens, s.width)
                out[s.forward_kwarg] = torch.zeros(shape, dtype=dtype, device=device)
        return out


def takes(layers: list[torch.nn.Module]) -> set[str]:
    """The argument names any of `layers`' forwards takes."""
    names: set[str] = set()
    for layer in layers:
        names |= set(inspect.signature(layer.forward).parameters)
    return names


def streams_of(config, layers: list[torch.nn.Module], embed_dim: int) -> tuple[Stream, ...]:
    """The streams a family's layers take besides the hidden states, by the arguments their forwards name (the
    families whose forwards are read here are listed in the docstring of this module)."""
    names, out = takes(layers), []
    n = int(config.num_hidden_layers)
    per_layer = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
    if "per_layer_input" in names and per_layer:
        out.append(Stream("per_layer_input", n * per_layer, per_layer=n, forward_kwarg="per_layer_inputs"))
    if "original_hidden_states" in names:
        out.append(Stream("original_hidden_states", embed_dim))
    if "prev_router_hidden_states" in names:
        out.append(Stream("prev_router_hidden_states", int(config.router_hidden_size), carried=True))
    return tuple(out)


def arg_of(layer: torch.nn.Module, args: tuple, kwargs: dict, name: str):
    """The value of argument `name` in a call of `layer` (None when not given)."""
    if name in kwargs:
        return kwargs[name]
    position = _position(layer, name)
    return args[position] if position is not None and position < len(args) else None


def with_arg(layer: torch.nn.Module, args: tuple, kwargs: dict, name: str, value) -> tuple[tuple, dict]:
    """The call `args, kwargs` of `layer` with argument `name` set to `value`."""
    position = _position(layer, name)
    if name not in kwargs and position is not None and position < len(args):
        return (*args[:position], value, *args[position + 1:]), kwargs
    return args, {**kwargs, name: value}


def _position(layer: torch.nn.Module, name: str) -> int | None:
    names = _positional(type(layer))
    return names.index(name) if name in names else None


@functools.cache
def _positional(cls: type) -> tuple[str, ...]:
    """The names a layer class's forward takes by position (after self): read once per class, not per call."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
