"""The gateway's head for many generations (`client.head_queue`): rows queued together are computed in one call
with the same numbers as alone; a call takes what is queued when it starts, waiting for more only while every
core is busy; an error reaches every caller of its call."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from client.head_queue import HeadQueue

pytestmark = pytest.mark.unit


class Head:
    """Logits of rows [n, 4]: a fixed linear map; records each call's rows."""

    def __init__(self, fail: bool = False):
        self.weight = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        self.calls: list[int] = []
        self.fail = fail

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        if self.fail:
            raise RuntimeError("head broke")
        time.sleep(0.02)
        return hidden @ self.weight


def test_rows_queued_together_share_one_call_and_keep_their_shapes():
    head = Head()

    async def main(queue):
        xs = [torch.randn(2, 4), torch.randn(1, 3, 4), torch.randn(4)]
        outs = await asyncio.gather(*(queue.logits(x) for x in xs))
        return xs, outs

    with ThreadPoolExecutor(1) as pool:
        xs, outs = asyncio.run(main(HeadQueue(head, pool, cores_busy=lambda: False)))
    assert head.calls == [6]  # one call for all three
    for x, out in zip(xs, outs):
        assert out.shape == (*x.shape[:-1], 3) and torch.allclose(out, x @ head.weight)


def test_a_call_waits_for_the_last_calls_rows_only_while_every_core_is_busy():
    async def main(queue):
        await asyncio.gather(queue.logits(torch.randn(1, 4)), queue.logits(torch.randn(1, 4)))  # a call of 2
        first = asyncio.ensure_future(queue.logits(torch.randn(1, 4)))
        await asyncio.sleep(0.01)  # the second comes a little later
        await asyncio.gather(first, queue.logits(torch.randn(1, 4)))

    for busy, calls in ((True, [2, 2]), (False, [2, 1, 1])):
        head = Head()
        with ThreadPoolExecutor(1) as pool:
            asyncio.run(main(HeadQueue(head, pool, company_wait=1.0, cores_busy=lambda: busy)))
        assert head.calls == calls


def test_the_heads_error_reaches_every_caller_of_its_call():
    async def main(queue):
        return await asyncio.gather(*(queue.logits(torch.randn(1, 4)) for _ in range(3)), return_exceptions=True)

    with ThreadPoolExecutor(1) as pool:
        results = asyncio.run(main(HeadQueue(Head(fail=True), pool, cores_busy=lambda: False)))
    assert all(isinstance(r, RuntimeError) and "head broke" in str(r) for r in results)
