"""The client's settings, shared by the SDK and the client commands, and the API gateway's. Light at import:
the commands read these to build their options."""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.config import check_port, check_positive, option
from swarm.errors import ConfigError
from swarm.formats import DTYPES, PRECISIONS
from swarm.net.messages import ENCODINGS


@dataclass(frozen=True)
class ClientConfig:
    initial_peers: tuple[str, ...] = option((), help="multiaddrs of the bootstrap node or any peer of the swarm")
    model_id: str | None = option(None, help="the model's name in the swarm (default: the hub repo id; for a "
                                  "directory, the name its marker gives, else one made of its weights' digest)")
    revision: str | None = option(None, help="branch, tag or commit of a hub model (default: main)")
    transport: str = option("p2pd", help="how the client reaches the swarm: p2pd (a DHT node on hivemind's "
                            "libp2p daemon) or libp2p (a light client on py-libp2p, pip install "
                            "'swarm-inference[light]': no daemon, records read from peers)")
    device: str = option("auto", help="where the client's embeddings and LM head compute: auto (a CUDA GPU if "
                         "present, else Apple's MPS, else the CPU), cpu, cuda, cuda:N or mps")
    dtype: str = option("float32", help="dtype of the client's embeddings and LM head: float32 (exact, the "
                        "default), bfloat16, float16 or auto (as peers choose it)")
    wire: str = option("auto", help="encoding of hidden states on the wire for decode steps: float32, float16, "
                       "bfloat16, int8 (blockwise 8-bit), or auto (the route's peers' 16-bit dtype when they "
                       "compute in 16 bits, bfloat16 when quantized, else float32)")
    prefill_wire: str = option("auto", help="encoding for prompt chunks of --prefill-wire-tokens tokens or more: "
                               "float32, float16, bfloat16, int8 (blockwise 8-bit), or auto (int8 when the route "
                               "computes in 16 bits or quantized, else as --wire)")
    prefill_wire_tokens: int = option(64, help="steps of at least this many tokens use --prefill-wire")
    prefill_chunk: int = option(128, help="a prompt of at least twice this many tokens goes through the route in "
                                "chunks of this many, so that peers work on different chunks at once (at least 64; "
                                "0: one step)")
    min_precision: str = option("nf4", help="route only through peers whose weights are at least this precise: "
                                "nf4 (any), int8, 16bit or float32")
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
    chain: bool = option(True, help="peers pass each step's activations straight to the next peer of the route "
                         "(--no-chain: the client relays every hop itself)")
    wait_for_blocks: float = option(30.0, metavar="SECONDS", help="seconds a running generation waits, when some "
                                    "of its blocks lose their last peer, for them to be served again before it fails "
                                    "(0: fail at once)")
    route_seed: int | None = option(None, help="seed of the random order in which sessions break ties between "
                                    "equally good peers (default: a random seed)")
    allow_peers: tuple[str, ...] = option((), metavar="PEER_ID", help="route only through these peers (ids as "
                                          "`swarm status` shows them); records of any other peer are ignored "
                                          "(default: any peer)")
    verify_fraction: float = option(0.1, metavar="P", help="after each step, each hop is checked against another "
                                    "replica of its blocks with this probability (everything since its last check "
                                    "is compared; 0: no checks); users see only checked output")
    remember_stalls: bool = option(True, help="remember peers that stalled (missed a deadline before they ever "
                                   "answered a step) for this machine's later clients, for 10 minutes "
                                   "(--no-remember-stalls: in this client only)")
    require_checked: bool = option(False, help="refuse to compute through blocks whose outputs no other peer can "
                                   "check (a sole server) with an error, instead of warning that the output is "
                                   "unchecked")

    def __post_init__(self) -> None:
        positive = ("refresh_interval", "ping_timeout", "open_timeout", "step_timeout", "min_deadline",
                    "deadline_factor", "ban_seconds", "slow_factor", "max_retries", "slow_steps",
                    "prefill_wire_tokens")
        check_positive(self, positive)
        if self.transport not in ("p2pd", "libp2p"):
            raise ConfigError(f"--transport must be p2pd or libp2p, not {self.transport!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.wire not in ("auto",) + ENCODINGS:
            raise ConfigError(f"--wire must be auto or one of {', '.join(ENCODINGS)}, not {self.wire!r}")
        if self.prefill_wire not in ("auto",) + ENCODINGS:
            raise ConfigError(f"--prefill-wire must be auto or one of {', '.join(ENCODINGS)}, not "
                              f"{self.prefill_wire!r}")
        if self.min_precision not in PRECISIONS:
            raise ConfigError(f"--min-precision must be one of {', '.join(PRECISIONS)}, not {self.min_precision!r}")
        if self.prefill_chunk < 0:
            raise ConfigError(f"--prefill-chunk must be 0 or more, not {self.prefill_chunk}")
        if not 0 <= self.verify_fraction <= 1:
            raise ConfigError(f"--verify-fraction must be in [0, 1], not {self.verify_fraction}")
        if self.require_checked and self.verify_fraction <= 0:
            raise ConfigError("--require-checked needs checks: --verify-fraction must be above 0")
        if not (math.isfinite(self.wait_for_blocks) and self.wait_for_blocks >= 0):
            raise ConfigError(f"--wait-for-blocks must be 0 or a number of seconds, not {self.wait_for_blocks}")


@dataclass(frozen=True)
class ApiConfig:
    host: str = option("127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    port: int = option(8000, help="TCP port to listen on (0: any free port)")
    max_tokens: int = option(512, help="the largest max_tokens a request may ask for; also the default for chat")
    context_length: int | None = option(None, help="longest prompt + completion in tokens (default: the model's, "
                                        "at most 4096, the peers' default session length)")
    max_generations: int = option(8, help="generations running at once; more wait in the queue")
    max_queue: int = option(32, help="requests waiting for a generation slot; beyond that they get 503")
    max_n: int = option(4, help="the largest n (choices per request)")
    max_prompts: int = option(16, help="prompts per completions request at most (they run at once, in one "
                              "generation slot)")
    speculative_tokens: int = option(16, help="tokens a request (n 1) may draft per step by prompt lookup (fewer "
                                     "round trips when the answer copies from its context, the same text; the "
                                     "number adapts to what the model accepts); 0: off")
    max_logprobs: int = option(20, help="the most likely tokens a request may ask for at each position "
                               "(logprobs, top_logprobs)")
    max_connections: int = option(512, help="open HTTP connections at most")
    header_timeout: float = option(10.0, help="seconds a connection may take to send a request's headers (and "
                                   "stay idle between requests)")
    body_timeout: float = option(30.0, help="seconds a request's body may take to arrive")
    write_timeout: float = option(30.0, help="seconds a streaming client may stop reading before it is cut off")
    max_body_bytes: int = option(1 << 20, help="largest request body in bytes")
    retry_after: int = option(5, help="seconds clients are told to wait (Retry-After) when blocks are uncovered")
    reuse_tokens: int = option(32768, help="prompt reuse: finished requests' sessions stay open on the peers, and "
                               "a request whose prompt begins the same way (the next turn of a chat, the same "
                               "system prompt) sends only the rest; they hold at most this many tokens together, "
                               "the least recently used closed first (0: no reuse)")
    reuse_seconds: float = option(120.0, help="seconds a finished request's session is kept unused for reuse (keep "
                                  "it below the peers' --idle-timeout, 300 s by default)")
    allow_origin: str | None = option(None, help="let web pages from this origin call the API from a browser "
                                      "(CORS), e.g. '*' for any (default: none)")
    api_key: tuple[str, ...] = option((), metavar="KEY", help="API keys that may call the API (as 'Authorization: "
                                      "Bearer KEY'); each is a user of its own: prompt reuse, limits and metrics per "
                                      "key (default: no keys, one user)")
    api_keys: str | None = option(None, metavar="FILE", help="a file of API keys, one per line: 'NAME KEY' or 'KEY'")
    key_generations: int = option(4, help="generations one API key may have running or waiting at once")

    def __post_init__(self) -> None:
        check_positive(self, ("max_tokens", "max_generations", "max_queue", "max_n", "max_prompts", "max_connections",
                              "header_timeout", "body_timeout", "write_timeout", "max_body_bytes", "retry_after",
                              "key_generations"),
                       ("--context-length",) if self.context_length is not None and self.context_length < 2 else ())
        check_port(self.port, "--port")
        if self.speculative_tokens < 0 or self.max_logprobs < 0 or self.reuse_tokens < 0:
            raise ConfigError("--speculative-tokens, --max-logprobs and --reuse-tokens must be 0 or more")
        if not (math.isfinite(self.reuse_seconds) and self.reuse_seconds > 0):
            raise ConfigError(f"--reuse-seconds must be a positive number of seconds, not {self.reuse_seconds}")

    @property
    def limits(self):
        from swarm import http

        return http.Limits(self.max_connections, self.header_timeout, self.body_timeout, self.max_body_bytes)
