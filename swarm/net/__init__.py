"""The network wing: identities, records, the wire protocol, the transport, discovery and the swarm view.

Torch-free at import, and never imports `swarm.model` (`tests/unit/test_layering.py`)."""
