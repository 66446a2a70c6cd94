"""The gateway's Prometheus metrics (`GET /metrics`): requests, tokens, latencies, failovers and
cancellations, and the state of its slots and connections read when scraped. What a generation of one model
does (tokens, latencies, failovers) carries a `model` label; what the gateway shares between its models
(requests by endpoint and status, slots, connections, drafts, cancellations) does not."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from swarm import metrics


class ApiMetrics:
    def __init__(self, gateway):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("swarm_api_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.tokens = Counter("swarm_api_tokens", "tokens processed, prompt and completion", ["kind", "model"],
                              registry=r)
        self.seconds = Histogram("swarm_api_request_seconds", "time to answer a generation request, whole",
                                 ["endpoint", "model"], buckets=metrics.LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("swarm_api_time_to_first_token_seconds", "from a generation's start to its first "
                              "token (prompt through every block, then sampling)", ["model"],
                              buckets=metrics.LATENCY_BUCKETS, registry=r)
        self.token_seconds = Histogram("swarm_api_token_seconds", "time between consecutive tokens of a "
                                       "generation", ["model"], buckets=metrics.LATENCY_BUCKETS, registry=r)
        self.failovers = Counter("swarm_api_failovers", "peers replaced during generations", ["reason", "model"],
                                 registry=r)
        self.drafts = Counter("swarm_api_drafted_tokens", "tokens drafted by prompt lookup (speculative decoding), "
                              "by whether the model kept them", ["outcome"], registry=r)
        self.reuse_hits = Counter("swarm_api_prefix_hits", "generations that began from a session holding the "
                                  "start of their prompt: a kept one taken, or a fork", ["kind", "model"], registry=r)
        self.reuse_misses = Counter("swarm_api_prefix_misses", "generations that began with a new session", ["model"],
                                    registry=r)
        self.reuse_saved = Counter("swarm_api_prefix_tokens_saved", "prompt tokens not sent again because a session "
                                   "held them", ["model"], registry=r)
        self.reuse_evicted = Counter("swarm_api_kept_sessions_closed", "kept sessions closed, by why: unused (too "
                                     "long), budget (least recently used beyond --reuse-tokens), shutdown",
                                     ["reason", "model"], registry=r)
        self.user_requests = Counter("swarm_api_user_requests", "HTTP requests answered, by API key's user (with "
                                     "--api-key or --api-keys) and status", ["user", "status"], registry=r)
        self.cancelled = Counter("swarm_api_cancelled", "generations cancelled because the client went away",
                                 registry=r)

        def state():
            guard = gateway.server.guard if gateway.server else None
            yield "swarm_api_generations_running", "generations running now", gateway.running, {}
            yield "swarm_api_generations_waiting", "requests waiting for a generation slot", gateway.waiting, {}
            for model, reuse in gateway.reuse.items():
                yield "swarm_api_kept_sessions", "sessions kept open for reuse now", len(reuse.kept), {"model": model}
                yield "swarm_api_kept_tokens", "tokens the kept sessions hold now", reuse.kept_tokens, {"model": model}
            if guard is not None:
                yield "swarm_api_connections_open", "HTTP connections open now", guard.open_connections(), {}
                for what, value in (("evicted", guard.evicted), ("refused", guard.refused),
                                    ("timed_out", guard.timed_out)):
                    yield ("swarm_api_connections_dropped", "connections closed by the guards since start "
                           "(cumulative)", value, {"reason": what})

        r.register(metrics.StateCollector(state))
