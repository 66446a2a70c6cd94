"""One session's cache for a span of blocks (`SpanCache`), the cache layers the family's forward calls
(`swarm.model.cache_layers`), and the per-block cache a span's forward is handed (`span_kv`).

Invariants:
- A `SpanCache` is indexed by global layer index; layers before the span stay empty and cost nothing.
  Every cached attention layer keeps the full history (no sliding eviction), so the cache can be rolled back
  to any earlier position; sliding-window layers get their window from the mask instead.
- Attention keys and values live in the session's `swarm.model.kv.Rows`, written in place: a layer's `update`
  writes the step's tokens after its length and returns views of its whole history. Rolling back moves
  lengths; a fork shares the source's full blocks. An indexed attention layer's indexer keys are one more part
  of the same rows (`IndexedLayer`): kept, rolled back and forked with its keys and values.
- The positions a family keeps on a cache entry for its indexers (`indexer_position_ids`) are read up to that
  entry's length, so a rollback forgets the later ones too; a fork copies them.
- The cache length always equals the session's position. A step runs between `begin` (room made for its
  tokens) and `advance` (its tokens counted) or `abort` (every layer back to the length before it).
- Recurrent layers, and compressed-attention layers' compressors (`swarm.model.compressed`), keep their state
  plus copies of it at the ends of the last `SNAPSHOTS` steps: a rollback to one of those positions (or to 0)
  is exact, any other is a `BadRequest`. So is a fork. A failed step puts the copy of the last end back. States a
  family keeps in its modules (`held`) are kept here too, as `swarm.model.recurrent.HeldStates`.
- A fork's recurrent states share no tensor with its source's: either may step or roll back without
  changing the other. Its attention blocks are shared until one of them writes there (copy on write).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import (CacheLayerMixin, DummyLayer, LinearAttentionAndFullAttentionLayer,
                                      LinearAttentionLayer)

from swarm.errors import BadRequest
from swarm.model.cache_layers import AttentionLayer, HybridLayer, IndexedLayer, LengthLayer
from swarm.model.kv import Pool, Rows
from swarm.model.recurrent import HeldStates
from swarm.span import Span

ATTENTION, INDEXED, RECURRENT, HYBRID, DUMMY = "attention", "indexed", "recurrent", "hybrid", "dummy"
COMPRESSED = "compressed"
# What each layer kind keeps. Attention kinds keep every past key and value (windows and chunks come from the
# masks), so any earlier position can be returned to. Recurrent kinds keep a state that cannot be cropped:
# rollback restores a copy taken at the end of an earlier step. Hybrid kinds keep both, and so do compressed
# kinds (keys, and compressor states: `swarm.model.compressed`).
KIND_CACHES = {
    "full_attention": ATTENTION, "sliding_attention": ATTENTION, "chunked_attention": ATTENTION,
    "indexed_attention": INDEXED,  # keys and values, plus the keys of an indexer choosing which ones each query sees
    "linear_attention": RECURRENT, "conv": RECURRENT, "hybrid": HYBRID, "hybrid_sliding": HYBRID,
    "dummy": DUMMY,  # layers with no cache of their own (no attention, or one shared with another layer)
    "compressed_sparse_attention": COMPRESSED, "heavily_compressed_attention": COMPRESSED,
}
STATE_FIELDS = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                "is_recurrent_states_initialized", "conv_kernel_size", "device", "dtype")
SNAPSHOTS = 8  # recurrent states kept per session and span: rollback reaches back this many steps


def kind_cache(kind: str) -> str:
    cache = KIND_CACHES.get(kind)
    if cache is None:
        raise BadRequest(f"no cache for layer kind {kind!r}")
    return cache


class SpanCache:
    """One session's cache for one span: keys and values of every past token (in `rows`), and for recurrent
    layers their state plus copies of it at the ends of the last `SNAPSHOTS` steps.

    The cache has an entry for every block of the model, as the family's forward expects: the span's
    blocks have their own; every other entry stands in for its kind (the span's first layer of the same
    kind, or a length-only layer), so that whatever the family asks of "the cache" (its length, mask
    sizes, whether a recurrent state exists) is the span's."""

    def __init__(self, span: Span, batch_size: int, max_length: int, num_blocks: int | None = None,
                 kinds: Sequence[str] | None = None, state_counts: Sequence[int] | None = None,
                 pool: Pool | None = None, rows: Rows | None = None, layer_kwargs: Sequence[dict] | None = None,
                 kv_class: type | None = None, held: Sequence[int] = ()):
        """`layer_kwargs`: transformers' per-layer cache arguments (`get_layer_types_and_kwargs`: the config of
        compressed kinds); `kv_class`: the class of the per-block cache the family's forward takes
        (`swarm.model.family_cache`); `held`: the layers whose family keeps their state in its modules
        (`SpanBlocks` loads it from here)."""
        self.span = span
        self.batch_size = batch_size
        self.max_length = max_length
        n = num_blocks or span.end
        self.kinds = list(kinds) if kinds is not None else ["full_attention"] * n
        self.state_counts = list(state_counts) if state_counts is not None else [1] * n
        self.pool = pool
        self.layer_kwargs = list(layer_kwargs) if layer_kwargs is not None else [{}] * n
        self.kv_class = kv_class
        self.rows = rows if rows is not None or pool is None else pool.rows(batch_size, max_length)
        self.clock = LengthLayer()  # the committed length, for entries the span cannot stand in for
        own = {i: self._layer(i) for i in span}
        self.kv = span_kv(span, n, own, self.kinds, self.clock, kv_class)
        self.attention = [own[i] for i in span if isinstance(own[i], LengthLayer)]  # every entry with a length
        self.held = {i: HeldStates() for i in span if i in held}
        self.stateful = [self.held.get(i, own[i]) for i in span if i in self.held
                         or isinstance(own[i], LinearAttentionLayer) or hasattr(own[i], "snapshot")]
        self.snapshots: dict[int, list[dict]] = {}

    def _layer(self, i: int):
        cache = kind_cache(self.kinds[i])
        part = indexer = None
        if cache in (ATTENTION, INDEXED, HYBRID, COMPRESSED) and self.pool is not None:
            try:
                part = self.pool.layout.part(i)
            except KeyError:  # the layer kept nothing when its shapes were probed: it reads another's
                part = None
            try:
                indexer = self.pool.layout.part(i, "indexer")
            except KeyError:  # its indexer ran on no keys of its own (or there is none)
                indexer = None
        if cache == INDEXED and part is not None and indexer is not None:
            return IndexedLayer(self.rows, part, indexer)
        if cache in (ATTENTION, INDEXED):
            return AttentionLayer(self.rows, part) if part is not None else LengthLayer()
        if cache == HYBRID:
            if part is None:  # a cache of no storage (what a checkpoint's probe hands the family): transformers' own
                return LinearAttentionAndFullAttentionLayer(number_of_states=self.state_counts[i])
            return HybridLayer(self.rows, part, number_of_states=self.state_counts[i])
        if cache == RECURRENT:
            return LinearAttentionLayer(number_of_states=self.state_counts[i])
        if cache == COMPRESSED:
            from swarm.model import compressed

            if part is None:  # no storage (a checkpoint's probe): transformers' own
                return compressed.family_layer(self.kinds[i], self.layer_kwargs[i])
            return compressed.CompressedLayer(self.rows, part, self.kinds[i],
                                              compressed.layer_kwargs_config(self.layer_kwargs[i]))
        return DummyLayer()

    @property
    def own(self) -> list:
        return self.kv.layers[self.span.start:self.span.end]

    @property
    def _kept(self) -> str:
        """What the stateful layers keep, for messages."""
        if all(hasattr(layer, "snapshot") for layer in self.stateful):
            return "compressed-attention state (entries and partial windows)"
        return "recurrent state"

    @property
    def length(self) -> int:
        return self.clock.length

    def begin(self, tokens: int) -> None:
        """Make room for a step of `tokens` tokens at the cache's end (`OutOfCache`, nothing written, if none)."""
        if self.rows is not None and any(isinstance(layer, AttentionLayer) for layer in self.attention):
            self.rows.prepare(self.length, self.length + tokens)

    def advance(self, tokens: int, step_end: bool = True) -> None:
        """Record that a step of `tokens` tokens ran (after it succeeded); not `step_end`: a part of a step run in
        several forwards, whose states are not kept for rollback."""
        self.clock.length += tokens
        for layer in self.attention:
            layer.length = self.clock.length
        if self.stateful and step_end:
            self.snapshots[self.length] = [_state_of(layer) for layer in self.stateful]
            for old in sorted(self.snapshots)[:-SNAPSHOTS]:
                del self.snapshots[old]

    def abort(self) -> None:
        """Forget a step that failed midway: every attention layer back to the cache's length, and every stateful
        layer (recurrent, compressed) back to its copy kept at that length (the last step's end), or fresh at 0:
        the layers may have changed their states before the failure."""
        for layer in self.attention:
            layer.length = self.length
        for i, layer in enumerate(self.stateful):
            if self.length in self.snapshots:
                _restore(layer, self.snapshots[self.length][i])
            elif not self.length:
                layer.reset()

    def rollback(self, position: int) -> None:
        """Forget every token at `position` and after."""
        if not 0 <= position <= self.length:
            raise BadRequest(f"cannot roll the cache of span {self.span} back to {position}: it holds {self.length}")
        if position == self.length:
            return
        if self.stateful and position and position not in self.snapshots:
            raise BadRequest(f"blocks {self.span}: {self._kept} can return only to the ends of the last "
                             f"{SNAPSHOTS} steps ({sorted(self.snapshots)}), not to {position}; replay from 0")
        self.clock.length = position
        for layer in self.attention:
            layer.length = position
        for i, layer in enumerate(self.stateful):
            if position:
                _restore(layer, self.snapshots[position][i])
            else:
                layer.reset()
        for later in [p for p in self.snapshots if p > position]:
            del self.snapshots[later]

    @torch.inference_mode()
    def fork(self, length: int, max_length: int | None = None, credits: int = 0) -> SpanCache:
        """A new cache holding positions [0, `length`) of this one, of `max_length` (default: this one's): its
        attention blocks shared with this one where full, the last partial one copied (`Rows.fork`, paid with
        `credits` first); recurrent states as they were at `length` (the current ones, or a kept snapshot: any
        other length is a `BadRequest`, as for `rollback`), copied, with the snapshots up to there."""
        if not 0 <= length <= self.length:
            raise BadRequest(f"cannot copy {length} positions of the cache of span {self.span}: it holds {self.length}")
        if self.stateful and length not in (0, self.length) and length not in self.snapshots:
            raise BadRequest(f"blocks {self.span}: {self._kept} is kept only at the ends of the last {SNAPSHOTS} "
                             f"steps ({sorted(self.snapshots)}) and at {self.length}, not at {length}")
        max_length = max_length or self.max_length
        rows = self.rows.fork(length, max_length, credits) if self.rows is not None else None
        new = SpanCache(self.span, self.batch_size, max_length, len(self.kinds), self.kinds, self.state_counts,
                        self.pool, rows, self.layer_kwargs, self.kv_class, tuple(self.held))
        for mine, theirs in zip(new.kv.layers + [new.clock], self.kv.layers + [self.clock]):
            if isinstance(theirs, LengthLayer) and theirs._positions is not None and length:
                mine.indexer_position_ids = theirs._positions[..., :length].clone()
        if length:  # at 0 the new cache's states are fresh, as a rollback to 0 resets them
            new.clock.length = length
            for layer in new.attention:
                layer.length = length
            for i, layer in enumerate(new.stateful):
                _restore(layer, self.snapshots[length][i] if length != self.length else _state_of(self.stateful[i]))
        new.snapshots = {p: [_clone(state) for state in snap] for p, snap in self.snapshots.items() if p <= length}
        return new

    def release(self) -> None:
        """Give the attention blocks back to the pool (the session closed)."""
        if self.rows is not None:
            self.rows.release()

    def nbytes(self) -> int:
        """Bytes this session's storage covers: its attention blocks (shared ones in full), its recurrent states
        and their snapshots."""
        tensors = {id(t): t for state in [_live(layer) for layer in self.stateful] + [
            state for snap in self.snapshots.values() for state in snap] for t in _tensors(state)}
        tensors.update({id(p): p for layer in self.kv.layers + [self.clock] if isinstance(layer, LengthLayer)
                        and (p := layer._positions) is not None})
        own = self.rows.nbytes() if self.rows is not None else 0
        return own + sum(t.numel() * t.element_size() for t in tensors.values())


def _clone(state: dict) -> dict:
    return {field: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in value.items()}
            if isinstance(value, dict) else value for field, value in state.items()}


def _live(layer) -> dict:
    """A stateful layer's state as it is (references): its own `state()`, or transformers' recurrent fields."""
    if hasattr(layer, "state"):
        return layer.state()
    return {field: getattr(layer, field) for field in getattr(layer, "STATE_FIELDS", STATE_FIELDS)}


def _tensors(state: dict) -> list:
    return [t for value in state.values() for t in (value.values() if isinstance(value, dict) else [value])
            if isinstance(t, torch.Tensor)]


def _state_of(layer) -> dict:
    if hasattr(layer, "snapshot"):  # a layer that says what a copy of its state needs (`swarm.model.compressed`)
        return layer.snapshot()
    return _clone(_live(layer))


def _restore(layer, state: dict) -> None:
    if hasattr(layer, "restore"):
        layer.restore(state)
        return
    for field, value in _clone(state).items():
        setattr(layer, field, value)


def span_kv(span: Span, num_blocks: int, layers: dict, kinds: Sequence[str] | None = None,
            clock: LengthLayer | None = None, kv_class: type | None = None) -> DynamicCache:
    """A cache with an entry per block: `layers` for the span's blocks; every other entry is the span's first
    layer of the same family of kinds (attention or recurrent), else `clock` (length only) for attention
    kinds and an empty recurrent layer for recurrent ones. An indexed entry outside the span is the span's first
    indexed layer, else `clock`: what a family keeps there for its indexers (positions) is the session's."""
    kinds = list(kinds) if kinds is not None else ["full_attention"] * num_blocks
    recurrent = [layers[i] for i in span if isinstance(layers[i], LinearAttentionLayer)]
    attention = [layers[i] for i in span if isinstance(layers[i], CacheLayerMixin)
                 and not isinstance(layers[i], DummyLayer)]
    indexed = [layers[i] for i in span
               if KIND_CACHES.get(kinds[i]) == INDEXED and not isinstance(layers[i], DummyLayer)]
    clock = clock or LengthLayer()
    spare_recurrent = None
    entries = []
    for i in range(num_blocks):
        cache = KIND_CACHES.get(kinds[i], ATTENTION)
        if i in layers:
            entries.append(layers[i])
        elif cache == DUMMY:
            entries.append(DummyLayer())
        elif cache == RECURRENT:
            if not recurrent and spare_recurrent is None:
                spare_recurrent = LinearAttentionLayer()
            entries.append(recurrent[0] if recurrent else spare_recurrent)
        elif cache == INDEXED:
            entries.append(indexed[0] if indexed else clock)
        else:
            entries.append(attention[0] if attention else clock)
    kv = (kv_class or DynamicCache)()
    kv.layers = entries
    return kv
