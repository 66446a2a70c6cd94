"""The cache layers a family's forward calls for one session's span (`swarm.model.cache.SpanCache` holds them):
`LengthLayer` (a length only), `AttentionLayer` (keys and values in the session's rows, written in place),
`IndexedLayer` (plus an indexer's keys) and `HybridLayer` (plus a recurrent state).

Invariants:
- `update` writes the step's tokens after the layer's length and returns views of its whole history, as
  transformers' own layers return their concatenation, with the same numbers.
- Lengths move only through the owning `SpanCache` (advance, abort, rollback), never by a write alone.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

from swarm.errors import BadRequest
from swarm.model.kv import Part, Rows


class LengthLayer(CacheLayerMixin):
    """An attention entry that holds nothing but a length: what the family asks of a layer the span does not
    cache (mask sizes, positions)."""

    is_sliding = False
    is_croppable = True

    def __init__(self, length: int = 0):
        super().__init__()
        self.length = length
        self.is_initialized = True
        self._positions: torch.Tensor | None = None  # [position dims, rows, tokens]: `indexer_position_ids`

    @property
    def indexer_position_ids(self) -> torch.Tensor | None:
        """Positions of the tokens cached so far, as a family's indexers keep them (up to this entry's length:
        those of tokens rolled back are forgotten)."""
        if self._positions is None or not self.length:
            return None
        return self._positions[..., :self.length]

    @indexer_position_ids.setter
    def indexer_position_ids(self, value: torch.Tensor | None) -> None:
        self._positions = value

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise BadRequest("a layer outside the span was asked to cache keys and values")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove))

    def reset(self) -> None:
        self.length = 0
        self._positions = None


class AttentionLayer(LengthLayer):
    """An attention layer's keys and values in a session's `Rows`: `update` writes the new tokens after the
    layer's length (in place) and returns views of everything up to them, as transformers' `DynamicLayer`
    returns its concatenation, with the same numbers."""

    def __init__(self, rows: Rows, part: Part):
        super().__init__()
        self.rows, self.part = rows, part

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self.length
        self.rows.write(self.part, start, key_states, value_states)
        self.length = start + key_states.shape[-2]
        return self.rows.keys(self.part, self.length), self.rows.values(self.part, self.length)

    @property
    def keys(self) -> torch.Tensor:
        return self.rows.keys(self.part, self.length)

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("an attention layer's keys are written through update()")

    @property
    def values(self) -> torch.Tensor:
        return self.rows.values(self.part, self.length)

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("an attention layer's values are written through update()")


class IndexedLayer(AttentionLayer):
    """An indexed attention layer (dynamic sparse attention): keys and values as an `AttentionLayer`, and its
    indexer's keys [rows, tokens, dim] as the `indexer` part (one head, no values) of the same rows. A family
    updates the indexer's keys before or after its keys and values within a step: each is written after the
    step's start (the layer's length before the step), each has a length of its own until the step is counted."""

    def __init__(self, rows: Rows, part: Part, indexer: Part):
        super().__init__(rows, part)
        self.indexer = indexer
        self.is_indexer_initialized = True

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, value: int) -> None:  # a step counted, aborted or rolled back: both parts end there
        self._length = self.indexer_length = value

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self._length
        self.rows.write(self.part, start, key_states, value_states)
        self._length = start + key_states.shape[-2]
        return self.rows.keys(self.part, self._length), self.rows.values(self.part, self._length)

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Write the step's indexer keys [rows, n, dim] after the step's start; all of them so far, as transformers'
        `DynamicIndexedLayer` returns its concatenation."""
        start = self.indexer_length
        self.rows.write(self.indexer, start, indexer_key_states.unsqueeze(1), None)
        self.indexer_length = start + indexer_key_states.shape[1]
        return self.indexer_keys

    @property
    def indexer_keys(self) -> torch.Tensor:
        return self.rows.keys(self.indexer, self.indexer_length)[:, 0]

    @indexer_keys.setter
    def indexer_keys(self, value) -> None:
        if value is not None:
            raise AttributeError("an indexed layer's indexer keys are written through update_indexer()")


class HybridLayer(LinearAttentionLayer, AttentionLayer):
    """A layer with both a recurrent state (transformers' own) and attention keys and values (ours)."""

    is_compileable = False

    def __init__(self, rows: Rows, part: Part, number_of_states: int = 1):
        AttentionLayer.__init__(self, rows, part)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if kwargs:  # the recurrent part: called with conv or recurrent states by keyword
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        AttentionLayer.reset(self)

    def crop(self, tokens_to_remove: int) -> None:
        AttentionLayer.crop(self, tokens_to_remove)
