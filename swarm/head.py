"""The client's local part of a model: token embeddings, final norm and LM head, without any layer.

Invariant: built as the family's own CausalLM with zero decoder layers, so embedding scaling, tied
weights and computed buffers are exactly the family's; only the head's tensors are read from disk.
"""

from __future__ import annotations

import copy
import logging

import torch
from transformers import AutoModelForCausalLM

from swarm.checkpoint import Checkpoint, parse_dtype
from swarm.errors import BadRequest, CheckpointError

logger = logging.getLogger(__name__)


class ModelHead(torch.nn.Module):
    def __init__(self, checkpoint: Checkpoint | str, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu"):
        super().__init__()
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        self.dtype, self.device = parse_dtype(dtype), torch.device(device)
        self.model_type, self.num_blocks = ckpt.model_type, ckpt.num_blocks

        config = copy.deepcopy(ckpt.config)
        config.num_hidden_layers = 0
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = []
        prefix = ckpt.layout.base_prefix
        names = [n for n in ckpt.tensor_names("") if not n.startswith(f"{prefix}.layers.")]
        if not any(n.startswith(f"{prefix}.embed_tokens.") for n in names):
            raise CheckpointError(f"{ckpt.path}: the checkpoint has no token embeddings")
        # Built for real (not on meta): computed buffers such as embedding scales must exist.
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=self.dtype)
        ckpt.load_into(model, names, self.dtype)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        base = getattr(model, prefix)
        self.embed_tokens = base.embed_tokens
        self.norm = base.norm
        self.lm_head = model.lm_head
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.to(self.device)
        self.requires_grad_(False)
        self.eval()
        logger.info("loaded head of %s (%.1fM parameters)", ckpt.model_type, self.num_parameters() / 1e6)

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.num_embeddings)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights count once

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.ndim != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise BadRequest(f"input ids must be an integer tensor [batch, tokens], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            raise BadRequest(f"token ids must lie in [0, {self.vocab_size})")
        return self.embed_tokens(input_ids.to(self.device))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and (where the family has it) logit soft-capping."""
        out = self.lm_head(self.norm(hidden.to(self.device, self.dtype)))
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out
