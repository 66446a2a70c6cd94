"""A public node relays with its own limits (`swarm.net.relays`): hivemind's daemon also runs a built-in relay
whose circuits are reset after 128 KiB, and which of the two serves is a race inside the daemon. The check
tells them apart (the built-in one alone: cut short), and a public node starts again until its own serves;
with no slots to give (`--relay-slots 0`) it gives none and says so.
Inside a box host (a public address, as a relay has)."""

from __future__ import annotations

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
