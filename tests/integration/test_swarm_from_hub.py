"""A swarm of peers started as volunteers start them, `swarm peer --model org/name`, from a hub (a real HTTP
server speaking the hub's file API): exact text, weights downloaded once by the swarm, a peer sending
wrong bytes banned, and peers with different weights under one name never in one route."""

from __future__ import annotations

import time

import pytest
import torch

from client.loop import LoopThread
from client.model import DistributedModelForCausalLM
from hub_repos import build_sharded_repo
from hub_server import HubServer
from swarm.local.launch import LocalSwarm, wait_until
from weights_adversary import LyingHolder

pytestmark = pytest.mark.integration

REPO = "tiny-org/tiny-llama"
PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
OPTIONS = ("--announce-interval", "2", "--record-ttl", "8", "--cache-tokens", "1024")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_sharded_repo(tmp_path_factory.mktemp("hub-repo") / "repo", "llama", seed=5)


def whole_shards(server: HubServer) -> set[str]:
    return {r.filename for r in server.log if r.kind == "resolve" and r.method == "GET" and r.status == 200
            and r.range is None and r.filename.endswith(".safetensors")}


def test_peers_from_a_hub_name_give_exact_text_and_share_their_weights(checkpoint, tmp_path, monkeypatch):
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with HubServer({REPO: checkpoint}) as hub, LocalSwarm(tmp_path / "swarm") as net:
        net.start_bootstrap()
        for name, blocks in (("first", "0:3"), ("second", "3:6")):
            net.start_peer(name, REPO, "--blocks", blocks, *OPTIONS, wait=False,
                           env=hub.client_env(tmp_path / f"hf-{name}"))
        for name in ("first", "second"):
            net.wait_serving(net.procs[name])
        first_shards = whole_shards(hub)
        for key, value in hub.client_env(tmp_path / "hf-client").items():
            if key.startswith("HF_"):
                monkeypatch.setenv(key, value)
        local = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        with DistributedModelForCausalLM.from_pretrained(REPO, net.bootstrap_addrs) as remote:
            expected = local.generate(PROMPT, max_new_tokens=16, do_sample=False, pad_token_id=0)
            assert remote.generate(PROMPT, max_new_tokens=16, do_sample=False, pad_token_id=0).tolist() == \
                expected.tolist()

        # a replica of blocks [0:3) takes its shards from the peer that has them, none from the hub
        hub.clear_log()
        replica = net.start_peer("replica", REPO, "--blocks", "0:3", *OPTIONS, env=hub.client_env(tmp_path / "hf-r"))
        assert whole_shards(hub) == set(), "the replica downloaded shards from the hub"
        assert "from peer" in replica.text() and first_shards
        header_bytes = sum(r.bytes_sent for r in hub.log if r.filename and r.filename.endswith(".safetensors"))
        assert header_bytes < 0.1 * sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))  # headers only

        # an API serving every model the swarm announces by name, fetched as a client fetches it
        api = net.start_api("api", None, "--all-models", env=hub.client_env(tmp_path / "hf-api"))
        oai = openai.OpenAI(base_url=api.extra["url"], api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in oai.models.list()] == [REPO]
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
        out = local.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        got = oai.completions.create(model=REPO, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert got.choices[0].text == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_a_peer_sending_wrong_bytes_is_banned_and_the_file_comes_from_elsewhere(checkpoint, tmp_path):
    from peer.announcer import Announcer, Figures
    from swarm.net import wire
    from swarm.net.identity import Identity
    from swarm.net.transport import Node
    from swarm.span import Span
    from swarm.weights.hub import sha256_of
    from swarm.weights.models import open_weights

    digest = open_weights(checkpoint, role="peer", cache_home=tmp_path).digest
    shards = {sha256_of(p): p.read_bytes() for p in checkpoint.glob("model-*.safetensors")}
    with HubServer({REPO: checkpoint}) as hub, LocalSwarm(tmp_path / "swarm") as net, LoopThread("liar") as loop:
        net.start_bootstrap()
        identity = Identity.generate()
        node = Node(identity, initial_peers=net.bootstrap_addrs)
        loop.run(node.__aenter__(), timeout=60)
        try:
            # the liar: announces blocks [0:6) of these weights and holds every shard, with every byte flipped
            liar = LyingHolder(shards)
            loop.run(node.serve(wire.WEIGHTS_PROTOCOL, liar.handler), timeout=30)
            announcer = Announcer(node, identity, REPO, Span(0, 6), 6, 30.0, digest)
            loop.run(announcer.announce("online", Figures(throughput=1.0)), timeout=30)
            peer = net.start_peer("honest", REPO, "--blocks", "0:2", *OPTIONS, env=hub.client_env(tmp_path / "hf"))
            assert liar.sent > 0
            assert "no peer delivered it" in peer.text() and "banned" in peer.text()
            assert whole_shards(hub), "the shards came from the hub after the liar was caught"
        finally:
            loop.run(node.__aexit__(None, None, None), timeout=30)


def test_a_peer_stops_at_once_while_it_downloads(checkpoint, tmp_path):
    with HubServer({REPO: checkpoint}, rate=20_000) as hub, LocalSwarm(tmp_path / "swarm") as net:
        net.start_bootstrap()
        proc = net.start_peer("slow", REPO, "--blocks", "0:6", *OPTIONS, wait=False,
                              env=hub.client_env(tmp_path / "hf"))
        wait_until(lambda: "fetching model-" in proc.text(), 90, "the download to start",
                   diagnostics=lambda: proc.text()[-2000:])
        started = time.monotonic()
        net.stop("slow", timeout=30)
        assert time.monotonic() - started < 10
        assert "stopped while loading" in proc.text()


def test_peers_with_other_weights_under_one_name_are_never_in_one_route(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    other = build_sharded_repo(tmp_path / "other", "llama", seed=6)
    name = ("--model-id", REPO)
    with LocalSwarm(tmp_path / "swarm") as net:
        net.start_bootstrap()
        for proc, model, blocks in (("a-head", checkpoint, "0:3"), ("a-tail", checkpoint, "3:6"),
                                    ("b-tail", other, "3:6"), ("b-tail2", other, "3:6")):
            net.start_peer(proc, model, "--blocks", blocks, *name, *OPTIONS, wait=False)
        for proc in ("a-head", "a-tail", "b-tail", "b-tail2"):
            net.wait_serving(net.procs[proc])
        ours = {net.procs["a-head"].peer_id, net.procs["a-tail"].peer_id}
        local = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        with DistributedModelForCausalLM.from_pretrained(checkpoint, net.bootstrap_addrs, model_id=REPO) as remote:
            for _ in range(5):
                assert {h.peer for h in remote.route()} == ours
            expected = local.generate(PROMPT, max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert remote.generate(PROMPT, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist() == \
                expected.tolist()
        from client.inference.peer_session import PeerSession
        from swarm.errors import NoRoute, NotServing
        from swarm.span import Span

        with DistributedModelForCausalLM.from_pretrained(other, net.bootstrap_addrs, model_id=REPO) as theirs:
            with pytest.raises(NoRoute, match=r"\[0:3\)|0, 1, 2|blocks"):
                theirs.route()
            # and a peer asked directly for a session with other weights than its own refuses it
            client = theirs.connection.client
            with pytest.raises(NotServing, match="serves other weights"):
                theirs.connection.run(PeerSession.open(client.node, net.procs["a-head"].peer_id, REPO, Span(0, 3),
                                                       max_length=16, digest=client.digest))
