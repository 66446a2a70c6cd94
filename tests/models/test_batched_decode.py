"""One-token steps of several sessions run as one forward equal the same steps run one at a time.

Sessions sit at different positions (prompts of 3, 7 and 12 tokens, one of them a batch of 2 with left
padding, one with no prompt at all) and decode greedily, once batched and once alone; logits within 1e-4
(float32), greedy tokens identical, and every session cache equal afterwards. Sliding-window families
are run past their window. Then the servicer's batch function: a bad step fails alone, a rollback step
runs alone, the rest share one forward.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from peer.config import PeerConfig
from peer.metrics import PeerMetrics
from peer.runtime import Runtime
from peer.servicer import Served, Servicer
from peer.sessions import SessionTable
from swarm.net import messages, wire
from swarm.model.blocks import SpanBlocks
from swarm.model.cache import SpanCache
from swarm.model.checkpoint import Checkpoint
from swarm.errors import BadRequest, UnknownSession
from swarm.model.head import ModelHead
from swarm.span import Span
from runtime_gate import Gate

pytestmark = pytest.mark.models

TOLERANCE = 1e-4
MAX_LENGTH = 48
DECODE_STEPS = 8
# (prompt length, session batch, left padding of its second row)
SESSIONS = [(3, 1, 0), (7, 1, 0), (12, 2, 3), (0, 1, 0)]


class Greedy:
    """One session decoding greedily through `blocks`: tokens, its padding mask, its cache."""

    def __init__(self, head: ModelHead, blocks: SpanBlocks, length: int, batch: int, pad: int, span: Span, seed: int):
        self.head, self.blocks = head, blocks
        self.cache = blocks.new_cache(batch, MAX_LENGTH, span)
        g = torch.Generator().manual_seed(seed)
        first = torch.randint(3, 256, (batch, 1), generator=g)
        self.tokens = torch.cat([torch.randint(3, 256, (batch, length), generator=g), first], dim=1)
        self.mask = None
        if pad:
            self.mask = torch.ones(batch, length + 1, dtype=torch.int64)
            self.mask[1, :pad] = 0
        self.logits: list[torch.Tensor] = []
        if length:
            self.blocks(head.embed(self.tokens[:, :length], 0), self.cache, 0,
                        None if self.mask is None else self.mask[:, :length])

    def step_input(self) -> tuple[SpanCache, torch.Tensor, torch.Tensor | None]:
        """The pending step: the last token, at the cache's end."""
        return self.cache, self.head.embed(self.tokens[:, -1:], self.cache.length, self.mask), self.mask

    def took(self, out: torch.Tensor) -> None:
        logits = self.head.logits(out)[:, -1]
        self.logits.append(logits)
        self.tokens = torch.cat([self.tokens, logits.argmax(-1, keepdim=True)], dim=1)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones(self.mask.shape[0], 1, dtype=self.mask.dtype)], dim=1)


def sessions(head, blocks, span: Span) -> list[Greedy]:
    return [Greedy(head, blocks, length, batch, pad, span, seed) for seed, (length, batch, pad) in enumerate(SESSIONS)]


def assert_caches_equal(a: SpanCache, b: SpanCache) -> None:
    assert a.length == b.length
    for i in a.span:
        torch.testing.assert_close(a.kv.layers[i].keys, b.kv.layers[i].keys, atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(a.kv.layers[i].values, b.kv.layers[i].values, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("family,span", [("llama", Span(0, 6)), ("mistral", Span(0, 6)),
                                         ("gemma3_text", Span(0, 6)), ("mixtral", Span(0, 6)),
                                         ("gemma3_text", Span(1, 5))])
@torch.inference_mode()
def test_batched_decode_equals_decode_alone(family, span, tiny_checkpoint):
    path = tiny_checkpoint(family)
    window = getattr(Checkpoint(path).config, "sliding_window", None)
    longest = max(length for length, _, _ in SESSIONS) + DECODE_STEPS
    assert window is None or window < longest, "the sliding window must matter in this test"
    head, blocks = ModelHead(path), SpanBlocks(path, Span(0, 6))
    alone, batched = sessions(head, blocks, span), sessions(head, blocks, span)

    for _ in range(DECODE_STEPS):
        for s in alone:
            cache, hidden, mask = s.step_input()
            s.took(blocks(hidden, cache, cache.length, mask))
        outs = blocks.decode_batch([s.step_input() for s in batched])
        for s, out in zip(batched, outs):
            s.took(out)

    for a, b in zip(alone, batched):
        assert torch.equal(a.tokens, b.tokens), f"{family}: greedy tokens differ when batched"
        torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), atol=TOLERANCE, rtol=TOLERANCE)
        assert_caches_equal(b.cache, a.cache)
        assert b.cache.length == a.tokens.shape[1] - 1


@torch.inference_mode()
def test_a_bad_item_fails_the_batch_before_any_cache_changes(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    head, blocks = ModelHead(path), SpanBlocks(path, Span(0, 6))
    good, bad = sessions(head, blocks, Span(0, 6))[:2]
    lengths = good.cache.length, bad.cache.length
    cache, hidden, _ = bad.step_input()
    with pytest.raises(BadRequest, match="attention mask must be"):
        blocks.decode_batch([good.step_input(), (cache, hidden, torch.ones(1, 3, dtype=torch.int64))])
    with pytest.raises(BadRequest, match="one token"):
        blocks.decode_batch([good.step_input(), (cache, torch.cat([hidden, hidden], dim=1), None)])
    other = blocks.new_cache(1, MAX_LENGTH, Span(0, 3))
    with pytest.raises(BadRequest, match="mixes spans"):
        blocks.decode_batch([good.step_input(), (other, hidden, None)])
    with pytest.raises(BadRequest, match="two steps of one session"):
        blocks.decode_batch([good.step_input(), good.step_input()])
    assert (good.cache.length, bad.cache.length) == lengths
    assert blocks.decode_batch([]) == []


# ---- the servicer's batch function ----


def step_message(step: int, position: int, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> messages.Step:
    return messages.Step(step, position, messages.Hidden.encode(hidden, "float32"), None if mask is None else wire.blob_of(mask))


@torch.inference_mode()
def test_servicer_batches_steps_and_fails_bad_ones_alone(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    blocks = SpanBlocks(path, Span(0, 6))
    reference = SpanBlocks(path, Span(0, 6))
    metrics = PeerMetrics()
    config = PeerConfig(model=Path(path))
    fields = {"model": "m", "start": 0, "end": 6, "max_length": MAX_LENGTH}
    g = torch.Generator().manual_seed(0)

    with Runtime() as runtime:
        servicer = Servicer(config, Served("peer", "m", Span(0, 6), "v"), blocks, runtime,
                            SessionTable(config.cache_tokens, config.max_sessions), metrics)
        opened = [servicer._open(messages.Open(**fields, batch=b)) for b in (1, 1, 2, 1, 1, 1)]
        refs = [reference.new_cache(s.batch, MAX_LENGTH) for s in opened]
        prompts = [torch.randn(s.batch, n, 64, generator=g) for s, n in zip(opened, (3, 7, 12, 5, 4, 6))]
        for s, ref, prompt in zip(opened, refs, prompts):
            servicer.compute.step(s, step_message(0, 0, prompt))
            reference(prompt, ref, 0)
        steps = [torch.randn(s.batch, 1, 64, generator=g) for s in opened]
        steps[3][0, 0, 0] = float("nan")  # fails alone
        servicer.sessions.close(opened[4].id)  # closed while its step waits
        rollback = 2  # session 5 steps at position 2: it rolls back, so it runs alone
        positions = [3, 7, 12, 5, 4, rollback]

        async def main():
            gate = Gate()
            held = asyncio.create_task(runtime.run(gate))
            await asyncio.to_thread(gate.started.wait, 10)
            tasks = [asyncio.create_task(servicer._step(s, step_message(1, p, h))) for s, p, h in
                     zip(opened, positions, steps)]
            await asyncio.sleep(0.05)
            assert runtime.queued == len(opened)
            gate.release.set()
            await held
            return await asyncio.gather(*tasks, return_exceptions=True)

        replies = asyncio.run(main())
        assert (runtime.batches_run, runtime.batched_jobs) == (1, 6)

    assert isinstance(replies[3], BadRequest) and "NaN" in str(replies[3])
    assert isinstance(replies[4], UnknownSession)
    shared = [0, 1, 2]
    for i in (*shared, 5):
        out = replies[i].hidden.decode()
        expected = reference(steps[i], refs[i], positions[i])
        torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)
        assert replies[i].length == positions[i] + 1 == opened[i].cache.length
        assert_caches_equal(opened[i].cache, refs[i])
    assert len({replies[i].compute_ms for i in shared}) == 1  # the shared forward's time
    assert opened[3].cache.length == 5  # the bad step left its session's cache untouched
    batch_sizes = {s.labels.get("le"): s.value for m in metrics.registry.collect() if m.name == "swarm_peer_batch_size"
                   for s in m.samples if s.name.endswith("_bucket")}
    assert batch_sizes["2.0"] == 0 and batch_sizes["3.0"] == 1  # one forward shared by the three good steps


@torch.inference_mode()
def test_a_session_closed_during_a_shared_forward_fails_no_other_session(tiny_checkpoint, monkeypatch):
    """The event loop may close a session while its step waits for a shared forward: that step fails alone
    (`unknown_session`), the others get their outputs from the one forward, whatever their lengths (each attends
    over its own history)."""
    path = tiny_checkpoint("llama")
    blocks = SpanBlocks(path, Span(0, 6))
    config = PeerConfig(model=Path(path))
    fields = messages.Open("m", 0, 6, 128, 1)
    g = torch.Generator().manual_seed(1)
    with Runtime() as runtime:
        servicer = Servicer(config, Served("peer", "m", Span(0, 6), "v"), blocks, runtime,
                            SessionTable(config.cache_tokens, config.max_sessions), PeerMetrics())
        opened = [servicer._open(fields) for _ in range(4)]
        for s, n in zip(opened, (3, 4, 5, 100)):
            servicer.compute.step(s, step_message(0, 0, torch.randn(1, n, 64, generator=g)))
        real, calls = blocks.decode_batch, []

        def closing(items):
            calls.append(len(items))
            servicer.sessions.close(opened[0].id)  # as the event loop would, mid-forward
            return real(items)

        monkeypatch.setattr(blocks, "decode_batch", closing)
        steps = [torch.randn(1, 1, 64, generator=g) for _ in opened]
        results = servicer.compute.batch([(s, step_message(1, s.cache.length, x)) for s, x in zip(opened, steps)])
    assert calls == [4]  # one shared forward, the long cache among the short ones
    assert isinstance(results[0], UnknownSession)  # closed before its token had room: it alone fails
    assert all(isinstance(r, tuple) for r in results[1:]), results
    assert [r[2] for r in results[1:]] == [5, 6, 101] and [r[3] for r in results[1:]] == [3, 3, 3]


# ---- what a ragged batch cannot follow ----


def test_families_whose_forward_follows_the_longest_sequence_of_a_batch_are_not_batched(tmp_path):
    from family_harness import build

    from swarm.model.ragged import batch_dependent

    path = build("llama", tmp_path / "dynamic", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 10000.0})
    assert "dynamic" in batch_dependent(Checkpoint(path).text_config)
    assert not SpanBlocks(path, Span(0, 6)).ragged  # its steps run one at a time, each with its own frequencies
    assert batch_dependent(Checkpoint(build("llama", tmp_path / "plain")).text_config) is None


@torch.inference_mode()
def test_another_thread_gets_the_familys_own_attention_while_a_batch_has_switched_it(tiny_checkpoint):
    """A peer moving to a new span probes it on another thread, with layers (and their config) it shares with
    the blocks a ragged batch may be running on."""
    import threading

    from swarm.model.ragged import RaggedBatch, ragged

    blocks = SpanBlocks(tiny_checkpoint("llama"), Span(0, 6))
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(3))
    expected = blocks(x)
    got = []
    with ragged(blocks._configs, RaggedBatch([], blocks.attention_implementation)):
        thread = threading.Thread(target=lambda: got.append(blocks(x)))
        thread.start()
        thread.join(30)
    assert torch.equal(got[0], expected)
