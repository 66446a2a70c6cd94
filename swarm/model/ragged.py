"""Ragged batches: one forward for the one-token steps of several sessions at different lengths, each attending
over its own history (a view of its own cache): no padding to the longest, no copies.

The family's own forward runs the batch's rows through its layers as one batch; only attention is per session.
For that call (`ragged`), the layers' attention implementation is one of ours, registered with transformers'
`AttentionInterface` (its masks with `AttentionMaskInterface`, as the family's own implementation makes them):
- the batch's cache (`RaggedLayer` per attention block) writes each session's new key and value into that
  session's own cache and keeps the views of each session's history;
- the attention call splits the rows by session and calls the family's own implementation (sdpa, or the eager
  function of its modeling module) once per session, with that session's keys, values and part of the mask.

The batch's mask is the left-padded one a padded batch would have (each session's keys end at the query), so
each session's slice of it, its last `length + 1` columns, is the mask it would get alone (sliding windows
included). Whatever the family does that this cannot follow (keys changed between the cache and attention, a
cache read by another layer, an implementation of its own) raises `RaggedUnsupported` before any session's
length changed: its steps then run one at a time.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from swarm.model.cache_layers import LengthLayer

NAMES = {"sdpa": "swarm_ragged_sdpa", "eager": "swarm_ragged_eager"}  # the family's implementation -> ours


class RaggedUnsupported(Exception):
    """This family's forward cannot run a ragged batch: run its sessions' steps one at a time."""


@dataclass
class RaggedBatch:
    """The sessions of one ragged forward: each session's cache layers by block and its rows of the batch."""

    sessions: Sequence[tuple[Sequence, slice]]  # (the session's cache entries by block, its rows)
    implementation: str  # the family's own ("sdpa" or "eager")
    pending: dict[int, list] = field(default_factory=dict)  # id(keys the cache returned) -> per-session views
    stand_ins: tuple = ()

    def attention(self, module: torch.nn.Module) -> Callable:
        if self.implementation == "sdpa":
            return ALL_ATTENTION_FUNCTIONS["sdpa"]
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise RaggedUnsupported(f"{type(module).__name__} has no eager attention function to call per session")
        return eager


class _Current(threading.local):
    batch: RaggedBatch | None = None


_CURRENT = _Current()


class _Views(torch.Tensor):
    """What a ragged batch's cache returns for keys and values: a stand-in the attention call recognizes, which
    refuses every other use (a family that computes with its cached keys itself is not run ragged)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RaggedUnsupported(f"the family uses its cached keys or values itself ({getattr(func, '__name__', func)})")


def _stand_in() -> torch.Tensor:
    return torch.empty(0).as_subclass(_Views)


class RaggedLayer(LengthLayer):
    """Block `index` of a ragged batch's cache: the longest session's length for mask sizes and positions;
    `update` writes each session's rows into its own cache layer and keeps the views for the attention call."""

    def __init__(self, batch: RaggedBatch, index: int, length: int):
        super().__init__(length)
        self.batch, self.index = batch, index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        views = []
        for layers, rows in self.batch.sessions:
            keys, values = layers[self.index].update(key_states[rows], value_states[rows])
            views.append((rows, keys, values))
        if self.batch.pending:
            raise RaggedUnsupported("a layer's attention did not go through the attention interface")
        keys, values = _stand_in(), _stand_in()
        self.batch.pending[id(keys)] = views  # the attention call finds the views by the stand-in
        self.batch.stand_ins = (keys, values)  # alive until then: ids are not reused
        return keys, values

    def update_indexer(self, indexer_key_states: torch.Tensor):
        raise RaggedUnsupported("an indexer scores its cached keys itself")

    @property
    def keys(self):
        raise RaggedUnsupported("a layer reads another layer's cached keys")

    @keys.setter
    def keys(self, value) -> None:
        pass

    @property
    def values(self):
        raise RaggedUnsupported("a layer reads another layer's cached values")

    @values.setter
    def values(self, value) -> None:
        pass


def ragged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs):
    """The family's own attention, once per session of the running ragged batch, over that session's views; in
    a thread running no ragged batch (its layers' config switched by another's), the family's own attention."""
    batch = _CURRENT.batch
    if batch is None:
        implementation = _SWITCHED.get(id(getattr(module, "config", None)))
        if implementation is None:
            raise RaggedUnsupported("ragged attention was called outside a ragged batch")
        return RaggedBatch((), implementation).attention(module)(module, query, key, value, attention_mask,
                                                                  **kwargs)
    views = batch.pending.pop(id(key), None)
    if views is None:
        raise RaggedUnsupported(f"{type(module).__name__} changed its keys between the cache and attention")
    fn = batch.attention(module)
    outs = []
    for rows, keys, values in views:
        mask = None if attention_mask is None else attention_mask[rows, ..., -keys.shape[-2]:]
        own = {name: (arg[rows] if name == "position_ids" and isinstance(arg, torch.Tensor) else arg)
               for name, arg in kwargs.items()}
        out, _ = fn(module, query[rows], keys, values, mask, **own)
        outs.append(out)
    return torch.cat(outs), None


for _family, _ours in NAMES.items():
    AttentionInterface.register(_ours, ragged_attention)
    AttentionMaskInterface.register(_ours, ALL_MASK_ATTENTION_FUNCTIONS[_family])


def configs_of(model: torch.nn.Module) -> list[PreTrainedConfig]:
    """Every distinct config the modules of `model` read their attention implementation from."""
    found: dict[int, PreTrainedConfig] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PreTrainedConfig):
            found.setdefault(id(config), config)
    return list(found.values())


_SWITCHED: dict[int, str] = {}  # id(config) -> the family's own implementation, while a ragged batch switched it


@contextlib.contextmanager
def ragged(configs: Sequence[PreTrainedConfig], batch: RaggedBatch):
    """Within: `configs` ask for the ragged implementation, and `batch` is the running batch (this thread)."""
    name = NAMES.get(batch.implementation)
    if name is None:
        raise RaggedUnsupported(f"attention implementation {batch.implementation!r} is not run ragged")
    before = [c._attn_implementation_internal for c in configs]
    for c in configs:
        _SWITCHED[id(c)] = batch.implementation
        c._attn_implementation_internal = name
    _CURRENT.batch = batch
    try:
        yield
    finally:
        _CURRENT.batch = None
        for c, impl in zip(configs, before):
            c._attn_implementation_internal = impl
            _SWITCHED.pop(id(c), None)


# Rotary embeddings whose frequencies follow the longest position of the whole batch (transformers' dynamic and
# longrope updates): a session batched with a longer one would get that one's frequencies.
BATCH_ROPES = ("dynamic", "longrope")


def batch_dependent(config: PreTrainedConfig) -> str | None:
    """Why the family's forward computes something for a batch from its longest sequence (so sessions of
    different lengths cannot share one), or None."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = [params.get("rope_type") or params.get("type")] if isinstance(params, dict) else []
    if isinstance(params, dict):
        kinds += [p.get("rope_type") or p.get("type") for p in params.values() if isinstance(p, dict)]
    dynamic = sorted({k for k in kinds if k in BATCH_ROPES})
    if dynamic:
        return f"its rotary embeddings ({', '.join(dynamic)}) follow the longest sequence of a batch"
    if getattr(config, "attn_temperature_tuning", False):
        return "its attention temperature follows the cache's length"
    return None
