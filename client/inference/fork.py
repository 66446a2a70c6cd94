"""A new inference session that starts as a copy of another's first positions: what lets many requests that
share a prefix (a system prompt, a tool list, a conversation so far) have it computed once per peer. Async.

`fork(source, length)` opens, at every peer of the source's route, a session that starts as a copy of the
source's session there up to `length` (the `fork` fields of `open`, docs/protocol.md), and copies what the
client holds for the source up to `length`: each hop's inputs (its replay history), the attention mask, and
the checks' state, whose checker sessions are forked the same way up to what they had checked. The new
session goes on from any position up to `length`, exactly as the source would have: every peer holds the
same cache for the same tokens.

Nothing here can make an output wrong, only cost more: a peer that refuses a fork (the source's session
there was closed or reclaimed meanwhile, or it is an older peer) leaves its link without a session, and the
first step replays the copied history into a new one (`Route.open`), as after a failover. A checker that
refuses leaves its hop to be checked afresh from position 0. Both sessions count toward their peers' load
and their client's share there, like any two sessions.
"""

from __future__ import annotations

import asyncio
import logging

from client.inference.encodings import REPLAY_ENCODING
from client.inference.hops import Inputs
from client.inference.session import InferenceSession
from client.inference.verify import Shadow, Verifier
from swarm.errors import BadRequest, SwarmError
from swarm.net.transport import describe_peer

logger = logging.getLogger(__name__)


def can_fork(source: InferenceSession, length: int) -> bool:
    """Whether `source` holds positions `[0, length)` on a whole route now (it may not stay so: `fork` copies
    only what it still holds when called)."""
    live = source.live
    return (not source.closed and 0 < length <= source.length and bool(live.links) and live.batch is not None
            and all(link.hop.span.start in live.history for link in live.links))


async def fork(source: InferenceSession, length: int, max_length: int | None = None) -> InferenceSession:
    """A session holding the source's positions `[0, length)` (module docstring), of `max_length` (default:
    the source's). `BadRequest` if the source does not hold them (`can_fork`). The source's `forking` counts
    it until the peers have copied it."""
    if not can_fork(source, length):
        raise BadRequest(f"the session does not hold {length} positions to fork")
    max_length = max_length or source.max_length
    if max_length < length:
        raise BadRequest(f"a fork of {length} positions needs a max_length of at least that, got {max_length}")
    session = InferenceSession(source.client, max_length, on_wait=source.on_wait)
    source.forking += 1  # until the peers have copied it: whoever holds it must not roll it back
    try:
        return await _fork(source, session, length, max_length)
    finally:
        source.forking -= 1


async def _fork(source: InferenceSession, session: InferenceSession, length: int,
                max_length: int) -> InferenceSession:
    src, live = source.live, session.live
    # the copies are taken before anything is awaited: the source may step on meanwhile
    live.batch, live.encodings = src.batch, src.encodings
    live.links = live.adopt(src.hops)
    live.history = {b: _copy(inputs, length, max_length) for b, inputs in src.history.items()}
    live.mask = None if src.mask is None else src.mask[:, :length].clone()
    session.length = length
    sources = [link.session for link in src.links]
    shadows = []  # (span, the fork's shadow, the source's checker sessions)
    if source.verifier is not None:
        session.verifier, shadows = _verifier(source.verifier, session, length)
    opens = [_fork_link(session, link, peer_session, length) for link, peer_session in zip(live.links, sources)]
    opens += [_fork_shadow(session.verifier, *shadow) for shadow in shadows]
    try:
        await asyncio.gather(*opens)
    except BaseException:
        await session.close()
        raise
    return session


async def _fork_link(session: InferenceSession, link, source, length: int) -> None:
    if source is None:
        return  # the source's own link has no session now: the first step replays into a new one
    live = session.live
    try:
        link.session = await session.client.open_session(link.hop, max_length=session.max_length, batch=live.batch,
                                                         encodings=live.encodings.all, fork=(source.id, length))
    except (asyncio.TimeoutError, SwarmError) as e:
        logger.info("peer %s did not fork session %s at %d (%s): its blocks %s are replayed instead",
                    describe_peer(link.hop.peer), source.id, length, e, link.hop.span)


async def _fork_shadow(verifier: Verifier, span, shadow: Shadow, sources: list) -> None:
    """Fork each of the source shadow's checker sessions (`sources`) at what it had verified; if any refuses,
    the hop is checked afresh (a shadow that verified positions its sessions lack would check nothing)."""
    try:
        for i, (hop, source) in enumerate(zip(shadow.hops, sources)):
            shadow.sessions[i] = await verifier.client.open_session(
                hop, max_length=verifier.max_length, batch=verifier.batch, encodings=(REPLAY_ENCODING,),
                fork=(source.id, shadow.verified))
    except (asyncio.TimeoutError, SwarmError) as e:
        logger.info("a checker of blocks %s did not fork (%s): they are checked afresh", span, e)
        if verifier.shadows.get(span) is shadow:
            verifier.drop(span)  # closes the sessions forked so far


def _verifier(source: Verifier, session: InferenceSession, length: int) -> tuple[Verifier, list[tuple]]:
    """The source's checks as they stood for positions `[0, length)`, for the fork's route (the same hops):
    shadows that had verified some of them (with no sessions yet: `_fork_shadow` forks the source's, listed
    with each shadow), outputs of replaced peers there, and the hops no one could check."""
    live = session.live
    verifier = Verifier(source.client, source.fraction, session.rng, session.max_length, live.batch, live.views,
                        live.formats, source.require_checked)
    peers = {link.hop.span: link.hop.peer for link in live.links}
    shadows = []
    for span, shadow in source.shadows.items():
        verified = min(shadow.verified, length)
        if peers.get(span) != shadow.primary or not verified or any(s is None for s in shadow.sessions):
            continue
        verifier.shadows[span] = copy = Shadow(
            list(shadow.hops), shadow.primary, [None] * len(shadow.hops),
            [None if kept is None else _copy(kept, verified, session.max_length) for kept in shadow.outputs],
            verified)
        shadows.append((span, copy, list(shadow.sessions)))
    verifier.unchecked = {span: peer for span, peer in source.unchecked.items() if peers.get(span) == peer}
    verifier.owners = {boundary: [(peer, min(until, length)) for peer, until in owners]
                       for boundary, owners in source.owners.items()}
    return verifier, shadows


def _copy(inputs: Inputs, length: int, max_length: int) -> Inputs:
    return Inputs(inputs.view()[:, :length], max_length)  # Inputs copies into a buffer of its own
