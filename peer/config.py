"""A peer's configuration: one frozen dataclass; the `swarm peer` options are derived from it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from swarm.config import check_port, check_positive, option
from swarm.formats import DTYPES, QUANTS
from swarm.errors import ConfigError
from swarm.span import Span

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """'1.5GB', '300MiB', '4096' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 800MB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class PeerConfig:
    model: str = option(help="the model: a hub repo id, org/name or org/name@revision (only this peer's shards are "
                        "fetched), or a checkpoint directory (transformers format, safetensors)", required=True)
    revision: str | None = option(None, help="branch, tag or commit of a hub model (default: main)")
    initial_peers: tuple[str, ...] = option((), help="multiaddrs of the bootstrap node or any peer of the swarm")
    blocks: Span | None = option(None, help="serve exactly these blocks, START:END; default: choose by memory "
                                 "budget where the swarm is weakest", parse=Span.parse)
    num_blocks: int | None = option(None, help="serve this many blocks, placed where the swarm is weakest")
    memory_budget: int | None = option(None, help="memory for weights and cache, e.g. 2GB; decides how many blocks "
                                       "(default: 80%% of available memory)", parse=parse_bytes)
    model_id: str | None = option(None, help="the model's name in the swarm (default: the hub repo id; for a "
                                  "directory, the name its marker gives, else one made of its weights' digest)")
    host: str = option("0.0.0.0", help="address to listen on (default: all interfaces; 127.0.0.1: this machine "
                       "only)")
    port: int = option(0, help="TCP port to listen on (0: any free port)")
    announce_host: str | None = option(None, help="public address to announce, if different from --host")
    announce_port: int | None = option(None, help="public TCP port to announce, if different from --port (a "
                                       "forwarded port or a proxy in front of this peer)")
    reachability: str = option("auto", help="how other machines reach this peer: auto (ask the peers it joins "
                               "through to dial it back; behind a NAT, through relays), public or private")
    relay_slots: int = option(128, help="NAT'd peers this peer holds relay slots for when it is public (0: it relays "
                              "for nobody; its clients and the peers it pushes to still reach NAT'd peers)")
    identity: Path | None = option(None, help="Ed25519 key file, created on first start (default: a new identity "
                                   "each start)")
    device: str = option("auto", help="where the blocks compute: auto (a CUDA GPU if present, else Apple's MPS, "
                         "else the CPU), cpu, cuda, cuda:N or mps")
    dtype: str | None = option(None, help="dtype of weights and cache: float32 (exact), bfloat16, float16, or auto "
                               "(bfloat16 on GPUs that compute it, else float16; on CPUs bfloat16 where the CPU "
                               "computes it natively, else float32) (default: float32; with --quant, the 16-bit "
                               "type its weights compute in)")
    quant: str = option("none", help="weight format of the served layers' linear weights: none, int8 (CUDA: "
                        "bitsandbytes; CPU: int8 linears computing in bfloat16) or nf4 (CUDA only)")
    threads: int | None = option(None, help="compute threads (default: torch's, one per core); peers sharing a "
                                 "machine do better with a share of its cores each")
    max_sessions: int = option(64, help="concurrent inference sessions at most")
    cache_tokens: int = option(16384, help="attention cache budget in tokens (each token held in every served block)")
    max_length: int = option(4096, help="longest session (prompt + generated tokens)")
    max_batch: int = option(8, help="largest batch per session or forward call")
    max_request_bytes: int = option(128 * 2**20, help="largest tensor payload of one request, e.g. 64MiB",
                                    parse=parse_bytes)
    step_timeout: float = option(60.0, help="seconds a step may take before it fails with a timeout")
    idle_timeout: float = option(300.0, help="seconds a session may stay silent before its cache is reclaimed")
    max_queue: int = option(256, help="steps waiting for compute at most; beyond that requests get 'busy'")
    client_share: float = option(0.25, help="share of the cache and of the sessions one client (peer id) keeps while "
                                 "others need room: beyond it, its sessions are reclaimed for a client within its "
                                 "share")
    reclaim_idle: float = option(5.0, help="seconds a session must be silent before it may be reclaimed for another "
                                 "session when the cache or the sessions are full")
    client_forwards: int = option(2, help="stateless forwards of one client computed or queued at once; more wait "
                                  "their turn")
    block_peers: tuple[str, ...] = option((), metavar="PEER_ID", help="peers and clients (ids) this peer never "
                                          "serves nor pushes to (default: none)")
    push: bool = option(True, help="pass a chained step's output straight to the next peer of the client's route "
                        "(--no-push: the client relays it)")
    announce_interval: float = option(20.0, help="seconds between re-announcements")
    record_ttl: float = option(60.0, help="seconds an announcement stays valid without re-announcement")
    rebalance: bool = option(True, help="move to other blocks when that raises the swarm's throughput clearly, or "
                             "when blocks have no peer (--no-rebalance: keep the first span; --blocks never moves)")
    rebalance_interval: float = option(60.0, help="seconds between re-evaluations of the served span (jittered by "
                                       "25%%)")
    check_interval: float = option(3.0, help="seconds between looks for blocks that no peer serves (a hole is "
                                   "filled at once): the sole servers of a block are pinged, the swarm read "
                                   "up to 8 looks apart while it does not change")
    drain_timeout: float = option(120.0, help="seconds a moving peer keeps serving the sessions open on its old "
                                  "span; then they are closed and their clients fail over")
    capacity_cache: Path | None = option(None, help="JSON file caching this machine's measured block cost per model, "
                                         "device and dtype (default: capacity.json in the cache home)")
    metrics_port: int | None = option(None, help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: "
                                      "any free port; default: off)")
    metrics_host: str = option("127.0.0.1", help="address the metrics listen on (0.0.0.0 to let another machine "
                               "scrape them)")
    share_weights: bool = option(True, help="give the weight files this peer holds to peers of the same weights, "
                                 "and take the files it lacks from them before the hub (--no-share-weights: "
                                 "neither)")
    share_rate: int | None = option(None, help="bytes per second this peer sends to other peers' downloads at most, "
                                    "e.g. 20MB (default: no cap)", parse=parse_bytes)

    def __post_init__(self) -> None:
        positive = ("max_sessions", "cache_tokens", "max_length", "max_batch", "max_request_bytes", "step_timeout",
                    "idle_timeout", "max_queue", "reclaim_idle", "client_forwards", "announce_interval", "record_ttl",
                    "rebalance_interval", "check_interval", "drain_timeout")
        optional = [f"--{n.replace('_', '-')}" for n in ("num_blocks", "memory_budget", "threads")
                    if getattr(self, n) is not None and getattr(self, n) < 1]
        check_positive(self, positive, tuple(optional))
        if not 0 < self.client_share <= 1:
            raise ConfigError(f"--client-share must be in (0, 1], not {self.client_share}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.quant not in QUANTS:
            raise ConfigError(f"--quant must be one of {', '.join(QUANTS)}, not {self.quant!r}")
        if self.announce_interval >= self.record_ttl:
            raise ConfigError("--announce-interval must be shorter than --record-ttl, or records expire between "
                              "announcements")
        if self.relay_slots < 0:
            raise ConfigError(f"--relay-slots must be 0 or more, not {self.relay_slots}")
        if self.reachability not in ("auto", "public", "private"):
            raise ConfigError(f"--reachability must be auto, public or private, not {self.reachability!r}")
        check_port(self.port, "--port")
        check_port(self.announce_port, "--announce-port")
        check_port(self.metrics_port, "--metrics-port")
        same_host = self.metrics_host == self.host or "0.0.0.0" in (self.metrics_host, self.host)
        if self.metrics_port == self.port != 0 and same_host:
            raise ConfigError(f"--metrics-port and --port are both {self.port}: give metrics a port of its own")
