"""A model run as head -> span -> ... -> span -> head inside one process.

This is the shape a swarm route has, without the network: the client's head (embeddings, final
norm, LM head) and a chain of block spans, each span with its own session cache. It serves the
offline demo and is the in-process reference that remote routes are compared against.
"""

from __future__ import annotations

import torch

from swarm.model.blocks import SpanBlocks
from swarm.model.cache import SpanCache
from swarm.model.checkpoint import Checkpoint
from swarm.model.head import ModelHead
from swarm.span import Span, span_starts, split_evenly


class LocalChain:
    def __init__(self, path, spans: list[Span], dtype: str = "float32"):
        ckpt = Checkpoint(path)
        covered = [b for s in spans for b in s]
        if covered != list(range(ckpt.num_blocks)):
            raise ValueError(f"spans {[str(s) for s in spans]} must cover blocks [0:{ckpt.num_blocks}) in order, once")
        self.checkpoint = ckpt
        self.head = ModelHead(ckpt, dtype=dtype)
        self.blocks = [SpanBlocks(ckpt, s, dtype=dtype) for s in spans]

    @classmethod
    def from_path(cls, path, parts: int, dtype: str = "float32") -> LocalChain:
        """The checkpoint at `path` cut into `parts` spans of nearly equal size, each starting where a span of the
        model may start (`swarm.span.span_starts`)."""
        ckpt = Checkpoint(path)
        return cls(path, split_evenly(ckpt.num_blocks, parts, span_starts(ckpt.config)), dtype=dtype)

    def session(self, batch_size: int = 1, max_length: int = 2048) -> LocalSession:
        return LocalSession(self, [b.new_cache(batch_size, max_length) for b in self.blocks])


class LocalSession:
    """One sequence batch's caches along the chain."""

    def __init__(self, chain: LocalChain, caches: list[SpanCache]):
        self.chain, self.caches = chain, caches

    @property
    def position(self) -> int:
        return self.caches[0].length

    def step(self, input_ids: torch.Tensor, position: int | None = None,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `input_ids` placed at `position` (default: after everything seen so far)."""
        position = self.position if position is None else position
        hidden = self.chain.head.embed(input_ids, position, attention_mask)
        for blocks, cache in zip(self.chain.blocks, self.caches):
            hidden = blocks(hidden, cache, position, attention_mask=attention_mask)
        return self.chain.head.logits(hidden)

    def prefill(self, input_ids: torch.Tensor, chunk: int = 256,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run a prompt in chunks of `chunk` tokens (how a swarm keeps messages under its size cap)."""
        outs = []
        for start in range(0, input_ids.shape[1], chunk):
            end = min(start + chunk, input_ids.shape[1])
            mask = None if attention_mask is None else attention_mask[:, :end]
            outs.append(self.step(input_ids[:, start:end], start, mask))
        return torch.cat(outs, dim=1)
