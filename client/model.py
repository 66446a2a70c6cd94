"""The SDK's model: transformers' own `generate()` over a swarm.

`DistributedModelForCausalLM.from_pretrained(path, initial_peers=[...])` loads only the head
(embeddings, final norm, LM head) from the checkpoint directory and runs every decoder block through
the swarm. It is a `PreTrainedModel` with `GenerationMixin`, so greedy search, sampling, repetition
penalties, stop strings, streamers and batches are transformers' code, unchanged.

How generation drives a session: `generate()` runs in an inference session (the active one, else one
it opens) and transformers calls `forward` with the whole sequence so far (this model keeps no
transformers cache). The session remembers the tokens it has processed; `forward` sends only the part
after the longest common prefix, at the position where it starts, so a changed history rolls the peers'
caches back.

Sessions kept across calls (`reuse_sessions`, on by default): a session `generate()` opened stays open
after it (`kept_session`), and the next `generate()` outside an active session goes on in it when its
input shares a first token with what the session holds (same batch size, same padding); otherwise the kept
session is closed and a new one opened. A chat loop that passes the whole conversation to every
`generate()` so sends the peers only each turn's new tokens. A session is sized for its call (its input and
new tokens); when the next call needs more room, the peers copy the kept session's caches up to what the
call shares into a session long enough (`client.inference.fork`) and the old one closes: nothing is
computed again. `last_reused_tokens` says how many tokens of the last call's input were not sent again
(the position of its first step). `inference_session()`, `close_session()` and `close()` close the kept
session.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from client.checked import checked_generate
from client.config import ClientConfig
from client.connection import SwarmConnection
from client.inference.forward import forward
from client.inference.hops import output_floor
from client.inference.routing import Hop
from client.inference.fork import can_fork, fork
from client.inference.referee import Referee
from client.inference.session import Failover, InferenceSession
from swarm.model.checkpoint import Checkpoint, num_blocks_of, read_config
from swarm.errors import BadRequest
from swarm.model.head import ModelHead
from swarm.model.precision import Precision
from swarm.span import span_starts
from swarm.weights.models import Weights, open_weights

logger = logging.getLogger(__name__)

DEFAULT_NEW_TOKENS = 20  # what transformers' generate makes when given no length at all


def notice_to_stderr(message: str) -> None:
    """The SDK's default `on_wait`: one line on stderr."""
    print(message, file=sys.stderr, flush=True)


class TokenSession:
    """A token-level inference session (sync): `with model.inference_session(max_length=64) as s:`.

    `step(new_ids)` appends tokens and returns their logits; `feed(all_ids)` takes the whole sequence
    and computes only what changed (what `generate` uses). Inside the `with`, `model.generate` continues
    this session instead of opening its own.

    `first_position`: where the first step since it was last set to None began (what was not sent again).
    `session`: an inference session to go on in instead of a new one (a fork, `longer`)."""

    def __init__(self, model: DistributedModelForCausalLM, max_length: int, session: InferenceSession | None = None):
        self.model = model
        self.session = session or InferenceSession(model.connection.client, max_length, on_wait=model.on_wait)
        self.tokens: torch.Tensor | None = None  # ids processed so far [batch, length]
        self.last_ids: torch.Tensor | None = None  # the ids of the last `feed` (a rewind goes on from a prefix)
        self.mask: torch.Tensor | None = None
        self.first_position: int | None = None

    @property
    def position(self) -> int:
        return 0 if self.tokens is None else self.tokens.shape[1]

    @property
    def route(self) -> list[Hop]:
        return self.session.route

    @property
    def failovers(self) -> list[Failover]:
        return self.session.failovers

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, new tokens, vocab] for `input_ids` appended to the session's sequence.
        `attention_mask`, if given, covers the whole sequence including the new tokens."""
        ids = input_ids if self.tokens is None else torch.cat([self.tokens, input_ids.to(self.tokens.dtype)], 1)
        return self.feed(ids, attention_mask)

    def feed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """Logits for the part of `input_ids` [batch, length] after its common prefix with the session; with
        `logits_to_keep`, for its last positions (an int above 0) or those indices (a tensor) only, positions
        the session held already being run again (assisted generation may verify drafts it holds)."""
        if input_ids.ndim != 2 or input_ids.shape[1] < 1:
            raise BadRequest(f"input ids must be [batch, tokens >= 1], got {list(input_ids.shape)}")
        attention_mask = self._mask_of(attention_mask)
        self.last_ids = input_ids
        keep = self.shared_prefix(input_ids, attention_mask)
        keep = min(keep, input_ids.shape[1] - 1)  # at least one token runs, to give logits
        if isinstance(logits_to_keep, torch.Tensor):  # indices into `input_ids`: those positions run again
            logits_to_keep = logits_to_keep % input_ids.shape[1]
            keep = min(keep, int(logits_to_keep.min())) if logits_to_keep.numel() else keep
            logits_to_keep = logits_to_keep - keep
        elif logits_to_keep > 0:  # the last positions' logits, whether or not the session holds them already
            keep = max(0, min(keep, input_ids.shape[1] - logits_to_keep))
        hidden = self.model.head.embed(input_ids[:, keep:], keep, attention_mask)
        try:
            out = self.model.connection.run(self.session.step(hidden, keep, attention_mask))
        except BaseException:
            if self.tokens is not None:  # the session now holds only the common prefix
                self.tokens = self.tokens[:, :min(keep, self.session.length)]
                self.mask = None if self.mask is None else self.mask[:, :self.tokens.shape[1]]
            raise
        self.tokens, self.mask = input_ids.clone(), None if attention_mask is None else attention_mask.clone()
        if self.first_position is None:
            self.first_position = keep
        return self.model.head.logits(kept_positions(out, logits_to_keep))

    def _mask_of(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask as the session compares it: none when it masks nothing and the session's masks nothing."""
        return None if attention_mask is not None and bool(attention_mask.all()) and self.mask is None \
            else attention_mask

    def longer(self, shared: int, max_length: int) -> TokenSession:
        """A session of `max_length` holding this one's first `shared` tokens, copied by the peers (`fork`); this
        one is closed. Where it cannot be forked (it holds less now), a new session."""
        inner = self.session
        session = None
        if can_fork(inner, shared):
            session = self.model.connection.run(fork(inner, shared, max_length))
        new = TokenSession(self.model, max_length, session)
        if session is not None:
            new.tokens = self.tokens[:, :shared].clone()
            new.mask = None if self.mask is None else self.mask[:, :shared].clone()
        self.close()
        return new

    def shared_prefix(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> int:
        """How many first tokens of `ids` (with `mask`) the session holds: what a `feed` of them would not send."""
        if self.tokens is not None and self.tokens.shape[1] > self.session.length:  # rolled back under us (a rewind)
            self.tokens = self.tokens[:, :self.session.length]
            self.mask = None if self.mask is None else self.mask[:, :self.session.length]
        return self._common_prefix(ids, self._mask_of(mask))

    def _common_prefix(self, ids: torch.Tensor, mask: torch.Tensor | None) -> int:
        if self.tokens is None or self.tokens.shape[0] != ids.shape[0]:
            return 0
        n = min(self.tokens.shape[1], ids.shape[1])
        old = torch.ones_like(self.tokens, dtype=torch.bool) if self.mask is None else self.mask.bool()
        new = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        same = (self.tokens[:, :n] == ids[:, :n]).all(0) & (old[:, :n] == new[:, :n]).all(0)
        differ = (~same).nonzero()
        return int(differ[0]) if len(differ) else n

    def truncate(self, length: int) -> None:
        """Forget the tokens after the first `length`: the next step goes on from there (the peers overwrite
        what their caches hold beyond it)."""
        if self.tokens is not None and length < self.tokens.shape[1]:
            self.tokens = self.tokens[:, :max(0, length)]
            self.mask = None if self.mask is None else self.mask[:, :self.tokens.shape[1]]

    def close(self) -> None:
        self.model.connection.run(self.session.close(), timeout=30)

    def __enter__(self) -> TokenSession:
        if self.model.active_session is not None:
            raise BadRequest("an inference session is already active on this model")
        self.model.active_session = self
        return self

    def __exit__(self, *exc) -> None:
        self.model.active_session = None
        self.close()


def kept_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of `hidden` [batch, tokens, hidden] whose logits are wanted (transformers' convention)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden[:, logits_to_keep.to(hidden.device)]
    return hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden



RemoteSession = TokenSession  # the name before 0.2; kept for code that imports it


class SwarmCache(Cache):
    """A remote session's caches as transformers' generation sees a cache: its length is the session's, and
    `crop` rolls the session back by position (`TokenSession.truncate`). What assisted generation needs:
    after a pass over drafted tokens, it crops the rejected ones, and the next step goes on from the last
    accepted token. It holds no tensors: the caches live on the peers."""

    def __init__(self, remote: TokenSession):
        super().__init__(layers=[])
        self.remote = remote

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.remote.position

    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers passes a negative count; a positive one is
        the length to keep, as older callers meant it)."""
        self.remote.truncate(self.remote.position + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove)


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose blocks run in the swarm; see the module docstring."""

    base_model_prefix = "swarm"
    main_input_name = "input_ids"
    _supports_sdpa = True  # attention runs on the peers; nothing here depends on its implementation

    def __init__(self, config, head: ModelHead, connection: SwarmConnection, model_id: str):
        super().__init__(config)
        self.head = head
        self.connection = connection
        self.model_id = model_id
        self.active_session: TokenSession | None = None
        # told (on the client's event loop) when a session starts to wait for blocks to be served again
        self.on_wait: Callable[[str], None] | None = notice_to_stderr
        self.reuse_sessions = True  # keep generate()'s session for the next call (module docstring)
        self.kept_session: TokenSession | None = None
        self.last_reused_tokens = 0  # tokens of the last generate()'s input the session held already

    @classmethod
    def from_pretrained(cls, model: str | Path | Weights, initial_peers=(), *, model_id: str | None = None,
                        revision: str | None = None, dtype: str | None = None, config: ClientConfig | None = None,
                        reuse_sessions: bool = True, **options) -> DistributedModelForCausalLM:
        """`model`: a hub repo id (`org/name`, `org/name@revision`; only the config, tokenizer files and
        the head's shards are fetched) or a local checkpoint directory (its config and head tensors are
        read; its blocks are not). `model_id`: the model's name in the swarm (default: the repo id, or
        the directory's own name, as peers use). Routes only chain peers serving these exact weights.
        `reuse_sessions`: keep a `generate()`'s session for the next call (the module docstring; the
        attribute of the same name can be changed later). `config` and `options`: settings of
        `ClientConfig` (deadlines, retries, ...)."""
        given = {"initial_peers": tuple(initial_peers), "model_id": model_id, "dtype": dtype, "revision": revision}
        config = dataclasses.replace(config or ClientConfig(), **{k: v for k, v in given.items() if v}, **options)
        weights = model if isinstance(model, Weights) else \
            open_weights(model, config.revision, role="client", model_id=config.model_id)
        model, model_id = weights.directory, weights.name
        model_config = read_config(model)  # the cheap checks; the family's forward runs in `Checkpoint`
        where = Precision.of(config.device, config.dtype)
        connection = SwarmConnection(model_id, num_blocks_of(model_config), config,  # joins while the head loads
                                     digest=weights.digest, floor=output_floor(model_config),
                                     starts=span_starts(model_config))
        try:
            ckpt = Checkpoint(model, model_config, source=weights.source)
            head = ModelHead(ckpt, dtype=where.dtype, device=where.device)
            connection.client.referee = Referee(ckpt)  # waits for the join, raising its error
            wrapper_config = copy.deepcopy(ckpt.config)
            # Building the family's classes chose an experts implementation on the config; this wrapper holds no
            # experts (they run on the peers) and transformers refuses to set one on it: it picks its own.
            wrapper_config._experts_implementation_internal = None
            self = cls(wrapper_config, head, connection, model_id)
            self.reuse_sessions = reuse_sessions
            if (Path(model) / "generation_config.json").exists():
                self.generation_config = GenerationConfig.from_pretrained(model)
        except BaseException:
            connection.close()
            raise
        self.eval()
        return self

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the caches live on the peers

    def close(self) -> None:
        """Close the kept session, if any, then the connection to the swarm."""
        try:
            self.close_session()
        finally:
            self.connection.close()

    def close_session(self) -> None:
        """Close the session kept from the last `generate()` (`reuse_sessions`), if any: its peers free its cache
        now rather than when they find it idle."""
        kept, self.kept_session = self.kept_session, None
        if kept is not None:
            kept.close()

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.head.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head.lm_head

    def inference_session(self, max_length: int) -> TokenSession:
        """A session whose caches on the peers hold up to `max_length` tokens per sequence. The session kept from
        an earlier `generate()` is closed first: inside `with`, `generate()` goes on in this one."""
        self.close_session()
        return TokenSession(self, max_length)

    def route(self) -> list[Hop]:
        """The chain of peers a new session would use now."""
        return self.connection.run(self.connection.client.route())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, cache: Cache | None = None,
                logits_to_keep: int | torch.Tensor = 0, **kwargs) -> CausalLMOutputWithPast:
        """Logits for `input_ids`. Inside a session: only for the tokens that are new to it. Otherwise a
        stateless forward of the whole sequence through the swarm. `logits_to_keep` as transformers' models
        take it: an int n > 0 keeps the last n positions' logits (what `generate` asks for: the LM head of a
        whole prompt costs more than a peer's blocks on a small model), a tensor keeps those indices."""
        if inputs_embeds is not None or input_ids is None:
            raise BadRequest("pass input_ids: inputs_embeds are not supported")
        if self.active_session is not None:
            return CausalLMOutputWithPast(logits=self.active_session.feed(input_ids, attention_mask, logits_to_keep),
                                          cache=cache)
        mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask
        hidden = self.head.embed(input_ids, 0, mask)
        out = self.connection.run(forward(self.connection.client, hidden, mask))
        return CausalLMOutputWithPast(logits=self.head.logits(kept_positions(out, logits_to_keep)))

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, **kwargs):
        # the whole sequence every time: the session itself finds what is new (see the module docstring)
        return super().prepare_inputs_for_generation(input_ids, next_sequence_length=None, **kwargs)

    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """transformers' `generate`, in the active session, else in the session kept from the last call if it
        holds a prefix of `inputs` and has room for this call, else in a new one (kept after the call when
        `reuse_sessions` is on, closed otherwise). See the module docstring."""
        ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if ids is None or args:
            raise BadRequest("generate needs input ids (and takes its other arguments by name)")
        with self._session_of_call(ids, kwargs) as remote:
            # called from here, so that an unchecked-output warning names the caller's line
            return checked_generate(self._generate_in(remote), remote, ids, kwargs)

    @contextlib.contextmanager
    def _session_of_call(self, ids: torch.Tensor, kwargs: dict) -> Iterator[TokenSession]:
        """The session a `generate()` runs in, active while it runs; `last_reused_tokens` is set at its end."""
        remote, owned, keep = self.active_session, self.active_session is None, self.reuse_sessions
        if owned:
            needed = self._max_length(ids.shape[1], kwargs)
            remote = self._kept_for(ids, kwargs.get("attention_mask"), needed) if keep else \
                self.inference_session(needed)
            self.active_session = remote
        remote.first_position = None
        try:
            yield remote
        except BaseException:
            if owned and keep:
                self._drop_kept()  # interrupted or failed half-way: start afresh next time
            raise
        finally:
            self.last_reused_tokens = remote.first_position or 0
            if owned:
                self.active_session = None
                if not keep:
                    remote.close()

    def _drop_kept(self) -> None:
        try:
            self.close_session()
        except Exception as e:  # noqa: BLE001 - the caller raises its own error; peers reclaim an idle session
            logger.debug("closing the kept session failed: %s", e)

    def _kept_for(self, ids: torch.Tensor, mask: torch.Tensor | None, needed: int) -> TokenSession:
        """The kept session if it holds a prefix of `ids` (forked into a longer one if it lacks room for `needed`
        tokens), else a new one, kept."""
        kept = self.kept_session
        shared = 0 if kept is None or kept.session.closed else kept.shared_prefix(ids, mask)
        if shared > 0 and needed <= kept.session.max_length:
            return kept
        if shared > 0:
            self.kept_session = kept.longer(min(shared, ids.shape[1] - 1), needed)
            return self.kept_session
        self.close_session()
        self.kept_session = TokenSession(self, needed)
        return self.kept_session

    def _generate_in(self, remote: TokenSession) -> Callable:
        """transformers' generate for a session: assisted generation (`prompt_lookup_num_tokens`,
        `assistant_model`) gets the session as a cache it can crop."""
        def generate(ids, **kwargs):
            if drafted_tokens(kwargs, self.generation_config) or kwargs.get("assistant_model") is not None:
                kwargs.setdefault("cache", SwarmCache(remote))
            return super(DistributedModelForCausalLM, self).generate(ids, **kwargs)

        return generate

    def _max_length(self, prompt_length: int, kwargs: dict) -> int:
        """The session length a call needs: the prompt, the tokens to generate, and room for the drafts of
        prompt lookup. transformers bounds where those are copied from by max_length, not how many it drafts
        (`PromptLookupCandidateGenerator`): a pass may verify `prompt_lookup_num_tokens` drafts after an input
        of up to max_length - 2 tokens. (An assistant model's drafts stop at max_length - 1.)"""
        config = kwargs.get("generation_config") or self.generation_config
        new = kwargs.get("max_new_tokens", config.max_new_tokens)
        longest = kwargs.get("max_length", config.max_length)
        if new is not None:
            length = prompt_length + new
        elif longest is not None:
            length = max(longest, prompt_length + 1)
        else:
            length = prompt_length + DEFAULT_NEW_TOKENS
        return length + drafted_tokens(kwargs, self.generation_config)


def drafted_tokens(kwargs: dict, default: GenerationConfig) -> int:
    """`prompt_lookup_num_tokens` of a generate call: its argument, else its generation config's, else 0."""
    if kwargs.get("prompt_lookup_num_tokens") is not None:
        return int(kwargs["prompt_lookup_num_tokens"])
    return int((kwargs.get("generation_config") or default).prompt_lookup_num_tokens or 0)
