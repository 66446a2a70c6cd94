"""What a span needs to know about its recurrent layers beyond their cache kind: whether their family can continue
a state with several tokens at once (`one_token_continuations`), and where a family keeps states in its modules
rather than in a transformers cache (`held_slots`, `HeldStates`).

Invariants:
- A step of several tokens after a state exists runs in one forward only where every recurrent layer's multi-token
  code reads every part of its state. Which do is found by running the family's own code once per layer class
  and kind, with one part of the state made NaN: output with no NaN means that part was ignored. Where any part
  is ignored (transformers' Mamba mixer scans from a zero state; RecurrentGemma's prefill convolution starts from
  zeros), such steps run one token at a time, as transformers generates (its one-token code reads the state).
  The test is exact (NaN reaches every output that reads it, in any dtype), so it cannot pass by rounding.
- States a family keeps in module attributes (RecurrentGemma: what its `_setup_cache` sets) belong to the
  session, not the modules: `HeldStates` keeps a session's copy, loaded into the modules before each step and read
  back after it (under one lock per blocks), and snapshotted, restored and forked like transformers' own states.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable

import torch
from transformers.cache_utils import LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

from swarm.span import Span

# Held while states kept in modules are used: layers (and their modules) may be shared by several blocks.
HELD_LOCK = threading.RLock()


class HeldStates:
    """A session's copy of the states one layer keeps in its modules, by attribute path; empty: a fresh session
    (the modules get None, and the family starts from zeros as its own `_setup_cache` would)."""

    STATE_FIELDS = ("conv_states", "recurrent_states")

    def __init__(self):
        self.conv_states: dict = {}  # none: the layer's whole state is in `recurrent_states`
        self.recurrent_states: dict[str, torch.Tensor | None] = {}

    def reset(self) -> None:
        self.recurrent_states = {}


Slot = tuple[torch.nn.Module, str]


def held_slots(layers: dict[int, torch.nn.Module], device, dtype) -> dict[int, dict[str, Slot]]:
    """Per layer index, the module attributes in which the layer keeps state: every plain tensor attribute the
    `_setup_cache` of one of its modules sets (transformers' convention for module-held caches). Left as None."""
    found: dict[int, dict[str, Slot]] = {}
    for i, layer in layers.items():
        for name, module in layer.named_modules():
            setup = getattr(module, "_setup_cache", None)
            if not callable(setup):
                continue
            before = {(sub, attr): v for sub, m in module.named_modules() for attr, v in vars(m).items()
                      if isinstance(v, torch.Tensor)}
            setup(1, device, dtype)
            for sub, m in module.named_modules():
                for attr, value in list(vars(m).items()):
                    # what it set anew (a tensor left from an earlier step would be replaced too)
                    if isinstance(value, torch.Tensor) and before.get((sub, attr)) is not value:
                        path = ".".join(p for p in (name, sub, attr) if p)
                        found.setdefault(i, {})[path] = (m, attr)
                        setattr(m, attr, None)
    return found


def load_held(slots: dict[int, dict[str, Slot]], held: dict[int, HeldStates]) -> None:
    for i, states in held.items():
        for path, (module, attr) in slots[i].items():
            setattr(module, attr, states.recurrent_states.get(path))


def save_held(slots: dict[int, dict[str, Slot]], held: dict[int, HeldStates]) -> None:
    """Take the states a step left in the modules into the session's `held`; the modules keep none between steps
    (blocks sharing these layers, and a later `held_slots`, find them empty)."""
    for i, states in held.items():
        states.recurrent_states = {path: getattr(module, attr) for path, (module, attr) in slots[i].items()}
        for module, attr in slots[i].values():
            setattr(module, attr, None)


def one_token_continuations(layers: dict[int, torch.nn.Module], kinds: list[str], stateful: Iterable[int],
                            slots: dict[int, dict[str, Slot]], state_counts: list[int], width: int,
                            run: Callable[[Span, torch.Tensor, dict, int], torch.Tensor]) -> frozenset[int]:
    """The layers (of `stateful`) whose code for several tokens ignores part of a state it continues from.

    One layer per class and kind is run alone (`run(span, hidden [1, tokens, width], its cache layers, position)`):
    two tokens from no state, then, once per part of the state made NaN, two more; an output with no NaN ignored
    that part."""
    groups: dict[tuple, list[int]] = {}
    for i in stateful:
        groups.setdefault((type(layers[i]), kinds[i], i in slots), []).append(i)
    found: set[int] = set()
    for members in groups.values():
        i = members[0]
        gen = torch.Generator().manual_seed(0)
        first, then = (torch.randn(1, 2, width, generator=gen) for _ in range(2))
        both = kinds[i] in ("hybrid", "hybrid_sliding")

        def fresh():  # a fresh session's state after two tokens: its cache layers and the state's parts
            for module, attr in slots.get(i, {}).values():
                setattr(module, attr, None)
            cache = {i: (LinearAttentionAndFullAttentionLayer if both else LinearAttentionLayer)(
                number_of_states=state_counts[i])}
            run(Span(i, i + 1), first, cache, 0)
            return cache, _parts(cache[i], slots.get(i, {}))

        parts = len(fresh()[1])
        ignores = not parts  # a stateful layer that showed no state: nothing proves it continues one
        for n in range(min(parts, 64)):  # each part of the state once (a layer has a few)
            cache, tensors = fresh()
            tensors[n].fill_(math.nan)
            try:
                out = run(Span(i, i + 1), then, cache, 2)
            except Exception:  # noqa: BLE001 - cannot continue from a state at all: one token at a time
                out = None
            if out is None or not torch.isnan(out).any():
                ignores = True
                break
        if ignores:
            found.update(members)
        for module, attr in slots.get(i, {}).values():
            setattr(module, attr, None)
    return frozenset(found)


def _parts(layer, slots: dict[str, Slot]) -> list[torch.Tensor]:
    """The state tensors a layer holds after a step: in its modules, or in its transformers cache layer."""
    if slots:
        return [getattr(m, attr) for m, attr in slots.values() if isinstance(getattr(m, attr), torch.Tensor)]
    return [t for states in (layer.conv_states, layer.recurrent_states) for t in states.values()
            if isinstance(t, torch.Tensor)]
