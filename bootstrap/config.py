"""The bootstrap's settings and the standalone monitor's: frozen dataclasses, light at import (the
`swarm` command builds its options from them before anything runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarm.config import check_port, check_positive, option
from swarm.errors import ConfigError


@dataclass(frozen=True)
class BootstrapConfig:
    identity: Path = option(help="Ed25519 key file, created on first start (default: <cache home>/bootstrap.key)",
                            required=False, default=None)
    host: str = option("127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    port: int = option(0, help="TCP port to listen on (0: any free port; give one for a stable address)")
    announce_host: str | None = option(None, help="public address to announce, if different from --host")
    initial_peers: tuple[str, ...] = option((), help="other bootstraps or peers of the swarm to join (default: the "
                                            "peers it met before, kept next to its key, else none: a new swarm)")
    reachability: str = option("public", help="how other machines reach it: public (a bootstrap is the swarm's "
                               "door), private (behind a NAT, through relays) or auto (ask peers to dial it back)")
    log_interval: float = option(60.0, help="seconds between swarm size reports")
    monitor_port: int | None = option(None, help="serve the swarm health page on this TCP port (0: any free port; "
                                      "default: no page)")
    monitor_host: str = option("127.0.0.1", help="address the health page is served on (0.0.0.0 for all interfaces)")
    monitor_interval: float = option(5.0, help="seconds between the health monitor's reads of the swarm")

    def __post_init__(self) -> None:
        check_positive(self, ("log_interval", "monitor_interval"))
        if self.reachability not in ("auto", "public", "private"):
            raise ConfigError(f"--reachability must be auto, public or private, not {self.reachability!r}")
        check_port(self.monitor_port, "--monitor-port")


@dataclass(frozen=True)
class MonitorConfig:
    initial_peers: tuple[str, ...] = option(help="multiaddrs of the bootstrap node or any peer of the swarm",
                                            required=True)
    host: str = option("127.0.0.1", help="address the page is served on (0.0.0.0 for all interfaces)")
    port: int = option(8090, help="TCP port of the page (0: any free port)")
    interval: float = option(5.0, help="seconds between reads of the swarm")

    def __post_init__(self) -> None:
        check_positive(self, ("interval",))
        check_port(self.port, "--port")
