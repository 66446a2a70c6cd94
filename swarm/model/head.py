"""The client's local part of a model: what the family computes before its first layer and after its last.

Invariant: the family's own causal-LM forward computes both (see `swarm.model.frame`): embeddings with
their scales, multipliers, norms and position embeddings on the way in; final norm, LM head, logit
scaling and soft-capping on the way out. Only the tensors those calls use are read from disk.
"""

from __future__ import annotations

import logging
import threading

import torch

from swarm.model.checkpoint import Checkpoint, parse_dtype
from swarm.errors import BadRequest, CheckpointError
from swarm.model.family_cache import cache_class
from swarm.model.frame import Plan, build, length_cache, position_ids_for

logger = logging.getLogger(__name__)


class ModelHead(torch.nn.Module):
    def __init__(self, checkpoint: Checkpoint | str, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu"):
        super().__init__()
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        self.dtype, self.device = parse_dtype(dtype), torch.device(device)
        self.model_type, self.num_blocks = ckpt.model_type, ckpt.num_blocks
        self.layout = ckpt.layout
        frame, _ = build(ckpt, self.dtype, self.device, modules=ckpt.layout.head_modules, tie=True)
        self.frame = frame
        self.model = frame.model  # registered: parameters(), to() and state see the head's weights
        self.embed_tokens = self.model.get_input_embeddings()
        self.lm_head = self.model.get_output_embeddings()
        if self.embed_tokens.weight.device.type == "meta":
            raise CheckpointError(f"{ckpt.path}: the checkpoint has no token embeddings")
        self.slot = frame.entries[0]
        self.kv_class = cache_class(ckpt.model_type)
        self.boundary = ckpt.boundary  # what the first span takes and the last returns (`swarm.model.streams`)
        self.hidden_size = self.boundary.width
        self.requires_grad_(False)
        self.eval()
        logger.info("loaded head of %s (%.1fM parameters)", ckpt.model_type, self.num_parameters() / 1e6)

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.num_embeddings)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.device.type != "meta")  # tied weights count once

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, position: int,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states the first layer gets for `input_ids` placed at `position` (`attention_mask`
        [batch, position + tokens] of 0/1 marks left padding, which shifts positions)."""
        if input_ids.ndim != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise BadRequest(f"input ids must be an integer tensor [batch, tokens], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            raise BadRequest(f"token ids must lie in [0, {self.vocab_size})")
        batch, tokens = input_ids.shape
        position_ids = position_ids_for(batch, tokens, position, attention_mask, self.device)
        streams = self.boundary.streams
        inputs = [s for s in streams if not s.carried]
        # Per-layer inputs are read off every slot's call, so the call stops at the last slot, not the first.
        plan = Plan(capture=self.frame.entries[-1] if any(s.per_layer for s in inputs) else self.slot,
                    record=tuple(s.arg for s in inputs))
        hidden = self.frame.call(plan, input_ids=input_ids.to(self.device), position_ids=position_ids,
                                 cache=length_cache(batch, position, self.num_blocks, self.device, self.kv_class),
                                 use_cache=True)
        if not streams:
            return self.boundary.flatten(hidden)
        hidden = self.boundary.flatten(plan.seen[0])  # what the first layer takes (slots pass it on unchanged)
        parts = []
        for stream in streams:
            if stream.carried:  # no layer has run: the first span's first layer starts it
                parts.append(hidden.new_zeros(*hidden.shape[:-1], stream.width))
            elif stream.per_layer:
                parts.append(torch.cat([seen[stream.arg] for seen in plan.recorded], dim=-1))
            else:
                parts.append(plan.recorded[0][stream.arg])
        return self.boundary.join(hidden, parts)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The family's logits of the last layer's hidden states [..., hidden] (any leading shape): final
        norm, LM head and whatever it applies after them."""
        if hidden.ndim != 3:  # e.g. the last position of each sequence, [batch, hidden]
            lead = hidden.shape[:-1]
            return self.logits(hidden.reshape(1, -1, hidden.shape[-1])).reshape(*lead, -1)
        if hidden.shape[-1] != self.boundary.width:
            raise BadRequest(f"hidden states must be [..., {self.boundary.width}], got {tuple(hidden.shape)}")
        batch, tokens, _ = hidden.shape
        # the family's collapse of its residual streams and final norm take the hidden part, as the layers pass it
        hidden = self.boundary.unflatten(self.boundary.split(hidden.to(self.device, self.dtype))[0])
        out = self.frame.call(Plan(enter=self.slot, hidden=hidden),
                              inputs_embeds=torch.zeros(batch, tokens, self.layout.embed_dim, dtype=self.dtype,
                                                        device=self.device),
                              position_ids=position_ids_for(batch, tokens, 0, None, self.device),
                              **self.boundary.forward_kwargs(batch, tokens, self.dtype, self.device))
        return out.logits

    @torch.inference_mode()
    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads for the last layer's hidden states [batch, tokens, hidden]: the states after
        the family's final norm (embeddings pool these). The head's forward stops there."""
        me, captured = threading.get_ident(), []

        def grab(module, args):
            if threading.get_ident() == me:  # other threads may be computing logits meanwhile
                captured.append(args[0])
                raise _Captured

        handle = self.lm_head.register_forward_pre_hook(grab)
        try:
            self.logits(hidden)
        except _Captured:
            pass
        finally:
            handle.remove()
        if not captured:
            raise CheckpointError(f"the {self.model_type} head never called its LM head")
        return captured[0]


class _Captured(Exception):  # noqa: N818 - control flow, never escapes `final_hidden`
    pass
