"""The light client's transport: py-libp2p in a thread of its own, no daemon. The only package that imports
`libp2p`."""
