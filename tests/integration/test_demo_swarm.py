"""The real demo model (SmolLM2-135M-Instruct) through three peer processes: the SDK's `generate`
equals transformers' local `generate`, and the commands (`generate`, `chat`, `status`, `demo`)
work end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client.model import DistributedModelForCausalLM
from swarm.local.launch import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="module")
def local(demo_model_dir):
    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def remote(demo_swarm, demo_model_dir):
    model = DistributedModelForCausalLM.from_pretrained(demo_model_dir, demo_swarm.bootstrap_addrs)
    yield model
    model.close()


def test_32_greedy_tokens_equal_local(remote, local, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, eos_token_id=None,
                  pad_token_id=tokenizer.eos_token_id)
    expected = local.generate(ids, **kwargs)
    got = remote.generate(ids, **kwargs)
    assert got.tolist() == expected.tolist(), (tokenizer.decode(got[0]), tokenizer.decode(expected[0]))
    assert got.shape[1] == ids.shape[1] + 32 and "Paris" in tokenizer.decode(got[0, ids.shape[1]:])
    assert [str(h.span) for h in remote.route()] == ["[0:10)", "[10:20)", "[20:30)"]


def test_stop_strings_end_generation_like_local(remote, local, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                  pad_token_id=tokenizer.eos_token_id, stop_strings=["Paris"], tokenizer=tokenizer)
    expected = local.generate(ids, **kwargs)
    got = remote.generate(ids, **kwargs)
    assert got.tolist() == expected.tolist()
    assert tokenizer.decode(got[0, ids.shape[1]:]).rstrip().endswith("Paris")


def swarm_command(*args: str, stdin: str = "", timeout: float = 180, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, **popen)


def test_generate_command_streams_text(demo_swarm, demo_model_dir):
    done = swarm_command("generate", "--model", str(demo_model_dir), "--initial-peers", *demo_swarm.bootstrap_addrs,
                         "--max-new-tokens", "8", PROMPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout
    assert "route: head -> [0:10)" in done.stderr and "tokens/s" in done.stderr
    predicted = re.search(r"predicted ([0-9.]+) ms per decode step", done.stderr)
    measured = re.search(r"tokens/s \(([0-9.]+) ms per token\)", done.stderr)
    assert predicted and measured and float(predicted.group(1)) > 0 and float(measured.group(1)) > 0, done.stderr


def test_chat_command_answers(demo_swarm, demo_model_dir):
    done = swarm_command("chat", "--model", str(demo_model_dir), "--initial-peers", *demo_swarm.bootstrap_addrs,
                         "--max-new-tokens", "12", stdin="What is the capital of France?\nAnd of Italy?\n\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout and "Rome" in done.stdout


def test_status_command_shows_every_peer(demo_swarm, demo_model_dir):
    done = swarm_command("status", "--model", str(demo_model_dir), "--initial-peers", *demo_swarm.bootstrap_addrs,
                         "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    status = json.loads(done.stdout)
    peers = {p["peer"]: p for p in status["peers"]}
    assert set(peers) == {demo_swarm.procs[f"peer{i}"].peer_id for i in range(3)}
    assert sorted((p["start"], p["end"]) for p in peers.values()) == [(0, 10), (10, 20), (20, 30)]
    assert all(p["state"] == "online" and p["latency_ms"] > 0 and p["throughput"] > 0 for p in peers.values())
    assert status["uncovered"] == [] and status["num_blocks"] == 30
    assert [(h["start"], h["end"]) for h in status["route"]] == [(0, 10), (10, 20), (20, 30)]
    assert {h["peer"] for h in status["route"]} == set(peers) and status["predicted_ms_per_token"] > 0
    table = swarm_command("status", "--model", str(demo_model_dir), "--initial-peers", *demo_swarm.bootstrap_addrs)
    assert "uncovered blocks: none" in table.stdout and table.stdout.count(" online ") == 3
    assert re.search(r"route now: head -> \[0:10\) at .* predicted [0-9.]+ ms per token", table.stdout), table.stdout


def session_members(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def test_demo_command_runs_a_swarm_and_leaves_nothing(demo_model_dir, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "swarm.cli", "demo", "--model", str(demo_model_dir),
                             "--max-new-tokens", "12", "What is the capital of France?"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "SWARM_HOME": str(tmp_path)})
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 0, err[-3000:]
    assert "Paris" in out
    assert "a bootstrap and 3 peers" in err and "route: head -> [0:10) at" in err and "tokens/s" in err
    wait_until(lambda: not session_members(proc.pid), 15, "the demo's processes to exit")
