"""A swarm on this machine: the offline demo model, real models from PyPI wheels, and processes to run them."""
