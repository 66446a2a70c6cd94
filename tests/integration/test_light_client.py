"""The light client (py-libp2p, `--transport libp2p`) in a process of its own, on real swarms: the same
greedy tokens as the hivemind client through the demo model's 3 peers, no hivemind imported and no daemon
started in its process tree, an exact failover when a replica is SIGKILLed, and forged or re-stamped records
from a lying source refused."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm.net import record_messages, records, wire
from swarm.net.identity import Identity
from swarm.weights.models import local_model_id
from swarm_harness import MODEL_ID, replicated_swarm

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNNER = Path(__file__).resolve().parent.parent / "light_runner.py"
PROMPT = [504, 3575, 282, 4649, 314]  # the demo model's tokens of "The capital of France is"
TINY_PROMPT = [5, 17, 42, 99, 3, 64, 200, 11]


def light(path, model_id: str, addrs: list[str], tokens: int, *extra: str, prompt=PROMPT) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(RUNNER), str(path), model_id, ",".join(map(str, prompt)), str(tokens),
                             *extra, *addrs], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def result(proc: subprocess.Popen, timeout: float = 240) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def children(pid: int) -> list[str]:
    """Command names of the processes whose parent is `pid`."""
    names = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                names.append(stat.split("(", 1)[1].rsplit(")", 1)[0])
    return names


def test_the_light_client_gives_the_hivemind_client_s_tokens(demo_swarm, demo_model_dir):
    from client.model import DistributedModelForCausalLM

    model_id = local_model_id(demo_model_dir)
    ids = torch.tensor([PROMPT])
    with DistributedModelForCausalLM.from_pretrained(demo_model_dir, demo_swarm.bootstrap_addrs,
                                                     model_id=model_id) as full:
        want = full.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             pad_token_id=0).tolist()[0]
    proc = light(demo_model_dir, model_id, demo_swarm.bootstrap_addrs, 12, "--pause-after", "4")
    line = proc.stdout.readline()
    assert line.startswith("paused "), proc.stderr.read()[-4000:] if proc.poll() is not None else line
    assert children(proc.pid) == []  # no daemon under the light client, in the middle of a generation
    proc.stdin.write("go\n")
    proc.stdin.flush()
    got = result(proc)
    assert got["tokens"] == want and not got["hivemind"] and got["refused"] == 0
    # the slim host: neither libp2p's package __init__ nor its full host ran (see client/light/host.py), and
    # the process's objects were frozen before the join (client.connection.settle_heap)
    assert not got["libp2p_package"] and not got["basic_host"] and got["frozen"] > 0
    assert got["libp2p_log_level"] >= logging.WARNING  # as libp2p's own __init__ sets it: no INFO per stream
    # QUIC (aioquic), DNS over HTTPS (httpx) and TLS with x509 were never loaded: the client dials TCP with Noise
    assert got["not_loaded"] == ["aioquic", "httpx", "cryptography.x509", "libp2p.security.tls"]


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, tiny_llama):
    with replicated_swarm(tmp_path_factory.mktemp("light"), tiny_llama) as net:
        yield net


def test_a_sigkilled_replica_is_failed_over_exactly(replicated, tiny_llama, local):
    ids = torch.tensor([TINY_PROMPT])
    want = local.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0).tolist()[0]
    proc = light(tiny_llama, MODEL_ID, replicated.bootstrap_addrs, 16, "--pause-after", "5", prompt=TINY_PROMPT)
    line = proc.stdout.readline()
    assert line.startswith("paused "), proc.stderr.read()[-4000:] if proc.poll() is not None else line
    route = dict(hop.split("=") for hop in line.split()[1:])
    victim = next(name for name, p in replicated.procs.items() if p.peer_id == route["3:6"])
    os.kill(replicated.procs[victim].popen.pid, signal.SIGKILL)
    replicated.procs[victim].popen.wait(10)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert result(proc)["tokens"] == want


def test_forged_and_restamped_records_from_a_lying_source_are_refused(swarm, loop, tiny_llama, local):
    """A node that serves the records protocol with, for every honest record it reads, a forged newer one (the
    peer's subkey, another key's signature) and a re-stamped one (a later expiration than was signed): the
    light client asks it and the bootstrap, refuses the lies, and generates the right tokens."""
    from swarm.net.transport import Node

    attacker = Identity.generate()

    def lying(node):
        async def serve(stream):
            keys = record_messages.GetRecords.from_message(await wire.read_message(stream.reader, 0)).keys
            found = await node.get_records(keys)
            entries = []
            for key in keys:
                for subkey, (value, expiration) in found.get(key, {}).items():
                    ann = records.Announcement.from_payload(records.open_envelope(value)[1])
                    worse = dataclasses.replace(ann, seq=ann.seq + 1000, state="offline").to_payload()
                    signed = records.signed_message(records.key_id(key), subkey, expiration, worse)
                    forged = bytes([records.ENVELOPE_VERSION]) + attacker.sign(signed) + worse
                    entries += [record_messages.RecordEntry(key, subkey, forged, expiration),
                                record_messages.RecordEntry(key, subkey, value, expiration + 60)]
            await wire.write_message(stream.writer, record_messages.Records(tuple(entries)).to_message())

        return serve

    liar = Node(Identity.generate(), initial_peers=swarm.bootstrap_addrs, host="127.0.0.1", port=0)
    loop.run(liar.__aenter__(), timeout=60)
    try:
        loop.run(liar.serve(wire.RECORDS_PROTOCOL, lying(liar)))
        liar_addr = loop.run(liar.maddrs())[0]
        ids = torch.tensor([TINY_PROMPT])
        want = local.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()[0]
        got = result(light(tiny_llama, MODEL_ID, [liar_addr, *swarm.bootstrap_addrs], 8, prompt=TINY_PROMPT))
        assert got["tokens"] == want and got["refused"] > 0
    finally:
        loop.run(liar.__aexit__(None, None, None), timeout=30)
