"""What `--model` accepts: hub repo ids with revisions, local directories, and nothing else."""

from __future__ import annotations

import json

import pytest

from swarm.errors import CheckpointError
from swarm.weights.digest import digest_of, local_digest
from swarm.weights.models import local_model_id
from swarm.weights.ref import ModelRef, parse_model


@pytest.mark.parametrize("value, repo, revision", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", None),
    ("org/name@v1.0", "org/name", "v1.0"),
    ("org/name@" + "a" * 40, "org/name", "a" * 40),
    ("org/name@refs/pr/3", "org/name", "refs/pr/3"),
])
def test_a_repo_id_with_or_without_a_revision(value, repo, revision):
    assert parse_model(value) == ModelRef(repo=repo, revision=revision)


def test_revision_given_apart_or_after_the_name():
    assert parse_model("org/name", "dev") == ModelRef(repo="org/name", revision="dev")
    assert parse_model("org/name@dev", "dev").revision == "dev"
    with pytest.raises(CheckpointError, match="names revision 'dev' but --revision says 'main'"):
        parse_model("org/name@dev", "main")


@pytest.mark.parametrize("value", ["org/na me", "org/name/extra", "-org/name", "org/name-", "org--x/name",
                                   "org/na..me", "o" * 50 + "/" + "n" * 50, "org/name@", "org/name@-bad",
                                   "justaname", "./missing", "/no/such/dir", "~/nothing-here"])
def test_what_is_neither_a_repo_id_nor_a_directory_is_refused(value):
    with pytest.raises(CheckpointError, match="repo id|no such directory|revision"):
        parse_model(value)


def test_an_existing_directory_wins_even_when_it_looks_like_a_repo_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_model("org/name") == ModelRef(path=tmp_path.joinpath("org/name").relative_to(tmp_path))
    with pytest.raises(CheckpointError, match="applies to a hub model"):
        parse_model("org/name", "main")


def _checkpoint(directory, shards: dict[str, bytes], config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if len(shards) == 1 and "model.safetensors" in shards:
        (directory / "model.safetensors").write_bytes(shards["model.safetensors"])
    else:
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {f"t{i}": name for i, name in enumerate(shards)}}))
        for name, data in shards.items():
            (directory / name).write_bytes(data)
    return directory


def test_the_digest_names_the_weights_not_the_folder(tmp_path):
    shards = {"model-00001-of-00002.safetensors": b"one", "model-00002-of-00002.safetensors": b"two"}
    a = _checkpoint(tmp_path / "a", shards, {"model_type": "llama"})
    b = _checkpoint(tmp_path / "somewhere" / "else", shards, {"model_type": "llama"})
    c = _checkpoint(tmp_path / "c", {**shards, "model-00002-of-00002.safetensors": b"TWO"}, {"model_type": "llama"})
    d = _checkpoint(tmp_path / "d", shards, {"model_type": "llama", "rope_theta": 1.0})
    digests = [local_digest(x, tmp_path / "home") for x in (a, b, c, d)]
    assert digests[0] == digests[1] and len(set(digests)) == 3
    assert local_model_id(a, tmp_path / "home") == local_model_id(b, tmp_path / "home") == f"local-{digests[0][:12]}"
    assert local_model_id(c, tmp_path / "home") != local_model_id(a, tmp_path / "home")


def test_the_digest_of_a_directory_equals_the_one_from_hub_hashes(tmp_path):
    import hashlib

    shards = {"model.safetensors": b"weights"}
    a = _checkpoint(tmp_path / "a", shards, {"model_type": "llama"})
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in shards.items()}
    config = hashlib.sha256((a / "config.json").read_bytes()).hexdigest()
    assert local_digest(a, None) == digest_of(config, sha)


def test_file_hashes_are_kept_and_a_changed_file_is_hashed_again(tmp_path):
    a = _checkpoint(tmp_path / "a", {"model.safetensors": b"weights"}, {"model_type": "llama"})
    first = local_digest(a, tmp_path / "home")
    kept = json.loads((a / ".swarm-file-hashes.json").read_text())
    assert len(kept) == 1
    (a / "model.safetensors").write_bytes(b"other weights")
    assert local_digest(a, tmp_path / "home") != first


def test_a_marker_names_a_checkpoint_of_our_own(tmp_path):
    a = _checkpoint(tmp_path / "a", {"model.safetensors": b"w"}, {"model_type": "llama"})
    (a / "swarm-model.json").write_text(json.dumps({"name": "gemma3-270m"}))
    assert local_model_id(a, tmp_path / "home") == "gemma3-270m"


def test_an_index_naming_a_missing_shard_is_refused(tmp_path):
    a = _checkpoint(tmp_path / "a", {"s1.safetensors": b"1", "s2.safetensors": b"2"}, {"model_type": "llama"})
    (a / "s2.safetensors").unlink()
    with pytest.raises(CheckpointError, match="names s2.safetensors, which is not there"):
        local_digest(a, None)
