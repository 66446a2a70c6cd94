"""A swarm downloads a model once: this peer gives the weight files it holds to peers serving the same
weights, and takes the files it lacks from them before it asks the hub.

Files are named by their sha256 (the hub's listing for a hub model, hashed once for a local directory),
so a file from a peer is used only once all its bytes match; a peer that sent wrong bytes is banned for
the rest of this peer's life and the file comes from another holder, or from the hub.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path

from peer.config import PeerConfig
from swarm.errors import WeightsUnavailable
from swarm.net import discovery, wire
from swarm.net.transport import Node, describe_peer
from swarm.weights.digest import local_hashes
from swarm.weights.download import Progress
from swarm.weights.hub import PROBE_BYTES, RepoFile
from swarm.weights.models import Weights
from swarm.weights.share import MIN_FETCH_RATE, FileShare, fetch_file, find_holders

logger = logging.getLogger(__name__)

FETCH_LIMIT_S = 6 * 3600.0  # one file from peers at most (a slow holder is dropped long before: share.MIN_FETCH_RATE)
HOLDERS_TIMEOUT_S = 5.0  # peers asked what they hold answer within this or count as holding nothing
HUB_FRACTION = 0.25  # a holder sending slower than this share of the hub's speed is left for the hub
PROBE_MIN_BYTES = 32 * PROBE_BYTES  # files at least this large have the hub's speed measured first (the probe
# then costs the hub at most 1/32 of what sharing saves it; a smaller file's holder is held to MIN_FETCH_RATE)


def min_rate(hub_rate: float | None) -> float:
    """The slowest a holder may send (bytes/s) before the file is asked of another holder or the hub: a share of
    the hub's measured speed, so that a peer sending at a trickle cannot hold a joiner for hours (it may take at
    most 1 / `HUB_FRACTION` times what the hub would), and never under the transfers' own floor."""
    return max(MIN_FETCH_RATE, HUB_FRACTION * hub_rate) if hub_rate else MIN_FETCH_RATE
MAX_CANDIDATES = 32  # peers asked at most per file


class Sharing:
    """This peer's side of weight sharing, for one model's weights."""

    def __init__(self, node: Node, weights: Weights, num_blocks: int, config: PeerConfig, cache_home: str | None):
        self.node, self.weights, self.num_blocks, self.config = node, weights, num_blocks, config
        self.share = FileShare(rate=config.share_rate, enabled=config.share_weights)
        self.banned: set[str] = set()
        self.from_peers: dict[str, str] = {}  # file -> the peer it came from
        self.cache_home = cache_home
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Serve the protocol (refusing while sharing is off), offer what is held, and take part in
        fetching: the hub model asks here before the hub."""
        self.loop = asyncio.get_running_loop()
        await self.node.serve(wire.WEIGHTS_PROTOCOL, self.share.handler)
        await self.loop.run_in_executor(None, self.offer_held)
        hub = self.weights.hub
        if hub is not None:
            hub.on_fetched = self.offer
            if self.config.share_weights:
                hub.fetch_hook = self.fetch_from_peers

    def offer_held(self) -> None:
        """Offer every weight file already here whose hash is known."""
        hub = self.weights.hub
        if hub is None:
            _, hashes = local_hashes(self.weights.directory, self.cache_home)
            for name, sha in hashes.items():
                path = self.weights.directory / name
                self.share.add(sha, path, path.stat().st_size)
            return
        for name in hub.weight_files:
            info = hub.files[name]
            if info.sha256 and hub.present(name):
                self.offer(info, hub.snapshot / name)

    def offer(self, info: RepoFile, path: Path) -> None:
        if info.sha256 and info.name in self.weights.hub.weight_files:
            self.share.add(info.sha256, path, path.stat().st_size)

    def fetch_from_peers(self, info: RepoFile, dest: Path) -> bool:
        """Called from a loading thread: take `info` from peers of the same weights into the hub cache;
        False when none had it, or anything went wrong (the hub is asked then)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop or self.loop is None or self.loop.is_closed():
            return False  # never block the loop that would do the work
        future = asyncio.run_coroutine_threadsafe(self._fetch(info), self.loop)
        try:
            return future.result(timeout=FETCH_LIMIT_S)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the hub is the fallback
            future.cancel()
            logger.warning("%s: fetching from peers failed (%s: %s); asking the hub", info.name, type(exc).__name__,
                           exc)
            return False

    async def _candidates(self) -> list[str]:
        anns = discovery.same_weights(await discovery.announcements(self.node, self.weights.name, self.num_blocks),
                                      self.weights.digest)
        peers = {a.peer for block in anns.values() for a in block if a.state != "offline"}
        peers.discard(self.node.peer_id)
        peers -= self.banned
        return random.sample(sorted(peers), min(len(peers), MAX_CANDIDATES))

    async def _fetch(self, info: RepoFile) -> bool:
        hub = self.weights.hub
        # the hub model holds the file's lock across processes while this runs: the partial file is this
        # process's alone, and stays for a later run to resume when nobody delivers the rest now
        part = hub.folder / "blobs" / f"{info.sha256}.from-peers"
        try:
            return await self._fetch_into(info, part)
        except Exception as exc:  # noqa: BLE001 - a failed DHT read, a lost stream, a full disk: the hub is asked
            logger.warning("%s: fetching from peers failed (%s: %s); asking the hub", info.name, type(exc).__name__,
                           exc)
            return False

    async def _fetch_into(self, info: RepoFile, part: Path) -> bool:
        hub = self.weights.hub
        try:
            peers = await self._candidates()
            if not peers:
                return False
            held = await find_holders(self.node, peers, [info.sha256], timeout=HOLDERS_TIMEOUT_S)
            holders = [p for p, size in held.get(info.sha256, []) if size == info.size and p not in self.banned]
            if not holders:
                return False
            random.shuffle(holders)
            part.parent.mkdir(parents=True, exist_ok=True)
            big = info.size >= PROBE_MIN_BYTES
            slowest = min_rate(await asyncio.to_thread(hub.probe_rate, info.name) if big else None)
            started = time.monotonic()
            logger.info("fetching %s of %s (%.1f MiB) from %d peers that hold it (each at %.1f MiB/s at least)",
                        info.name, hub, info.size / 2**20, len(holders), slowest / 2**20)
            sender = await fetch_file(self.node, holders, info.sha256, info.size, part, banned=self.banned,
                                      progress=Progress(info.name), min_rate=slowest)
        except WeightsUnavailable as exc:
            logger.warning("%s: no peer delivered it (%s); asking the hub", info.name, exc)
            return False
        hub.place(info.name, part)
        self.from_peers[info.name] = sender
        elapsed = max(time.monotonic() - started, 1e-6)
        logger.info("fetched %s from peer %s (%.1f MiB/s)", info.name, describe_peer(sender),
                    info.size / 2**20 / elapsed)
        return True
