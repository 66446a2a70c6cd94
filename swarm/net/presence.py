"""A node's presence off this machine, watched while it runs: the relays it is reachable through, a warning
when it has none or announces only private addresses, and the file of peers it met (`known_peers`).

`watch(node)` runs as one task of a `transport.Node` that is not on loopback; it reads the daemon's addresses
and asks connected peers where they can be dialled, and changes how a NAT'd node works in two cases: once,
`PUNCH_AT_S` after its start, it closes its relayed connections so that they open again punchable (`reopen`);
and when it lost every relay, it chooses new ones (`relays.replace`, which starts its daemon again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from swarm.net.identity import describe_peer
from swarm.net.relays import replace
from swarm.net.reach import (ASK_TIMEOUT_S, PRIVATE, PUBLIC, UNKNOWN, ask, check, ip_of, is_loopback_addr,
                             is_private_addr, peer_of)

logger = logging.getLogger("swarm.net.transport")

WATCH_GRACE_S = 10.0  # a private node without a relay after this long is warned about
REPLACE_AFTER_S = 5.0  # a private node that lost every relay this long ago chooses new ones (`relays.replace`)
REPLACE_EVERY_S = 60.0  # and not again before this long
PUNCH_AT_S = 10.0  # a private node closes its relayed connections once, this long after it started (`reopen`)
KNOWN_PEERS_AT_S = (5.0, 20.0, 60.0)  # when a node first asks the peers it is connected to where they are
KNOWN_PEERS_INTERVAL_S = 120.0  # and how often after that


async def watch(node) -> None:
    """Log the relays this node is reachable through as they change (a private node without any is warned
    about), warn about a node announcing only private addresses, check again how it is reached when its
    addresses change (or when it had nobody to ask), and keep the file of peers met. Runs until cancelled."""
    started, warned, last_known, last_direct = time.monotonic(), False, -math.inf, None
    lost_at, replaced_at = math.inf, -math.inf  # when the last relay was lost; when relays were last replaced
    reopened = False
    first_asks = list(KNOWN_PEERS_AT_S)
    while True:
        now = time.monotonic()
        due = bool(first_asks) and now - started >= first_asks[0]
        while first_asks and now - started >= first_asks[0]:
            first_asks.pop(0)
        try:
            addrs = [str(a) for a in await node._p2p.get_visible_maddrs(latest=True)]
            relays = sorted({a.split("/p2p-circuit")[0].rsplit("/p2p/", 1)[-1] for a in addrs
                             if "/p2p-circuit" in a})
            if relays != node.relays:
                if relays:
                    logger.info("reachable through relay %s", ", ".join(describe_peer(r) for r in relays))
                elif node.relays:
                    logger.warning("no longer reachable through a relay (was %s)",
                                   ", ".join(describe_peer(r) for r in node.relays))
                    lost_at = now
                node.relays = relays
            if node.reach == PRIVATE and not reopened and now - started >= PUNCH_AT_S:
                reopened = True
                await reopen(node)
            if relays:
                lost_at = math.inf
            elif node.reach == PRIVATE and now - lost_at >= REPLACE_AFTER_S and now - replaced_at >= REPLACE_EVERY_S:
                replaced_at = now
                if await replace(node):
                    lost_at = math.inf
            direct = [a for a in addrs if ip_of(a) and not is_loopback_addr(a)]
            if not warned and now - started > WATCH_GRACE_S and not node.client_mode and lost_at == math.inf:
                warned = _warn(node, relays, direct)
            moved = last_direct is not None and frozenset(direct) != last_direct
            last_direct = frozenset(direct)
            if not node.client_mode and (moved or (due and node.reach == UNKNOWN)):
                await recheck(node, "its addresses changed" if moved else "it had nobody to ask at start")
            if node.known is not None and (due or now - last_known > KNOWN_PEERS_INTERVAL_S):
                last_known = now
                await remember_peers(node)
        except Exception as e:  # boundary: a daemon gone away is reported by its own watcher; the rest is logged
            logger.log(logging.WARNING if lost_at < math.inf else logging.DEBUG, "reachability watch: %r", e)
        await asyncio.sleep(2.0 if now - started < WATCH_GRACE_S * 3 or lost_at < math.inf else
                            5.0 if node.reach == PRIVATE else 15.0)


async def reopen(node) -> None:
    """Close this NAT'd node's relayed connections once its daemon can punch holes: the daemon punches a direct
    connection only when a relayed one opens, and only once 4 hosts saw its outside address (`relays.meet`),
    so the connections opened while it started (its links to the next peers, the DHT, the first clients) would
    stay relayed for their whole life. The next stream to each peer opens a new relayed connection, which the
    routers may let go direct; a session on a closed one fails over exactly (as at any relay's loss)."""
    from swarm.net.dht_glue import hm

    closed = 0
    for info in await node._p2p.list_peers():
        addrs = [str(a) for a in info.addrs]
        if addrs and all("/p2p-circuit" in a for a in addrs):
            with contextlib.suppress(Exception):  # gone already: nothing to close
                await node._p2p._client.disconnect(hm().PeerID.from_base58(str(info.peer_id)))
                closed += 1
    if closed:
        logger.info("closed %d relayed connections, to be opened again: they may go direct (hole punching)", closed)


def _warn(node, relays: list[str], direct: list[str]) -> bool:
    """Warn once about a private node without a relay, or one announcing only private addresses."""
    if node.reach == PRIVATE and not relays:
        logger.warning("no relay has given this node a slot (asked: %s): peers that it did not dial cannot reach it; "
                       "the daemon keeps asking",
                       ", ".join(describe_peer(peer_of(a)) for a in node._joined_through) or "none")
        return True
    if direct and all(is_private_addr(a) for a in direct) and not relays and node.reach != PUBLIC:
        logger.warning("this node announces only private addresses (%s): only its own network reaches it",
                       ", ".join(direct[:3]))
        return True
    return False


async def recheck(node, why: str) -> None:
    """Ask connected peers to dial this node back again. A node found public after all is announced so (its
    daemon relays once its own AutoNAT agrees); any other change needs a restart, which the log says."""
    state, detail = await check(node._open_rw, await node.connected_peer_ids(), node.announce_port or node._port)
    if state == node.reach or state == UNKNOWN:
        return
    if node.reach == UNKNOWN and state == PUBLIC:
        logger.info("reachability: public (%s; checked again as %s)", detail, why)
        node.reach, node.reach_why = state, detail
    else:
        logger.warning("reachability is now %s (%s), was %s: restart this node to be reached as it is now",
                       state, detail, node.reach)


async def remember_peers(node) -> None:
    """Ask up to 8 connected peers where they can be dialled, and keep the answers in the known peers file."""
    found: dict[str, list[str]] = {}
    for peer in (await node.connected_peer_ids())[:8]:
        try:
            answer = await asyncio.wait_for(ask(node._open_rw, peer, {"addrs": True}), ASK_TIMEOUT_S)
        except Exception:  # boundary: a client or an older peer does not answer; it is not remembered
            continue
        addrs = answer.get("addrs")
        if isinstance(addrs, list):
            found[peer] = [a for a in addrs if isinstance(a, str)][:8]
    if found:
        await asyncio.get_running_loop().run_in_executor(None, node.known.remember, found)
