"""`POST /v1/embeddings`: text embeddings from the swarm's model, in OpenAI's shapes.

Each input (a string, token ids, or a list of either) runs through every block once, as a stateless
forward (`client.inference.forward`); its embedding is the mean over its tokens of the last layer's hidden
states after the model's final norm (what the LM head reads), scaled to unit length, as OpenAI's embeddings
are. Mean pooling suits a causal LM that was not trained for embeddings (its last token alone sees the whole
text, but carries what comes next rather than what the text means); a model trained for last-token pooling
is better served by a dedicated embedding server. `encoding_format` `base64` sends the float32
little-endian bytes, as OpenAI's clients decode them. `dimensions` is refused: these models have no
shortened embeddings.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from client.api.requests import ApiError, invalid, texts_or_ids
from client.inference.forward import forward

MAX_INPUTS = 2048  # as OpenAI's
CONCURRENT = 4  # forwards of one request in flight at once


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: tuple[str | tuple[int, ...], ...]
    base64: bool


def parse_embeddings(body: dict, vocab_size: int) -> EmbeddingRequest:
    inputs = texts_or_ids(body.get("input"), "input", MAX_INPUTS, vocab_size, empty_text=False)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64", None):
        raise invalid("encoding_format", "'encoding_format' must be 'float' or 'base64'")
    if body.get("dimensions") is not None:
        raise ApiError(400, "'dimensions' is not supported: this model's embeddings cannot be shortened",
                       param="dimensions", code="unsupported_parameter")
    return EmbeddingRequest(inputs, fmt == "base64")


def pooled(head, hidden: torch.Tensor) -> torch.Tensor:
    """The unit-length mean of the final-normed hidden states `hidden` [1, tokens, hidden]."""
    final = head.final_hidden(hidden).float()[0].mean(0)
    return final / final.norm().clamp_min(1e-12)


async def embed_all(client, head, executor, ids: list[list[int]]) -> list[torch.Tensor]:
    """The embedding of each token list, `CONCURRENT` forwards through the swarm at a time."""
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(CONCURRENT)

    async def one(tokens: list[int]) -> torch.Tensor:
        async with gate:
            hidden = await loop.run_in_executor(executor, head.embed, torch.tensor([tokens]), 0)
            out = await forward(client, hidden)
            return await loop.run_in_executor(executor, pooled, head, out)

    tasks = [asyncio.ensure_future(one(t)) for t in ids]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()  # one failed: the others stop too


def answer(model: str, vectors: list[torch.Tensor], as_base64: bool, tokens: int) -> dict[str, Any]:
    data = []
    for i, v in enumerate(vectors):
        values = v.numpy().astype("<f4")
        embedding = base64.b64encode(values.tobytes()).decode() if as_base64 else values.astype(np.float64).tolist()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
