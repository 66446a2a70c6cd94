"""Relays: which ones a NAT'd node reserves slots on, and whether a public node relays with its own limits.

**Choosing.** A NAT'd node reserves slots on up to `RELAYS` public nodes, the nearest by measured round trip
among those it knows, and only near ones (a round trip within 3 times the nearest's, plus 10 ms): a client
dials a node through whichever of its relays the daemon picks, and measured in the box with one near and one
far relay, half the fresh clients of the near region went through the far one and paid twice the per-token
time (so a node with one near public peer holds one slot, not a far spare): the peers it is connected to (its initial peers), the public peers they remember
(`reach` protocol, `peers`), and the peers it met before. Each is asked where it can be dialled (`addrs`),
timed once connected; one that says its relay is capped (below) is never chosen, one that does not answer is
not either. With no answer at all, the node falls back to its initial peers and the peers met before. The
daemon's static relays are exactly these, so all of them are live when it starts: its relay finder waits
for as many candidates as it was given (minutes, when one of them is dead) before it takes any slot.

**Replaced.** The daemon holds a slot on every relay it was given and takes no other (its static relays are
all its candidates), and it cannot be given one while it runs. A NAT'd node whose relays are all gone
(`presence.watch`: none in its own addresses for `REPLACE_AFTER_S`) chooses again among the public peers it
knows now and, when that finds one it did not hold, starts its daemon again with them (`replace`): its DHT node
and stream handlers are set up again on the new daemon, and the sessions it served (dead with their relays
anyway) fail over. With two or more near relays a node loses none of this to one relay's death.

**Hole punching.** The daemon punches a direct connection between two NAT'd nodes (DCUtR, on with AutoNAT)
only once its outside address was seen by 4 hosts at distinct addresses, and only when a relayed connection
opens. A NAT'd node therefore connects again, once its daemon holds its relays, to the `MEET` nearest public
nodes that answered as candidates (`meet`).

**Their limits.** 
hivemind's daemon runs two relay services on the same protocol: ours, with the limits it is given, created
once the node is known to be public, and a built-in one with the circuit relay v2 defaults, whose relayed
connections are reset after 128 KiB each way or 2 minutes. Whichever registers its handler last serves, and
which one does is a race inside the daemon: measured here, the built-in one won 8 of 10 plain daemon starts
(and 2 of 5 whole swarms in the box). A session through a capped relay dies as soon as what it carried passes
128 KiB (about 55 tokens of a 576-wide model in float32), and every retry replays more than that, so it can
never complete.

The race is the daemon's start: its main goroutine registers the built-in relay right after building the
host, while ours is registered by a goroutine of the host's own once the host says it is public. With one Go
thread (`GOMAXPROCS=1`, `ours_last`) the main goroutine runs on until it blocks, after both are set up, so ours
registers last: 30 of 30 plain daemon starts here, against 2 of 10 without. A relaying node's daemon starts so.

`check(host, port, relay_id)` finds out which one serves: two throwaway daemons on this machine; one listens
nowhere (so it is reached only through a relay) and holds a slot on the node at host:port, the other connects
to it through the node and pulls `CHECK_BYTES`. All of it arrives only through our relay. True (ours), False
(cut short: the built-in one), None (no slot or no circuit in time: unknown). About 1.3 s. A public node with
relay limits checks at its start (`ensure_own`) and restarts its daemon until ours serves, `RELAY_TRIES`
times at most; it says what it found in its `addrs` answers (`relay`), and NAT'd nodes skip a capped one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from swarm.net import distance, reach
from swarm.errors import SwarmError
from swarm.net.identity import describe_peer

logger = logging.getLogger("swarm.net.transport")

RELAYS = 3  # slots a NAT'd node reserves at most
MAX_CANDIDATES = 12  # public nodes timed when choosing
MEET = 6  # of those, the nearest the node connects to again once its daemon holds its relays (`meet`)
RELAY_TRIES = 8  # daemon starts a public node tries for its own relay

CHECK_BYTES = 192 * 1024  # more than the built-in limit (128 KiB), far below ours
CHECK_PROTOCOL = "/swarm/relay-check/1.0.0"
SLOT_WAIT_S = 1.0  # the slot holder's reservation, taken at its start (static relay, no discovery)
CHECK_TIMEOUT_S = 15.0


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class _RawAddr:
    """A multiaddr as the daemon's client sends it (`to_bytes`). hivemind's multiaddr encodes `/p2p/<id>` as a
    CID, which the daemon refuses in a circuit address; the daemon wants the bare multihash."""

    def __init__(self, data: bytes):
        self.data = data

    def to_bytes(self) -> bytes:
        return self.data


def circuit_addr(hm, host: str, port: int, relay_id: str) -> _RawAddr:
    """`/ip4/HOST/tcp/PORT/p2p/RELAY/p2p-circuit`, encoded for the daemon."""
    relay = hm.PeerID.from_base58(relay_id).to_bytes()
    p2p, circuit = b"\xa5\x03", b"\xa2\x02"  # the varint codes of p2p (421) and p2p-circuit (290)
    return _RawAddr(hm.Multiaddr(f"/ip4/{host}/tcp/{port}").to_bytes() + p2p + _varint(len(relay)) + relay + circuit)


async def _pull(hm, holder, puller, host: str, port: int, relay_id: str, size: int) -> bool | None:
    """`puller` connects to `holder` through the relay and pulls `size` bytes: whether all of them came."""
    async def give(_info, _reader, writer) -> None:
        with contextlib.suppress(Exception):  # a circuit reset midway is the answer, not an error
            writer.write(b"\0" * size)
            await writer.drain()
        writer.close()

    await holder.add_binary_stream_handler(CHECK_PROTOCOL, give)
    await asyncio.sleep(SLOT_WAIT_S)
    for attempt in range(3):
        try:
            await puller._client.connect(holder.peer_id, [circuit_addr(hm, host, port, relay_id)])
            break
        except Exception as e:  # boundary: no slot yet (NO_RESERVATION), or a refused dial
            logger.debug("relay check: no circuit yet (%s)", e)
            await asyncio.sleep(1.0 + attempt)
    else:
        return None
    _, reader, writer = await puller.call_binary_stream_handler(holder.peer_id, CHECK_PROTOCOL)
    got = 0
    with contextlib.suppress(Exception):  # a reset circuit ends the read: `got` tells
        while chunk := await reader.read(65536):
            got += len(chunk)
    writer.close()
    return got >= size


async def check(host: str, port: int, relay_id: str, p2p_class, size: int = CHECK_BYTES) -> bool | None:
    """Whether the relay at host:port (this machine's node `relay_id`) carries `size` bytes in one circuit.
    `p2p_class(flags)`: the transport's daemon class with these extra daemon flags."""
    from swarm.net.dht_glue import hm

    hm = hm()
    holder = puller = None
    try:
        # started before the timeout below: a start cut short by a cancellation could leave its process behind
        holder = await p2p_class({"relayDiscovery": 0, "relayService": 0}).create(
            no_listen=True, use_auto_relay=True, auto_nat=False, force_reachability="private",
            trusted_relays=[f"/ip4/{host}/tcp/{port}/p2p/{relay_id}"])
        puller = await hm.P2P.create(host_maddrs=[f"/ip4/{host}/tcp/0"], auto_nat=False)
        return await asyncio.wait_for(_pull(hm, holder, puller, host, port, relay_id, size), CHECK_TIMEOUT_S)
    except Exception as e:  # boundary (a timeout included): a check that cannot run says nothing about the relay
        logger.debug("relay check failed to run: %r", e)
        return None
    finally:
        for daemon in (puller, holder):
            if daemon is not None:
                with contextlib.suppress(Exception):
                    await daemon.shutdown()


@contextlib.contextmanager
def ours_last(active: bool):
    """While active: daemons started here run one Go thread, so our relay registers last (see the module
    docstring). The daemon copies the environment when it starts."""
    before = os.environ.get("GOMAXPROCS")
    if active:
        os.environ["GOMAXPROCS"] = "1"
    try:
        yield
    finally:
        if active:
            if before is None:
                os.environ.pop("GOMAXPROCS", None)
            else:
                os.environ["GOMAXPROCS"] = before


def refusal(error: str) -> str:
    """What a relay's refusal in a dial error means, for the error's reader ("" when there is none)."""
    if "RESOURCE_LIMIT_EXCEEDED" in error:
        return " (the relay is at its limit of circuits to this peer: it refuses new ones while the open ones go on)"
    if "NO_RESERVATION" in error:
        return " (the peer holds no slot on that relay any more)"
    return ""


async def ensure_own(node, restart) -> None:
    """Check that `node` (public, with relay limits) relays with its own limits; `restart()` its daemon until it
    does, `RELAY_TRIES` starts at most. Sets `node.relay_checked` (True, False or None) and logs the outcome."""
    host = "127.0.0.1" if node.host in ("0.0.0.0", "::") else node.host
    started = time.monotonic()
    for attempt in range(1, RELAY_TRIES + 1):
        node.relay_checked = await check(host, node._port, node.peer_id, node.p2p_class)
        if node.relay_checked is not False or attempt == RELAY_TRIES:
            break
        await restart()
    took = time.monotonic() - started
    if node.relay.reservations == 0:  # ours gives no slot; the built-in one would, and is restarted away above
        declined, node.relay_checked = node.relay_checked is None, False  # never chosen as a relay, either way
        logger.info("relaying for nobody (--relay-slots 0): %s after %d daemon start%s", "no slot given (checked)"
                    if declined else "the daemon's built-in relay still gives slots", attempt, "s" if attempt > 1 else "")
    elif node.relay_checked:
        logger.info("relaying with this node's own limits (checked in %.1f s, %d daemon start%s)", took, attempt,
                    "s" if attempt > 1 else "")
    elif node.relay_checked is False:
        logger.warning("the transport daemon relays with its built-in limits (128 KiB or 2 minutes a circuit) "
                       "after %d starts: NAT'd peers will not choose this node as their relay", attempt)
    else:
        logger.info("could not check this node's relay (%.1f s): NAT'd peers may still choose it", took)


async def _timed_addrs(node, peer: str) -> tuple[dict | None, float]:
    """`peer`'s answer to an `addrs` request, and its round trip in ms: the second of two asks, once the first
    opened the connection (the first includes dialling)."""
    try:
        await reach.ask(node._open_rw, peer, {"addrs": True})
        started = time.perf_counter()
        answer = await reach.ask(node._open_rw, peer, {"addrs": True})
        return answer, (time.perf_counter() - started) * 1e3
    except Exception as e:  # boundary: a peer that does not answer is not a relay candidate
        logger.debug("relay candidate %s: %r", describe_peer(peer), e)
        return None, float("inf")


async def meet(node) -> None:
    """Connect the (restarted) daemon to the nearest public nodes that answered as relay candidates. Its daemon
    offers to punch holes only once 4 hosts at distinct addresses saw its outside address (go-libp2p's
    activation threshold, which no flag changes), and a daemon started with its relays alone knows its initial
    peers and those: often fewer than 4. Best effort, each within `reach.ASK_TIMEOUT_S`."""
    async def one(peer: str, addr: str) -> None:
        with contextlib.suppress(Exception):  # one that is gone is simply not met
            await _dial(node, peer, [addr])

    await asyncio.gather(*(one(p, a) for p, a in node.public_met.items()))


async def _dial(node, peer: str, addrs: list[str]) -> None:
    from swarm.net.dht_glue import hm

    hm = hm()
    await asyncio.wait_for(node._p2p._client.connect(hm.PeerID.from_base58(peer), [hm.Multiaddr(a) for a in addrs[:4]]),
                           reach.ASK_TIMEOUT_S)


async def choose(node, fallback: list[str]) -> list[str]:
    """Full multiaddrs of up to `RELAYS` relays for `node` (see the module docstring); `fallback` if none
    answered."""
    timed = await _timed_candidates(node, fallback)
    node.public_met = {peer: addr for _, peer, addr in sorted(timed)[:MEET]}
    if not timed:
        logger.info("no public peer answered as a relay candidate: asking the initial peers and those met before")
        return fallback
    return _nearest(timed)


def _nearest(timed: list[tuple[float, str, str]]) -> list[str]:
    ranked = sorted(timed)
    chosen = [c for c in ranked if c[0] <= distance.cut_ms(ranked[0][0])][:RELAYS]
    logger.info("relays chosen by round trip: %s (of %d candidates)",
                ", ".join(f"{describe_peer(p)} {ms:.1f} ms" for ms, p, _ in chosen), len(timed))
    return [f"{addr}/p2p/{peer}" for _, peer, addr in chosen]


async def _timed_candidates(node, fallback: list[str]) -> list[tuple[float, str, str]]:
    """(round trip ms, peer, address) of each public node that answered as a relay candidate."""
    known: dict[str, list[str]] = {}
    for addr in fallback:
        known.setdefault(reach.peer_of(addr), []).append(addr.split("/p2p/")[0])
    if node.known is not None:
        for peer, v in node.known.load().items():
            known.setdefault(peer, list(v["addrs"]))
    asked = (await node.connected_peer_ids())[:4]

    async def remembered(peer: str) -> dict:
        try:
            return (await reach.ask(node._open_rw, peer, {"peers": True})).get("peers") or {}
        except Exception:  # boundary: a node that does not answer remembers nothing for us
            return {}

    for answer in await asyncio.gather(*(remembered(p) for p in asked)):  # what the nodes it joined through met
        for other, addrs in (answer if isinstance(answer, dict) else {}).items():
            if isinstance(other, str) and isinstance(addrs, list) and other != node.peer_id:
                known.setdefault(other, [a for a in addrs if isinstance(a, str) and reach.dialable(a)][:4])

    async def candidate(peer: str) -> tuple[float, str, str] | None:
        if peer not in asked and known.get(peer):
            with contextlib.suppress(Exception):  # an address the daemon refuses: the ask fails below
                await _dial(node, peer, known[peer])
        answer, ms = await _timed_addrs(node, peer)
        addrs = [a.split("/p2p/")[0] for a in ((answer or {}).get("addrs") or []) if isinstance(a, str)]
        addrs = [a for a in addrs if reach.dialable(a)]
        if answer is None or not addrs or answer.get("relay") is False:
            return None
        return ms, peer, addrs[0]

    peers = [p for p in dict.fromkeys(asked + list(known)) if p != node.peer_id][:MAX_CANDIDATES]
    return [c for c in await asyncio.gather(*(candidate(p) for p in peers)) if c is not None]


async def replace(node) -> bool:
    """A NAT'd node that lost every relay: choose relays anew among the public peers that answer now and start
    its daemon again with them (see the module docstring). Whether it did (False: no new relay answered).
    Shielded: a node stopped meanwhile waits for it (`Node._stop`), so no daemon is left behind."""
    given = {reach.peer_of(a) for a in node._settings[0].get("trusted_relays") or []}
    timed = [c for c in await _timed_candidates(node, list(node._joined_through)) if c[1] not in given]
    if not timed:
        logger.warning("no relay left, and no other public peer answered as one: trying again in a minute")
        return False
    node.public_met = {peer: addr for _, peer, addr in sorted(timed)[:MEET]}
    node._replacing = asyncio.ensure_future(_restart(node, _nearest(timed)))
    return await asyncio.shield(node._replacing)


async def _restart(node, chosen: list[str]) -> bool:
    """Start the daemon again with relays `chosen`; failing that, as it was; failing that, joined through
    nobody (the daemon meets its peers again through the DHT node's own lookups). Then the DHT node and the
    stream handlers on it. Ends with a running daemon whatever fails."""
    started, before = time.monotonic(), (node._settings, list(node._joined_through))
    await node._stop_dht()
    tries = [(reach.daemon_settings(reach.PRIVATE, relays=chosen, limits=node.relay), chosen), before,
             (before[0], [])]
    for (kwargs, extra), initial in tries:
        await node._stop_for_restart()
        try:
            await node._start_daemon(kwargs, extra, initial)
            node._joined_through = list(initial)
            break
        except Exception as e:  # boundary: the next try; the last one joins through nobody, which cannot fail so
            logger.warning("starting the transport daemon again (%s) failed: %s", ", ".join(initial) or "alone", e)
    for protocol, handler in node._handlers.items():
        await node._p2p.add_binary_stream_handler(protocol, handler)
    await meet(node)  # the new daemon's outside address seen by enough hosts again
    try:
        await node._make_dht()
    except SwarmError as e:  # nobody it joined through answered: a DHT node of its own, found by the others
        logger.warning("the DHT node did not join again (%s): starting it alone", e)
        node._joined_through = []
        await node._make_dht()
    ok = node._joined_through == chosen
    logger.info("daemon started again%s in %.1f s: its sessions fail over to other peers or to it",
                f" with relays {', '.join(describe_peer(reach.peer_of(a)) for a in chosen)}" if ok else
                " as it was", time.monotonic() - started)
    return ok


__all__ = ["check", "choose", "ensure_own", "refusal", "replace", "CHECK_BYTES", "RELAYS", "circuit_addr"]
