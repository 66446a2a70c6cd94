"""Placement that keeps regions whole (`peer.placement`, regions), in an internet in a box with two regions
(`tests/netbox.py`): 2 ms one way within each, 30 ms between. Four public peers, each with room for half of
the tiny llama's 6 blocks (`--num-blocks 3`), join one after another, alternating regions; each times its
round trips to the others (`peer.balancer.Distances`) and prefers the blocks no peer near it serves. Each
region ends up holding the whole model, and a client in each region routes through its own region's peers
only, with transformers' greedy tokens. Placed by throughput alone, the third peer could double the first
peer's half (it did in the unit test of the same arrival order: `test_placement.py`)."""

from __future__ import annotations

import os

import pytest
import torch

import netbox
from box_swarm import BoxSwarm
from netbox import Box

pytestmark = pytest.mark.integration

if netbox.available() is not None and os.geteuid() != 0:  # CI runs as root; missing tools there are a failure
    pytest.skip(f"not root: {netbox.available()} (network namespaces need root; CI runs as root, where a missing "
                "tool fails the test instead of skipping it)", allow_module_level=True)

MODEL_ID = "tiny-llama"
PEER_OPTIONS = ("--cache-tokens", "1024", "--announce-interval", "2", "--record-ttl", "8", "--num-blocks", "3")
PROMPT = [5, 17, 42, 99, 3, 64, 200, 11]
NEW_TOKENS = 12
START_S = 90
GENERATE_S = 120


def test_peers_joining_two_regions_make_each_region_hold_the_model(tmp_path, tiny_llama, local):
    expected = local.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0).tolist()
    with Box(regions={"eu": 2.0, "us": 2.0}, between_ms=30.0) as box:
        sw = BoxSwarm(box, tmp_path, tiny_llama, MODEL_ID, PEER_OPTIONS)
        try:
            boot = sw.bootstrap(box.public("boot", region="eu"))
            region_of = {}
            for name, region in (("eu1", "eu"), ("us1", "us"), ("eu2", "eu"), ("us2", "us")):
                proc = sw.peer(name, box.public(name, region=region), None, [boot.addr])
                sw.wait_serving([proc], START_S)
                region_of[proc.peer_id] = region
            chose = {name: next(ln for ln in sw.procs[name].text().splitlines() if " chose blocks " in ln)
                     for name in ("eu1", "us1", "eu2", "us2")}
            assert "1 peers near" in chose["eu2"] and "1 peers near" in chose["us2"], chose
            spans: dict[str, set[int]] = {"eu": set(), "us": set()}
            for p in sw.status(box.hosts["boot"], [boot.addr])["peers"]:
                if p["state"] == "online":
                    spans[region_of[p["peer"]]].update(range(p["start"], p["end"]))
            assert spans == {"eu": set(range(6)), "us": set(range(6))}, chose
            for region in ("eu", "us"):
                host = box.public(f"client-{region}", region=region)
                done = sw.client(f"client-{region}", host, [boot.addr], PROMPT, NEW_TOKENS).expect("done", GENERATE_S)
                assert done["event"] == "done", done
                assert done["tokens"] == expected
                assert {region_of[peer] for peer, _ in done["route"]} == {region}, (done["route"], region_of)
        except BaseException:
            print(sw.diagnostics())
            raise
