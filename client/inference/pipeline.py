"""Pipelined prompt steps of an inference session: a long prompt goes through the route in chunks, so that
while one peer runs chunk c, the peer before it already runs chunk c + 1. Functions over a `Route`
(client/inference/route.py) that return a `Pipelined` result; the session (client/inference/session.py) reads
it and runs the step the ordinary way when the pipeline stopped. They never call the session.

Without it a prompt of T tokens costs the sum of every hop's time for T tokens; in chunks, the hops overlap,
and the time approaches the slowest hop's plus one chunk through the others. Chunks are relayed: the client
sends each chunk to a hop as soon as the hop before returned it, without waiting for the hop's earlier
chunks (a peer runs its session's steps in the order they arrive). Chained steps could not overlap: a peer
takes a pushed step only at the end of what its session has run.

Invariants: the whole prompt's outputs equal one step's (the peers' caches grow chunk by chunk, as in any
multi-step prompt), and the history each hop is given is the same as for one step. If any hop fails or is
late, the pipeline stops and the step is done again the ordinary way, from the step's position (the peers
roll back over whatever chunks they ran). Only a pipeline that went through keeps its chunks in the history.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from client.inference.hops import check_plausible
from client.inference.route import Route
from swarm.errors import SwarmError

logger = logging.getLogger(__name__)

MIN_CHUNK = 64  # tokens per chunk at least: a peer's step of fewer costs nearly as much as one of this many


def chunk_bounds(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a step of `tokens` tokens, chunks of `chunk` (the last one may be longer,
    up to 1.5x: a small last chunk would cost nearly a whole one)."""
    bounds, start = [], 0
    while tokens - start > chunk * 3 // 2:
        bounds.append((start, start + chunk))
        start += chunk
    bounds.append((start, tokens))
    return bounds


@dataclass(frozen=True)
class Pipelined:
    """What a pipelined step came to: the route's output, or None with the error that stopped it (nothing of
    it is kept: the caller runs the step the ordinary way); `hops`, the hop inputs the client sent."""

    out: torch.Tensor | None
    error: BaseException | None = None
    hops: int = 0


def can_pipeline(route: Route, tokens: int) -> bool:
    """A step of `tokens` is pipelined when chunking is on, it makes at least two chunks, there are at least
    two hops, and every hop has an open session (the step does not replay history on the way)."""
    chunk = route.config.prefill_chunk
    return (chunk > 0 and tokens >= 2 * max(chunk, MIN_CHUNK) and len(route.links) > 1
            and all(link.session is not None and not link.slow for link in route.links))


async def pipeline(route: Route, x: torch.Tensor, position: int, mask: torch.Tensor | None,
                   encoding: str) -> Pipelined:
    """The route's output for `x` [batch, tokens, hidden] at `position`, run in chunks, each chunk kept in the
    history; if a hop failed or was late, no output and nothing kept."""
    chunks = chunk_bounds(x.shape[1], max(route.config.prefill_chunk, MIN_CHUNK))
    links = list(route.links)
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(len(links) + 1)]
    for start, end in chunks:
        queues[0].put_nowait(x[:, start:end])
    inputs: list[list[torch.Tensor]] = [[] for _ in links]  # what each hop was sent, chunk by chunk

    async def hop(i: int) -> None:
        link = links[i]
        step_ids = [asyncio.get_running_loop().create_future() for _ in chunks]  # each chunk's, once sent
        sent_at: list[float] = []

        async def send() -> None:
            try:
                for c, (start, end) in enumerate(chunks):
                    chunk = await queues[i].get()
                    link.used_at = time.monotonic()
                    sent_at.append(time.monotonic())
                    step = await link.session.send(chunk, position + start,
                                                   None if mask is None else mask[:, :position + end],
                                                   encoding=encoding)
                    inputs[i].append(chunk)
                    step_ids[c].set_result(step)
            except (SwarmError, OSError) as e:
                for future in step_ids:
                    if not future.done():
                        future.set_exception(e)

        sender = asyncio.ensure_future(send())
        try:
            for c, (start, end) in enumerate(chunks):
                step = await step_ids[c]
                # the peer runs this chunk after the ones before it that it has not answered yet
                timeout = route.deadline(link, x.shape[0] * end)
                out = await link.session.receive(step, (x.shape[0], end - start, x.shape[2]),
                                                 max(0.0, sent_at[c] + timeout - time.monotonic()))
                check_plausible(link.hop, inputs[i][c], out, route.client.floor)
                queues[i + 1].put_nowait(out)
        finally:
            sender.cancel()
            for future in step_ids:  # a failed send's error is in each later chunk's future: read them
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()

    tasks = [asyncio.ensure_future(hop(i)) for i in range(len(links))]
    try:
        await asyncio.gather(*tasks)
    except (asyncio.TimeoutError, SwarmError) as e:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        logger.info("pipelined prompt step failed (%s): running it hop by hop", e)
        return Pipelined(None, e)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    for i, sent in enumerate(inputs):
        for (start, _), chunk in zip(chunks, sent):
            route.record(i, chunk, position + start)
    return Pipelined(torch.cat([queues[-1].get_nowait() for _ in chunks], 1), hops=len(links))
