"""Shared core of the swarm, in wings: `swarm.net` (identities, records, the wire protocol, the
transport), `swarm.model` (checkpoints, blocks, caches, the head, precision) and `swarm.local` (a swarm
on this machine: the demo model, processes). Its own top-level modules are the ground every wing stands
on: errors, spans, formats, configuration, the `swarm` command, HTTP and metrics.

This is the bottom layer: it imports none of `peer`, `client` or `bootstrap`.
"""

__version__ = "0.1.0"
