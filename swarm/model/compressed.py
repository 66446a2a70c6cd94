"""Cache layers of compressed attention (DeepSeek-V4's "compressed_sparse_attention" and
"heavily_compressed_attention" kinds): a sliding-window attention over the layer's own keys plus a series of
compressed entries, one per window of `compress_rate` tokens, that the family's compressor computes.

What such a layer keeps for a session:
- keys of every past token, in the session's pooled rows (`AttentionLayer`: the window comes from the mask,
  and a rollback is a change of length);
- per compressor ("compressor", and "indexer" for the sparse kind): the compressed entries emitted so far, the
  projections of the tokens since the last full window (fewer than `compress_rate`), and for the sparse kind
  the first half of the last full window's projections (the next entry overlaps it).

Invariants:
- An entry depends on the projections of the tokens of its windows, which are not kept once it is emitted:
  the compressor state can return only to where a snapshot was taken (`snapshot`, at the end of each step,
  as for recurrent states) or to 0. `swarm.model.cache.SpanCache` refuses any other position, naming those.
- Transformers' compressors replace these tensors (concatenation, slices, clones), never write into them:
  a snapshot holds the compressed entries of its time by reference (no copy), and copies the partial-window
  buffers (fewer than `compress_rate` tokens each).
- The methods the family's compressor calls (`store_compression_weights`, `update_overlap_state`,
  `update_compressor_states`) are transformers' own (`DeepseekV4HCACache`, `DeepseekV4CSACache`), called on
  this layer's fields.
"""

from __future__ import annotations

import torch

from swarm.model.cache_layers import AttentionLayer
from swarm.model.kv import Part, Rows

SPARSE, HEAVY = "compressed_sparse_attention", "heavily_compressed_attention"
COMPRESSED_KINDS = (SPARSE, HEAVY)
FIELDS = ("buffer_kv", "buffer_gate", "compressed_kv", "entry_count", "overlap_kv", "overlap_gate")


def _family_class(kind: str):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    return v4.DeepseekV4CSACache if kind == SPARSE else v4.DeepseekV4HCACache


class CompressedLayer(AttentionLayer):
    """One compressed-attention block of a session: keys in `rows`, compressor state here."""

    is_compileable = False

    def __init__(self, rows: Rows, part: Part, kind: str, config):
        super().__init__(rows, part)
        self.kind = kind
        self.compress_rate = config.compress_rates[kind]
        self.names = ("compressor", "indexer") if kind == SPARSE else ("compressor",)
        self.buffer_kv: dict = {}
        self.buffer_gate: dict = {}
        self.compressed_kv: dict = {}
        self.entry_count: dict = {}
        self.overlap_kv: dict = {}
        self.overlap_gate: dict = {}
        self.reset_compressors()

    # The compressor's calls, by transformers' own methods on this layer's fields.
    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        return _family_class(HEAVY).store_compression_weights(self, name, kv, gate)

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        return _family_class(HEAVY).update_compressor_states(self, name, compressed)

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        return _family_class(SPARSE).update_overlap_state(self, name, chunk_kv, chunk_gate, head_dim)

    def reset_compressors(self) -> None:
        for field in FIELDS:
            getattr(self, field).update({name: 0 if field == "entry_count" else None for name in self.names})

    def reset(self) -> None:
        super().reset()
        self.reset_compressors()

    def state(self) -> dict:
        """The compressor state as it is now (live references)."""
        return {field: dict(getattr(self, field)) for field in FIELDS}

    def snapshot(self) -> dict:
        """The compressor state now, unchanged by later steps: entries by reference (only ever replaced),
        partial-window buffers and overlaps copied."""
        return {field: {name: (value.clone() if isinstance(value, torch.Tensor) and field != "compressed_kv"
                               else value) for name, value in values.items()}
                for field, values in self.state().items()}

    def restore(self, state: dict) -> None:
        """Put back a state `snapshot` returned (it stays usable for another restore)."""
        for field, values in state.items():
            getattr(self, field).update({name: (value.clone() if isinstance(value, torch.Tensor)
                                                 and field != "compressed_kv" else value)
                                         for name, value in values.items()})


def layer_kwargs_config(layer_kwargs: dict):
    """The per-layer config transformers gives compressed kinds (`get_layer_types_and_kwargs`)."""
    config = layer_kwargs.get("config")
    if config is None or not hasattr(config, "compress_rates"):
        raise ValueError("a compressed-attention layer needs its config (compress_rates)")
    return config


def family_layer(kind: str, layer_kwargs: dict):
    """Transformers' own cache layer of a compressed kind (what a probe with no pooled rows hands the family)."""
    return _family_class(kind)(config=layer_kwargs_config(layer_kwargs))
