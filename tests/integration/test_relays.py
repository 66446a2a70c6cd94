"""A public node relays with its own limits (`swarm.net.relays`): hivemind's daemon also runs a built-in relay
whose circuits are reset after 128 KiB, and which of the two serves is a race inside the daemon. The check
tells them apart (the built-in one alone: cut short), and a public node starts again until its own serves;
with no slots to give (`--relay-slots 0`) it gives none and says so.
Inside a box host (a public address, as a relay has)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

import netbox
from netbox import Box

pytestmark = pytest.mark.integration

if netbox.available() is not None and os.geteuid() != 0:  # CI runs as root; missing tools there are a failure
    pytest.skip(netbox.available(), allow_module_level=True)

SCRIPT = r"""
import asyncio, json, sys
from swarm.net import reach, relays
from swarm.net.identity import Identity
from swarm.net.transport import Node

async def main(ip):
    out = {}
    # a daemon with the built-in relay only (no relay service of ours): the check sees circuits cut short
    kwargs, _ = reach.daemon_settings("public", relays=[], limits=None)
    builtin = await Node.p2p_class({"relayService": 0}).create(host_maddrs=[f"/ip4/{ip}/tcp/0"], **kwargs)
    try:
        port = int(str((await builtin.get_visible_maddrs())[0]).split("/tcp/")[1].split("/")[0])
        out["builtin"] = await relays.check(ip, port, str(builtin.peer_id), Node.p2p_class)
    finally:
        await builtin.shutdown()
    # a public node with relay limits: started again until its own relay serves
    async with Node(Identity.generate(), host="0.0.0.0", reachability="public", relay=reach.RelayLimits(),
                    join_alone=True) as node:
        out["node"] = node.relay_checked
        out["again"] = await relays.check(ip, node._port, node.peer_id, Node.p2p_class)
    # --relay-slots 0: its own relay gives nobody a slot, and it says it relays for nobody
    async with Node(Identity.generate(), host="0.0.0.0", reachability="public", relay=reach.RelayLimits(reservations=0),
                    join_alone=True) as node:
        out["declining"] = node.relay_checked
        out["declined"] = await relays.check(ip, node._port, node.peer_id, Node.p2p_class)
    print(json.dumps(out))

asyncio.run(main(sys.argv[1]))
"""


def test_a_public_node_relays_with_its_own_limits_and_the_check_tells_the_built_in_relay_apart():
    with Box() as box:
        host = box.public("relay")
        done = box.run(host, [sys.executable, "-c", SCRIPT, host.address], timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        found = json.loads(done.stdout.strip().splitlines()[-1])
        assert found == {"builtin": False, "node": True, "again": True, "declining": False, "declined": None}, \
            (found, done.stderr[-2000:])


def test_a_nat_peer_whose_only_relay_died_takes_another_and_serves_a_new_client(tmp_path, tiny_llama, local):
    """Two regions; the bootstrap far away (us). A NAT'd peer in eu [3:6) starts when the only public peer near
    it is pub1 [0:3): pub1 is its only relay. pub2 [0:3) starts near it later; pub1 is killed. Within 30 s the
    NAT'd peer holds a slot on pub2 (its daemon started again with it), and a new NAT'd client in eu, which
    reaches it only through a relay, generates transformers' greedy tokens through it."""
    import torch

    from box_links import relays
    from box_swarm import BoxSwarm, wait_until

    def slots(proc) -> list[str]:
        try:
            return asyncio.run(relays(proc.popen.pid))
        except Exception:  # its daemon starting again: no answer yet
            return []

    prompt, new = [5, 17, 42, 99, 3, 64, 200, 11], 12
    expected = local.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0).tolist()
    options = ("--cache-tokens", "1024", "--announce-interval", "2", "--record-ttl", "8")
    with Box(regions={"eu": 2.0, "us": 2.0}, between_ms=30.0) as box:
        sw = BoxSwarm(box, tmp_path, tiny_llama, "tiny-llama", options)
        try:
            boot = sw.bootstrap(box.public("boot", region="us"))
            pub1 = sw.peer("pub1", box.public("pub1", region="eu"), "0:3", [boot.addr])
            sw.wait_serving([pub1], 90)
            met = tmp_path / "bootstrap" / "identity.key.known-peers.json"
            wait_until(lambda: met.exists() and pub1.peer_id in met.read_text(), 120, "the bootstrap to remember pub1")
            nat = sw.peer("nat", box.home("nat", region="eu"), "3:6", [boot.addr])
            sw.wait_serving([nat], 90)
            held = wait_until(lambda: slots(nat), 30, "nat to hold a relay slot", interval=1, diagnostics=nat.tail)
            assert held == [pub1.peer_id], held
            pub2 = sw.peer("pub2", box.public("pub2", region="eu"), "0:3", [boot.addr])
            sw.wait_serving([pub2], 90)
            sw.kill(pub1)
            wait_until(lambda: slots(nat) == [pub2.peer_id], 30, "nat to hold a slot on pub2",
                       interval=1, diagnostics=nat.tail)
            sw.wait_log(nat, "daemon started again with relays", 30)  # logged once its DHT node is back
            # a client that knows only the bootstrap finds the NAT'd peer's new relay address
            run = sw.client("cli", box.home("cli", region="eu"), [boot.addr], prompt, new)
            done = run.expect("done", 120)
            assert done["event"] == "done", (done, run.proc.tail())
            assert done["tokens"] == expected
            assert [p for p, _ in done["route"]] == [pub2.peer_id, nat.peer_id], done["route"]
        except BaseException:
            print(sw.diagnostics())
            raise
