"""`swarm peer`: serve a span of a model's blocks to the swarm. Light at import."""

from __future__ import annotations

import argparse
import os


def register_peer(sub: argparse._SubParsersAction) -> None:
    from peer.config import PeerConfig
    from swarm.signals import add_service_command

    def load_serve():
        # Compute threads sleep between steps instead of spinning: a spinning pool starves the network
        # side (event loop, transport daemon) and other processes on the machine; measured on 2 cores,
        # 3 local peers decode about 10% faster. Set before torch loads; an explicit setting wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        from peer.server import serve  # torch and transformers: only when a peer actually runs

        return serve

    def finish(config: PeerConfig, args) -> PeerConfig:
        import dataclasses
        from pathlib import Path

        if config.capacity_cache is None:  # measured once per machine, model and dtype
            config = dataclasses.replace(config, capacity_cache=Path(args.cache_home) / "capacity.json")
        if config.threads is not None:
            # before torch loads: the OpenMP pool that bfloat16 and int8 kernels use is sized from it, and
            # torch.set_num_threads alone leaves it at one thread per core (measured: a 1-thread peer of the
            # demo model in bfloat16 took 22 ms per step that way, 11.5 ms with the variable set)
            os.environ["OMP_NUM_THREADS"] = str(config.threads)
        return config

    add_service_command(sub, "peer", PeerConfig, load_serve, finish=finish, help="serve blocks of a model to the swarm",
                        description="Load a span of a model's blocks, announce them (signed) in the swarm's DHT "
                        "and serve inference sessions until stopped with Ctrl-C or SIGTERM.")
