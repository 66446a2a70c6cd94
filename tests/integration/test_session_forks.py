"""A session opened as a fork of another session of the same client (`open` with `fork`) starts from a copy
of its cache: its next step is exactly the source's, and the peer ran the shared prefix through its blocks
once. A fork of what is not the client's open session, or past what it holds, is a typed refusal that
leaves nothing open, and the peer keeps serving."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from client.inference import peer_session
from swarm.errors import BadRequest, UnknownSession
from swarm.span import Span
from swarm_harness import MODEL_ID, client_node, wait_until

pytestmark = pytest.mark.integration

PREFIX, MAX_LENGTH = 12, 32


def counters(url: str) -> dict[str, float]:
    """The peer's unlabelled samples, e.g. `swarm_peer_tokens_total`."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


@pytest.fixture(scope="module")
def target(swarm, client, loop):
    """(peer id, its span, its /metrics URL)."""
    proc = swarm.procs["peer2"]
    info = loop.run(peer_session.info(client, proc.peer_id))
    return proc.peer_id, Span(info.start, info.end), swarm.metrics_url(proc)


@pytest.fixture(scope="module")
def source(target, client, loop):
    """A session of `client` that has run a prefix of PREFIX positions, and that prefix."""
    peer, span, _ = target
    session = loop.run(peer_session.PeerSession.open(client, peer, MODEL_ID, span, max_length=MAX_LENGTH))
    prefix = torch.randn(1, PREFIX, 64, generator=torch.Generator().manual_seed(1))
    loop.run(session.step(prefix, 0))
    yield session
    loop.run(session.close())


def fork(client, target, of: str, length: int, **changes) -> peer_session.PeerSession:
    peer, span, _ = target
    options = dict(max_length=MAX_LENGTH, fork=(of, length)) | changes
    return peer_session.PeerSession.open(client, peer, MODEL_ID, options.pop("span", span), **options)


def test_a_fork_goes_on_exactly_as_its_source_without_computing_the_prefix(target, source, client, loop):
    url = target[2]
    nxt, later = (torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(seed)) for seed in (2, 3))
    before = counters(url)
    copy = loop.run(fork(client, target, source.id, PREFIX))
    assert copy.opened.forked == PREFIX  # what an older peer, which cannot fork, leaves out
    try:
        got = loop.run(copy.step(nxt, PREFIX))
        after = counters(url)
        assert torch.equal(got, loop.run(source.step(nxt, PREFIX)))
        expected = loop.run(source.step(later, PREFIX + 1))
        shorter = loop.run(fork(client, target, source.id, 5))
        try:  # a fork of the first 5 positions goes on as the source rolled back there
            assert torch.equal(loop.run(shorter.step(nxt, 5)), loop.run(source.step(nxt, 5)))
        finally:
            loop.run(shorter.close())
        # the source rolled back and went another way: the first fork still holds its own copy
        assert torch.equal(loop.run(copy.step(later, PREFIX + 1)), expected)
    finally:
        loop.run(copy.close())
    grew = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    assert grew["swarm_peer_tokens_total"] == 1, "the forked prefix went through the blocks again"
    longer = loop.run(fork(client, target, source.id, 5, max_length=2 * MAX_LENGTH))
    try:  # a fork may hold more than its source: a conversation's next turn, longer than the last
        past = torch.randn(1, MAX_LENGTH, 64, generator=torch.Generator().manual_seed(4))
        assert loop.run(longer.step(past, 5)).shape == past.shape
    finally:
        loop.run(longer.close())
    assert grew["swarm_peer_sessions_forked_total"] == 1 and grew["swarm_peer_tokens_forked_total"] == PREFIX
    assert grew["swarm_peer_sessions_opened_total"] == 1


@pytest.fixture(scope="module")
def stranger(swarm, loop):
    """Another client: a node with an identity of its own."""
    with client_node(loop, swarm.bootstrap_addrs) as node:
        yield node


@pytest.mark.parametrize("case", ["no such session", "closed", "another client's", "past its length",
                                  "other blocks", "other batch"])
def test_a_bad_fork_is_refused_and_leaves_nothing_open(case, target, source, client, stranger, loop):
    peer, span, url = target
    missing = "s999999-" + "ab" * 12
    asker, of, length, changes = client, source.id, 4, {}
    if case == "no such session":
        of = missing
    elif case == "closed":
        sessions = counters(url)["swarm_peer_sessions_open"]
        ended = loop.run(peer_session.PeerSession.open(client, peer, MODEL_ID, span, max_length=MAX_LENGTH))
        loop.run(ended.step(torch.randn(1, 6, 64), 0))
        loop.run(ended.close())
        wait_until(lambda: counters(url)["swarm_peer_sessions_open"] == sessions, 10, "the peer to close it")
        of = ended.id
    elif case == "another client's":
        asker = stranger
    elif case == "past its length":
        length = MAX_LENGTH  # the source holds 6 positions (the test above rolled it back)
    elif case == "other blocks":
        changes = {"span": Span(span.start, span.end - 1)}
    elif case == "other batch":
        changes = {"batch": 2}
    before = counters(url)
    with pytest.raises(UnknownSession if case in ("no such session", "closed", "another client's") else BadRequest) \
            as refused:
        loop.run(fork(asker, target, of, length, **changes))
    if case == "another client's":  # the same answer as for a session that does not exist: nothing shows
        with pytest.raises(UnknownSession) as unknown:
            loop.run(fork(stranger, target, missing, length))
        assert str(refused.value).replace(of, "ID") == str(unknown.value).replace(missing, "ID")
    after = counters(url)
    for name in ("swarm_peer_sessions_open", "swarm_peer_cache_tokens_used", "swarm_peer_sessions_opened_total",
                 "swarm_peer_sessions_forked_total"):
        assert after.get(name) == before.get(name), name
    nxt = torch.randn(1, 1, 64)  # the peer still serves the source, and its cache is as it was
    assert torch.equal(loop.run(source.step(nxt, 5)), loop.run(source.step(nxt, 5)))
