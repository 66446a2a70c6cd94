"""The client's settings: one frozen dataclass, shared by the SDK and the client commands."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.config import check_dtype, check_positive, option


@dataclass(frozen=True)
class ClientConfig:
    initial_peers: tuple[str, ...] = option((), help="multiaddrs of the bootstrap node or any peer of the swarm")
    model_id: str | None = option(None, help="the model's name in the swarm (default: the checkpoint directory name)")
    dtype: str = option("float32", help="dtype of activations sent to peers: float32, bfloat16 or float16")
    refresh_interval: float = option(10.0, help="seconds a view of who serves what is reused before reading the "
                                     "DHT again")
    ping_timeout: float = option(2.0, help="seconds a peer may take to answer a ping before it counts as failed")
    open_timeout: float = option(10.0, help="seconds a peer may take to open a session")
    step_timeout: float = option(60.0, help="the longest any step may take, whatever a peer's recent latency")
    min_deadline: float = option(1.5, help="seconds every step deadline allows on top of the expected time")
    deadline_factor: float = option(8.0, help="a step's deadline allows this many times its expected time")
    max_retries: int = option(8, help="reroutes one step may try before it fails")
    ban_seconds: float = option(5.0, help="first ban of a failed peer; doubles with each further failure")
    slow_factor: float = option(4.0, help="a peer is slow when its steps take this many times its usual latency")
    slow_steps: int = option(3, help="... for this many decode steps in a row; it is then avoided for the session")

    def __post_init__(self) -> None:
        positive = ("refresh_interval", "ping_timeout", "open_timeout", "step_timeout", "min_deadline",
                    "deadline_factor", "ban_seconds", "slow_factor", "max_retries", "slow_steps")
        check_positive(self, positive)
        check_dtype(self.dtype)
