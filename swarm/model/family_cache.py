"""Caches of the class a family's forward insists on, holding a span's own cache layers.

Most families take any `transformers.Cache` and call its layers. A few check the cache's class and keep
state through methods of their own; for those, the per-block cache handed to the forward is an object
of that class whose methods read and write the session's own layers (`swarm.model.cache`), so rollback,
fork and snapshots work on them as on every other family's.

Invariants:
- The object holds no state of its own: everything a step leaves behind is in the layers it was given.
- Only cache classes are subclassed here, never a model class, and every method of the family's class
  that the object keeps reads the same layers.
"""

from __future__ import annotations

from transformers import DynamicCache


def minimax_cache():
    """MiniMax's lightning-attention layers keep `K^T V` through `get_linear_cache` / `set_linear_cache` of a
    `MiniMaxCache` (its forward refuses any other class): here that state is the recurrent state of the
    layer's own `LinearAttentionLayer` entry; `None` until a step stored it (its prefill path)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class SpanMiniMaxCache(MiniMaxCache):
        def __init__(self):
            DynamicCache.__init__(self)
            self.layer_class_to_replicate = None  # every block has its entry, set by `span_kv`

        @property
        def linear_cache(self) -> list:
            return [self.get_linear_cache(i) for i in range(len(self.layers))]

        @linear_cache.setter
        def linear_cache(self, value) -> None:
            if value:
                raise AttributeError("the linear-attention states live in the span's layers")

        def get_linear_cache(self, layer_idx: int):
            layer = self.layers[layer_idx]
            if not getattr(layer, "has_previous_state", {}).get(0, False):
                return None
            return layer.recurrent_states[0]

        def set_linear_cache(self, layer_idx: int, linear_cache) -> None:
            layer = self.layers[layer_idx]
            layer.update_recurrent_state(linear_cache, 0)
            layer.has_previous_state[0] = True

        def __len__(self) -> int:
            return len(self.layers)

    return SpanMiniMaxCache


# model type -> the class of the per-block cache its forward takes (made on first use: its module is imported then)
FAMILY_CACHES = {"minimax": minimax_cache}
_MADE: dict[str, type] = {}


def cache_class(model_type: str) -> type:
    """The cache class a span of `model_type` hands its family's forward (`DynamicCache` for most)."""
    if model_type not in FAMILY_CACHES:
        return DynamicCache
    if model_type not in _MADE:
        _MADE[model_type] = FAMILY_CACHES[model_type]()
    return _MADE[model_type]
