"""Where a model's weights come from: names (`org/name` or a directory), the hub, the digest that names
exactly which weights, and peers that give weight files to each other."""
