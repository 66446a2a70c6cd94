"""A lease source for tests (`client.leases`): every lease holds the one session given, a stand-in for an
inference session."""

from __future__ import annotations

import contextlib

from client.leases import Lease


class Given:
    def __init__(self, session):
        self.session = session
        self.leases: list[Lease] = []

    @contextlib.asynccontextmanager
    async def lease(self, prompt: list[int], max_length: int):
        lease = Lease(self.session)
        self.leases.append(lease)
        try:
            yield lease
        finally:
            lease.prefilled.set()
