"""Volunteers behind home NAT routers (issue 30), proved in an internet in a box (`tests/netbox.py`).

Every scenario runs in a box of its own: a public bootstrap on the public segment, peers and clients each
behind their own home router (masquerade, nothing inbound unasked), unless said otherwise. The test process
stays outside the box; clients are `box_client.py` processes in their homes (`box_swarm.py`), and the
ground truth is transformers run here on the same tiny llama. Every wait has a deadline, and each box
is closed (its processes stopped, its namespaces deleted) whatever happens.

(a) two NAT'd peers (half the blocks each) and a NAT'd client: greedy tokens equal transformers'; the
    records (`swarm status`, JSON and table) say both peers are reached through a relay, and so do their logs;
(b) the NAT'd peer a generation uses is killed mid-generation: it fails over to a NAT'd spare, exactly;
(c) the bootstrap is killed mid-generation: the generation completes exactly, and a new client given the
    dead bootstrap and a live public peer it never met joins and generates.

Not here: a relay at its circuit limit. The daemon runs a relay service of its own besides the one our
flags configure, and which serves is a race (docs/operations.md, "What a relay costs its operator"), so
no limit of ours can be set for a test to rely on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import torch

import netbox
from box_links import Daemons, End, identify, kind, relays
from box_swarm import BoxSwarm, ClientRun, wait_until
from netbox import Box

pytestmark = pytest.mark.integration

if netbox.available() is not None and os.geteuid() != 0:  # CI runs as root; missing tools there are a failure
    pytest.skip(netbox.available(), allow_module_level=True)

MODEL_ID = "tiny-llama"
PEER_OPTIONS = ("--cache-tokens", "1024", "--announce-interval", "2", "--record-ttl", "8", "--max-sessions", "32")
PROMPT = [5, 17, 42, 99, 3, 64, 200, 11]
NEW_TOKENS = 24
PAUSE_AFTER = 8  # new tokens before the fault
START_S = 90  # a process's start, on 2 busy cores
GENERATE_S = 120  # a generation, failovers and waits for blocks included
REACH_S = 30  # a NAT'd peer's dial-back and relay reservation
LOG_S = 5  # a line the peer logs once its daemon holds what the line says


@pytest.fixture(scope="module")
def expected(local):
    out = local.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out.tolist()


@contextlib.contextmanager
def explained(sw: BoxSwarm):
    """On failure, every process's log tail goes with the test's output."""
    try:
        yield
    except BaseException:
        print(sw.diagnostics())
        raise


def finished(run: ClientRun, timeout: float = GENERATE_S) -> dict:
    event = run.expect("done", timeout)
    assert event["event"] == "done", f"client {run.proc.name}: {event.get('causes') or event}\n{run.proc.tail()}"
    return event


def paused(run: ClientRun) -> dict:
    event = run.expect("paused", START_S + GENERATE_S)
    assert event["event"] == "paused", f"client {run.proc.name}: {event.get('causes') or event}\n{run.proc.tail()}"
    return event


def wait_relayed(sw: BoxSwarm, *peers) -> None:
    """Each NAT'd peer found itself private and holds a slot on a relay (its daemon's addresses, asked anew,
    go through one)."""
    for proc in peers:
        sw.wait_log(proc, "reachability: private", REACH_S)

        def slot():
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited\n{proc.tail()}")
            return asyncio.run(relays(proc.popen.pid))

        wait_until(slot, REACH_S, f"{proc.name} to hold a slot on a relay", interval=1, diagnostics=proc.tail)


def reach_of(sw: BoxSwarm, host, initial_peers: list[str], peer_ids: list[str]) -> dict[str, str]:
    """The `reach` each peer's record carries, as `swarm status --json` shows it, once all of them are set."""
    seen: dict[str, str] = {}

    def all_set():
        seen.clear()
        seen.update({p["peer"]: p.get("reach") for p in sw.status(host, initial_peers)["peers"]})
        return all(seen.get(p) for p in peer_ids)

    with contextlib.suppress(TimeoutError):
        wait_until(all_set, REACH_S, "records with a reach", interval=1)
    return seen


async def link_to(client, peer) -> tuple[str, list[str]]:
    """How a client process is connected to a peer (box_links): relayed, direct, hole-punched or failed, and
    the remote addresses of its connections to it."""
    a = End(client.name, await identify(client.popen.pid), True, client.popen.pid)
    b = End(peer.name, peer.peer_id, not peer.host.public, peer.popen.pid)
    async with Daemons([a, b]) as daemons:
        addrs = await daemons.addrs(a, b)
        return kind(a, b, addrs), addrs


# ---- (a) and (b): two NAT'd peers, a NAT'd spare, NAT'd clients ----

@pytest.fixture(scope="module")
def homes(tmp_path_factory, tiny_llama):
    """A public bootstrap; alice [0:3), bob [3:6) and the spare carol [3:6), each behind its own router."""
    with Box() as box:
        sw = BoxSwarm(box, tmp_path_factory.mktemp("homes"), tiny_llama, MODEL_ID, PEER_OPTIONS)
        with explained(sw):
            boot = sw.bootstrap(box.public("boot"))
            peers = [sw.peer(name, box.home(name), blocks, [boot.addr])
                     for name, blocks in (("alice", "0:3"), ("bob", "3:6"), ("carol", "3:6"))]
            box.home("dana")  # the clients' home
            sw.wait_serving(peers, START_S)
        yield sw


def test_nat_peers_serve_a_nat_client_through_relays(homes, expected):
    sw = homes
    boot, peers = sw.procs["bootstrap"], [sw.procs[n] for n in ("alice", "bob", "carol")]
    with explained(sw):
        wait_relayed(sw, *peers)
        done = finished(sw.client("client-a", sw.box.hosts["dana"], [boot.addr], PROMPT, NEW_TOKENS))
        assert done["tokens"] == expected
        route = {span: peer for peer, span in done["route"]}
        assert route["[0:3)"] == sw.procs["alice"].peer_id and route["[3:6)"] in (peers[1].peer_id, peers[2].peer_id)
        ids = [p.peer_id for p in peers]
        reach = reach_of(sw, sw.box.hosts["boot"], [boot.addr], ids)
        assert {p.name: reach.get(p.peer_id) for p in peers} == {"alice": "relay", "bob": "relay", "carol": "relay"}
        table = sw.status(sw.box.hosts["boot"], [boot.addr], as_json=False)
        header = next(line for line in table.splitlines() if line.startswith("PEER"))
        rows = {line.split()[0]: line.split() for line in table.splitlines() if line.split()[:1] in ([i] for i in ids)}
        assert "REACH" in header.split() and all("relay" in rows[i] for i in ids), table
        for proc in peers:  # the daemon holds a slot (wait_relayed): the peer has said so by now
            sw.wait_log(proc, "reachable through relay", LOG_S)


def test_a_nat_peer_killed_mid_generation_fails_over_to_a_nat_spare(homes, expected):
    sw = homes
    boot = sw.procs["bootstrap"]
    with explained(sw):
        wait_relayed(sw, *(sw.procs[n] for n in ("alice", "bob", "carol")))
        run = sw.client("client-b", sw.box.hosts["dana"], [boot.addr], PROMPT, NEW_TOKENS, pause_after=PAUSE_AFTER)
        route = {span: peer for peer, span in paused(run)["route"]}
        victim = next(p for p in sw.procs.values() if p.peer_id == route["[3:6)"])
        spare = next(sw.procs[n] for n in ("bob", "carol") if sw.procs[n] is not victim)
        sw.kill(victim)
        run.go()
        done = finished(run)
        assert done["tokens"] == expected
        [failover] = done["failovers"]
        assert failover["blocks"] == "[3:6)" and failover["failed_peer"] == victim.peer_id, failover
        assert [spare.peer_id, "[3:6)"] in done["route"]


# ---- (c): the bootstrap dies ----

def test_the_bootstrap_killed_mid_generation(tmp_path, tiny_llama, expected):
    """A public peer `pub` [0:3) and a NAT'd peer alice [3:6) (initial peers: the bootstrap and `pub`): the
    bootstrap dies while a NAT'd client generates; then a fresh client given the dead bootstrap and `pub`
    (which it never met) joins; then the bootstrap comes back and rejoins through the peers it met."""
    with Box() as box:
        sw = BoxSwarm(box, tmp_path, tiny_llama, MODEL_ID, PEER_OPTIONS)
        with explained(sw):
            boot = sw.bootstrap(box.public("boot"))
            pub = sw.peer("pub", box.public("pub"), "0:3", [boot.addr])
            sw.wait_serving([pub], START_S)
            # two initial peers, as docs/operations.md advises: both are alice's relays
            alice = sw.peer("alice", box.home("alice"), "3:6", [boot.addr, pub.addr])
            sw.wait_serving([alice], START_S)
            sw.wait_log(pub, "reachability: public", REACH_S)
            wait_relayed(sw, alice)

            run = sw.client("client", box.home("dana"), [boot.addr], PROMPT, NEW_TOKENS, pause_after=PAUSE_AFTER)
            paused(run)
            met = sw.root / "bootstrap" / "identity.key.known-peers.json"  # next to its key
            wait_until(lambda: met.exists() and pub.peer_id in met.read_text(), REACH_S * 3,
                       "the bootstrap to remember pub", diagnostics=lambda: met.read_text() if met.exists() else "")
            assert alice.peer_id not in met.read_text()  # NAT'd: nothing to dial it at directly
            sw.kill(boot)
            run.go()
            assert finished(run)["tokens"] == expected

            late = sw.client("late-client", box.home("erin"), [boot.addr, pub.addr], PROMPT, NEW_TOKENS)
            done = finished(late)
            assert done["tokens"] == expected
            assert sorted(span for _, span in done["route"]) == ["[0:3)", "[3:6)"]

            back = sw.bootstrap(boot.host)  # same key, same address, no --initial-peers
            sw.wait_log(back, "joined through the peers met before", REACH_S)
            seen = sw.status(box.home("frank"), [back.addr])
            assert {p["peer"]: p["reach"] for p in seen["peers"] if p["state"] == "online"} == \
                {pub.peer_id: "direct", alice.peer_id: "relay"}
