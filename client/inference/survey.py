"""Every model of the swarm, as `swarm status` without a model shows them: the models the swarm's directory
lists (`swarm.net.discovery.directory`, every peer of every model), each read and pinged as `SwarmClient.status`
reads one model.

A model's number of blocks is what most of its directory records announce (`swarm.net.view.count_blocks`):
records are signed by the peers that announce them, not checked against a checkpoint, so a model nobody
else serves is shown as its own peers describe it. At most `MAX_MODELS` models are read, the first by id.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from client.config import ClientConfig
from client.inference.swarm_client import PeerState, SwarmClient
from swarm.net import discovery, view

MAX_MODELS = 64


@dataclass(frozen=True)
class ModelStatus:
    """One model of the swarm: its peers (pinged if online) and the blocks no answering online peer serves."""

    model: str
    num_blocks: int
    peers: list[PeerState]
    uncovered: list[int]

    @property
    def covered(self) -> int:
        return self.num_blocks - len(self.uncovered)

    @property
    def online(self) -> int:
        return sum(p.state == "online" for p in self.peers)


async def survey(node, config: ClientConfig) -> list[ModelStatus]:
    """Every model the directory lists (at most `MAX_MODELS`), by id, each with its peers and uncovered blocks."""
    sizes = list(view.models(await discovery.directory(node)).items())[:MAX_MODELS]
    found = await asyncio.gather(*(SwarmClient(node, model, n, config).status() for model, n in sizes))
    return [ModelStatus(model, n, peers, uncovered) for (model, n), (peers, uncovered) in zip(sizes, found)]
