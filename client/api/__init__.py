"""`swarm api`: the OpenAI-compatible gateway, its requests, responses, streams, tools, embeddings,
tokenizer endpoints, metrics, errors and chat page."""
