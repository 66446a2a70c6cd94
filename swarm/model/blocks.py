"""A span of a model's decoder layers, loaded alone and run step by step against a session cache.

Invariants:
- Layers are the family's own transformers classes, built from the config by composition, with
  their global layer index (so per-layer settings such as sliding windows stay right). Only the
  span's tensors are read from disk.
- Sessions' caches are `swarm.model.cache.SpanCache`s: full history per layer, so any rollback is a crop.
- The cache length always equals the session's position: a step at position p first rolls the cache
  back to p, and a step past the cache end is refused.
- The attention mask is built for every step with transformers' own mask functions, sized against
  the first layer of the span of each attention kind.
- `decode_batch` runs one-token steps of several sessions as one forward: their caches are copied,
  left-padded to the longest, into a temporary cache, and padding is masked out. Left padding keeps
  the distance between the query (last) and every real key, so sliding windows stay right. Each
  session's cache then gets only its own new key and value: it ends exactly as a step of its own
  would have left it. A failed batch leaves every session cache untouched.
- A step of several tokens after a recurrent state exists runs one token at a time where a layer's family cannot
  continue its state over several tokens (`one_token`, found at load: `swarm.model.recurrent`); otherwise in one
  forward. States a family keeps in its modules are the stepping session's during its step (`swarm.model.recurrent`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import (DummyLayer, DynamicIndexedLayer, DynamicLayer,
                                      LinearAttentionAndFullAttentionLayer, LinearAttentionLayer,
                                      get_layer_types_and_kwargs)

from swarm.model.checkpoint import Checkpoint, parse_dtype
from swarm.model.precision import Precision, module_bytes, quantize
from swarm.errors import BadRequest, SwarmError
from swarm.model.cache import ATTENTION, COMPRESSED, HYBRID, INDEXED, RECURRENT, SpanCache, kind_cache, span_kv
from swarm.model.cache_layers import AttentionLayer, LengthLayer
from swarm.model.compressed import family_layer
from swarm.model.family_cache import cache_class
from swarm.model.ragged import (NAMES as RAGGED_NAMES, RaggedBatch, RaggedLayer, RaggedUnsupported, batch_dependent,
                                configs_of, ragged)
from swarm.model.kv import KVLayout, Pool, Rows
from swarm.model.frame import LayerSlot, Plan, build, position_ids_for
from swarm.model.recurrent import HELD_LOCK, held_slots, load_held, one_token_continuations, save_held
from swarm.span import Span, check_start, span_starts

logger = logging.getLogger(__name__)

# Tokens the blocks' own cache pool holds when nobody sized it (`size_pool`): blocks are memory only once written.
DEFAULT_POOL_TOKENS = 1 << 18

class SpanBlocks(torch.nn.Module):
    """Decoder layers `[start, end)` of a checkpoint, ready to run steps for sessions."""

    def __init__(self, checkpoint: Checkpoint | str, span: Span, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", reuse: SpanBlocks | None = None, quant: str = "none"):
        """`reuse`: blocks already loaded (same checkpoint, dtype, device and weight format) whose layers
        inside `span` are shared rather than read again, so a peer moving to an overlapping span loads only
        the new blocks and holds the overlap once. `quant`: the layers' linear weights in int8 or nf4
        (`swarm.model.precision.quantize`)."""
        super().__init__()
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        span.check_within(ckpt.num_blocks)
        self.span, self.dtype, self.device = span, parse_dtype(dtype), torch.device(device)
        self.precision = Precision(self.device, str(self.dtype).removeprefix("torch."), quant)
        if reuse is not None and (reuse.dtype, reuse.device, reuse.model_type, reuse.precision.quant) != (
                self.dtype, self.device, ckpt.model_type, quant):
            raise ValueError(f"cannot reuse blocks {reuse.span} ({reuse.model_type}, {reuse.precision.format}, "
                             f"{reuse.device}) for {ckpt.model_type} in {self.precision.format} on {self.device}")
        shared = {i: reuse.layers[i - reuse.span.start] for i in span
                  if reuse is not None and reuse.span.start <= i < reuse.span.end}
        self.model_type = ckpt.model_type
        self.num_blocks = ckpt.num_blocks
        # blocks a span may start at (`swarm.span.span_starts`): not one that takes what the block before it
        # computed inside the family's layer loop (an indexer's choice)
        self.starts = span_starts(ckpt.text_config)
        check_start(span, self.starts)
        self.layer_types = ckpt.layout.layer_types[span.start:span.end]
        self.embed_dim = ckpt.layout.embed_dim

        started = time.monotonic()
        self.frame, layers = build(ckpt, self.dtype, self.device, blocks=list(span), modules=ckpt.layout.peer_modules,
                                   shared=shared)
        for i in span:
            if i not in shared:
                quantize(layers[i], self.precision)
        self.config = ckpt.text_config
        self.boundary = ckpt.boundary  # what the span takes and returns per token (`swarm.model.streams`)
        kinds, per_layer = get_layer_types_and_kwargs(ckpt.text_config)
        self.cache_kinds = list(kinds)
        self.state_counts = [kw.get("number_of_states", 1) for kw in per_layer]
        self.layer_kwargs = list(per_layer)
        self.kv_class = cache_class(ckpt.model_type)
        with HELD_LOCK:  # module-held states of these layers: found, and left empty (swarm.model.recurrent)
            self.held = held_slots({i: layers[i] for i in span}, self.device, self.dtype)
        stateful = [i for i in span if i in self.held or kind_cache(kinds[i]) in (RECURRENT, HYBRID, COMPRESSED)]
        self.recurrent = bool(stateful)
        self._layout: KVLayout | None = None
        self._pool: Pool | None = None
        self._pool_tokens = DEFAULT_POOL_TOKENS
        self.layers = torch.nn.ModuleList(layers[i] for i in span)
        self.outside = self.frame.model  # not a submodule: its only weights here are the layers'
        self.attention_implementation = getattr(self.config, "_attn_implementation", None) or "eager"
        self._configs = configs_of(self.outside)
        # whether steps of several sessions share one forward: until the family shows it cannot (`decode_batch`)
        self.ragged = self.attention_implementation in RAGGED_NAMES and not batch_dependent(self.config)
        self._entries: dict[Span, torch.nn.ModuleList] = {}
        self._slots = list(self.frame.entries)
        self.requires_grad_(False)
        self.eval()
        with self._held_states(), torch.inference_mode():
            # the stateful layers whose family cannot continue a state over several tokens at once
            recurrent = [i for i in stateful if kind_cache(kinds[i]) != COMPRESSED]  # compressors: own caches
            self.one_token = one_token_continuations(dict(zip(span, self.layers)), self.cache_kinds, recurrent,
                                                     self.held, self.state_counts, self.hidden_size, self._probe_run)
        if self.one_token:
            logger.info("blocks %s of %s: steps of several tokens after the first run one token at a time (layers %s "
                        "ignore part of their state over several tokens)", span, ckpt.model_type, sorted(self.one_token))
        logger.info("loaded blocks %s of %s (%s, %.1f MB of weights%s) in %.1f s", span, ckpt.model_type,
                    self.precision.format, self.weight_bytes() / 1e6,
                    f"; {len(shared)} blocks shared with {reuse.span}" if shared else "", time.monotonic() - started)

    def __setattr__(self, name, value):
        if name == "outside":  # the family's model is driven, not owned: keep it out of the module tree
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def hidden_size(self) -> int:
        """The width of what the span takes and returns per token (and the wire carries): the hidden states, and
        the family's other streams after them (`swarm.model.streams.Boundary`)."""
        return self.boundary.width

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def weight_bytes(self) -> int:
        """Bytes the served layers' weights take on the device, in their format."""
        return sum(module_bytes(layer) for layer in self.layers)

    @property
    def kv_layout(self) -> KVLayout:
        """What one token of a session's cache holds: each attention block's keys and values (and an indexed block's
        indexer keys), as the family's own layers produce them (probed once: one token through the span with
        transformers' own cache layers)."""
        if self._layout is None:
            self._layout = self._probe_layout()
        return self._layout

    @torch.inference_mode()
    def _probe_layout(self) -> KVLayout:
        layers = {}
        for i in self.span:
            cache = kind_cache(self.cache_kinds[i])
            if cache in (RECURRENT, HYBRID):
                layers[i] = (LinearAttentionLayer if cache == RECURRENT else LinearAttentionAndFullAttentionLayer)(
                    number_of_states=self.state_counts[i])
            elif cache == COMPRESSED:
                layers[i] = family_layer(self.cache_kinds[i], self.layer_kwargs[i])
            else:
                layers[i] = {ATTENTION: DynamicLayer, INDEXED: DynamicIndexedLayer}.get(cache, DummyLayer)()
        kv = span_kv(self.span, self.num_blocks, layers, self.cache_kinds, kv_class=self.kv_class)
        hidden = torch.randn(1, 1, self.hidden_size, generator=torch.Generator().manual_seed(0)).to(self.device,
                                                                                                    self.dtype)
        with self._held_states():
            self._run(self.span, hidden, kv, position_ids_for(1, 1, 0, None, self.device), None)
        stored = {i: layer for i, layer in layers.items() if isinstance(layer, DynamicLayer) and layer.is_initialized
                  and layer.keys is not None and layer.keys.numel()}
        indexers = {i: layer.indexer_keys for i, layer in layers.items() if isinstance(layer, DynamicIndexedLayer)
                    and layer.is_indexer_initialized and layer.indexer_keys.numel()}
        if set(indexers) - set(stored):
            raise BadRequest(f"blocks {self.span}: layers {sorted(set(indexers) - set(stored))} keep indexer keys "
                             "and no keys and values")
        dtypes = {t.dtype for layer in stored.values() for t in (layer.keys, layer.values)}
        dtypes |= {keys.dtype for keys in indexers.values()}
        if len(dtypes) > 1:
            raise BadRequest(f"blocks {self.span} keep keys and values in several dtypes {sorted(map(str, dtypes))}")
        shapes = {i: (layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[1], layer.values.shape[3])
                  for i, layer in stored.items()}
        return KVLayout.of(shapes, dtypes.pop() if dtypes else self.dtype, self.device,
                           {i: keys.shape[-1] for i, keys in indexers.items()})

    def size_pool(self, tokens: int) -> None:
        """Hold `tokens` tokens in the blocks' own cache pool (before its first session)."""
        if self._pool is not None and self._pool.blocks * self._pool.block_tokens < tokens:
            raise ValueError("the cache pool already serves sessions; size it before the first one")
        self._pool_tokens = tokens

    @property
    def pool(self) -> Pool:
        """The cache pool sessions of these blocks take their storage from (`swarm.model.kv`)."""
        if self._pool is None:
            self._pool = Pool(self.kv_layout, self._pool_tokens)
        return self._pool

    def new_cache(self, batch_size: int, max_length: int, span: Span | None = None,
                  rows: Rows | None = None) -> SpanCache:
        """A session's cache; its keys and values in `rows` (a peer's session table makes them from `pool`, to
        count them) or in new rows of the blocks' own pool."""
        return SpanCache(span or self.span, batch_size, max_length, self.num_blocks, self.cache_kinds,
                         self.state_counts, rows.pool if rows is not None else self.pool, rows, self.layer_kwargs,
                         self.kv_class, tuple(self.held))

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, cache: SpanCache | None = None, position: int = 0,
                attention_mask: torch.Tensor | None = None, span: Span | None = None) -> torch.Tensor:
        """Run `hidden` [batch, new_tokens, hidden] through the span, starting at `position`.

        With a cache, a position below its length rolls it back first, and the cache's span (which
        may be a sub-span of these blocks) says which blocks run. Without one, this is a stateless
        forward of whole sequences (position must be 0) through `span` (default: all blocks).
        `attention_mask` [batch, position + new_tokens] of 0/1 marks padding (left padding, as
        transformers generates).
        """
        run = cache.span if cache is not None else (span or self.span)
        self._check_within(run)
        self.check_step(hidden, cache, position, attention_mask)
        hidden = hidden.to(self.device, self.dtype)
        batch, new_tokens, _ = hidden.shape
        if cache is not None:
            cache.rollback(position)
            if position and new_tokens > 1 and cache.stateful and any(i in self.one_token for i in run):
                return self._token_by_token(run, hidden, cache, position, attention_mask)
            cache.begin(new_tokens)
        position_ids = self._position_ids(batch, new_tokens, position, attention_mask)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device, torch.bool)
        try:
            out = self._step(run, hidden, cache, position_ids, attention_mask)
        except BaseException:
            if cache is not None:
                cache.abort()
            raise
        if cache is not None:
            cache.advance(new_tokens)
        return out

    @torch.inference_mode()
    def decode_batch(self, items: Sequence[tuple[SpanCache, torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
        """One-token steps of several sessions, at their caches' ends, as one forward; one output per item, or
        the typed error of that item's step alone (its session closed meanwhile, no block for its token).

        Each item is (cache, hidden [batch_i, 1, hidden], attention mask [batch_i, length_i + 1] or None);
        all caches are of one span. The result equals running `self(hidden, cache, cache.length, mask)`
        for each item (up to float rounding), caches included. Each session attends over its own history
        (`swarm.model.ragged`); where the family cannot run that way, or holds recurrent states, the steps
        run one after another.
        """
        if not items:
            return []
        run = items[0][0].span
        self._check_within(run)
        lengths = []
        for cache, hidden, mask in items:
            if cache.span != run:
                raise BadRequest(f"blocks {self.span}: a batch mixes spans {run} and {cache.span}")
            self.check_step(hidden, cache, cache.length, mask)
            if hidden.shape[1] != 1:
                raise BadRequest(f"blocks {self.span}: a batched step takes one token, got {hidden.shape[1]}")
            lengths.append(cache.length)
        if len({id(cache) for cache, _, _ in items}) != len(items):
            raise BadRequest(f"blocks {self.span}: a batch holds two steps of one session")
        if len(items) == 1 or not self.ragged or any(cache.stateful for cache, _, _ in items):
            return [self._alone(hidden, cache, mask) for cache, hidden, mask in items]
        results: list = [None] * len(items)
        ready = []  # (index, item) of the steps that have room for their token
        for i, item in enumerate(items):
            try:
                item[0].begin(1)
                ready.append((i, item))
            except SwarmError as e:  # closed meanwhile, or no block for its token: that step alone fails
                results[i] = e
        if not ready:
            return results
        try:
            out = self._ragged(run, [item for _, item in ready], [lengths[i] for i, _ in ready])
        except RaggedUnsupported as e:
            for _, (cache, _, _) in ready:
                cache.abort()
            self.ragged = False
            logger.info("blocks %s of %s: steps of several sessions run one at a time (%s)", self.span,
                        self.model_type, e)
            for i, (cache, hidden, mask) in ready:
                results[i] = self._alone(hidden, cache, mask)
            return results
        except BaseException:
            for _, (cache, _, _) in ready:
                cache.abort()
            raise
        for (i, (cache, hidden, _)), part in zip(ready, out.split([h.shape[0] for _, (_, h, _) in ready])):
            cache.advance(1)
            results[i] = part
        return results

    def _token_by_token(self, run: Span, hidden: torch.Tensor, cache: SpanCache, position: int,
                        mask: torch.Tensor | None) -> torch.Tensor:
        """A step of several tokens on a recurrent state, one token at a time (as transformers generates); only its
        end is kept for rollback. A failure midway returns the cache to `position`."""
        batch, tokens, _ = hidden.shape
        cache.begin(tokens)
        outs = []
        try:
            for t in range(tokens):
                own = None if mask is None else mask[:, :position + t + 1]
                ids = self._position_ids(batch, 1, position + t, own)
                outs.append(self._step(run, hidden[:, t:t + 1], cache, ids,
                                       None if own is None else own.to(self.device, torch.bool)))
                cache.advance(1, step_end=t == tokens - 1)
        except BaseException:
            cache.abort()
            if cache.length > position and position in cache.snapshots:
                cache.rollback(position)
            raise
        return torch.cat(outs, dim=1)

    def _held_states(self):
        """Held while states kept in these layers' modules are used (layers may be shared with other blocks)."""
        return HELD_LOCK if self.held else contextlib.nullcontext()

    def _step(self, run: Span, hidden: torch.Tensor, cache: SpanCache | None, position_ids: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """`_run` on a session's cache: states its family keeps in modules are the session's meanwhile."""
        kv = cache.kv if cache is not None else None
        with self._held_states():
            if cache is not None:
                load_held(self.held, cache.held)
            try:
                return self._run(run, hidden, kv, position_ids, mask)
            finally:
                if cache is not None:
                    save_held(self.held, cache.held)

    def _probe_run(self, run: Span, hidden: torch.Tensor, layers: dict, position: int) -> torch.Tensor:
        """`run` over `hidden` [1, tokens, hidden] at `position`, on transformers' own cache `layers`."""
        kv = span_kv(run, self.num_blocks, layers, self.cache_kinds, LengthLayer(position), self.kv_class)
        return self._run(run, hidden.to(self.device, self.dtype), kv,
                         position_ids_for(1, hidden.shape[1], position, None, self.device), None)

    def _alone(self, hidden: torch.Tensor, cache: SpanCache, mask: torch.Tensor | None):
        """One step of a batch run by itself: its output, or its error (the batch's other steps go on)."""
        try:
            return self(hidden, cache, cache.length, mask)
        except SwarmError as e:
            return e

    def _ragged(self, run: Span, items, lengths: list[int]) -> torch.Tensor:
        """The ragged forward of `items` (prepared): rows in item order, left-padded mask to the longest."""
        longest = max(lengths)
        hidden = torch.cat([h.to(self.device, self.dtype) for _, h, _ in items])
        mask = torch.zeros(hidden.shape[0], longest + 1, dtype=torch.bool, device=self.device)
        position_ids, sessions, r = [], [], 0
        for (cache, h, own), length in zip(items, lengths):
            rows = slice(r, r + h.shape[0])
            mask[rows, longest - length:] = True if own is None else own.to(self.device, torch.bool)
            position_ids.append(self._position_ids(h.shape[0], 1, length, own))
            sessions.append((cache.kv.layers, rows))
            r = rows.stop
        batch = RaggedBatch(sessions, self.attention_implementation)
        first = items[0][0].kv.layers
        layers = {i: RaggedLayer(batch, i, longest) if isinstance(first[i], AttentionLayer) else
                  LengthLayer(longest) if isinstance(first[i], LengthLayer) else DummyLayer() for i in run}
        kv = span_kv(run, self.num_blocks, layers, self.cache_kinds, LengthLayer(longest), self.kv_class)
        with ragged(self._configs, batch):
            try:
                out = self._run(run, hidden, kv, torch.cat(position_ids), mask)
            except RaggedUnsupported:
                raise
            except Exception as e:  # views a layer never took: it attends in code of its own, not per session
                if batch.pending:
                    raise RaggedUnsupported(f"a layer attends in code of its own ({type(e).__name__})") from e
                raise
        if batch.pending:
            raise RaggedUnsupported("a layer attends in code of its own")
        return out

    def _check_within(self, run: Span) -> None:
        if not (self.span.start <= run.start and run.end <= self.span.end):
            raise BadRequest(f"blocks {run} are not within the served blocks {self.span}")
        check_start(run, self.starts)

    def _run(self, run: Span, hidden: torch.Tensor, kv: DynamicCache | None, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The blocks of `run` over `hidden`, inside the family's own forward: it builds the masks, position
        embeddings and whatever else its layers take, exactly as for the whole model."""
        entries = self._entries.get(run)
        if entries is None:
            layers = dict(zip(self.span, self.layers))
            entries = torch.nn.ModuleList(layers[i] if i in run else self._slot(i) for i in range(self.num_blocks))
            self._entries[run] = entries
        batch, tokens, _ = hidden.shape
        boundary = self.boundary
        hidden, parts = boundary.split(hidden)
        plan = Plan(enter=entries[run.start], hidden=boundary.unflatten(hidden), leave=entries[run.end - 1])
        for stream, part in zip(boundary.streams, parts):
            # a carried stream enters at the span's first layer; at block 0 the family's own (none) is right
            for i in ([run.start] if run.start > 0 else []) if stream.carried else run:
                plan.args.setdefault(id(entries[i]), {})[stream.arg] = boundary.layer_args(stream, part, i)
        out = self.frame.call(
            plan, entries=entries, decoder=True,
            inputs_embeds=torch.zeros(batch, tokens, self.embed_dim, dtype=self.dtype, device=self.device),
            attention_mask=None if attention_mask is None else attention_mask.long(), position_ids=position_ids,
            cache=kv, use_cache=kv is not None,
            **boundary.forward_kwargs(batch, tokens, self.dtype, self.device))
        out = boundary.flatten(out)
        if not boundary.streams:
            return out
        parts = [plan.output[1] if stream.carried else part for stream, part in zip(boundary.streams, parts)]
        return boundary.join(out, parts)

    def _slot(self, i: int) -> LayerSlot:
        entry = self._slots[i]
        if isinstance(entry, LayerSlot):
            return entry
        slot = LayerSlot(i, entry)  # a served block left out of this call: it passes through
        slot.returns = self.frame.returns
        self._slots[i] = slot
        return slot

    def _position_ids(self, batch: int, new_tokens: int, position: int, mask: torch.Tensor | None) -> torch.Tensor:
        return position_ids_for(batch, new_tokens, position, mask, self.device)

    def check_step(self, hidden: torch.Tensor, cache: SpanCache | None, position: int,
                   mask: torch.Tensor | None) -> None:
        """`BadRequest` unless `hidden` at `position` (with `mask`) is a step these blocks can run on `cache`."""
        if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3 or hidden.shape[-1] != self.hidden_size:
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise BadRequest(f"blocks {self.span}: expected hidden states [batch, tokens, {self.hidden_size}], got {shape}")
        if not hidden.is_floating_point():
            raise BadRequest(f"blocks {self.span}: hidden states must be floating point, got {hidden.dtype}")
        batch, new_tokens, _ = hidden.shape
        if batch < 1 or new_tokens < 1:
            raise BadRequest(f"blocks {self.span}: empty step (batch {batch}, tokens {new_tokens})")
        if not isinstance(position, int) or position < 0:
            raise BadRequest(f"blocks {self.span}: position must be a non-negative integer, got {position!r}")
        if cache is None:
            if position != 0:
                raise BadRequest(f"blocks {self.span}: a forward without a cache must start at position 0")
        else:
            if batch != cache.batch_size:
                raise BadRequest(f"blocks {self.span}: session batch size is {cache.batch_size}, step has {batch}")
            if position > cache.length:
                raise BadRequest(f"blocks {self.span}: step at position {position} skips past the cache end "
                                 f"{cache.length}")
            if position + new_tokens > cache.max_length:
                raise BadRequest(f"blocks {self.span}: step to {position + new_tokens} exceeds the session's "
                                 f"max length {cache.max_length}")
        if mask is not None and tuple(mask.shape) != (batch, position + new_tokens):
            raise BadRequest(f"blocks {self.span}: attention mask must be [{batch}, {position + new_tokens}], "
                             f"got {tuple(mask.shape)}")
