"""The radix tree over token ids (client.api.prefixes) and the gateway's choice of where a request starts
(client.api.reuse): taken, forked or new."""

from __future__ import annotations

import asyncio
import random

from client.api.prefixes import PrefixTree
from client.api.reuse import MIN_SHARED, Reuse
from client.leases import Lease


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_longest_prefix_matches_a_linear_scan_under_random_inserts_and_removals():
    rng = random.Random(0)
    for _ in range(200):
        tree, seqs = PrefixTree(), {}
        for _ in range(40):
            if rng.random() < 0.5 or not seqs:
                base = list(rng.choice(list(seqs.values()))) if seqs and rng.random() < 0.7 else []
                seq = base[:rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
                key = rng.randint(0, 9)
                seqs[key] = tuple(seq)
                tree.insert(key, seq)
            else:
                key = rng.choice(list(seqs))
                del seqs[key]
                tree.remove(key)
            query = [rng.randint(0, 3) for _ in range(rng.randint(0, 8))]
            items, length = tree.longest(query)
            best = max((common(s, query) for s in seqs.values()), default=0)
            assert length == best
            assert items == {k for k, s in seqs.items() if common(s, query) == best}
            assert len(tree) == len(seqs)


class Route:
    def __init__(self):
        self.resting = False

    def rest(self):
        self.resting = True


class Session:
    """What the pool uses of an inference session: whether it is closed, closing it, its route's claims."""

    def __init__(self):
        self.closed = False
        self.live = Route()
        self.forking = 0

    async def close(self):
        self.closed = True


def test_a_request_takes_the_session_its_prompt_extends_and_forks_one_it_only_shares():
    async def main():
        pool = Reuse(None, max_tokens=1000, max_seconds=60)
        system = list(range(100, 100 + MIN_SHARED + 4))
        first = Session()
        assert pool.keep(first, system + [1, 2, 3])
        assert first.live.resting  # a kept session does not count toward its peers' load
        taken = pool.choose(system + [1, 2, 3, 4, 5])  # the next turn: taken
        assert (taken.how, taken.kept.session, taken.position) == ("kept", first, len(system) + 3)
        assert len(pool.kept) == 0
        pool.keep(first, system + [1, 2, 3, 4, 5, 6])
        other = pool.choose(system + [7, 8, 9, 10, 11, 12, 13, 14])  # the same system prompt only
        assert (other.how, other.kept.session, other.position) == ("fork", first, len(system))
        assert len(pool.kept) == 1 and other.kept.forks == 1  # kept for its own conversation, pinned meanwhile
        assert pool.choose(system + [1, 2, 3, 4, 5, 6, 7]).how == "fork"  # a pinned session is not taken
        assert pool.choose([5, 6, 7]).how == ""  # nothing shared: a new session
        await pool.close()
        assert first.closed

    asyncio.run(main())


def test_one_users_sessions_are_neither_taken_nor_forked_for_another():
    async def main():
        pool = Reuse(None, max_tokens=1000, max_seconds=60)
        system = list(range(100, 100 + MIN_SHARED + 4))
        alice = Session()
        assert pool.keep(alice, system + [1, 2, 3], "alice")
        assert pool.choose(system + [1, 2, 3, 4], "bob").how == ""  # bob's request: a new session
        assert pool.choose(system + [7, 8], "bob").how == ""
        running, long = Lease(), list(range(500, 500 + 3 * MIN_SHARED))
        pool.running.insert(running, pool._key("alice", long))
        assert pool.choose(long + [5], "bob").how == ""
        assert pool.choose(long + [5], "alice").how == "running"
        assert pool.choose(system + [1, 2, 3, 4], "alice").how == "kept"
        await pool.close()

    asyncio.run(main())


def test_a_running_request_is_forked_once_it_shares_clearly_more():
    async def main():
        pool = Reuse(None, max_tokens=1000, max_seconds=60)
        system = list(range(100, 100 + 3 * MIN_SHARED))
        running = Lease()
        pool.running.insert(running, pool._key("", system + [1]))
        chosen = pool.choose(system + [2, 3])
        assert (chosen.how, chosen.of, chosen.position) == ("running", running, len(system))
        pool.keep(Session(), system[:MIN_SHARED] + [9] * 10)  # a kept session sharing less than the running one
        assert pool.choose(system + [2, 3]).how == "running"
        await pool.close()

    asyncio.run(main())


def test_the_budget_closes_the_least_recently_used_first():
    async def main():
        pool = Reuse(None, max_tokens=100, max_seconds=60)
        sessions = [Session() for _ in range(3)]
        for i, session in enumerate(sessions):
            pool.keep(session, [i] * 40)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        assert [s.closed for s in sessions] == [True, False, False]
        assert pool.kept_tokens == 80
        assert not pool.keep(Session(), [9] * 101)  # more than the whole budget: not kept
        await pool.close()

    asyncio.run(main())


def test_a_session_unused_too_long_is_closed():
    async def main():
        pool = Reuse(None, max_tokens=100, max_seconds=0.05)
        session = Session()
        pool.keep(session, [1] * 30)
        await asyncio.sleep(0.1)
        assert pool.choose([1] * 40).how == ""
        await asyncio.sleep(0)
        assert session.closed

    asyncio.run(main())
