"""One session's cache for a span of blocks (`SpanCache`), and the per-block cache the family's forward
is handed for a span (`span_kv`).

Invariants:
- A `SpanCache` is indexed by global layer index; layers before the span stay empty and cost nothing.
  Every cached layer keeps the full history (no sliding eviction), so the cache can be rolled back to
  any earlier position; sliding-window layers get their window from the mask instead.
- The cache length always equals the session's position.
- Recurrent layers keep their state plus copies of it at the ends of the last `SNAPSHOTS` steps: a
  rollback to one of those positions (or to 0) is exact, any other is a `BadRequest`. So is a `copy`.
- A copy shares no tensor with its original: either may step or roll back without changing the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

from swarm.errors import BadRequest
from swarm.span import Span

# Cache entry classes by layer kind. Attention kinds keep every past key and value (windows and chunks
# come from the masks), so any earlier position can be returned to by cropping. Recurrent kinds keep a
# state that cannot be cropped: rollback restores a copy taken at the end of an earlier step.
CACHE_LAYERS = {
    "full_attention": DynamicLayer, "sliding_attention": DynamicLayer, "chunked_attention": DynamicLayer,
    "linear_attention": LinearAttentionLayer, "conv": LinearAttentionLayer,
    "hybrid": LinearAttentionAndFullAttentionLayer, "hybrid_sliding": LinearAttentionAndFullAttentionLayer,
    "dummy": DummyLayer,  # layers with no cache of their own (no attention, or one shared with another layer)
}
STATE_FIELDS = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                "is_recurrent_states_initialized", "conv_kernel_size", "device", "dtype")
SNAPSHOTS = 8  # recurrent states kept per session and span: rollback reaches back this many steps


class SpanCache:
    """One session's cache for one span: keys and values of every past token, and for recurrent layers
    their state plus copies of it at the ends of the last `SNAPSHOTS` steps.

    The cache has an entry for every block of the model, as the family's forward expects: the span's
    blocks have their own; every other entry stands in for its kind (the span's first layer of the same
    kind, or a length-only layer), so that whatever the family asks of "the cache" (its length, mask
    sizes, whether a recurrent state exists) is the span's."""

    def __init__(self, span: Span, batch_size: int, max_length: int, num_blocks: int | None = None,
                 kinds: Sequence[str] | None = None, state_counts: Sequence[int] | None = None):
        self.span = span
        self.batch_size = batch_size
        self.max_length = max_length
        n = num_blocks or span.end
        kinds = list(kinds) if kinds is not None else ["full_attention"] * n
        counts = list(state_counts) if state_counts is not None else [1] * n
        self.kinds, self.state_counts = kinds, counts
        self.clock = DynamicLayer()  # holds only the length: zeros [batch, 1, length, 1]
        own = {i: _cache_layer(kinds[i], counts[i]) for i in span}
        self.kv = span_kv(span, n, own, kinds, self.clock)
        self.stateful = [own[i] for i in span if isinstance(own[i], LinearAttentionLayer)]
        self.snapshots: dict[int, list[dict]] = {}

    @property
    def own(self) -> list:
        return self.kv.layers[self.span.start:self.span.end]

    @property
    def length(self) -> int:
        return self.clock.get_seq_length()

    def advance(self, tokens: int) -> None:
        """Record that a step of `tokens` tokens ran (after it succeeded)."""
        zeros = torch.zeros(self.batch_size, 1, tokens, 1)
        self.clock.update(zeros, zeros)
        if self.stateful:
            self.snapshots[self.length] = [_state_of(layer) for layer in self.stateful]
            for old in sorted(self.snapshots)[:-SNAPSHOTS]:
                del self.snapshots[old]

    def rollback(self, position: int) -> None:
        """Forget every token at `position` and after."""
        if not 0 <= position <= self.length:
            raise BadRequest(f"cannot roll the cache of span {self.span} back to {position}: it holds {self.length}")
        drop = self.length - position
        if not drop:
            return
        if self.stateful and position and position not in self.snapshots:
            raise BadRequest(f"blocks {self.span}: recurrent state can return only to the ends of the last "
                             f"{SNAPSHOTS} steps ({sorted(self.snapshots)}), not to {position}; replay from 0")
        for layer in self.own:
            if isinstance(layer, DynamicLayer):
                DynamicLayer.crop(layer, -drop)  # a negative count drops that many tokens from the end
        DynamicLayer.crop(self.clock, -drop)
        for i, layer in enumerate(self.stateful):
            if position:
                _restore(layer, self.snapshots[position][i])
            else:
                layer.reset()
        for later in [p for p in self.snapshots if p > position]:
            del self.snapshots[later]

    @torch.inference_mode()
    def copy(self, length: int, max_length: int | None = None) -> SpanCache:
        """A new cache holding positions [0, `length`) of this one, of `max_length` (default: this one's), sharing
        no tensor with it: attention keys and values cut at `length`; recurrent states as they were at `length`
        (the current ones, or a kept snapshot: any other length is a `BadRequest`, as for `rollback`), with the
        snapshots up to there."""
        if not 0 <= length <= self.length:
            raise BadRequest(f"cannot copy {length} positions of the cache of span {self.span}: it holds {self.length}")
        if self.stateful and length not in (0, self.length) and length not in self.snapshots:
            raise BadRequest(f"blocks {self.span}: recurrent state is kept only at the ends of the last {SNAPSHOTS} "
                             f"steps ({sorted(self.snapshots)}) and at {self.length}, not at {length}")
        new = SpanCache(self.span, self.batch_size, max_length or self.max_length, len(self.kinds), self.kinds,
                        self.state_counts)
        for mine, theirs in zip(self.own, new.own):
            if isinstance(mine, DynamicLayer) and mine.is_initialized:
                theirs.keys, theirs.values = (t[..., :length, :].clone() for t in (mine.keys, mine.values))
                theirs.is_initialized, theirs.device = True, mine.device
        if length:  # at 0 the new cache's states are fresh, as a rollback to 0 resets them
            zeros = torch.zeros(self.batch_size, 1, length, 1)
            new.clock.update(zeros, zeros)
            for i, layer in enumerate(new.stateful):
                _restore(layer, self.snapshots[length][i] if length != self.length else _state_of(self.stateful[i]))
        new.snapshots = {p: [_clone(state) for state in snap] for p, snap in self.snapshots.items() if p <= length}
        return new

    def nbytes(self) -> int:
        tensors = [t for layer in self.own for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
        tensors += [t for layer in self.stateful for states in (layer.conv_states, layer.recurrent_states)
                    for t in states.values()]
        tensors += [t for snap in self.snapshots.values() for state in snap
                    for states in (state["conv_states"], state["recurrent_states"]) for t in states.values()]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _cache_layer(kind: str, states: int):
    cls = CACHE_LAYERS.get(kind)
    if cls is None:
        raise BadRequest(f"no cache for layer kind {kind!r}")
    return cls(number_of_states=states) if issubclass(cls, LinearAttentionLayer) else cls()


def _clone(state: dict) -> dict:
    return {field: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in value.items()}
            if isinstance(value, dict) else value for field, value in state.items()}


def _state_of(layer) -> dict:
    return _clone({field: getattr(layer, field) for field in STATE_FIELDS})


def _restore(layer, state: dict) -> None:
    for field, value in _clone(state).items():
        setattr(layer, field, value)


def span_kv(span: Span, num_blocks: int, layers: dict, kinds: Sequence[str] | None = None,
            clock: DynamicLayer | None = None) -> DynamicCache:
    """A cache with an entry per block: `layers` for the span's blocks; every other entry is the span's first
    layer of the same family of kinds (attention or recurrent), else `clock` (length only) for attention
    kinds and an empty recurrent layer for recurrent ones."""
    kinds = list(kinds) if kinds is not None else ["full_attention"] * num_blocks
    recurrent = [layers[i] for i in span if isinstance(layers[i], LinearAttentionLayer)]
    attention = [layers[i] for i in span if isinstance(layers[i], DynamicLayer)]
    spare_recurrent = None
    entries = []
    for i in range(num_blocks):
        if i in layers:
            entries.append(layers[i])
        elif kinds[i] == "dummy":
            entries.append(DummyLayer())
        elif issubclass(CACHE_LAYERS.get(kinds[i], DynamicLayer), LinearAttentionLayer) and \
                not issubclass(CACHE_LAYERS.get(kinds[i], DynamicLayer), DynamicLayer):
            if not recurrent and spare_recurrent is None:
                spare_recurrent = LinearAttentionLayer()
            entries.append(recurrent[0] if recurrent else spare_recurrent)
        else:
            entries.append(attention[0] if attention else (clock or layers[span.start]))
    kv = DynamicCache()
    kv.layers = entries
    return kv
