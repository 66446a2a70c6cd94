"""The client SDK: keeps the model's head locally and runs its blocks through the swarm."""
