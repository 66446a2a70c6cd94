"""Where a model's weights come from: names, the hub, digests, and peers that share files."""
