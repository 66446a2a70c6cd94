"""Shared core of the swarm: identities, records, wire protocol, routing and model blocks.

This is the bottom layer: it imports none of `peer`, `client` or `bootstrap`.
"""

__version__ = "0.1.0"
