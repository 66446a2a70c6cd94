"""Hidden states through the swarm: routing, peer sessions, inference sessions with failover, chaining,
pipelining and checked outputs. Imports no `client.api`, `client.light` or generation front end."""
