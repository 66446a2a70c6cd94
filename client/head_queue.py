"""The head's logits for many generations at once (`HeadQueue`): one call of the LM head for whatever is ready.

A server runs many generations on one event loop; each token of each needs the logits of its last hidden
state, and the LM head's weights (a vocabulary by the hidden size: 113 MB for the demo model in float32) are
read once per call whatever its rows: one row takes 7.9 ms here, eight take 15 ms. So generations do not call
the head themselves: they queue their hidden states, and one call at a time in the executor computes every
queued row. A call takes what is queued when it starts, and what arrives while it runs goes into the next one
(continuous batching, as on the peers), with the peers' one exception (`swarm.machine`): while every core of
the machine has other work, a call with fewer rows than the last one waits for more,
`machine.COMPANY_WAIT` at most.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

import torch

from swarm import machine



class HeadQueue:
    """`await logits(hidden)`: the head's logits of `hidden` [..., hidden size] (any leading shape), computed
    together with the other generations' rows queued at the same time."""

    def __init__(self, head, executor: Executor, company_wait: float = machine.COMPANY_WAIT,
                 cores_busy=machine.cores_busy):
        self.head, self.executor = head, executor
        self.company_wait, self.cores_busy = company_wait, cores_busy
        self._queued: list[tuple[torch.Tensor, asyncio.Future]] = []
        self._running = False
        self._last = 0  # the callers of the last call
        self.calls = self.rows = 0  # head calls made, and the rows they computed

    async def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        future = asyncio.get_running_loop().create_future()
        self._queued.append((hidden, future))
        if not self._running:
            self._running = True
            asyncio.ensure_future(self._drain())  # after this iteration: what else is ready joins
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queued:
                deadline = loop.time() + self.company_wait
                while len(self._queued) < self._last and loop.time() < deadline and self.cores_busy():
                    await asyncio.sleep(machine.COMPANY_CHECK)
                batch, self._queued = self._queued, []
                self._last = len(batch)
                batch = [(h, f) for h, f in batch if not f.cancelled()]
                if not batch:
                    continue
                try:
                    flat = [h.reshape(-1, h.shape[-1]) for h, _ in batch]
                    out = await loop.run_in_executor(self.executor, self.head.logits, torch.cat(flat))
                except Exception as e:  # boundary: each caller gets the head's error
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(e)
                    continue
                self.calls, self.rows = self.calls + 1, self.rows + out.shape[0]
                for (h, f), part in zip(batch, out.split([x.shape[0] for x in flat])):
                    if not f.done():
                        f.set_result(part.reshape(*h.shape[:-1], part.shape[-1]))
        finally:
            self._running = False
