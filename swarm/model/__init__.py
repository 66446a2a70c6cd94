"""The model wing: checkpoints, the family's forward around a span, blocks, caches, the head, precision.

Never imports `swarm.net` (`tests/unit/test_layering.py`)."""
