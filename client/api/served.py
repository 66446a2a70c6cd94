"""The models a gateway serves: `ServedModel`, one model's client, head, tokenizer and limits, with the checks
of a request against that model; `resolve_model`, the one place a `--model` value becomes (a local checkpoint
directory, the model's id in the swarm); `served_models`, the command line's `--model` and `--model-id`
values paired; and `load`, a model's local parts (head, tokenizer, end tokens) read from its checkpoint.

Every served model has its own client (its view of the swarm, routes, bans), head, tokenizer and context
length; they share the gateway's one DHT node, thread pools, generation slots and queue.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client.api.requests import CHARS_PER_TOKEN, ApiError, Common, invalid
from client.config import ApiConfig, ClientConfig
from client.inference.hops import output_floor
from client.inference.referee import Referee
from swarm.errors import ConfigError


@dataclass(frozen=True, eq=False)
class ServedModel:
    """One model of the swarm as the gateway serves it (`client` is set once the gateway has joined)."""

    model_id: str
    client: Any  # SwarmClient
    head: Any  # swarm.model.head.ModelHead
    tokenizer: Any
    context_length: int
    end_tokens: list[int]
    num_blocks: int = 0
    path: Path | None = field(default=None, compare=False)
    digest: str | None = None  # the weights of its head: routes only through peers with the same
    floor: float = output_floor()  # the spread under which its hidden states are degenerate (`hops.output_floor`)
    recurrent: bool = False  # some layer keeps a recurrent state: caches return only to recent step ends
    referee: Any = None  # client.inference.referee.Referee: this checkpoint's blocks, computed here to settle disputes
    starts: Sequence[int] | None = None  # the blocks a hop of its routes may start at (`swarm.span.span_starts`)

    @property
    def vocab_size(self) -> int:
        return self.head.vocab_size

    def card(self, created: int) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": created, "owned_by": "swarm"}

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse a text too long for the context before it is tokenized."""
        if chars > self.context_length * CHARS_PER_TOKEN:
            raise ApiError(400, f"this model's maximum context length is {self.context_length} tokens; the "
                           f"{param} has {chars} characters", param=param, code="context_length_exceeded")

    def max_tokens(self, common: Common, prompt: list[int], default_max: int, param: str) -> int:
        """The completion's max_tokens (`default_max` if not given, at most what the context leaves), after
        checking the prompt against the context length."""
        room = self.context_length - len(prompt)
        if room < 1:
            raise ApiError(400, f"this model's maximum context length is {self.context_length} tokens; the "
                           f"{param} has {len(prompt)}", param=param, code="context_length_exceeded")
        max_tokens = common.max_tokens if common.max_tokens is not None else min(default_max, room)
        if max_tokens > room:
            raise ApiError(400, f"this model's maximum context length is {self.context_length} tokens; you asked "
                           f"for {len(prompt) + max_tokens} ({len(prompt)} in the {param}, {max_tokens} in the "
                           "completion)", param=common.max_tokens_param, code="context_length_exceeded")
        return max_tokens

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 tools: list | None = None) -> list[int]:
        from jinja2 import TemplateError

        try:
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                           tools=tools or None, tokenize=True,
                                                           return_dict=True)["input_ids"])
        except (TemplateError, ValueError, TypeError) as e:  # templates refuse, e.g., a system role
            raise invalid("messages", f"the model's chat template refused these messages: {e}") from None

    def check_chat_template(self) -> None:
        if not self.tokenizer.chat_template:
            raise ApiError(400, f"the model '{self.model_id}' has no chat template: use /v1/completions",
                           code="no_chat_template")


# ---- the command line: which models, under which names ----

def resolve_model(value: Path | str | None, model_id: str | None, cache_home: str | Path | None,
                  revision: str | None = None):
    """One `--model` value opened for a client (`swarm.weights.models.Weights`: where its files are, its
    name in the swarm, its digest): a hub repo id (config, tokenizer and head shards fetched) or a
    checkpoint directory (None: the prepared demo model), named `model_id`, else as `swarm peer` names it."""
    from swarm.weights.models import open_weights

    if value is None:
        from swarm.local.demo_model import default_demo_dir, prepare_demo_model

        value = prepare_demo_model(default_demo_dir(cache_home))
    return open_weights(value, revision, role="client", model_id=model_id, cache_home=cache_home)


def served_models(values: Sequence[Path | str] | None, model_ids: Sequence[str] | None,
                  cache_home: str | Path | None, revision: str | None = None) -> list:
    """The weights (`swarm.weights.models.Weights`) of each model `swarm api` serves: one per `--model`
    (none: the demo model), each named by the `--model-id` at its place, if given (then one per `--model`)."""
    values = list(values or [None])
    model_ids = list(model_ids or [])
    if model_ids and len(model_ids) != len(values):
        raise ConfigError(f"{len(model_ids)} --model-id for {len(values)} --model: give none (each model is "
                          "named as its peers name it) or one per --model, in the same order")
    models = [resolve_model(v, model_ids[i] if model_ids else None, cache_home, revision)
              for i, v in enumerate(values)]
    ids = [weights.name for weights in models]
    twice = sorted({m for m in ids if ids.count(m) > 1})
    if twice:
        raise ConfigError(f"two models would be served as {', '.join(twice)}: name them apart with --model-id "
                          "(one per --model, in the same order)")
    return models


# ---- loading ----

def context_length_of(model_config, configured: int | None) -> int:
    native = getattr(model_config, "max_position_embeddings", None) or 4096
    return configured if configured is not None else min(int(native), 4096)


async def load(weights, config: ApiConfig, client_config: ClientConfig) -> ServedModel:
    """The model's local parts, read from its checkpoint (no client yet): head, tokenizer, end tokens, and
    the grammar engine's view of its vocabulary, built now rather than on the first structured request."""
    from transformers import AutoTokenizer, GenerationConfig

    from client import grammar
    from client.generation import stop_token_ids
    from swarm.model.checkpoint import Checkpoint
    from swarm.model.head import ModelHead
    from swarm.model.precision import Precision
    from swarm.span import span_starts

    path, model_id = weights.directory, weights.name
    print(f"[api] loading the head of {weights.describe()}", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    ckpt = await loop.run_in_executor(None, lambda: Checkpoint(path, source=weights.source))
    where = Precision.of(client_config.device, client_config.dtype)
    head = await loop.run_in_executor(None, lambda: ModelHead(ckpt, dtype=where.dtype, device=where.device))
    tokenizer = await loop.run_in_executor(None, AutoTokenizer.from_pretrained, path)
    generation_config = GenerationConfig.from_pretrained(path) if (Path(path) / "generation_config.json").exists() \
        else None
    end_tokens = stop_token_ids(tokenizer, generation_config)
    await loop.run_in_executor(None, grammar.grammar_tokenizer, tokenizer, head.vocab_size, end_tokens)
    return ServedModel(model_id, None, head, tokenizer, context_length_of(ckpt.config, config.context_length),
                       end_tokens, ckpt.num_blocks, Path(path), weights.digest, output_floor(ckpt.config),
                       ckpt.recurrent, Referee(ckpt), span_starts(ckpt.config))
