"""The test hub (`tests/hub_server.py`) speaks the model hub's file API as huggingface_hub and transformers
expect it, unpatched: downloads, revisions, listings, file metadata, byte ranges, typed errors, gated repos,
an interrupted download, a capped rate; and its repos (a tiny sharded checkpoint with a tokenizer, a
resharded checkpoint) load."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from hub_content import git_blob_sha1, lfs_pointer
from hub_server import HubServer, build_sharded_repo, reshard

pytestmark = pytest.mark.unit

REPO = "org/tiny"
TOKEN = "hf_test_token"
SHARD = "model-00001-of-00006.safetensors"


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory) -> Path:
    """A tiny llama in 6 shards with an index, a generation config and the byte tokenizer."""
    return build_sharded_repo(tmp_path_factory.mktemp("hub") / "tiny")


@pytest.fixture
def hub(tiny_repo):
    with HubServer({REPO: tiny_repo}, token=TOKEN) as server:
        yield server


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "hf-cache"


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def _http(url: str, method: str = "GET", **headers) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_a_download_is_a_head_then_a_get_and_is_cached_as_from_the_hub(hub, tiny_repo, cache):
    sha = hub.commits(REPO)[-1]
    config = (tiny_repo / "config.json").read_bytes()
    path = Path(hf_hub_download(REPO, "config.json", endpoint=hub.url, cache_dir=cache, token=False))
    assert path.read_bytes() == config
    assert [(r.method, r.kind, r.revision, r.filename, r.range, r.status, r.bytes_sent, r.commit) for r in hub.log] == [
        ("HEAD", "resolve", "main", "config.json", None, 200, 0, sha),
        ("GET", "resolve", "main", "config.json", None, 200, len(config), sha),
    ]
    # the cache's layout is the hub's: a snapshot per commit; blobs named by git sha1, or sha256 for LFS files
    assert path.parent.name == sha and path.resolve().name == git_blob_sha1(config)
    shard = (tiny_repo / SHARD).read_bytes()
    shard_path = Path(hf_hub_download(REPO, SHARD, endpoint=hub.url, cache_dir=cache, token=False))
    assert shard_path.resolve().name == hashlib.sha256(shard).hexdigest()

    hub.clear_log()  # a branch is checked again (HEAD), a cached file is not fetched again
    hf_hub_download(REPO, "config.json", endpoint=hub.url, cache_dir=cache, token=False)
    assert [(r.method, r.bytes_sent) for r in hub.log] == [("HEAD", 0)]
    hub.clear_log()  # ... and a commit sha whose file is cached asks nothing
    hf_hub_download(REPO, "config.json", revision=sha, endpoint=hub.url, cache_dir=cache, token=False)
    assert hub.log == []


def test_resolve_answers_with_the_hubs_headers_and_byte_ranges(hub, tiny_repo):
    sha = hub.commits(REPO)[-1]
    config, shard = (tiny_repo / "config.json").read_bytes(), (tiny_repo / SHARD).read_bytes()
    status, headers, body = _http(f"{hub.url}/{REPO}/resolve/main/config.json", "HEAD")
    assert (status, body) == (200, b"")
    assert headers["ETag"] == f'"{git_blob_sha1(config)}"' and headers["X-Repo-Commit"] == sha
    assert headers["Content-Length"] == str(len(config)) and headers["Accept-Ranges"] == "bytes"
    assert "X-Linked-Etag" not in headers

    status, headers, _ = _http(f"{hub.url}/{REPO}/resolve/{sha}/{SHARD}", "HEAD")
    sha256 = hashlib.sha256(shard).hexdigest()
    assert status == 200 and headers["X-Linked-Etag"] == f'"{sha256}"'
    assert headers["X-Linked-Size"] == headers["Content-Length"] == str(len(shard))
    assert headers["ETag"] == f'"{git_blob_sha1(lfs_pointer(sha256, len(shard)))}"'  # the pointer's blob, as the hub

    url = f"{hub.url}/{REPO}/resolve/main/{SHARD}"
    for header, want in [("bytes=10-19", slice(10, 20)), ("bytes=100-", slice(100, None)),
                         ("bytes=-5", slice(len(shard) - 5, None)), ("bytes=0-999999999", slice(0, None))]:
        status, headers, body = _http(url, Range=header)
        first, last = want.start, (want.stop or len(shard)) - 1
        assert (status, body, headers["Content-Range"]) == (206, shard[want], f"bytes {first}-{last}/{len(shard)}")
    status, headers, _ = _http(url, Range=f"bytes={len(shard)}-")
    assert (status, headers["Content-Range"]) == (416, f"bytes */{len(shard)}")
    assert [r.range for r in hub.log if r.method == "GET"] == [
        "bytes=10-19", "bytes=100-", "bytes=-5", "bytes=0-999999999", f"bytes={len(shard)}-"]
    assert [r.bytes_sent for r in hub.log if r.method == "GET"][:4] == [10, len(shard) - 100, 5, len(shard)]


def test_a_second_commit_moves_main_and_the_first_stays_reachable_by_sha(hub, tiny_repo, tmp_path, cache):
    first = hub.commits(REPO)[-1]
    newer = tmp_path / "newer"
    shutil.copytree(tiny_repo, newer)
    config = json.loads((newer / "config.json").read_text())
    (newer / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    second = hub.add_repo(REPO, newer)
    assert second != first and hub.commits(REPO) == [first, second]
    assert hub.add_repo(REPO, newer) == second  # the same files: the same commit

    def layers(revision: str) -> int:
        path = hf_hub_download(REPO, "config.json", revision=revision, endpoint=hub.url, cache_dir=cache)
        return json.loads(Path(path).read_text())["num_hidden_layers"]

    assert (layers("main"), layers(first), layers(second), layers(first[:7])) == (3, 6, 3, 6)
    api = HfApi(endpoint=hub.url, token=False)
    assert api.model_info(REPO).sha == second and api.model_info(REPO, revision=first).sha == first
    assert [(b.name, b.target_commit) for b in api.list_repo_refs(REPO).branches] == [("main", second)]
    hub.add_repo(REPO, tiny_repo, revision_names=("v1",))  # a name for an older commit; main stays
    assert api.model_info(REPO, revision="v1").sha == first and api.model_info(REPO).sha == second


def test_snapshot_download_fetches_only_the_files_asked_for(hub, tiny_repo, cache):
    sha = hub.commits(REPO)[-1]
    files = _files(tiny_repo)
    wanted = {name for name in files if name.endswith(".json") or name.startswith("tokenizer")}
    folder = Path(snapshot_download(REPO, allow_patterns=["*.json", "tokenizer*"], endpoint=hub.url,
                                    cache_dir=cache, token=False))
    assert folder.name == sha and _files(folder) == {name: files[name] for name in wanted}
    assert [(r.kind, r.revision, r.path.split("?")[-1]) for r in hub.log[:2]] == [
        ("info", "main", f"/api/models/{REPO}/revision/main"), ("tree", sha, "recursive=true&expand=false")]
    # then a HEAD and a GET of each wanted file, at the commit; nothing of the weights
    assert hub.fetched(REPO) == {name: len(files[name]) for name in hub.fetched(REPO)}
    assert set(hub.fetched(REPO)) == wanted
    assert sorted(r.filename for r in hub.log if r.method == "HEAD") == sorted(wanted)
    assert {r.revision for r in hub.log[2:]} == {sha}
    assert hub.bytes_sent(REPO) == sum(len(files[n]) for n in wanted) + sum(r.bytes_sent for r in hub.log[:2])


def test_a_tree_listing_is_paged_as_on_the_hub(hub, tiny_repo):
    hub.tree_page_size = 5
    entries = list(HfApi(endpoint=hub.url, token=False).list_repo_tree(REPO, recursive=True))
    assert sorted(e.path for e in entries) == sorted(_files(tiny_repo))
    assert [r.kind for r in hub.log] == ["tree"] * 3 and "cursor=10" in hub.log[-1].path


def test_model_info_with_files_metadata_gives_the_real_hashes(hub, tiny_repo):
    api = HfApi(endpoint=hub.url, token=False)
    info = api.model_info(REPO, files_metadata=True)
    assert hub.log[-1].path == f"/api/models/{REPO}?blobs=true"
    assert (info.id, info.sha, info.private, info.gated) == (REPO, hub.commits(REPO)[-1], False, False)
    files = _files(tiny_repo)
    assert {s.rfilename for s in info.siblings} == set(files)
    for s in info.siblings:
        data = files[s.rfilename]
        assert s.size == len(data)
        if s.rfilename.endswith(".safetensors"):
            sha256 = hashlib.sha256(data).hexdigest()
            assert (s.lfs.sha256, s.lfs.size) == (sha256, len(data))
            assert s.blob_id == git_blob_sha1(lfs_pointer(sha256, len(data)))
        else:
            assert s.lfs is None and s.blob_id == git_blob_sha1(data)
    assert all(s.size is None and s.lfs is None for s in api.model_info(REPO).siblings)  # only with blobs=true
    assert api.model_info(REPO, expand=["sha"]).sha == info.sha


SAFETENSORS_CLIENT = """
import json
from huggingface_hub import get_safetensors_metadata
meta = get_safetensors_metadata("org/tiny")
print(json.dumps({"sharded": meta.sharded, "weight_map": meta.weight_map, "parameters": meta.parameter_count}))
"""


def _client(script: str, hub: HubServer, home: Path) -> dict:
    """Run `script` in a fresh process pointed at the hub (HF_ENDPOINT is read at import), with its own cache
    (get_safetensors_metadata and from_pretrained take no cache_dir); its last line of output, as JSON."""
    run = subprocess.run([sys.executable, "-c", script], env=hub.client_env(home / "hf-home"), cwd=home,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_safetensors_metadata_reads_only_the_headers(hub, tiny_repo, tmp_path):
    meta = _client(SAFETENSORS_CLIENT, hub, tmp_path)
    index = json.loads((tiny_repo / "model.safetensors.index.json").read_text())
    assert meta["sharded"] and meta["weight_map"] == index["weight_map"]
    assert meta["parameters"] == HfApi(endpoint=hub.url, token=False).model_info(REPO).safetensors.parameters
    shards = sorted(set(index["weight_map"].values()))
    reads = [r for r in hub.log if r.method == "GET" and r.filename in shards]
    assert sorted(r.filename for r in reads) == shards  # one ranged read each, of at most 100 kB
    for r in reads:
        size = (tiny_repo / r.filename).stat().st_size
        assert (r.range, r.status, r.bytes_sent) == ("bytes=0-100000", 206, min(size, 100_001))
    assert sum(r.bytes_sent for r in reads) < sum((tiny_repo / s).stat().st_size for s in shards) * 0.6
    # how it found them: model.safetensors is missing (404), the index exists (HEAD) and is downloaded
    files = [(r.method, r.filename, r.status) for r in hub.log if r.kind == "resolve"]
    assert files[:4] == [("HEAD", "model.safetensors", 404), ("HEAD", "model.safetensors.index.json", 200),
                         ("HEAD", "model.safetensors.index.json", 200), ("GET", "model.safetensors.index.json", 200)]
    assert len(files) == 4 + len(shards)


TRANSFORMERS_CLIENT = """
import json
from transformers import AutoConfig, AutoTokenizer
config = AutoConfig.from_pretrained("org/tiny")
tokenizer = AutoTokenizer.from_pretrained("org/tiny")
chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
print(json.dumps({"model_type": config.model_type, "layers": config.num_hidden_layers, "vocab": len(tokenizer),
                  "ids": tokenizer("Hé!")["input_ids"], "chat": chat}))
"""


def test_transformers_loads_a_config_and_a_tokenizer_through_the_hub(hub, tiny_repo, tmp_path):
    got = _client(TRANSFORMERS_CLIENT, hub, tmp_path)
    assert got == {"model_type": "llama", "layers": 6, "vocab": 256, "ids": [72, 195, 169, 33],  # UTF-8 bytes
                   "chat": "<s>user\nhi</s>\n<s>assistant\n"}
    wanted = ("config.json", "tokenizer_config.json", "tokenizer.json", "chat_template.jinja")
    assert hub.fetched(REPO) == {name: (tiny_repo / name).stat().st_size for name in wanted}
    assert not [r for r in hub.log if r.filename and r.filename.endswith(".safetensors")]
    assert (tmp_path / "hf-home" / "hub" / "models--org--tiny").is_dir()


def test_errors_are_the_hubs_and_raise_huggingface_hubs_typed_errors(hub, cache):
    kwargs = dict(endpoint=hub.url, cache_dir=cache)
    with pytest.raises(RepositoryNotFoundError) as anonymous:
        hf_hub_download("org/missing", "config.json", token=False, **kwargs)
    with pytest.raises(RepositoryNotFoundError) as signed_in:
        hf_hub_download("org/missing", "config.json", token="hf_someone", **kwargs)
    assert type(anonymous.value) is type(signed_in.value) is RepositoryNotFoundError
    assert [r.status for r in hub.log] == [401, 404]  # the hub tells an anonymous client nothing more
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="no-such-branch", **kwargs)
    with pytest.raises(EntryNotFoundError) as missing:
        hf_hub_download(REPO, "no-such-file.txt", **kwargs)
    assert type(missing.value) is RemoteEntryNotFoundError
    sha = hub.commits(REPO)[-1]  # X-Repo-Commit on the 404: the client remembers the file is missing
    assert (cache / "models--org--tiny" / ".no_exist" / sha / "no-such-file.txt").exists()
    api = HfApi(endpoint=hub.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="no-such-branch", **kwargs)
    codes = [(r.status, r.kind) for r in hub.log[2:]]
    assert codes == [(404, "resolve"), (404, "resolve"), (401, "info"), (404, "info"), (404, "info")]


def test_a_gated_repo_needs_the_token(hub, tiny_repo, cache):
    hub.add_repo("org/gated", tiny_repo, gated=True)
    kwargs = dict(endpoint=hub.url, cache_dir=cache)
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/gated", "config.json", token=False, **kwargs)
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/gated", "config.json", token="hf_not_approved", **kwargs)
    path = hf_hub_download("org/gated", "config.json", token=TOKEN, **kwargs)
    assert Path(path).read_bytes() == (tiny_repo / "config.json").read_bytes()
    assert [(r.method, r.status) for r in hub.log] == [("HEAD", 401), ("HEAD", 403), ("HEAD", 200), ("GET", 200)]
    info = HfApi(endpoint=hub.url, token=False).model_info("org/gated")  # its page is public
    assert info.gated == "auto"


def test_an_interrupted_download_is_retried_and_resumed_past_the_clients_first_chunk(hub, tmp_path, cache):
    """huggingface_hub retries a body cut short after a second. It writes the body in 10 MiB chunks: a cut
    within the first chunk loses what was read and starts over; a later cut resumes with a Range."""
    big = tmp_path / "big"
    big.mkdir()
    data = os.urandom(12 * 2**20)
    (big / "weights.dat").write_bytes(data)  # over 10 MB: an LFS file, served from the folder
    (big / "notes.txt").write_text("notes " * 100)
    hub.add_repo("org/big", big)
    hub.fail_after("weights.dat", 11 * 2**20)
    hub.fail_after("notes.txt", 100)
    for name in ("weights.dat", "notes.txt"):
        path = hf_hub_download("org/big", name, endpoint=hub.url, cache_dir=cache)
        assert Path(path).read_bytes() == (big / name).read_bytes()
    gets = [(r.filename, r.range, r.status, r.bytes_sent, r.interrupted) for r in hub.log if r.method == "GET"]
    assert gets == [
        ("weights.dat", None, 200, 11 * 2**20, True), ("weights.dat", "bytes=10485760-", 206, 2 * 2**20, False),
        ("notes.txt", None, 200, 100, True), ("notes.txt", None, 200, 600, False),
    ]


def test_the_rate_caps_all_downloads_together(hub, tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name, size in [("a.bin", 1_000_000), ("b.bin", 500_000), ("c.bin", 500_000)]:
        (blobs / name).write_bytes(os.urandom(size))
    hub.add_repo("org/blobs", blobs)
    hub.rate = 4_000_000  # set while running
    started = time.monotonic()
    hf_hub_download("org/blobs", "a.bin", endpoint=hub.url, cache_dir=tmp_path / "one")
    assert 0.2 <= time.monotonic() - started < 10
    started = time.monotonic()
    threads = [threading.Thread(target=hf_hub_download, args=("org/blobs", name),
                                kwargs=dict(endpoint=hub.url, cache_dir=tmp_path / "two"))
               for name in ("b.bin", "c.bin")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0.2 <= time.monotonic() - started < 10  # 1 MB in all, at 4 MB/s, however many connections
    assert hub.fetched("org/blobs") == {"a.bin": 1_000_000, "b.bin": 500_000, "c.bin": 500_000}


def test_a_folder_of_repos_and_a_resharded_checkpoint(tiny_repo, tmp_path, cache):
    from safetensors.torch import load_file

    root = tmp_path / "hub"
    reshard(tiny_repo, root / "org" / "one-file", "10MB")
    reshard(root / "org" / "one-file", root / "solo", "100KB")  # a repo id without an owner
    assert sorted(p.name for p in (root / "org" / "one-file").glob("*.safetensors")) == ["model.safetensors"]
    shards = sorted(p.name for p in (root / "solo").glob("*.safetensors"))
    assert len(shards) > 6 and (root / "solo" / "model.safetensors.index.json").exists()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        assert (root / "solo" / name).read_bytes() == (tiny_repo / name).read_bytes()

    def tensors(directory: Path) -> dict:
        return {k: v for p in directory.glob("*.safetensors") for k, v in load_file(p).items()}

    original, resharded = tensors(tiny_repo), tensors(root / "solo")
    assert original.keys() == resharded.keys() and all(original[k].equal(resharded[k]) for k in original)
    index = json.loads((root / "solo" / "model.safetensors.index.json").read_text())
    layer_shards = [index["weight_map"][k] for k in sorted(index["weight_map"], key=_layer) if _layer(k) >= 0]
    assert layer_shards == sorted(layer_shards)  # a span of layers lies in consecutive shards

    with HubServer(root) as hub:
        for repo in ("org/one-file", "solo"):
            path = hf_hub_download(repo, "config.json", endpoint=hub.url, cache_dir=cache)
            assert Path(path).read_bytes() == (tiny_repo / "config.json").read_bytes()
        path = hf_hub_download("solo", "model.safetensors.index.json", endpoint=hub.url, cache_dir=cache)
        assert json.loads(Path(path).read_text()) == index


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if parts[1:2] == ["layers"] else -1
