"""Models named as users name them: `org/name` from a hub (a real HTTP server speaking the hub's file API,
with `huggingface_hub` as the client), each role fetching only what it needs, one swarm per set of weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hub_repos import build_sharded_repo
from hub_server import HubServer
from swarm.errors import CheckpointError
from swarm.span import Span
from swarm.weights.hub import Hub, ModelUnavailable
from swarm.weights.models import open_weights

REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_sharded_repo(tmp_path_factory.mktemp("tiny-sharded") / "repo", "llama", seed=3)


@pytest.fixture()
def hub(checkpoint):
    with HubServer({REPO: checkpoint}) as server:
        yield server


def hub_of(server: HubServer, home: Path, **changes) -> Hub:
    return dataclasses.replace(Hub(endpoint=server.url, cache_dir=home / "hub", token=None, offline=False,
                                   manifests=home / "manifests"), **changes)


def whole_files(server: HubServer) -> set[str]:
    """Files downloaded whole (header reads are ranges of a few bytes)."""
    return {r.filename for r in server.log if r.kind == "resolve" and r.method == "GET" and r.status == 200
            and r.range is None}


def shards_of(checkpoint: Path, prefixes: tuple[str, ...]) -> set[str]:
    weight_map = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    return {file for name, file in weight_map.items() if name.startswith(prefixes)}


def test_a_peer_fetches_the_config_and_only_its_spans_shards(hub, checkpoint, tmp_path):
    from swarm.model.blocks import SpanBlocks
    from swarm.model.checkpoint import Checkpoint

    weights = open_weights(REPO, role="peer", hub=hub_of(hub, tmp_path), cache_home=tmp_path)
    assert whole_files(hub) == {"config.json", "model.safetensors.index.json"}
    assert weights.name == REPO and len(weights.digest) == 32
    ckpt = Checkpoint(weights.directory, source=weights.source)
    assert ckpt.block_bytes(4, torch.float32) > 0  # from the shards' headers, read with ranges
    timing = SpanBlocks(ckpt.stand_in(), Span(0, 1), "float32", "cpu")  # random weights to time, nothing fetched
    assert timing.hidden_size == 64
    assert whole_files(hub) == {"config.json", "model.safetensors.index.json"}
    SpanBlocks(ckpt, Span(2, 4), "float32", "cpu")
    needed = shards_of(checkpoint, ("model.layers.2.", "model.layers.3."))
    assert whole_files(hub) == {"config.json", "model.safetensors.index.json"} | needed
    assert len(needed) < len(shards_of(checkpoint, ("",)))


def test_a_client_fetches_config_tokenizer_templates_and_only_the_heads_shards(hub, checkpoint, tmp_path):
    from swarm.model.checkpoint import Checkpoint
    from swarm.model.head import ModelHead

    weights = open_weights(REPO, role="client", hub=hub_of(hub, tmp_path), cache_home=tmp_path)
    small = {p.name for p in checkpoint.iterdir() if not p.name.endswith(".safetensors") and not p.name.startswith(".")}
    assert whole_files(hub) == small
    ModelHead(Checkpoint(weights.directory, source=weights.source))
    head = shards_of(checkpoint, ("model.embed_tokens.", "model.norm.", "lm_head."))
    assert whole_files(hub) == small | head
    assert not whole_files(hub) & (shards_of(checkpoint, ("model.layers.",)) - head)


def test_a_single_file_checkpoint_is_sized_from_its_header_and_fetched_whole_when_a_block_loads(tmp_path):
    from swarm.model.blocks import SpanBlocks
    from swarm.model.checkpoint import Checkpoint

    single = build_sharded_repo(tmp_path / "single", "llama", seed=3, max_shard_size=None)
    assert (single / "model.safetensors").is_file()
    with HubServer({"tiny-org/single": single}) as server:
        weights = open_weights("tiny-org/single", role="peer", hub=hub_of(server, tmp_path), cache_home=tmp_path)
        ckpt = Checkpoint(weights.directory, source=weights.source)
        assert ckpt.block_bytes(0, torch.float32) > 0 and whole_files(server) == {"config.json"}
        SpanBlocks(ckpt, Span(0, 2), "float32", "cpu")
        assert whole_files(server) == {"config.json", "model.safetensors"}
        assert weights.digest == open_weights(single, role="peer", cache_home=tmp_path).digest


def test_the_same_weights_have_one_digest_from_the_hub_and_from_a_directory(hub, checkpoint, tmp_path):
    from_hub = open_weights(REPO, role="peer", hub=hub_of(hub, tmp_path), cache_home=tmp_path)
    from_dir = open_weights(checkpoint, role="peer", cache_home=tmp_path)
    assert from_hub.digest == from_dir.digest


def test_a_revision_is_one_commit_and_other_weights_another_digest(hub, checkpoint, tmp_path):
    first = hub.commits(REPO)[0]
    other = build_sharded_repo(tmp_path / "other", "llama", seed=4)
    second = hub.add_repo(REPO, other)
    newest = open_weights(REPO, role="peer", hub=hub_of(hub, tmp_path), cache_home=tmp_path)
    pinned = open_weights(f"{REPO}@{first}", role="peer", hub=hub_of(hub, tmp_path), cache_home=tmp_path)
    assert newest.hub.commit == second and pinned.hub.commit == first
    assert newest.digest != pinned.digest and newest.name == pinned.name == REPO


def test_offline_a_cached_model_is_used_as_it_is_and_nothing_else(hub, tmp_path):
    online = open_weights(REPO, role="client", hub=hub_of(hub, tmp_path), cache_home=tmp_path)
    hub.clear_log()
    offline = open_weights(REPO, role="client", hub=hub_of(hub, tmp_path, offline=True), cache_home=tmp_path)
    assert (offline.digest, offline.hub.commit) == (online.digest, online.hub.commit)
    assert hub.log == []
    with pytest.raises(ModelUnavailable, match="HF_HUB_OFFLINE"):
        offline.hub.fetch(offline.hub.weight_files[:1])
    with pytest.raises(ModelUnavailable, match="not in the hub cache .* HF_HUB_OFFLINE is set"):
        open_weights("tiny-org/never-fetched", role="peer", hub=hub_of(hub, tmp_path, offline=True))


def test_a_model_the_hub_client_cached_is_used_as_it_is_offline(hub, checkpoint, tmp_path):
    from huggingface_hub import snapshot_download

    snapshot_download(REPO, cache_dir=tmp_path / "hub", endpoint=hub.url)  # as `hf download` leaves it
    hub.clear_log()
    offline = open_weights(REPO, role="client", hub=hub_of(hub, tmp_path, offline=True), cache_home=tmp_path)
    assert hub.log == [] and not offline.hub.fetched
    assert offline.digest == open_weights(checkpoint, role="peer", cache_home=tmp_path).digest


def test_each_error_says_what_to_do(hub, checkpoint, tmp_path):
    home = hub_of(hub, tmp_path)
    with pytest.raises(ModelUnavailable, match="repository not found"):
        open_weights("tiny-org/no-such-model", role="peer", hub=home)
    with pytest.raises(ModelUnavailable, match="revision 'v9' not found"):
        open_weights(f"{REPO}@v9", role="peer", hub=home)
    with pytest.raises(CheckpointError, match="not a hub repo id"):
        open_weights("tiny-org/bad name", role="peer", hub=home)
    hub.set_gated(REPO, True)
    with pytest.raises(ModelUnavailable, match="gated and no token is set; accept its terms"):
        open_weights(REPO, role="peer", hub=home)
    hub.set_gated(REPO, False)
    with pytest.raises(ModelUnavailable, match="could not reach the hub"):
        open_weights(REPO, role="peer", hub=dataclasses.replace(home, endpoint="http://127.0.0.1:9"))


def test_a_gated_model_opens_with_its_token(checkpoint, tmp_path):
    with HubServer({REPO: checkpoint}, token="hf_secret") as server:
        server.set_gated(REPO, True)
        weights = open_weights(REPO, role="client", hub=hub_of(server, tmp_path, token="hf_secret"))
        assert weights.hub.present("config.json")


def test_an_index_naming_a_missing_shard_is_refused_before_anything_loads(checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in checkpoint.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.unlink()
    with HubServer({"tiny-org/broken": broken}) as server:
        with pytest.raises(ModelUnavailable, match=f"names shards the repository lacks: {shard.name}"):
            open_weights("tiny-org/broken", role="peer", hub=hub_of(server, tmp_path))
        assert whole_files(server) <= {"model.safetensors.index.json"}  # read to check it; no shard fetched


def test_a_shard_whose_hash_does_not_match_is_deleted_and_refused(hub, checkpoint, tmp_path):
    from swarm.model.blocks import SpanBlocks
    from swarm.model.checkpoint import Checkpoint

    weights = open_weights(REPO, role="peer", hub=hub_of(hub, tmp_path), cache_home=tmp_path)
    shard = sorted(shards_of(checkpoint, ("model.layers.0.",)))[0]
    listed = weights.hub.files[shard]
    weights.hub.files[shard] = dataclasses.replace(listed, sha256="0" * 64)  # as if the hub listed other bytes
    with pytest.raises(ModelUnavailable, match="does not match the sha256 the hub lists .* deleted, try again"):
        SpanBlocks(Checkpoint(weights.directory, source=weights.source), Span(0, 1), "float32", "cpu")
    assert not weights.hub.present(shard)


def test_a_disk_without_room_is_refused_before_the_download(hub, checkpoint, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs as the full disk; CI runs as root, so it runs there")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(small)], check=True)
    try:
        weights = open_weights(REPO, role="peer", hub=hub_of(hub, small), cache_home=tmp_path)
        big = max(weights.hub.weight_files, key=lambda f: weights.hub.files[f].size)
        with pytest.raises(ModelUnavailable, match="free some space or point HF_HOME"):
            weights.hub.fetch([big])
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_an_interrupted_download_resumes_where_it_stopped(hub, checkpoint, tmp_path):
    weights = open_weights(REPO, role="peer", hub=hub_of(hub, tmp_path), cache_home=tmp_path)
    shard = max(weights.hub.weight_files, key=lambda f: weights.hub.files[f].size)
    size = weights.hub.files[shard].size
    hub.fail_after(shard, size // 3)
    with pytest.raises(ModelUnavailable, match="run again to resume|could not reach the hub"):
        weights.hub.fetch([shard])
    again = open_weights(REPO, role="peer", hub=hub_of(hub, tmp_path), cache_home=tmp_path)  # a later run
    hub.clear_log()
    again.hub.fetch([shard])
    ranges = [r.range for r in hub.log if r.filename == shard and r.method == "GET"]
    assert len(ranges) == 1 and ranges[0].startswith("bytes=") and not ranges[0].startswith("bytes=0-")
    assert sum(r.bytes_sent for r in hub.log if r.filename == shard) < size
    assert (again.directory / shard).read_bytes() == (checkpoint / shard).read_bytes()


def test_hub_access_honours_the_environment(hub, tmp_path):
    """HF_ENDPOINT, HF_HOME (the hub cache inside it) and HF_HUB_OFFLINE, as a user's shell sets them."""
    env = hub.client_env(tmp_path / "hf-home")
    code = ("from swarm.weights.models import open_weights; w = open_weights(%r, role='client'); "
            "print(w.directory, w.digest)" % REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    directory, digest = out.stdout.split()
    assert Path(directory).is_relative_to(tmp_path / "hf-home" / "hub")
    hub.clear_log()
    out = subprocess.run([sys.executable, "-c", code], env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.split() == [directory, digest] and hub.log == []


def test_the_hubs_speed_is_measured_so_a_holder_may_not_trickle(checkpoint, tmp_path):
    """A peer takes weight files from other peers first; one sending slower than a share of the hub's speed is
    left for the hub (`peer.weights.min_rate`), so the hub's speed is measured once, with a range request."""
    from peer.weights import HUB_FRACTION, min_rate
    from swarm.weights.share import MIN_FETCH_RATE

    with HubServer({REPO: checkpoint}, rate=4 * 2**20) as server:
        weights = open_weights(REPO, role="peer", hub=hub_of(server, tmp_path), cache_home=tmp_path)
        shard = sorted(shards_of(checkpoint, ("model.layers.",)))[0]
        rate = weights.hub.probe_rate(shard, nbytes=256 * 1024)
        ranges = [r.range for r in server.log if r.filename == shard]
        assert weights.hub.probe_rate(shard) == rate and len(ranges) == 1  # measured once
        offline = open_weights(REPO, role="peer", hub=hub_of(server, tmp_path, offline=True), cache_home=tmp_path)
        assert offline.hub.probe_rate(shard) is None
    assert 1 * 2**20 < rate < 8 * 2**20, rate  # the hub's cap, give or take its start
    assert min_rate(rate) == max(MIN_FETCH_RATE, HUB_FRACTION * rate) and min_rate(None) == MIN_FETCH_RATE
