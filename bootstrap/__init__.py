"""The public entry node of a swarm: DHT only, stable identity, health page. Never imports torch."""
